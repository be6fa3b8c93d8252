"""`pdcluster demo` / `make run`: the engine on the built-in model, a mixed workload, a report."""
from __future__ import annotations

import random
import statistics
import time

from router.slo import tpot_s
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

SYSTEM_PROMPT = "You are a terse assistant. Answer in one line. "
TOPICS = ["prefill", "decode", "KV cache", "paged attention", "prefix caching", "chunked prefill",
          "preemption", "goodput", "power of two choices", "continuous batching"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def run_offline_demo(cfg, num_prompts: int = 64) -> int:
    rng = random.Random(0)
    t_load = time.perf_counter()
    engine = LLMEngine(cfg)
    load_s = time.perf_counter() - t_load
    seqs = []
    for i in range(num_prompts):
        question = f"Explain {rng.choice(TOPICS)} " + "in detail " * rng.randint(0, 40)
        prompt = (SYSTEM_PROMPT if i % 2 == 0 else "") + question
        params = SamplingParams(max_tokens=rng.randint(16, 128), temperature=0.8, top_p=0.95, seed=i,
                                ignore_eos=True)
        seqs.append(engine.add_request(prompt, params))
    finish: dict[str, float] = {}
    t0 = time.monotonic()
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finish[o.request_id] = time.monotonic()
        steps += 1
    wall = time.monotonic() - t0
    results = [engine.result(s) for s in seqs]
    out_tokens = sum(len(r.token_ids) for r in results)
    in_tokens = sum(len(r.prompt_token_ids) for r in results)
    ttft = [(s.first_token_time - s.arrival_time) * 1e3 for s in seqs]
    # TPOT as the router and `pdcluster bench` define it (router/slo.py), from the same clock.
    tpot = [t * 1e3 for s in seqs
            if (t := tpot_s(s.first_token_time - s.arrival_time, finish[s.seq_id] - s.arrival_time,
                            s.num_output_tokens)) is not None]
    st = engine.scheduler.stats
    hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
    lines = [
        "pdcluster demo: one engine, offline",
        f"  model           {cfg.model}: {engine.model_config.num_params() / 1e6:.1f}M params, "
        f"{str(engine.dtype).removeprefix('torch.')} on {engine.device}, attention {engine.runner.backend.name}, "
        f"loaded in {load_s:.2f}s",
        f"  {engine.layout.describe(1024)}",
        f"  requests        {num_prompts} ({in_tokens} prompt tokens, {out_tokens} generated) in {wall:.2f}s, "
        f"{steps} steps",
        f"  throughput      {out_tokens / wall:.0f} output tok/s, {(in_tokens + out_tokens) / wall:.0f} total tok/s",
        f"  TTFT ms         p50 {_pct(ttft, 50):.1f}  p90 {_pct(ttft, 90):.1f}  p99 {_pct(ttft, 99):.1f}",
        f"  TPOT ms         p50 {_pct(tpot, 50):.2f}  p90 {_pct(tpot, 90):.2f}  mean {statistics.fmean(tpot):.2f}",
        f"  prefix cache    {st.prefix_cache_hits}/{st.prefix_cache_queries} prompt tokens hit ({hit:.0%})",
        f"  preemptions     {st.num_preemptions}",
        f"  KV blocks free  {engine.kv.num_free_blocks}/{engine.layout.num_blocks} after the run",
        "  sample          " + repr(results[0].text[:60]),
    ]
    print("\n".join(lines))
    return 0
