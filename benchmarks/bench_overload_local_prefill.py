#!/usr/bin/env python
"""Local prefill at a sustained overload (issue 27): where a 1P+1D cluster's served requests miss
their TPOT target at three times the rate it serves.

    .venv/bin/python benchmarks/bench_overload_local_prefill.py [--settings auto,0] [--rounds 2]
        [--rate 10] [--seconds 15]

The shape of tests/test_admission_live.py's overload: `tiny`, 1 prefill + 1 decode worker (half a
core each), `serve`'s defaults (SLO admission, the decode gate) but for
--local-prefill-max-tokens, which takes each of --settings in turn, alternated over --rounds;
targets TTFT 1 s and TPOT 100 ms; streamed greedy requests of 512 random prompt tokens and 8
output tokens (ignore_eos), open-loop Poisson arrivals at --rate for --seconds, then at three
times it. Run it beside `python3 -c "while True: pass"` for a busy box (CI's).

Printed per setting, round and phase: requests sent, served, refused (429), good (both targets
met), served requests that missed the TTFT target, those that met it but missed the TPOT target,
and for the misses the gap between first and second token and the pace after it (seconds per
token); the first-to-second-token gap's median and 90th percentile over the good ones; the
router's local prefills over the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from cluster.run.launcher import ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.names import AUTO  # noqa: E402

PROMPT, OUTPUT = 512, 8
SLO = SLOTargets(ttft_s=1.0, tpot_s=0.1)


async def one(session, url: str, rng: random.Random) -> dict:
    body = {"model": "tiny", "prompt": [rng.randrange(256) for _ in range(PROMPT)], "max_tokens": OUTPUT,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0, times = time.perf_counter(), []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return {"status": resp.status}
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    times.append(time.perf_counter())
    n = len(times)
    if n < OUTPUT:                       # ended early (an error event): not a served request
        return {"status": "cut"}
    return {"status": 200, "ttft": times[0] - t0, "tpot": (times[-1] - times[0]) / (n - 1),
            "gap": times[1] - times[0], "pace": (times[-1] - times[1]) / (n - 2)}


async def poisson(base_url: str, rate: float, seconds: float, seed: int) -> list[dict]:
    rng, tasks = random.Random(seed), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(8):                                     # warm-up, one at a time
            await one(session, base_url + "/completions", rng)
        t = time.perf_counter()
        end = t + seconds
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(session, base_url + "/completions", rng)))
        return await asyncio.gather(*tasks)


def summary(results: list[dict]) -> str:
    served = [r for r in results if r["status"] == 200]
    good = [r for r in served if r["ttft"] <= SLO.ttft_s and r["tpot"] <= SLO.tpot_s]
    ttft_miss = [r for r in served if r["ttft"] > SLO.ttft_s]
    tpot_miss = [r for r in served if r["ttft"] <= SLO.ttft_s and r["tpot"] > SLO.tpot_s]
    gaps = sorted(r["gap"] for r in good)
    line = (f"sent {len(results)}, served {len(served)}, refused {sum(r['status'] == 429 for r in results)}, "
            f"good {len(good)}, TTFT misses {len(ttft_miss)}, TPOT misses {len(tpot_miss)}")
    if tpot_miss:
        line += (f" (their gap p50 {statistics.median(r['gap'] for r in tpot_miss):.3f} s, "
                 f"pace p50 {statistics.median(r['pace'] for r in tpot_miss):.3f} s/token)")
    if gaps:
        line += f"; good: gap p50 {gaps[len(gaps) // 2]:.3f} s, p90 {gaps[int(0.9 * len(gaps))]:.3f} s"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="auto,0", help="--local-prefill-max-tokens values, alternated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second of the first phase")
    ap.add_argument("--seconds", type=float, default=15.0, help="of arrivals per phase")
    a = ap.parse_args()
    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    for rnd in range(a.rounds):
        for setting in a.settings.split(","):
            local = setting if setting == AUTO else int(setting)
            with ServingCluster(spec, port=0, slo=SLO, local_prefill_max_tokens=local) as c:
                for mult in (1, 3):
                    results = asyncio.run_coroutine_threadsafe(
                        poisson(c.base_url, mult * a.rate, a.seconds, seed=rnd * 10 + mult), c.loop).result(600)
                    print(f"local prefill {setting:>4}, round {rnd + 1}, {mult}x ({mult * a.rate:g}/s): "
                          f"{summary(results)}", flush=True)
                local_prefills = c.server.metrics.registry.get_sample_value("pdcluster:local_prefills_total") or 0
                print(f"local prefill {setting:>4}, round {rnd + 1}: {local_prefills:.0f} local prefills", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
