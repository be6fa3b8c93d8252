"""Sampling: seeds, greedy equivalences, stop conditions, max_tokens, logprobs, and the
top-k / top-p distributions.

Oracles: greedy runs of the same engine (for equivalences), the decoded greedy text (for stop
strings), transformers' logits on prompt + outputs (for logprobs), and transformers' own
temperature / top-k / top-p warpers plus the softmax they leave (for which tokens may be drawn
and how often)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from common import PROMPTS, assert_all_blocks_free, random_prompts
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sampler import sample
from workers.sequence import SamplingParams, Sequence

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
    # a temperature too small to divide by (logits / 1e-300 overflow) is greedy too, as in vLLM
    tiny_t = SamplingParams(temperature=1e-300, max_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in run(engine, [ids(p) for p in prompts], tiny_t)] == greedy


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


# -- top-k / top-p against transformers' warpers ------------------------------------------------
# (temperature, top_k, top_p): top-k alone, nucleus alone (at a temperature != 1, so a cutoff
# computed before the temperature shows), and both (the nucleus of the top-k renormalised).
WARP_CONFIGS = [(1.0, 8, 1.0), (0.7, 5, 1.0), (0.8, 0, 0.5), (1.0, 20, 0.6), (1.3, 0, 0.3)]
# Our model's logits and transformers' differ by ~1e-5 (see test_logprobs_match_hf); a token
# this close to a cutoff (in logit, or in probability mass for top-p) could land on either side,
# so the chosen prompts must keep clear of it (the closest here is ~5e-4).
CUTOFF_MARGIN = 2e-4


def hf_last_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0, -1].float()


def hf_warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling pipeline (temperature, then top-k, then top-p, as in `generate`)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]


def allowed_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """token -> probability of drawing it: the softmax (float64) of the tempered logits over the
    set transformers' warpers keep. Asserts no token sits within CUTOFF_MARGIN of a cutoff."""
    kept = torch.isfinite(hf_warped(logits, temperature, top_k, top_p)).nonzero().flatten().tolist()
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True).tolist()
    assert sorted(order[:len(kept)]) == sorted(kept), "the kept set is not a top prefix"
    if top_k > 0:
        after_k = min(top_k, len(order))
        kth, next_ = scaled[order[after_k - 1]], scaled[order[after_k]]
        assert kth - next_ > CUTOFF_MARGIN, "top-k boundary too close to call"
    if top_p < 1.0:
        pool = order[:top_k] if top_k > 0 else order
        probs = torch.softmax(scaled[pool], dim=0)
        before = (probs.cumsum(0) - probs).tolist()          # mass ahead of each token
        assert all(abs(m - top_p) > CUTOFF_MARGIN for m in before), "top-p boundary too close to call"
    probs = torch.softmax(scaled[kept], dim=0).tolist()
    return dict(zip(kept, probs))


def chi_square_critical(df: int, z: float = 4.265) -> float:
    """The chi-square quantile at the normal quantile z (4.265: upper tail 1e-5), by the
    Wilson-Hilferty approximation (no scipy here)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", WARP_CONFIGS)
def test_sampler_draws_follow_the_truncated_softmax(hf_model, temperature, top_k, top_p):
    """8000 seeded draws of workers/sampler.py on transformers' logits: none outside the set
    transformers' warpers keep, and the counts fit the softmax restricted to that set
    (chi-square). A cutoff one token off either way, a nucleus taken before the temperature or
    over the whole vocabulary instead of the top-k, or a wrong temperature all fail here."""
    n = 8000
    for prompt in (PROMPTS[0], PROMPTS[3], PROMPTS[5]):
        logits = hf_last_logits(hf_model, prompt)
        dist = allowed_distribution(logits, temperature, top_k, top_p)
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i, max_tokens=1)
                  for i in range(n)]
        seqs = [Sequence(f"r{i}", prompt, p) for i, p in enumerate(params)]
        drawn = sample(logits[None].expand(n, -1).contiguous(), seqs).token_ids
        counts = Counter(drawn)
        outside = {t: c for t, c in counts.items() if t not in dist}
        assert not outside, f"drawn outside the {len(dist)} allowed tokens: {outside}"
        # Pearson's chi-square, tokens expecting fewer than 5 draws pooled into one bin.
        bins, small_obs, small_exp = [], 0, 0.0
        for t, q in dist.items():
            if n * q >= 5:
                bins.append((counts[t], n * q))
            else:
                small_obs, small_exp = small_obs + counts[t], small_exp + n * q
        if small_exp > 0:
            bins.append((small_obs, small_exp))
        assert len(bins) >= 2, "a degenerate configuration: one bin tests nothing"
        chi2 = sum((o - e) ** 2 / e for o, e in bins)
        assert chi2 < chi_square_critical(len(bins) - 1), (len(prompt), len(dist), chi2, len(bins) - 1)
        # The same seeds draw the same tokens: the draws above are a fixed sample.
        assert sample(logits[None].expand(8, -1).contiguous(),
                      [Sequence(f"again{i}", prompt, params[i]) for i in range(8)]).token_ids == drawn[:8]


@pytest.mark.parametrize("temperature, top_k, top_p", WARP_CONFIGS)
def test_engine_draws_stay_in_transformers_top_k_and_nucleus(engine, hf_model, temperature, top_k, top_p):
    """The whole engine (its own model's logits, batched with other requests): every seeded
    first token lies in the set transformers' warpers keep for that prompt, and every allowed
    token likely to show up (>= 8 expected draws) does show up."""
    n = 150
    for prompt in (PROMPTS[2], PROMPTS[4], PROMPTS[10]):
        dist = allowed_distribution(hf_last_logits(hf_model, prompt), temperature, top_k, top_p)
        reqs = [dict(ids(prompt), params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                        seed=1000 + i, max_tokens=1, ignore_eos=True))
                for i in range(n)]
        drawn = [r.token_ids[0] for r in run(engine, reqs)]
        outside = sorted({t for t in drawn if t not in dist})
        assert not outside, f"prompt of {len(prompt)}: drawn {outside} outside the {len(dist)} allowed tokens"
        likely = {t for t, q in dist.items() if n * q >= 8}
        assert likely <= set(drawn), f"never drawn: {sorted(likely - set(drawn))}"
