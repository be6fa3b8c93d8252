#!/usr/bin/env python
"""Conditional disaggregation (issue 15, item 2): the --local-prefill-max-tokens threshold swept
on one served cluster, 1 prefill + 1 decode `tiny`, the same load for each setting.

    .venv/bin/python benchmarks/bench_local_prefill.py [--rate 4] [--num-requests 80] [--thresholds 0,64,256,2048,auto]

The load is bench_interference.py's: long prompts (--long-len in, --long-out out) for a
--long-frac share of the requests, short ones (--short-len in, --short-out out) otherwise, sent
open-loop at gamma gaps (`pdcluster bench`'s load generator). Every setting gets the same send
times and lengths and prompts of its own (so no setting reads another's prefix cache). A
threshold of 0 is plain disaggregation; one at least the long prompts' length prefills
everything on the decode worker (a colocated worker that also lends prefill to a prefill worker
never used); `auto` decides request by request with the fitted cost model. Reported per setting:
TTFT p50 and p99 over all requests and p50 over the short ones, ITL p99 and TPOT p99 over the
short ones, KV handoffs and local prefills (the workers' and the router's counters).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter, add_common_args, write_json  # noqa: E402
from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import sample_random  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402
from workers.names import AUTO  # noqa: E402

MODEL = "tiny"
ROWS = [("TTFT p50", "median_ttft_ms", "all"), ("TTFT p99", "p99_ttft_ms", "all"),
        ("TTFT p50 short", "median_ttft_ms", "short"), ("ITL p99 short", "p99_itl_ms", "short"),
        ("TPOT p99 short", "p99_tpot_ms", "short")]


def make_load(a, tokenizer, seed: int):
    n_long = round(a.long_frac * a.num_requests)
    is_long = [True] * n_long + [False] * (a.num_requests - n_long)
    random.Random(a.seed).shuffle(is_long)                       # the same pattern for every setting
    longs = iter(sample_random(tokenizer, n_long, a.long_len, a.long_out, seed=seed + 1))
    shorts = iter(sample_random(tokenizer, a.num_requests - n_long, a.short_len, a.short_out, seed=seed + 2))
    return [next(longs) if x else next(shorts) for x in is_long], is_long


def pulls(cluster) -> int:
    import ray
    return sum(r.kv_transfer.count for r in ray.get([m.handle.stats.remote() for m in cluster.workers]))


def local_prefills(cluster) -> float:
    return sum(s.value for family in cluster.server.metrics.registry.collect() for s in family.samples
               if s.name == "pdcluster:local_prefills_total")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--short-out", type=int, default=96)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunk size)")
    p.add_argument("--thresholds", default="0,64,256,2048,auto")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, "each setting")
    a = p.parse_args()
    settings = [AUTO if t == AUTO else int(t) for t in a.thresholds.split(",")]
    import ray
    ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    meter, tok, rows = Meter(), load_tokenizer(MODEL), {}
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_batched_tokens": a.budget}})
    with ServingCluster(spec, port=free_port(), admission="queue", max_pending=4096,
                        local_prefill_max_tokens=AUTO) as c:
        d = c.server.dispatcher
        target = loadgen.Target(f"http://{c.host}:{c.port}", "/v1/completions", MODEL, ignore_eos=True)
        warm, _ = make_load(a, tok, 1000)
        asyncio.run(loadgen.run_load(target, warm[:16]))                 # the cost model gets fitted
        for i, setting in enumerate(settings):
            d.placement.local_prefill_max_tokens = setting
            requests, is_long = make_load(a, tok, 10 * (i + 1))
            if a.wait_idle:
                meter.wait_idle(a.wait_idle)
            before_pulls, before_local = pulls(c), local_prefills(c)
            with meter.part(str(setting)):
                results, duration = asyncio.run(loadgen.run_load(target, requests, a.rate, seed=a.seed))
            short = [r for r, long in zip(results, is_long) if not long]
            summary = {"all": loadgen.summarize(results, duration), "short": loadgen.summarize(short, duration)}
            rows[str(setting)] = {label: summary[which][key] for label, key, which in ROWS}
            rows[str(setting)].update(failed=sum(not r.success for r in results), handoffs=pulls(c) - before_pulls,
                                      local=local_prefills(c) - before_local)
    print(f"\n{a.num_requests} requests at {a.rate:g}/s, {a.long_frac:.0%} long ({a.long_len} in, {a.long_out} out), "
          f"short {a.short_len} in, {a.short_out} out; 1 prefill + 1 decode {MODEL}, budget {a.budget}")
    print(f"{'threshold':>10s} " + " ".join(f"{label + ' ms':>18s}" for label, _, _ in ROWS)
          + f" {'handoffs':>9s} {'local':>6s} {'failed':>7s}")
    for setting, r in rows.items():
        print(f"{setting:>10s} " + " ".join(f"{r[label]:18.1f}" for label, _, _ in ROWS)
              + f" {r['handoffs']:9d} {r['local']:6.0f} {r['failed']:7d}")
    base = rows.get("0")
    if base:
        print("\nagainst 0 (plain disaggregation): " + "; ".join(
            f"{s}: TTFT p50 {r['TTFT p50'] / base['TTFT p50']:.2f}x, ITL p99 short "
            f"{r['ITL p99 short'] / base['ITL p99 short']:.2f}x" for s, r in rows.items() if s != "0"))
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")
    write_json(a.json, {"args": vars(a), "rows": rows, "parts": meter.parts})


if __name__ == "__main__":
    main()
