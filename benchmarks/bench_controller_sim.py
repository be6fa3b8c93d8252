#!/usr/bin/env python
"""The pool-ratio controller against every fixed ratio, in simulation, on phases that shift.

    .venv/bin/python benchmarks/bench_controller_sim.py [--workers 32] [--segment-s 600] [--segments 4]

Segments of the two Azure 2023 traces alternate (code: prefill-heavy; conversation:
decode-heavy), each scaled in time to --code-rate / --conv-rate and in length by
--length-scale; the same requests go to the controlled cluster (starting at half and half) and
to every fixed split of --workers workers. Prints goodput (requests meeting both SLOs per
second) over the whole run and per segment, and the controller's decisions.

The defaults: TTFT 1 s and TPOT 25 ms (interactive serving; at 50 ms nearly any decode pool
keeps up and the split barely matters), and rates that load 32 H100s with Llama-3-8B near what
the best split of each phase serves within those SLOs (code 340 req/s: its best split, ~28
prefill + 4 decode, serves ~360; conversation 380 req/s: ~19 + 13 serves ~415). The phases
want different splits: code's 2,048-token prompts with 28-token replies lean on prefill,
conversation's 1,154-token prompts with 211-token replies need ~13 decode workers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import load_trace  # noqa: E402
from cluster.run.controller import ControllerConfig  # noqa: E402
from cluster.capacity.sim_control import ControlledSimulator, SimControl  # noqa: E402
from cluster.capacity.simulate import SimCluster, SimRequest, Simulator  # noqa: E402
from workers.config import CacheConfig, EngineConfig  # noqa: E402
from workers.cost_model import roofline  # noqa: E402


def phases(a) -> tuple[list[SimRequest], list[tuple[str, float, float]]]:
    """Alternating segments; each takes the next rows of its trace (wrapping around), with the
    trace's own gaps scaled to the segment's rate."""
    traces = {"code": load_trace("azure-code", max_len=a.max_len), "conv": load_trace("azure-conv", max_len=a.max_len)}
    rates = {"code": a.code_rate, "conv": a.conv_rate}
    cursor = {"code": 0, "conv": 0}
    out, spans, t0 = [], [], 0.0
    for k in range(a.segments):
        name = ("code", "conv")[k % 2]
        rows, i = traces[name], cursor[name]
        scale = ((len(rows) - 1) / (rows[-1].arrival_s - rows[0].arrival_s)) / rates[name]
        t = 0.0
        while True:
            r, nxt = rows[i % len(rows)], rows[(i + 1) % len(rows)]
            gap = nxt.arrival_s - r.arrival_s if (i + 1) % len(rows) else 1.0 / rates[name] / scale
            t += max(0.0, gap) * scale
            if t >= a.segment_s:
                break
            n = max(2, round(r.prompt_len * a.length_scale))
            out.append(SimRequest.synthetic(t0 + t, n, max(1, round(r.output_len * a.length_scale)), len(out)))
            i += 1
        cursor[name] = i
        spans.append((name, t0, t0 + a.segment_s))
        t0 += a.segment_s
    return out, spans


def goodput(results, spans, slos) -> tuple[float, list[float]]:
    targets = loadgen.SLOTargets(ttft_s=slos["ttft"], tpot_s=slos["tpot"])
    good = [loadgen.meets(r, slos, targets) for r in results]
    total = sum(good) / spans[-1][2]
    per = []
    for _, a, b in spans:
        per.append(sum(g for g, r in zip(good, results) if a <= r.start < b) / (b - a))
    return total, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--segment-s", type=float, default=600.0)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--code-rate", type=float, default=340.0, help="requests/s of the code segments")
    ap.add_argument("--conv-rate", type=float, default=380.0, help="requests/s of the conversation segments")
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0)
    ap.add_argument("--max-pending", type=int, default=4096, help="requests in flight before 429")
    ap.add_argument("--fixed-step", type=int, default=4, help="fixed splits tried: every this many prefill workers")
    ap.add_argument("--fixed", default=None, help="the fixed splits' prefill workers, comma-separated (in place of "
                    "--fixed-step; empty: none)")
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--cooldown-s", type=float, default=30.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cost = roofline(a.model, a.gpu, 1)
    engine = EngineConfig(cache=CacheConfig(enable_prefix_caching=False))
    slos = {"ttft": a.slo_ttft_ms / 1000, "tpot": a.slo_tpot_ms / 1000}
    requests, spans = phases(a)
    print(f"{len(requests)} requests over {len(spans)} segments of {a.segment_s:g} s "
          f"({', '.join(s[0] for s in spans)}), {a.workers} x {a.gpu} {a.model}")
    splits = ([int(x) for x in a.fixed.split(",") if x.strip()] if a.fixed is not None
              else list(range(a.fixed_step, a.workers, a.fixed_step)))
    started = time.perf_counter()
    half = a.workers // 2
    cluster = SimCluster(num_prefill=half, num_decode=a.workers - half, prefill_cost=cost, decode_cost=cost,
                         engine=engine, max_pending=a.max_pending)
    control = SimControl(ControllerConfig(a.workers, a.cooldown_s), a.interval_s, a.window_s, slos["ttft"],
                         slos["tpot"])
    sim = ControlledSimulator(cluster, control, record_itl=False)
    t = time.perf_counter()
    results, _ = sim.run(requests)
    wall = time.perf_counter() - t
    total, per = goodput(results, spans, slos)
    print(f"  controller        goodput {total:7.2f} req/s  per segment " + " ".join(f"{x:7.2f}" for x in per)
          + f"  ({wall:.0f} s)", flush=True)
    rows = []
    for p in splits:
        cluster = SimCluster(num_prefill=p, num_decode=a.workers - p, prefill_cost=cost, decode_cost=cost,
                             engine=engine, max_pending=a.max_pending)
        t = time.perf_counter()
        res, _ = Simulator(cluster, record_itl=False).run(requests)
        fixed_total, fixed_per = goodput(res, spans, slos)
        rows.append({"ratio": f"{p}P+{a.workers - p}D", "goodput": fixed_total, "per_segment": fixed_per,
                     "wall_s": time.perf_counter() - t})
        print(f"  fixed {p:>3}P+{a.workers - p:<3}D  goodput {fixed_total:7.2f} req/s  per segment "
              + " ".join(f"{x:7.2f}" for x in fixed_per) + f"  ({rows[-1]['wall_s']:.0f} s)", flush=True)
    if rows:
        best = max(rows, key=lambda r: r["goodput"])
        best_per = [max(r["per_segment"][i] for r in rows) for i in range(len(spans))]
        print(f"controller / best fixed ({best['ratio']}): {total / best['goodput']:.2f}x; per segment against "
              "that segment's best fixed (" + ", ".join(max(rows, key=lambda r: r["per_segment"][i])["ratio"]
                                                        for i in range(len(spans))) + "): "
              + " ".join(f"{c / b:.2f}" if b else "-" for c, b in zip(per, best_per)))
    print(f"{sim.role_changes} role changes in {len(sim.decisions)} decisions:")
    for d in sim.decisions:
        took = f"(done in {d['settled'] - d['t']:.0f} s)" if "settled" in d else ""
        print(f"  t={d['t']:5.0f} {took:>15}  {d['prefill']:>2}P+{d['decode']:<2}D  {d['action']:<11} {d['reason']}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "fixed": rows,
                       "controller": {"goodput": total, "per_segment": per, "wall_s": wall,
                                      "role_changes": sim.role_changes, "decisions": sim.decisions}}, f, indent=1)


if __name__ == "__main__":
    main()
