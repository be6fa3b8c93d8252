#!/usr/bin/env python
"""n samples per prompt from one shared start against the same samples sent as n requests
(issue 14, item 3), on the served path: a local 1 prefill + 1 decode `tiny` cluster.

    .venv/bin/python benchmarks/bench_samples.py [--prompts 16] [--n 4] [--input-len 1024] [--output-len 32]

Each round sends --prompts requests at once, two ways, alternating which goes first:
  shared    one request per prompt with n samples (one prefill, one handoff, forks);
  separate  n requests per prompt with n=1, sample j seeded as the server seeds sample j
            (`sample_seed`), so the outputs are the same (checked); the prefix cache serves
            later copies of a prompt what earlier ones computed, as it would any client.
Each way gets prompts of its own (the same lengths), so neither reuses the other's cache. Printed
per way: wall time, prompt tokens the prefill worker computed (looked up minus cache hits), KV
pulls and bytes, from the router's /metrics counters; the ratio separate / shared.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.common import Meter, add_common_args, write_json  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from workers.sequence import sample_seed  # noqa: E402

COUNTERS = {"computed": ("pdcluster:prefix_cache_queries_total", "pdcluster:prefix_cache_hits_total"),
            "pulls": ("pdcluster:kv_transfer_seconds_count", None),
            "kv_bytes": ("pdcluster:kv_transfer_bytes_total", None)}


def counters(cluster) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in cluster.server.metrics.registry.collect():
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return {k: values.get(plus, 0.0) - (values.get(minus, 0.0) if minus else 0.0)
            for k, (plus, minus) in COUNTERS.items()}


async def send(client: httpx.AsyncClient, prompt: list[int], seed: int, n: int, a) -> list[list[int]]:
    r = await client.post("/completions", json={"model": "tiny", "prompt": prompt, "n": n, "seed": seed,
                                                "temperature": 1.0, "max_tokens": a.output_len, "ignore_eos": True})
    r.raise_for_status()
    return [c["token_ids"] for c in r.json()["choices"]]


async def run_way(base_url: str, way: str, prompts: list[list[int]], seeds: list[int], a) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        if way == "shared":
            outs = await asyncio.gather(*(send(client, p, s, a.n, a) for p, s in zip(prompts, seeds)))
            return [o for each in outs for o in each]
        outs = await asyncio.gather(*(send(client, p, sample_seed(s, j), 1, a)
                                      for p, s in zip(prompts, seeds) for j in range(a.n)))
        return [each[0] for each in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ray-cpus", type=int, default=4)
    add_common_args(p, "the run")
    a = p.parse_args()
    import ray
    ray.init(num_cpus=a.ray_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    meter = Meter()
    rng = random.Random(0)
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 256}})
    totals = {way: {"wall_s": 0.0, "computed": 0.0, "pulls": 0.0, "kv_bytes": 0.0} for way in ("shared", "separate")}
    with ServingCluster(spec, port=free_port(), admission="queue", max_pending=4096) as c:
        # The same samples both ways: one prompt, checked token for token.
        check = [[rng.randrange(256) for _ in range(a.input_len)]]
        same = (asyncio.run(run_way(c.base_url, "shared", check, [7], a))
                == asyncio.run(run_way(c.base_url, "separate", check, [7], a)))
        print(f"{a.prompts} prompts x n={a.n}, {a.input_len} -> {a.output_len} tokens, 1P+1D tiny; "
              f"the two ways give the same tokens: {same}", flush=True)
        if a.wait_idle:
            meter.wait_idle(a.wait_idle)
        for r in range(a.rounds):
            for way in (("shared", "separate") if r % 2 == 0 else ("separate", "shared")):
                prompts = [[rng.randrange(256) for _ in range(a.input_len)] for _ in range(a.prompts)]
                seeds = [rng.randrange(2**31) for _ in prompts]
                before = counters(c)
                with meter.part(f"{way}-{r}"):
                    asyncio.run(run_way(c.base_url, way, prompts, seeds, a))
                after = counters(c)
                t = totals[way]
                t["wall_s"] += meter.parts[f"{way}-{r}"]["wall_s"]
                for k in COUNTERS:
                    t[k] += after[k] - before[k]
    print(f"\n{'way':10s} {'wall s':>8s} {'prompt tokens computed':>24s} {'KV pulls':>9s} {'KV MiB':>8s}")
    for way, t in totals.items():
        print(f"{way:10s} {t['wall_s']:8.2f} {t['computed']:24.0f} {t['pulls']:9.0f} {t['kv_bytes'] / 2**20:8.1f}")
    s, d = totals["shared"], totals["separate"]
    print(f"\nseparate / shared: wall {d['wall_s'] / s['wall_s']:.2f}x, prompt tokens computed "
          f"{d['computed'] / max(1, s['computed']):.2f}x, KV pulls {d['pulls'] / max(1, s['pulls']):.2f}x")
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")
    write_json(a.json, {"args": vars(a), "same_tokens": same, "totals": totals, "parts": meter.parts})


if __name__ == "__main__":
    main()
