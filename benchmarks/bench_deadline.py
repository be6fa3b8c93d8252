#!/usr/bin/env python
"""Deadline-aware batch assembly against FCFS, in simulation: SLO attainment of two SLO classes
mixed at the same load, the same arrivals both ways.

    .venv/bin/python benchmarks/bench_deadline.py [--trace azure-conv] [--rate 22] [--duration-s 300]

The requests are a real trace's (Azure 2023, lengths as recorded, gaps scaled to --rate); every
--tight-every-th one carries a tight TTFT target (`ttft_slo_ms` --tight-ttft-ms), the rest a loose one
(--loose-ttft-ms); all share --tpot-ms. The simulator runs the real EngineCore and Scheduler on
the cost model (a roofline of --model on --gpu) with a virtual clock and hands each request its
own deadlines, as the router does. Attainment: the share of a class meeting both its TTFT and
its TPOT target. Prints a table per policy and the deadline/FCFS ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cluster.loadtest.bench_data import load_trace  # noqa: E402
from cluster.capacity.simulate import SimCluster, SimRequest, Simulator  # noqa: E402
from router.slo import SLOTargets, judge  # noqa: E402
from workers.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from workers.cost_model import roofline  # noqa: E402
from workers.names import COLOCATED  # noqa: E402


def workload(a) -> list[SimRequest]:
    rows = load_trace(a.trace, max_len=a.max_len)
    scale = ((len(rows) - 1) / (rows[-1].arrival_s - rows[0].arrival_s)) / a.rate
    out = []
    for i, r in enumerate(rows):
        t = r.arrival_s * scale
        if t >= a.duration_s:
            break
        tight = i % a.tight_every == 0
        req = SimRequest.synthetic(t, max(2, r.prompt_len), max(1, r.output_len), i)
        out.append(dataclasses.replace(req, ttft_slo_s=(a.tight_ttft_ms if tight else a.loose_ttft_ms) / 1000,
                                       tpot_slo_s=a.tpot_ms / 1000))
    return out


def attainment(requests, results) -> dict[str, dict]:
    """Per class: requests, the share meeting both targets, TTFT p50 and p99."""
    out = {}
    for name, tight in (("tight", True), ("loose", False), ("all", None)):
        pairs = [(q, r) for q, r in zip(requests, results)
                 if tight is None or (q.ttft_slo_s == min(x.ttft_slo_s for x in requests)) == tight]
        good = sum(r.success and judge(SLOTargets(q.ttft_slo_s, q.tpot_slo_s), r.ttft, r.latency, r.output_len).both
                   for q, r in pairs)
        ttfts = sorted(r.ttft for _, r in pairs if r.success)
        pct = (lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]) if ttfts else (lambda p: float("nan"))
        out[name] = {"requests": len(pairs), "attainment": good / max(1, len(pairs)),
                     "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99),
                     "failed": sum(not r.success for _, r in pairs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--rate", type=float, default=22.0, help="requests/s")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--tight-every", type=int, default=4, help="every this many requests is of the tight class")
    ap.add_argument("--tight-ttft-ms", type=float, default=300.0)
    ap.add_argument("--loose-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=1, help="colocated workers")
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    requests = workload(a)
    cost = roofline(a.model, a.gpu, 1)
    tight = sum(q.ttft_slo_s == a.tight_ttft_ms / 1000 for q in requests)
    print(f"{len(requests)} requests of {a.trace} at {a.rate:g} req/s over {a.duration_s:g} s on {a.workers} "
          f"colocated {a.gpu} {a.model} (budget {a.max_num_batched_tokens} tokens/step): {tight} tight "
          f"(TTFT {a.tight_ttft_ms:g} ms), {len(requests) - tight} loose (TTFT {a.loose_ttft_ms:g} ms), "
          f"TPOT {a.tpot_ms:g} ms", flush=True)
    runs = {}
    for policy in ("fcfs", "deadline"):
        engine = EngineConfig(cache=CacheConfig(enable_prefix_caching=False), scheduler=SchedulerConfig(
            max_num_batched_tokens=a.max_num_batched_tokens, policy=policy))
        cluster = SimCluster(mode=COLOCATED, num_colocated=a.workers, prefill_cost=cost, engine=engine,
                             max_pending=100_000)
        t = time.perf_counter()
        results, _ = Simulator(cluster, record_itl=False).run(requests)
        runs[policy] = attainment(requests, results)
        runs[policy]["wall_s"] = time.perf_counter() - t
    print(f"{'policy':<9} {'class':<6} {'requests':>8} {'attainment':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'failed':>6}")
    for policy, run in runs.items():
        for name in ("tight", "loose", "all"):
            c = run[name]
            print(f"{policy:<9} {name:<6} {c['requests']:>8} {c['attainment']:>10.1%} {c['ttft_p50_s']:>8.3f}s "
                  f"{c['ttft_p99_s']:>8.3f}s {c['failed']:>6}")
    print("deadline / fcfs attainment: " + ", ".join(
        f"{name} {runs['deadline'][name]['attainment'] / max(1e-9, runs['fcfs'][name]['attainment']):.2f}x"
        for name in ("tight", "loose", "all")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
