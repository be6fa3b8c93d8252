"""Prefill-decode interference: disaggregated (1 prefill + 1 decode) against 2 colocated workers.

Same model, same load, one run. Short requests decode steadily while long prompts arrive
(Poisson, fixed rate); in a colocated worker each long prefill shares steps with the decodes
and stretches their inter-token latency, while a disaggregated cluster keeps prefill off the
decode worker. Reports p50/p99 TTFT and ITL (from SSE arrival times) for both.

    .venv/bin/python benchmarks/bench_interference.py [--rate 4] [--num-requests 80] [--long-frac 0.25]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from cluster.launcher import ClusterSpec
from cluster.serve import ServingCluster, free_port


def make_load(n: int, long_frac: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    load = []
    for _ in range(n):
        if rng.random() < long_frac:
            load.append({"prompt": [rng.randrange(256) for _ in range(1536)], "max_tokens": 8, "kind": "long"})
        else:
            load.append({"prompt": [rng.randrange(256) for _ in range(64)], "max_tokens": 96, "kind": "short"})
    return load


async def one(client: httpx.AsyncClient, url: str, req: dict) -> dict:
    body = {"model": "tiny", "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    stamps = []
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                stamps += [time.monotonic()] * n
    return {"kind": req["kind"], "ttft": stamps[0] - t0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def drive(url: str, load: list[dict], rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for req in load:
            tasks.append(asyncio.create_task(one(client, url, req)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3


def run(mode: str, args) -> dict:
    spec = ClusterSpec(model="tiny", mode=mode, num_prefill=1, num_decode=1, num_colocated=2,
                       num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_batched_tokens": args.budget}})
    with ServingCluster(spec, port=free_port(), ray_num_cpus=4) as c:
        url = f"{c.base_url}/completions"
        asyncio.run(drive(url, make_load(8, 0.0, 99), 100.0, 1))                 # warm up
        results = asyncio.run(drive(url, make_load(args.num_requests, args.long_frac, args.seed),
                                    args.rate, args.seed))
    short = [r for r in results if r["kind"] == "short"]
    itl = [x for r in short for x in r["itl"]]
    return {"mode": mode, "ttft_p50_ms": pct([r["ttft"] for r in results], 50),
            "ttft_p99_ms": pct([r["ttft"] for r in results], 99),
            "short_ttft_p50_ms": pct([r["ttft"] for r in short], 50),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "itl_mean_ms": statistics.fmean(itl) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunk size)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = [run("disaggregated", args), run("colocated", args)]
    print(f"load: {args.num_requests} requests at {args.rate}/s, {args.long_frac:.0%} long (1536-token "
          f"prompt, 8 out), the rest short (64 in, 96 out); token budget {args.budget}")
    print(f"{'mode':15s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'ITL mean':>9s}  (ms)")
    for r in rows:
        print(f"{r['mode']:15s} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} {r['itl_p50_ms']:8.2f} "
              f"{r['itl_p99_ms']:8.2f} {r['itl_mean_ms']:9.2f}")
    d, c = rows
    print(f"ITL p99 colocated / disaggregated: {c['itl_p99_ms'] / d['itl_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
