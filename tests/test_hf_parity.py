"""Greedy outputs of our engine equal Hugging Face transformers' on the same checkpoint,
whatever the scheduler and cache do underneath (chunked prefill, block sizes, prefix hits,
preemption by recompute and by swap). Every run must also give every block back."""
from __future__ import annotations

import pytest

from common import MAX_NEW_TOKENS, PROMPTS, SHARED_PREFIX_PROMPTS, assert_all_blocks_free
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
SMALL_KV = dict(kv_cache_memory_bytes=32 * 2**20, swap_space_bytes=0)   # keeps start-up cheap


def generate_ids(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    results = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for r in results:
        assert r.finish_reason == "length"
        assert len(r.token_ids) == MAX_NEW_TOKENS
    return [r.token_ids for r in results]


def assert_same_as_hf(got: list[list[int]], want: list[list[int]], prompts: list[list[int]]) -> None:
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
            bad.append(f"prompt {i} (len {len(prompts[i])}): first difference at output {at}")
    assert not bad, "; ".join(bad)


CONFIGS = {
    "defaults": lambda: dict(),
    "chunked-prefill-16": lambda: dict(cache=CacheConfig(**SMALL_KV),
                                       scheduler=SchedulerConfig(max_num_batched_tokens=16)),
    "block-size-1": lambda: dict(cache=CacheConfig(block_size=1, **SMALL_KV)),
    "block-size-32": lambda: dict(cache=CacheConfig(block_size=32, **SMALL_KV)),
    # "auto" picks the C++ kernel on CPU when it builds: run the torch reference backend too,
    # over chunks on context (paged reads) and decodes alike.
    "torch-backend-chunked-bs8": lambda: dict(attention_backend="torch",
                                              cache=CacheConfig(block_size=8, **SMALL_KV),
                                              scheduler=SchedulerConfig(max_num_batched_tokens=48)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(name, tiny_dir, hf_greedy):
    engine = LLMEngine(EngineConfig(model=tiny_dir, **CONFIGS[name]()))
    if name.startswith("torch-backend"):
        assert engine.runner.backend.name == "torch"
    got = generate_ids(engine, PROMPTS)
    assert_same_as_hf(got, hf_greedy(PROMPTS), PROMPTS)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_hf_under_preemption(mode, tiny_dir, hf_greedy):
    # 40 blocks x 16 tokens = 640 resident tokens for 16 prompts of up to 300 + 64 tokens.
    engine = LLMEngine(EngineConfig(
        model=tiny_dir,
        cache=CacheConfig(num_blocks=40, swap_space_bytes=8 * 2**20 if mode == "swap" else 0),
        scheduler=SchedulerConfig(preemption_mode=mode)))
    got = generate_ids(engine, PROMPTS)
    assert engine.scheduler.stats.num_preemptions[mode] > 0, engine.scheduler.stats
    assert_same_as_hf(got, hf_greedy(PROMPTS), PROMPTS)
    assert_all_blocks_free(engine)


PREFIX_CONFIGS = {
    "defaults": lambda: dict(cache=CacheConfig(**SMALL_KV)),
    # Hits on blocks written by a chunk of the same step, and on one-token blocks.
    "chunked-bs4": lambda: dict(cache=CacheConfig(block_size=4, **SMALL_KV),
                                scheduler=SchedulerConfig(max_num_batched_tokens=64)),
}


@pytest.mark.parametrize("name", list(PREFIX_CONFIGS))
def test_greedy_matches_hf_with_prefix_cache_hits(name, tiny_dir, hf_greedy):
    prompts = SHARED_PREFIX_PROMPTS
    want = hf_greedy(prompts)
    engine = LLMEngine(EngineConfig(model=tiny_dir, **PREFIX_CONFIGS[name]()))
    stats = engine.scheduler.stats

    assert_same_as_hf(generate_ids(engine, prompts), want, prompts)
    first_hits = stats.prefix_cache_hits
    assert first_hits > 0, stats
    assert_all_blocks_free(engine)

    # A second batch after the first has finished: its blocks sit on the free list, cached.
    again = list(reversed(prompts))
    results = engine.generate([{"prompt_token_ids": p} for p in again], GREEDY)
    assert_same_as_hf([r.token_ids for r in results], list(reversed(want)), again)
    assert stats.prefix_cache_hits > first_hits
    block_size = engine.kv.block_size
    for p, r in zip(again, results):
        # Every full block but the one holding the last prompt token was cached by batch 1.
        assert r.num_cached_tokens == (len(p) - 1) // block_size * block_size, len(p)
    assert_all_blocks_free(engine)


def test_builtin_name_and_exported_dir_agree(tiny_dir):
    prompts = PROMPTS[:6]
    cfg = dict(cache=CacheConfig(**SMALL_KV))
    by_name = generate_ids(LLMEngine(EngineConfig(model="tiny", **cfg)), prompts)
    by_dir = generate_ids(LLMEngine(EngineConfig(model=tiny_dir, **cfg)), prompts)
    assert by_name == by_dir


TEXTS = ["Hello, world!", "  two  spaces\tand a tab\nand a newline", "naïve café 日本語 🙂",
         "<s>special tokens</s> inside", "0123456789" * 5, ""]


def test_exported_tokenizer_loads_in_transformers(tiny_dir):
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(num_blocks=8, swap_space_bytes=0)))
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        assert hf_tok.encode(text) == ids, text
        assert hf_tok.decode(ids, skip_special_tokens=True) == engine.tokenizer.decode(ids), text
    assert hf_tok.eos_token_id == engine.tokenizer.eos_token_id
    assert hf_tok.bos_token_id == engine.tokenizer.bos_token_id
