#!/usr/bin/env python
"""Prefix-aware picking against power-of-two-choices (issue 15, item 1), on the served path: a
local `tiny` cluster of 4 prefill workers and 1 decode worker, the same prefix-repetition load
(`pdcluster bench --dataset-name prefix-repetition`: shared prefixes, each followed by distinct
suffixes, shuffled) sent to it once with `--policy p2c` and once with `--policy prefix`.

    .venv/bin/python benchmarks/bench_prefix.py [--prefixes 4] [--per-prefix 10] [--prefix-len 800]

Printed per policy: the prefill pool's prefix-cache hit rate (prompt tokens served from the
cache / looked up, from the workers' own counters), the ideal one for this load (every prefix
computed once, every later request hitting all its prefix's full blocks), failed requests, and
TTFT (mean, median, p99) and wall time. Each policy gets a fresh cluster (empty caches), the
policies alternate which runs first over --rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter, add_common_args, write_json  # noqa: E402
from cluster.loadtest.bench_data import sample_prefix_repetition  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.loadtest.loadgen import Target, run_load, summarize  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from workers.names import P2C, PREFILL, PREFIX  # noqa: E402
from router.prefix_index import PrefixIndex  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402


def prefill_cache(cluster) -> tuple[float, float]:
    """(prompt tokens looked up, served from the cache) over the prefill pool."""
    totals = {"pdcluster:prefix_cache_queries_total": 0.0, "pdcluster:prefix_cache_hits_total": 0.0}
    for family in cluster.server.metrics.registry.collect():
        for s in family.samples:
            if s.name in totals and s.labels.get("role") == PREFILL:
                totals[s.name] += s.value
    return tuple(totals.values())


def ideal_hit_rate(reqs, tok, block_size: int) -> float:
    """One cache that forgets nothing, seeing the prompts in order: what it serves of them."""
    index, hits, total = PrefixIndex(block_size), 0, 0
    for r in reqs:
        ids = tok.encode(r.prompt)
        h = index.hashes(ids)
        hits += index.matches(h).get("all", 0) * block_size
        total += len(ids)
        index.add("all", h)
    return hits / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=10)
    p.add_argument("--prefix-len", type=int, default=800)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ray-cpus", type=int, default=6)
    add_common_args(p, "the run")
    a = p.parse_args()
    import ray
    ray.init(num_cpus=a.ray_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    meter = Meter()
    spec = ClusterSpec(model="tiny", num_prefill=4, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 64}})
    report = {}
    for r in range(a.rounds):
        for policy in ((P2C, PREFIX) if r % 2 == 0 else (PREFIX, P2C)):
            with ServingCluster(spec, port=free_port(), policy=policy, admission="queue", max_pending=4096) as c:
                tok = load_tokenizer(c.spec.model)
                reqs = sample_prefix_repetition(tok, a.prefixes * a.per_prefix, a.prefix_len, a.suffix_len,
                                                a.prefixes, a.output_len, seed=r)
                block_size = c.infos[0].block_size
                if a.wait_idle:
                    meter.wait_idle(a.wait_idle)
                with meter.part(f"{policy}-{r}"):
                    results, wall = asyncio.run(run_load(Target(c.base_url.removesuffix("/v1"), model="tiny", ignore_eos=True), reqs,
                                                         rate=a.request_rate, seed=r))
                queries, hits = prefill_cache(c)
            s = summarize(results, wall)
            errors = [e for e in s["errors"] if e]
            if errors:
                print(f"{policy}: {len(errors)} failed, the first: {errors[0]}", flush=True)
            row = report.setdefault(policy, {"queries": 0.0, "hits": 0.0, "failed": 0, "ttft_ms": [], "wall_s": 0.0})
            row["queries"] += queries
            row["hits"] += hits
            row["failed"] += s["failed"]
            row["ttft_ms"] += [t * 1000 for t in s["ttfts"] if t is not None]
            row["wall_s"] += wall
            row["ideal"] = ideal_hit_rate(reqs, tok, block_size)
    import numpy as np
    print(f"\n{a.prefixes} prefixes x {a.per_prefix} requests, {a.prefix_len}+{a.suffix_len} -> {a.output_len} "
          f"tokens at {a.request_rate:g} req/s; 4 prefill + 1 decode, tiny; {a.rounds} round(s)")
    print(f"{'policy':8s} {'hit rate':>9s} {'ideal':>7s} {'failed':>7s} {'TTFT mean':>10s} {'median':>8s} "
          f"{'p99':>8s} {'wall s':>7s}")
    for policy, row in report.items():
        t = np.asarray(row["ttft_ms"])
        row["hit_rate"] = row["hits"] / max(1.0, row["queries"])
        print(f"{policy:8s} {row['hit_rate']:9.1%} {row['ideal']:7.1%} {row['failed']:7d} {t.mean():10.0f} "
              f"{np.median(t):8.0f} {np.percentile(t, 99):8.0f} {row['wall_s']:7.1f}")
    if P2C in report and PREFIX in report:
        tp, tq = np.asarray(report[P2C]["ttft_ms"]), np.asarray(report[PREFIX]["ttft_ms"])
        print(f"\nprefix / p2c: hit rate {report[PREFIX]['hit_rate'] / max(1e-9, report[P2C]['hit_rate']):.2f}x, "
              f"mean TTFT {tq.mean() / tp.mean():.2f}x, p99 TTFT {np.percentile(tq, 99) / np.percentile(tp, 99):.2f}x")
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")
    write_json(a.json, {"args": vars(a), "report": {k: {kk: vv for kk, vv in v.items() if kk != "ttft_ms"}
                                                     for k, v in report.items()}, "parts": meter.parts})


if __name__ == "__main__":
    main()
