"""Sampling: seeds, greedy equivalences, stop conditions, max_tokens and logprobs.

Oracles: greedy runs of the same engine (for equivalences), the decoded greedy text (for stop
strings), and transformers' logits on prompt + outputs (for logprobs)."""
from __future__ import annotations

import pytest
import torch

from common import PROMPTS, assert_all_blocks_free, random_prompts
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

TEXT_PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,",
                "def fibonacci(n):", "Q: What is the capital of France?\nA:"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20,
                                                                     swap_space_bytes=0)))


def run(engine, requests, params=None):
    results = engine.generate(requests, params)
    assert_all_blocks_free(engine)
    return results


def ids(p):
    return {"prompt_token_ids": p}


def test_seeded_sampling_reproducible_and_independent_of_batch(engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    target = ids(PROMPTS[4])
    alone = run(engine, [dict(target, params=seeded)])[0].token_ids
    assert run(engine, [dict(target, params=seeded)])[0].token_ids == alone

    others = [dict(ids(p), params=SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=m, ignore_eos=True))
              for p, t, k, s, m in [(PROMPTS[1], 0.8, 0, None, 40), (PROMPTS[5], 1.3, 20, 7, 16),
                                    (PROMPTS[0], 0.0, 0, None, 32), (PROMPTS[4], 1.0, 0, None, 32)]]
    batch = run(engine, others[:2] + [dict(target, params=seeded)] + others[2:])
    assert batch[2].token_ids == alone
    # The seed is really used: another seed gives another continuation.
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=32, ignore_eos=True)
    assert run(engine, [dict(target, params=other_seed)])[0].token_ids != alone


def greedy_ids(engine, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in run(engine, [ids(p) for p in prompts], params)]


def test_top_k_1_and_temperature_0_equal_greedy(engine):
    prompts = PROMPTS[:6]
    greedy = greedy_ids(engine, prompts)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in run(engine, [ids(p) for p in prompts], top1)] == greedy
    # temperature 0 next to random requests in the same batch is still greedy
    mixed = []
    for i, p in enumerate(prompts):
        mixed.append(dict(ids(p), params=SamplingParams(temperature=0.0, top_p=0.5, top_k=5, seed=i,
                                                        max_tokens=24, ignore_eos=True)))
        mixed.append(dict(ids(p), params=SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)))
    got = run(engine, mixed)
    assert [r.token_ids for r in got[::2]] == greedy


def test_stop_string_ends_output_and_is_excluded(engine):
    checked = 0
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt in TEXT_PROMPTS:
        full = run(engine, [prompt], plain)[0]
        text = full.text
        # A run of two printable ASCII characters past the start of the output: it decodes
        # the same whatever bytes surround it, so the first match is where we expect it.
        at = next((i for i in range(3, len(text) - 1)
                   if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
        if at is None:
            continue
        stop = text[at:at + 2]
        first = text.find(stop)
        r = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                 stop=[stop, "\x00never\x00"]))[0]
        assert r.finish_reason == "stop"
        assert r.text == text[:first]
        assert stop not in r.text
        assert r.token_ids == full.token_ids[:len(r.token_ids)]
        assert len(r.token_ids) < len(full.token_ids)
        checked += 1
    assert checked >= 2


def test_stop_token_ids(engine):
    for prompt in PROMPTS[:4]:
        greedy = greedy_ids(engine, [prompt], max_tokens=32)[0]
        stop_tok = greedy[5]
        first = greedy.index(stop_tok)
        r = run(engine, [ids(prompt)], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                      stop_token_ids=[stop_tok]))[0]
        assert r.finish_reason == "stop"
        assert r.token_ids == greedy[:first + 1]


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_max_tokens_gives_length(engine, max_tokens):
    prompts = PROMPTS[:5]
    results = run(engine, [ids(p) for p in prompts],
                  SamplingParams(temperature=0.7, seed=3, max_tokens=max_tokens, ignore_eos=True))
    for r in results:
        assert r.finish_reason == "length"
        assert len(r.token_ids) == max_tokens


def test_logprobs_match_hf(engine, hf_model):
    prompts = random_prompts(5, [1, 9, 40, 130])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    results = run(engine, [ids(p) for p in prompts], params)
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=3)
    results += run(engine, [ids(p) for p in prompts], sampled)
    for p, r in zip(prompts + prompts, results):
        assert len(r.logprobs) == len(r.token_ids) == 12
        with torch.inference_mode():
            logits = hf_model(torch.tensor([p + r.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(p) - 1:len(p) - 1 + len(r.token_ids)], dim=-1)
        for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)):
            assert lp["logprob"] == pytest.approx(ref[i, tok].item(), abs=1e-4), (len(p), i)
            k = len(lp["top"])
            vals, top_ids = ref[i].topk(k)
            assert sorted(lp["top"]) == sorted(top_ids.tolist()), (len(p), i)
            for t, v in zip(top_ids.tolist(), vals.tolist()):
                assert lp["top"][t] == pytest.approx(v, abs=1e-4)
