#!/usr/bin/env python
"""The pool-ratio controller against each fixed split, on the real local cluster, in one run.

    .venv/bin/python benchmarks/bench_controller_live.py [--workers 3] [--phases 4] [--phase-s 60]

The load is `pdcluster bench --dataset-name phases`: phases alternate between prefill-heavy
(long prompts, a couple of output tokens) and decode-heavy (short prompts, long outputs), each
with its own rate; the same requests at the same send times go to every fixed split of
--workers `tiny` workers (1P+(N-1)D .. (N-1)P+1D) and to the controlled cluster, which starts at
1 prefill + (N-1) decode. Streaming, greedy, ignore_eos (cluster.loadtest.loadgen, as bench sends). Each
run reports goodput (requests meeting both SLOs per second) over the whole load and per phase,
failures by kind, and, for the controller, its decisions and role changes. On this 2-core box
every worker shares the cores with the router and each other, so the splits differ by where the
cores go; the run also reports how many cores other processes kept busy (benchmarks/common.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter  # noqa: E402
from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import DECODE_HEAVY, PREFILL_HEAVY, Phase, alternate, phase_rows, sample_trace  # noqa: E402
from cluster.run.launcher import ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402


def run_one(label: str, spec: ClusterSpec, slo: SLOTargets, requests, arrivals, phases, meter: Meter) -> dict:
    with meter.part(label), ServingCluster(spec, port=free_port(), slo=slo) as c:
        target = loadgen.Target(f"http://{c.host}:{c.port}", model="tiny", ignore_eos=True)
        fut = asyncio.run_coroutine_threadsafe(loadgen.run_load(target, requests, arrivals=arrivals), c.loop)
        results, duration = fut.result()
        slos = {"ttft": slo.ttft_s, "tpot": slo.tpot_s}
        per = loadgen.summarize_phases(results, arrivals, phases, slos)
        total = loadgen.summarize(results, duration, slos, ("ttft", "tpot"), (99.0,))
        metrics = c.server.metrics.registry
        changes = sum(metrics.get_sample_value("pdcluster:pool_role_changes_total", {"from_role": a, "to_role": b})
                      or 0 for a, b in (("prefill", "decode"), ("decode", "prefill")))
        errors = [r.error for r in results if not r.success]
        good = sum(p["request_goodput"] * (p["end_s"] - p["start_s"]) for p in per)
        out = {"label": label, "goodput": good / (per[-1]["end_s"] - per[0]["start_s"]), "phases": per,
               "completed": total["completed"], "failed": len(errors),
               "failed_not_429": sum("429" not in e for e in errors), "role_changes": changes,
               "decisions": list(c.controller.decisions) if c.controller else []}
    print(f"  {label:<12} goodput {out['goodput']:6.2f} req/s  per phase "
          + " ".join(f"{p['request_goodput']:6.2f}" for p in per)
          + f"  failed {out['failed']} (not 429: {out['failed_not_429']})  role changes {changes}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--prefill-phase", default="900,2,4", help="input tokens, output tokens, req/s")
    ap.add_argument("--decode-phase", default="32,200,8", help="input tokens, output tokens, req/s")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=40.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--cooldown-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    pre, dec = ([int(x) for x in s.split(",")[:2]] + [float(s.split(",")[2])] for s in (a.prefill_phase, a.decode_phase))
    rows = phase_rows(alternate(a.phases, Phase(PREFILL_HEAVY, *pre), Phase(DECODE_HEAVY, *dec)), a.phase_s,
                      seed=a.seed)
    requests = sample_trace(load_tokenizer("tiny"), rows, a.seed)
    arrivals, phases = [r.arrival_s for r in rows], [r.phase for r in rows]
    slo = SLOTargets(ttft_s=a.slo_ttft_ms / 1000, tpot_s=a.slo_tpot_ms / 1000)
    print(f"{len(rows)} requests: {a.phases} phases of {a.phase_s:g} s (prefill-heavy {a.prefill_phase}, "
          f"decode-heavy {a.decode_phase}: in, out, req/s); SLOs TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms; "
          f"{a.workers} tiny workers", flush=True)
    meter = Meter()
    engine = {"scheduler": {"max_num_batched_tokens": 2048}}
    runs = []
    for p in range(1, a.workers):
        spec = ClusterSpec(model="tiny", num_prefill=p, num_decode=a.workers - p, engine=engine)
        runs.append(run_one(f"fixed {p}P+{a.workers - p}D", spec, slo, requests, arrivals, phases, meter))
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=a.workers - 1, engine=engine, controller=True,
                       controller_interval_s=a.interval_s, controller_window_s=a.window_s,
                       controller_cooldown_s=a.cooldown_s)
    ctl = run_one("controller", spec, slo, requests, arrivals, phases, meter)
    best = max(runs, key=lambda r: r["goodput"])
    print(f"controller / best fixed ({best['label']}): {ctl['goodput'] / best['goodput']:.2f}x; per phase against "
          "that phase's best fixed: " + " ".join(
              f"{c['request_goodput'] / b:.2f}" if b else "-" for c, b in
              zip(ctl["phases"], [max(r["phases"][i]["request_goodput"] for r in runs) for i in range(a.phases)])))
    for d in ctl["decisions"]:
        print(f"  t={d['t']:6.1f} s  {d['prefill']}P+{d['decode']}D  {d['action']} x{d['count']}: {d['reason']}")
    if busy := meter.busy():
        print(f"warning: other processes kept cores busy during {', '.join(busy)}: the ratios are unreliable")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs + [ctl], "meter": meter.parts,
                                            "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
