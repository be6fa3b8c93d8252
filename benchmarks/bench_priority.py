#!/usr/bin/env python
"""Priority inheritance on and off, in simulation: time to first token of high-priority requests
that share prefixes with low-priority ones, the same arrivals both ways.

    .venv/bin/python benchmarks/bench_priority.py [--rate 3] [--duration-s 300]

One worker (the real EngineCore and Scheduler, `--scheduling-policy priority`) steps on a virtual
clock, each step taking the cost model's time for its batch (a roofline of --model on --gpu).
Requests arrive as a Poisson process: each starts with one of --prefixes shared prefixes of
--prefix-len tokens; a --high-share of them are high priority (0) with --high-own tokens of
their own, the rest low priority (1) with --low-own. Prints TTFT per class, the prompt tokens
computed (a prefix computed twice counts twice) and the ratios.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers.config import SchedulerConfig  # noqa: E402
from workers.cost_model import roofline  # noqa: E402
from workers.engine_core import EngineCore, KVCacheLayout  # noqa: E402
from workers.sequence import SamplingParams  # noqa: E402


class CostEngine(EngineCore):
    """The engine's bookkeeping with a fake model: every sampled token is 0."""

    def _execute(self, out):
        seqs = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
        return seqs, [0] * len(seqs), None


def workload(a) -> list[tuple[float, int, list[int], int]]:
    """(arrival s, priority, prompt, max_tokens), in arrival order."""
    rng = random.Random(a.seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(a.prefix_len)] for _ in range(a.prefixes)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.duration_s:
            return out
        high = rng.random() < a.high_share
        own = [rng.randrange(1, 30000) for _ in range(a.high_own if high else a.low_own)]
        out.append((t, 0 if high else 1, rng.choice(prefixes) + own, a.output_len))


def run(a, cost, requests, inheritance: bool) -> dict:
    cfg = SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens, policy="priority",
                          priority_inheritance=inheritance)
    now = [0.0]
    e = CostEngine(cfg, KVCacheLayout(cost.kv_bytes_per_token, 16, cost.kv_capacity_tokens // 16, 0),
                   1 << 20, 32000, clock=lambda: now[0])
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    seqs, i, computed = [], 0, 0
    while i < len(requests) or e.has_unfinished():
        while i < len(requests) and requests[i][0] <= now[0]:
            t, priority, ids, _ = requests[i]
            seqs.append(e.add_request(prompt_token_ids=ids, params=params, request_id=f"r{i}", priority=priority,
                                      arrival_time=t))
            i += 1
        out = e.schedule_step()
        if out.is_empty:
            now[0] = requests[i][0]
            continue
        computed += e.last_shape.prefill_tokens
        now[0] += cost.step_s(e.last_shape)
        e.finish_step(out, *e._execute(out))
    stats = {}
    for name, prio in (("high", 0), ("low", 1)):
        ttft = sorted(s.first_token_time - s.arrival_time for s in seqs if s.priority == prio)
        stats[name] = {"n": len(ttft), "mean": sum(ttft) / max(1, len(ttft)),
                       "p50": ttft[len(ttft) // 2] if ttft else float("nan"),
                       "p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan")}
    stats["prefill_tokens"] = computed
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=3.0, help="requests/s")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--high-share", type=float, default=0.25)
    ap.add_argument("--high-own", type=int, default=64)
    ap.add_argument("--low-own", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu", default="h100-sxm")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cost = roofline(a.model, a.gpu, 1)
    requests = workload(a)
    print(f"{len(requests)} requests at {a.rate:g} req/s over {a.duration_s:g} s on one {a.gpu} {a.model}: "
          f"{a.prefixes} prefixes of {a.prefix_len} tokens; {a.high_share:.0%} high priority (+{a.high_own} tokens), "
          f"the rest low (+{a.low_own}); budget {a.max_num_batched_tokens} tokens/step", flush=True)
    runs = {on: run(a, cost, requests, on) for on in (True, False)}
    print(f"{'inheritance':<12} {'class':<5} {'requests':>8} {'TTFT mean':>10} {'p50':>8} {'p99':>8} "
          f"{'prompt tokens computed':>23}")
    for on, r in runs.items():
        for name in ("high", "low"):
            c = r[name]
            print(f"{'on' if on else 'off':<12} {name:<5} {c['n']:>8} {c['mean']:>9.3f}s {c['p50']:>7.3f}s "
                  f"{c['p99']:>7.3f}s {r['prefill_tokens'] if name == 'high' else '':>23}")
    on, off = runs[True], runs[False]
    print(f"on / off: high TTFT mean {on['high']['mean'] / off['high']['mean']:.2f}x, p99 "
          f"{on['high']['p99'] / off['high']['p99']:.2f}x; low TTFT mean {on['low']['mean'] / off['low']['mean']:.2f}x; "
          f"prompt tokens computed {on['prefill_tokens'] / off['prefill_tokens']:.2f}x")


if __name__ == "__main__":
    main()
