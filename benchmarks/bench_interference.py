#!/usr/bin/env python
"""Prefill-decode interference: disaggregated (1 prefill + 1 decode) against 2 colocated workers.

Same model, same load, one run. Short requests decode steadily while long prompts arrive
(open-loop, gamma arrivals at a fixed rate: Poisson by default); in a colocated worker each long
prefill shares steps with the decodes and stretches their inter-token latency, while a
disaggregated cluster keeps prefill off the decode worker.

    .venv/bin/python benchmarks/bench_interference.py [--rate 4] [--num-requests 80] [--long-frac 0.25]

The load is `pdcluster bench`'s: cluster.loadtest.loadgen sends the requests (streaming
/v1/completions, ignore_eos, greedy) at gamma-distributed gaps (cluster.loadtest.loadgen.arrival_gaps,
--burstiness 1 = Poisson) and times each from its SSE stream; prompts are random text of an
exact length in `tiny`'s tokenizer (cluster.loadtest.bench_data.sample_random). Each request is long
(--long-len prompt tokens, --long-out new tokens) for a --long-frac share of them, else short
(--short-len in, --short-out out); both modes get the same requests at the same send times.
Reported per mode, with colocated / disaggregated beside each:
    TTFT p50, p99   over all requests, and p50 of the short ones
    ITL p50, p99, mean, TPOT p99   over the short requests: the gaps between streamed chunks
                    (loadgen's and vLLM's ITL), i.e. what a decoding user sees while long
                    prompts arrive
The cluster runs 1 torch thread per worker, half a core each. Every mode also reports how many
cores other processes kept busy during its load (the machine's busy time minus this process and
its descendants, Ray's workers included): on a shared 2-core box a neighbour changes the answer
(a 7.4x "gain" measured beside a `make test` was 0.91x on a quiet machine), so the script warns
when that is above 0.3 cores; --wait-idle S waits for quiet before each mode.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter, add_common_args, write_json  # noqa: E402
from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import BenchRequest, sample_random  # noqa: E402
from cluster.run.launcher import ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402
from workers.names import MODES  # noqa: E402

MODEL = "tiny"
# (label, summary key, which requests): the rows of the report
ROWS = [("TTFT p50 (all)", "median_ttft_ms", "all"), ("TTFT p99 (all)", "p99_ttft_ms", "all"),
        ("TTFT p50 (short)", "median_ttft_ms", "short"), ("ITL p50 (short)", "median_itl_ms", "short"),
        ("ITL p99 (short)", "p99_itl_ms", "short"), ("ITL mean (short)", "mean_itl_ms", "short"),
        ("TPOT p99 (short)", "p99_tpot_ms", "short")]


def make_load(args, tokenizer) -> tuple[list[BenchRequest], list[bool], list[BenchRequest]]:
    """The requests in send order, for each whether it is a long one, and 8 short warm-up
    requests with prompts of their own (a shared prompt would be a prefix-cache hit later)."""
    n_long = round(args.long_frac * args.num_requests)     # exactly that share, in a seeded order
    is_long = [True] * n_long + [False] * (args.num_requests - n_long)
    random.Random(args.seed).shuffle(is_long)
    longs = iter(sample_random(tokenizer, n_long, args.long_len, args.long_out, seed=args.seed + 1)
                 if n_long else [])
    shorts = iter(sample_random(tokenizer, len(is_long) - n_long + 8, args.short_len, args.short_out,
                                seed=args.seed + 2))
    requests = [next(longs) if long else next(shorts) for long in is_long]
    return requests, is_long, list(shorts)


def run_mode(mode: str, args, load: tuple, meter: Meter) -> dict:
    requests, is_long, warm = load
    spec = ClusterSpec(model=MODEL, mode=mode, num_prefill=1, num_decode=1, num_colocated=2,
                       num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_batched_tokens": args.budget}})
    with ServingCluster(spec, port=free_port(), ray_num_cpus=4) as c:
        target = loadgen.Target(f"http://{c.host}:{c.port}", "/v1/completions", MODEL,
                                ignore_eos=True, timeout_s=args.request_timeout)
        asyncio.run(loadgen.run_load(target, warm))                         # all at once
        if args.wait_idle > 0:
            Meter.wait_idle(args.wait_idle)
        with meter.part(mode):
            results, duration = asyncio.run(loadgen.run_load(
                target, requests, args.rate, args.burstiness, seed=args.seed))
    short = [r for r, long in zip(results, is_long) if not long]

    def summary(rs: list[loadgen.RequestResult]) -> dict:
        return loadgen.summarize(rs, duration, percentile_metrics=("ttft", "tpot", "itl"), percentiles=(99,))
    out = {"all": summary(results), "short": summary(short), "duration_s": duration,
           "failed": sum(not r.success for r in results),
           "errors": sorted({r.error for r in results if r.error})[:5],
           "other_procs_cores": meter.parts[mode]["other_procs_cores"]}
    out["metrics_ms"] = {label: out[which][key] for label, key, which in ROWS}
    return out


def report(args, rows: dict[str, dict], is_long: list[bool]) -> str:
    d, c = (rows[m] for m in MODES)
    lines = [f"load: {args.num_requests} requests at {args.rate:g}/s (burstiness {args.burstiness:g}), "
             f"{sum(is_long)} long ({args.long_len}-token prompt, {args.long_out} out), "
             f"{len(is_long) - sum(is_long)} short ({args.short_len} in, {args.short_out} out); "
             f"{MODEL}, token budget {args.budget}",
             f"{'':20s} {'disaggregated':>14s} {'colocated':>10s} {'colocated / disagg.':>20s}"]
    for label, _, _ in ROWS:
        a, b = d["metrics_ms"][label], c["metrics_ms"][label]
        lines.append(f"{label + ' ms':20s} {a:14.1f} {b:10.1f} {(f'{b / a:.2f}x' if a else '-'):>20s}")
    lines.append(f"{'failed requests':20s} {d['failed']:14d} {c['failed']:10d}")
    lines.append(f"{'others, cores':20s} {d['other_procs_cores']:14.2f} {c['other_procs_cores']:10.2f}"
                 f"   (of {os.cpu_count()}, busy with other processes during the load)")
    for m in MODES:
        for e in rows[m]["errors"]:
            lines.append(f"  {m} error: {e[:200]}")
    if any(rows[m]["other_procs_cores"] > 0.3 for m in MODES):
        lines.append("WARNING: other processes were busy during the load; these numbers do not stand "
                     "(rerun on a quiet machine, or with --wait-idle)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--long-frac", type=float, default=0.25, help="share of long requests")
    p.add_argument("--long-len", type=int, default=1536, help="prompt tokens of a long request")
    p.add_argument("--long-out", type=int, default=8, help="new tokens of a long request")
    p.add_argument("--short-len", type=int, default=64, help="prompt tokens of a short request")
    p.add_argument("--short-out", type=int, default=96, help="new tokens of a short request")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunk size)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, "each mode's load")
    args = p.parse_args(argv)
    if not 0 <= args.long_frac <= 1:
        p.error("--long-frac must be in [0, 1]")

    load = make_load(args, load_tokenizer(MODEL))
    is_long = load[1]
    if all(is_long):
        p.error("no short requests: lower --long-frac or raise --num-requests")
    meter = Meter()
    rows = {m: run_mode(m, args, load, meter) for m in MODES}
    print(report(args, rows, is_long))
    write_json(args.json, {"args": vars(args), "num_long": sum(is_long), "cpus": os.cpu_count(),
                           "modes": {m: {k: v for k, v in r.items() if k not in ("all", "short")}
                                     for m, r in rows.items()}})
    return 1 if any(rows[m]["failed"] for m in MODES) else 0


if __name__ == "__main__":
    sys.exit(main())
