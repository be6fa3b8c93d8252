#!/usr/bin/env python
"""What the sampling parameters of issue 29 cost a step: penalties, logit_bias and min_p
against plain greedy sampling, side by side in one run.

    .venv/bin/python benchmarks/bench_sampling_params.py [--vocab 32000] [--batch 64] [--reps 20]

1. The sampler alone (workers/sampler.py `sample`) on random logits of a real vocabulary's width
   (--vocab) for a decode batch of --batch sequences, each with a 512-token prompt and
   --output-len tokens out: milliseconds per call, plain greedy against greedy with presence,
   frequency and repetition penalties and a 16-entry logit_bias (the same for every row: the worst
   case, every row asking), and against seeded sampling with min_p; medians of --reps calls.
2. The engine (the exported `tiny`, offline, 32 prompts x 128 -> 64 tokens, greedy): output
   tokens per second without and with the same penalties, and with a structured output (a JSON
   schema that never ends within 64 tokens, so every step masks every row), alternated twice.
3. Grammar compilation for benchmarks/schemas.py's suite of 50 JSON schemas (the exported
   `tiny`'s byte-level tokenizer): each compiled afresh, then its first mask; median and max ms.
Prints each and the ratios.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.schemas import schema_suite  # noqa: E402
from workers.config import CacheConfig, EngineConfig  # noqa: E402
from workers import grammar as grammar_module  # noqa: E402
from workers.grammar import Grammars  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.sampler import sample  # noqa: E402
from workers.sequence import SamplingParams, Sequence  # noqa: E402

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                 logit_bias={str(t): 1.0 for t in range(100, 116)})


def sampler_ms(vocab: int, batch: int, output_len: int, reps: int, **params) -> float:
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        s = Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(512)], SamplingParams(max_tokens=4096, **params))
        s.token_ids += [rng.randrange(vocab) for _ in range(output_len)]
        seqs.append(s)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sample(logits, seqs, (vocab - 1,))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def engine_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], **params) -> float:
    t0 = time.perf_counter()
    results = engine.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, **params))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)


# Grammars built to be slow (each mask costs every request in the batch its time).
HOSTILE = {"regex a{100000}": {"regex": "a{100000}"}, "regex a{20000}": {"regex": "a{20000}"},
           "regex (a{100}){100}": {"regex": "(a{100}){100}"},
           "regex 5,000-way alternation": {"regex": "|".join(f"w{i}q{i * 13}" for i in range(5000))},
           "JSON, 300 anyOf branches with patterns": {"json": json.dumps({"anyOf": [
               {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,40}"}},
                "required": [f"k{i}"]} for i in range(300)]})},
           "Lark, 'xy' then a{100000}": {"grammar": 'start: "xy" /a{100000}/'}}


def hostile_costs(tokenizer, limits: dict, steps: int = 40) -> dict[str, str]:
    """Each hostile grammar under `limits` (workers/grammar.py's LIMITS, or llguidance's
    defaults): compile time (with the first mask), the slowest later mask over `steps` tokens,
    each the first token its mask allows, and whether the grammar ran out of fuel."""
    saved, grammar_module.LIMITS = grammar_module.LIMITS, limits
    try:
        grammars = Grammars(tokenizer)
    finally:
        grammar_module.LIMITS = saved
    out = {}
    for name, spec in HOSTILE.items():
        t0 = time.perf_counter()
        error = grammars.check(spec)
        compile_ms = 1000 * (time.perf_counter() - t0)
        if error:
            out[name] = f"refused in {compile_ms:.0f} ms"
            continue
        m, slowest, ended = grammars.state(spec).matcher, 0.0, ""
        for step in range(steps):
            t = time.perf_counter()
            mask = m.compute_bitmask()
            slowest = max(slowest, time.perf_counter() - t) if step else slowest
            if m.is_error():
                ended = f", out of fuel at token {step}"
                break
            allowed = next((i * 8 + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1), None)
            if allowed is None or m.is_stopped():
                break
            m.consume_token(allowed)
        out[name] = f"compile {compile_ms:.0f} ms, later masks up to {1000 * slowest:.1f} ms{ended}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    plain = sampler_ms(a.vocab, a.batch, a.output_len, a.reps, temperature=0)
    shaped = sampler_ms(a.vocab, a.batch, a.output_len, a.reps, temperature=0, **PENALTIES)
    seeded = sampler_ms(a.vocab, a.batch, a.output_len, a.reps, temperature=1.0, seed=1)
    min_p = sampler_ms(a.vocab, a.batch, a.output_len, a.reps, temperature=1.0, seed=1, min_p=0.05)
    print(f"sampler, vocab {a.vocab}, batch {a.batch}, {a.output_len} tokens out each (median of {a.reps}):")
    print(f"  greedy {plain:.2f} ms; with penalties and logit_bias {shaped:.2f} ms ({shaped / plain:.2f}x)")
    print(f"  seeded {seeded:.2f} ms; with min_p {min_p:.2f} ms ({min_p / seeded:.2f}x)")

    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20,
                                                                     swap_space_bytes=0)))
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(128)] for _ in range(32)]
    engine_tokens_per_s(engine, prompts)                       # warm
    schema = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "integer"}}}}
    kinds = {"plain": {}, "penalties": PENALTIES, "JSON schema": {"structured": {"json": json.dumps(schema)}}}
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(2):
        for name, params in kinds.items():
            runs[name].append(engine_tokens_per_s(engine, prompts, **params))
    compile_ms, mask_ms = [], []
    for schema in schema_suite():
        grammars = Grammars(engine.tokenizer)                  # no cache: each compiled afresh
        t0 = time.perf_counter()
        state = grammars.state({"json": json.dumps(schema)})
        t1 = time.perf_counter()
        state.matcher.compute_bitmask()
        compile_ms.append(1000 * (t1 - t0))
        mask_ms.append(1000 * (time.perf_counter() - t1))
    print(f"grammar compilation, 50 schemas: median {statistics.median(compile_ms):.2f} ms, max "
          f"{max(compile_ms):.2f} ms; first mask median {statistics.median(mask_ms):.3f} ms, max {max(mask_ms):.3f} ms")
    ours, defaults = hostile_costs(engine.tokenizer, grammar_module.LIMITS), hostile_costs(engine.tokenizer, {})
    print("hostile grammars (byte-level vocabulary): llguidance's default limits | ours (workers/grammar.py LIMITS)")
    for name in HOSTILE:
        print(f"  {name}: {defaults[name]} | {ours[name]}")
    p = statistics.mean(runs["plain"])
    print("engine (tiny, 32 x 128 -> 64, greedy), output tokens/s: " + "; ".join(
        f"{name} {statistics.mean(r):.0f} ({statistics.mean(r) / p:.2f}x, runs {[round(x) for x in r]})"
        for name, r in runs.items()))


if __name__ == "__main__":
    main()
