#!/usr/bin/env python
"""pdcluster's controller against Dynamo's planner and fixed clusters, in simulation, on a real
trace under an hour-scale rise and fall of its rate.

    .venv/bin/python benchmarks/bench_planner_sim.py [--trace azure-conv] [--model llama-3-8b] \\
        [--low-rate 100] [--peak-rate 400] [--period-s 3600] [--duration-s 3600] [--max-workers 32] \\
        [--fixed 6+10,8+14] [--colocated 16,20] [--max-num-batched-tokens 2048] \
        [--rows controller,controller-mixed,dynamo-constant,dynamo-kalman,dynamo-load,fixed]

The requests: the trace's own rows (arrival gaps and lengths) replayed in order under
`cluster.loadtest.bench_data.rise_and_fall` (rate low -> peak at half the period -> low). The
same requests go to every row: pdcluster's controller with an elastic size (2 to
--max-workers workers, a forecast floor every --forecast-s), the same with the mixed role
allowed (`--controller-mixed`: no prefill pool while splitting does not pay), Dynamo's throughput planner with
its constant and its Kalman predictor, its load-based planner (cluster/capacity/dynamo_baseline.py,
from its published design, with its defaults), and fixed clusters. Every elastic row starts at
--start and pays --startup-s for each worker it adds (its GPUs held from the ask). Each row:
goodput (requests meeting both SLOs per second), SLO attainment (their share of all requests),
GPU-hours held, goodput per GPU-hour (good requests per GPU-hour), changes and changes undone
within 5 minutes. --plot writes pool sizes over time beside the offered load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cluster.capacity import dynamo_baseline as db  # noqa: E402
from cluster.capacity.sim_control import ControlledSimulator, PlannedSimulator, SimControl  # noqa: E402
from cluster.capacity.simulate import SimCluster, SimRequest, Simulator  # noqa: E402
from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import load_trace, rise_and_fall  # noqa: E402
from cluster.run.controller import ControllerConfig  # noqa: E402
from router.slo import judge  # noqa: E402
from workers.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from workers.cost_model import roofline  # noqa: E402
from workers.names import COLOCATED  # noqa: E402

ROWS = ("controller", "controller-mixed", "dynamo-constant", "dynamo-kalman", "dynamo-load", "fixed")


def split(text: str) -> tuple[int, int]:
    p, d = text.split("+")
    return int(p), int(d)


def summary(name: str, results, end_s: float, gpu_hours: float, slos, sim=None) -> dict:
    targets = loadgen.SLOTargets(ttft_s=slos["ttft"], tpot_s=slos["tpot"])
    good = sum(loadgen.meets(r, slos, targets) for r in results)
    # Which target the misses miss: each one's attainment alone, over every request (a failed one
    # meets neither).
    verdicts = [judge(targets, r.ttft, r.latency, r.output_len) for r in results if r.success]
    row = {"row": name, "goodput": good / end_s, "attainment": good / len(results), "gpu_hours": gpu_hours,
           "good_per_gpu_hour": good / gpu_hours, "failed": sum(not r.success for r in results),
           "ttft_attainment": sum(v.ttft for v in verdicts) / len(results),
           "tpot_attainment": sum(v.tpot for v in verdicts) / len(results)}
    if sim is not None:
        row.update(changes=len(sim.decisions), undone=sim.undone, added=sim.added, removed=sim.removed,
                   role_changes=sim.role_changes, sizes=sim.sizes, decisions=sim.decisions)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per worker")
    ap.add_argument("--low-rate", type=float, default=100.0)
    ap.add_argument("--peak-rate", type=float, default=400.0)
    ap.add_argument("--period-s", type=float, default=3600.0)
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--max-workers", type=int, default=32)
    ap.add_argument("--start", default="4+4", help="the elastic rows' pools at the start, P+D")
    ap.add_argument("--startup-s", type=float, default=60.0, help="an added worker's start-up (weights, warm-up)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0)
    ap.add_argument("--max-pending", type=int, default=100_000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig().max_num_batched_tokens,
                    help="every row's workers' per-step token budget (a colocated worker's chunk size)")
    ap.add_argument("--interval-s", type=float, default=10.0, help="pdcluster's controller: its interval")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--cooldown-s", type=float, default=30.0)
    ap.add_argument("--forecast-s", type=float, default=180.0, help="pdcluster's long interval (0: no forecast)")
    ap.add_argument("--fixed", default="", help="fixed clusters, P+D, comma-separated")
    ap.add_argument("--colocated", default="", help="fixed colocated clusters, workers, comma-separated")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG of the pools over time")
    a = ap.parse_args()
    rows_wanted = [r for r in a.rows.split(",") if r]
    for r in rows_wanted:
        if r not in ROWS:
            ap.error(f"--rows: unknown row {r!r} (one of {', '.join(ROWS)})")
    cost = roofline(a.model, a.gpu, a.tp)
    engine = EngineConfig(cache=CacheConfig(enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens))
    slos = {"ttft": a.slo_ttft_ms / 1000, "tpot": a.slo_tpot_ms / 1000}
    trace = load_trace(a.trace, max_len=a.max_len)
    rows = rise_and_fall(trace, a.low_rate, a.peak_rate, a.period_s, a.duration_s)
    requests = [SimRequest.synthetic(r.arrival_s, max(2, r.prompt_len), max(1, r.output_len), i)
                for i, r in enumerate(rows)]
    start_p, start_d = split(a.start)
    print(f"{len(requests)} requests of {a.trace}, rate {a.low_rate:g} -> {a.peak_rate:g} -> {a.low_rate:g} req/s "
          f"over {a.period_s:g} s (run {a.duration_s:g} s); {a.model} on {a.gpu} x{a.tp} per worker, "
          f"up to {a.max_workers} workers; SLOs TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms; "
          f"start {a.start}, start-up {a.startup_s:g} s", flush=True)

    def cluster(p: int, d: int) -> SimCluster:
        return SimCluster(num_prefill=p, num_decode=d, prefill_cost=cost, decode_cost=cost, engine=engine,
                          max_pending=a.max_pending)

    out = []

    def report(row: dict, wall: float) -> None:
        row["wall_s"] = wall
        out.append(row)
        extra = (f"  changes {row['changes']:3d} (undone {row['undone']})" if "changes" in row else "")
        print(f"  {row['row']:<18} goodput {row['goodput']:7.2f} req/s  attainment {row['attainment']:.3f} "
              f"(TTFT {row['ttft_attainment']:.3f}, TPOT {row['tpot_attainment']:.3f})  GPU-h {row['gpu_hours']:7.2f}  good/GPU-h {row['good_per_gpu_hour']:9.0f}{extra}  ({wall:.0f} s)",
              flush=True)

    planner_cfg = db.PlannerConfig(ttft_s=slos["ttft"], itl_s=slos["tpot"], max_gpu_budget=a.max_workers * a.tp,
                                   gpus_per_engine=a.tp)
    for name in rows_wanted:
        if name == "fixed":
            continue
        t = time.perf_counter()
        if name.startswith("controller"):
            cfg = ControllerConfig.sized(a.max_workers, a.cooldown_s, min_workers=2, mixed=name == "controller-mixed")
            control = SimControl(cfg, a.interval_s, a.window_s, slos["ttft"], slos["tpot"], a.startup_s, a.forecast_s)
            sim = ControlledSimulator(cluster(start_p, start_d), control, record_itl=False)
        else:
            mode = db.LOAD if name == "dynamo-load" else db.THROUGHPUT
            pcfg = dataclasses.replace(planner_cfg, predictor="kalman" if name == "dynamo-kalman" else "constant")
            sim = PlannedSimulator(cluster(start_p, start_d), pcfg, mode, a.startup_s, record_itl=False)
        results, _ = sim.run(requests)
        end = a.duration_s
        report(summary(name, results, end, sim.gpu_hours(), slos, sim), time.perf_counter() - t)
    if "fixed" in rows_wanted:
        for p, d in (split(x) for x in a.fixed.split(",") if x.strip()):
            t = time.perf_counter()
            sim = Simulator(cluster(p, d), record_itl=False)
            results, end = sim.run(requests)
            report(summary(f"fixed {p}P+{d}D", results, a.duration_s, (p + d) * a.tp * max(end, a.duration_s) / 3600,
                           slos), time.perf_counter() - t)
        for n in (int(x) for x in a.colocated.split(",") if x.strip()):
            t = time.perf_counter()
            sim = Simulator(SimCluster(mode=COLOCATED, num_colocated=n, prefill_cost=cost, engine=engine,
                                       max_pending=a.max_pending), record_itl=False)
            results, end = sim.run(requests)
            report(summary(f"fixed {n} colocated", results, a.duration_s, n * a.tp * max(end, a.duration_s) / 3600,
                           slos), time.perf_counter() - t)
    elastic = {r["row"]: r for r in out if "changes" in r}
    fixed = [r for r in out if r["row"].startswith("fixed")]
    for ours in (elastic.get("controller"), elastic.get("controller-mixed")):
        if ours is None:
            continue
        for r in out:
            if r is not ours:
                print(f"{ours['row']} / {r['row']}: good per GPU-hour {ours['good_per_gpu_hour'] / r['good_per_gpu_hour']:.2f}x, "
                      f"goodput {ours['goodput'] / max(1e-9, r['goodput']):.2f}x, attainment "
                      f"{ours['attainment']:.3f} vs {r['attainment']:.3f}")
        if fixed:
            best = max(fixed, key=lambda r: r["good_per_gpu_hour"])
            print(f"best fixed by good per GPU-hour: {best['row']}")
    for name, r in elastic.items():
        changes = [f"{d['t']:.0f}s {d['action']} {d['count']}" + (" (undoes)" if d["undoes"] is not None else "")
                   for d in r["decisions"]]
        print(f"{name}: " + ("; ".join(changes[:40]) + (" ..." if len(changes) > 40 else "") if changes else "no change"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": out}, f, indent=1)
    if a.plot and elastic:
        plot(a.plot, rows, elastic, a)


def plot(path: str, rows, elastic: dict, a) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(elastic) + 1, 1, figsize=(10, 2.2 * (len(elastic) + 1)), sharex=True)
    bucket = 60.0
    counts = [0] * (int(a.duration_s // bucket) + 1)
    for r in rows:
        counts[min(len(counts) - 1, int(r.arrival_s // bucket))] += 1
    axes[0].plot([i * bucket / 60 for i in range(len(counts))], [c / bucket for c in counts], color="black")
    axes[0].set_ylabel("offered req/s")
    for ax, (name, r) in zip(axes[1:], elastic.items()):
        ts = [s[0] / 60 for s in r["sizes"]]
        ax.step(ts, [s[1] for s in r["sizes"]], where="post", label="prefill")
        ax.step(ts, [s[2] for s in r["sizes"]], where="post", label="decode")
        ax.step(ts, [s[3] for s in r["sizes"]], where="post", label="held (incl. starting)", linestyle=":")
        ax.set_ylabel("workers")
        ax.set_title(f"{name}: good/GPU-h {r['good_per_gpu_hour']:.0f}, attainment {r['attainment']:.3f}",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
