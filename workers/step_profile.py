"""Timed engine steps over a grid of batch shapes: the samples the step cost model is fitted on
(workers/cost_model.py). `pdcluster profile` runs it on an engine of its own; a serving worker
runs it on its own engine when the pool controller asks, before it serves (Worker.profile).

The grid: prefill batches of k prompts of l tokens, chunks on cached context, and decode
batches of n sequences at context c. Each timed step's shape is the one the engine itself
reports (`last_shape`), so the fit sees exactly what the simulator and the controller ask about.
"""
from __future__ import annotations

import random
import statistics
import time

from workers.cost_model import BatchShape

PREFILL_GRID = [(1, 16), (1, 64), (1, 128), (1, 256), (1, 384), (1, 512), (2, 256), (4, 128), (4, 256),
                (8, 64), (2, 512), (1, 1024)]                   # (prompts, tokens each)
DECODE_GRID = [(1, 64), (1, 512), (4, 128), (8, 256), (16, 128), (16, 512), (32, 64), (32, 256), (64, 128),
               (64, 384), (128, 64), (8, 1024)]                 # (sequences, context)


def _median_step(engine, repeats: int) -> tuple[BatchShape, float] | None:
    """Time `repeats` steps of the engine as it stands; the median, with the first step's shape
    (later steps of a decode batch differ only in context, which the fit sees per sample)."""
    samples = []
    for _ in range(repeats):
        if not engine.has_unfinished():
            break
        t0 = time.perf_counter()
        engine.step()
        samples.append((engine.last_shape, time.perf_counter() - t0))
    if not samples:
        return None
    samples.sort(key=lambda s: s[1])
    return samples[len(samples) // 2]


def profile_steps(engine, repeats: int = 5, seed: int = 0, progress=print,
                  decode: bool = True) -> list[tuple[BatchShape, float]]:
    """Timed steps over the grids (the prefill ones only unless `decode`), on an engine without
    prefix caching (every token computes)."""
    from workers.sequence import SamplingParams
    rng = random.Random(seed)
    vocab, limit = engine.vocab_size, engine.max_model_len
    budget = engine.scheduler.cfg.max_num_batched_tokens
    max_seqs = engine.scheduler.cfg.max_num_seqs
    out = []
    def ids(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def clear():
        for rid in list(engine._seqs):
            engine.abort(rid)

    engine.generate([{"prompt_token_ids": ids(32)}], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
    for k, n in PREFILL_GRID:
        if k * n > budget or n >= limit:
            continue
        for _ in range(repeats):                  # each prompt prefills once: repeat the batch
            for _ in range(k):
                engine.add_request(prompt_token_ids=ids(n), params=SamplingParams(max_tokens=1, ignore_eos=True))
            s = _median_step(engine, 1)
            clear()
            out.append(s)
        progress(f"  prefill {k} x {n} tokens: {statistics.median(t for _, t in out[-repeats:]) * 1e3:.2f} ms")
    # A chunk on cached context: a long prompt split by a small budget (its later chunks attend to the earlier).
    for n in (512, 1024):
        if n >= limit:
            continue
        engine.scheduler.cfg.max_num_batched_tokens = n // 4
        engine.add_request(prompt_token_ids=ids(n), params=SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            out.append((engine.last_shape, time.perf_counter() - t0))
        engine.scheduler.cfg.max_num_batched_tokens = budget
        progress(f"  chunked prefill of {n} tokens in chunks of {n // 4}")
    for k, ctx in DECODE_GRID if decode else ():
        if k > max_seqs or ctx + repeats + 2 >= limit or k * ctx > engine.layout.max_resident_tokens * 0.9:
            continue
        for _ in range(k):
            engine.add_request(prompt_token_ids=ids(ctx), params=SamplingParams(max_tokens=repeats + 2,
                                                                                 ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in engine._seqs.values()):
            engine.step()                          # prefill them all (not timed)
        s = _median_step(engine, repeats)
        clear()
        if s is not None and s[0].num_decode == k:
            out.append(s)
            progress(f"  decode {k} x {ctx} context: {s[1] * 1e3:.2f} ms")
    return out
