"""Penalties, logit_bias, min_p and min_tokens (workers/sampler.py) against transformers: its own
logits processors on the same logits, row by row with each row's own parameters (the sampler
does the whole batch at once), and its generate() on the same weights for greedy runs of our
engine. OpenAI's presence and frequency penalties have no transformers processor: their oracle
is the formula OpenAI documents, applied to transformers' logits step by step."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from common import PROMPTS, VOCAB, assert_all_blocks_free
from router.app import Detokenizer
from router.protocol import APIError, bad_words_tokens
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sampler import _apply_min_p, shape_logits
from workers.sequence import SamplingParams, Sequence
from workers.tokenizer import byte_level_tokenizer

EOS = VOCAB - 1                     # the byte-level tokenizer's </s>
STEPS = 24                          # greedy tokens per engine-against-transformers run


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(max_tokens=64, **params))
    s.token_ids += output
    return s


def histories(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs with repeats, some empty outputs (a first token)."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
             [rng.randrange(40) for _ in range(rng.choice([0, 1, 5, 30]))]) for _ in range(n)]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def test_repetition_penalties_of_a_batch_equal_transformers_row_by_row():
    rows = histories(12)
    penalties = [1.0, 1.3, 0.7, 2.0] * 3               # 1.0: a row that asks for none beside others that do
    logits = logits_for(len(rows))
    got = shape_logits(logits, [seq(p, o, repetition_penalty=r) for (p, o), r in zip(rows, penalties)])
    for i, ((p, o), r) in enumerate(zip(rows, penalties)):
        want = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), logits[i:i + 1].clone())[0]
        assert torch.equal(got[i], want), i


def test_presence_and_frequency_penalties_follow_openais_formula_over_the_output_only():
    rows = histories(12, seed=1)
    pf = [(0.0, 0.0), (0.5, 0.0), (0.0, 1.5), (-1.0, 2.0)] * 3
    logits = logits_for(len(rows), seed=1)
    got = shape_logits(logits, [seq(p, o, presence_penalty=a, frequency_penalty=b) for (p, o), (a, b) in zip(rows, pf)])
    for i, ((_, o), (presence, frequency)) in enumerate(zip(rows, pf)):
        want = logits[i].clone()
        for token, count in Counter(o).items():      # mu[j] - c[j] * frequency - (c[j] > 0) * presence
            want[token] -= count * frequency + presence
        assert torch.allclose(got[i], want, atol=1e-5), i


def test_logit_bias_equals_transformers_sequence_bias_of_single_tokens():
    rows = histories(6, seed=2)
    biases = [{}, {"3": 5.0, "7": -100.0}, {str(EOS): 2.5}, {"0": -0.5, "1": 0.5, "2": 100.0}, {}, {"9": 1.0}]
    logits = logits_for(len(rows), seed=2)
    got = shape_logits(logits, [seq(p, o, logit_bias=b) for (p, o), b in zip(rows, biases)])
    for i, ((p, o), b) in enumerate(zip(rows, biases)):
        want = logits[i:i + 1].clone()
        if b:
            want = SequenceBiasLogitsProcessor([[[int(t)], v] for t, v in b.items()])(torch.tensor([p + o]), want)
        assert torch.allclose(got[i], want[0]), i


def test_bad_words_ban_as_transformers_bans_them_after_their_prefix():
    """A word's last token is banned where the output ends with its other tokens. The prompts
    hold none of the words' tokens, so transformers (which reads prompt and output) and vLLM's
    rule (the output only) agree."""
    rng = random.Random(4)
    rows = [([rng.randrange(100, 200) for _ in range(rng.randrange(1, 20))],
             [rng.randrange(3) for _ in range(rng.choice([0, 1, 2, 6, 30]))]) for _ in range(16)]
    words = [[[rng.randrange(3) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 4))] for _ in rows]
    logits = logits_for(len(rows), seed=4)
    got = shape_logits(logits, [seq(p, o, bad_words_token_ids=w) for (p, o), w in zip(rows, words)])
    prefixed = sum(1 for (_, o), w in zip(rows, words) for word in w
                   if 1 < len(word) <= len(o) + 1 and o[len(o) - len(word) + 1:] == word[:-1])
    assert prefixed >= 5                              # words whose prefix the output ends with
    for i, ((p, o), w) in enumerate(zip(rows, words)):
        want = logits[i:i + 1].clone()
        if w:
            want = NoBadWordsLogitsProcessor(w, eos_token_id=EOS)(torch.tensor([p + o]), want)
        assert torch.equal(got[i], want[0]), i


def test_bad_words_are_tokenized_as_written_and_after_a_space():
    tok = byte_level_tokenizer()
    encode = lambda t: tok.encode(t, add_special_tokens=False)   # noqa: E731
    assert bad_words_tokens(["hi", " hi", "a b"], encode) == [encode("hi"), encode(" hi"), encode("a b"),
                                                              encode(" a b")]
    for bad in ("x", [""], ["  "], [1], ["x"] * 129, ["y" * 513]):
        with pytest.raises(APIError) as e:
            bad_words_tokens(bad, encode)
        assert e.value.param == "bad_words"


def test_min_tokens_holds_back_eos_and_stop_ids_as_transformers_holds_eos():
    rows = histories(8, seed=3)
    mins = [0, 3, 40, 1, 5, 30, 2, 0]
    logits = logits_for(len(rows), seed=3)
    got = shape_logits(logits, [seq(p, o, min_tokens=m) for (p, o), m in zip(rows, mins)], eos_token_ids=(EOS,))
    for i, ((p, o), m) in enumerate(zip(rows, mins)):
        want = MinNewTokensLengthLogitsProcessor(len(p), m, EOS)(torch.tensor([p + o]), logits[i:i + 1].clone())[0]
        assert torch.equal(got[i], want), (i, m, len(o))
    # Its own stop token ids too, and EOS not when the request ignores it.
    got = shape_logits(logits[:1], [seq([1], [], min_tokens=2, stop_token_ids=[5], ignore_eos=True)], (EOS,))
    assert got[0, 5] == float("-inf") and got[0, EOS] == logits[0, EOS]


def test_min_p_keeps_the_tokens_transformers_keeps():
    logits = logits_for(6, seed=4)
    min_ps = torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 1.0])
    got = _apply_min_p(logits, min_ps)
    for i, m in enumerate(min_ps.tolist()):
        want = MinPLogitsWarper(m)(None, logits[i:i + 1].clone())[0] if m > 0 else logits[i]
        assert torch.equal(got[i].isinf(), want.isinf()), i
        assert torch.equal(got[i][~got[i].isinf()], logits[i][~got[i].isinf()])


# -- the engine against transformers' generate() on the same weights -------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20,
                                                                     swap_space_bytes=0)))


def engine_greedy(engine, prompts, **params) -> list[list[int]]:
    results = engine.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=STEPS, **params))
    assert_all_blocks_free(engine)
    return [r.token_ids for r in results]


def hf_greedy_with(hf_model, prompt: list[int], **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                pad_token_id=VOCAB - 2, **kw)
    return out[0, len(prompt):].tolist()


PICKED = PROMPTS[:6]


def test_greedy_with_a_repetition_penalty_equals_transformers(engine, hf_model):
    got = engine_greedy(engine, PICKED, repetition_penalty=1.5, ignore_eos=True)
    plain = engine_greedy(engine, PICKED, ignore_eos=True)
    assert got != plain                                  # the penalty changes what is generated
    assert got == [hf_greedy_with(hf_model, p, repetition_penalty=1.5, eos_token_id=None) for p in PICKED]


def test_greedy_with_logit_bias_equals_transformers(engine, hf_model):
    plain = engine_greedy(engine, PICKED, ignore_eos=True)
    bias = {str(t): -100.0 for t in {ids[0] for ids in plain}} | {"65": 8.0}   # ban each first token, favour "A"
    got = engine_greedy(engine, PICKED, logit_bias=bias, ignore_eos=True)
    assert all(g[0] != p[0] for g, p in zip(got, plain))
    hf_bias = [[[int(t)], b] for t, b in bias.items()]
    assert got == [hf_greedy_with(hf_model, p, sequence_bias=hf_bias, eos_token_id=None) for p in PICKED]


def test_greedy_with_bad_words_equals_transformers(engine, hf_model):
    """Each prompt's first two greedy tokens as a word, and its fourth alone: neither is
    generated again (a prompt that ends with a word's first token is left out: transformers
    would read the prompt's end as the word's start)."""
    plain = engine_greedy(engine, PROMPTS, ignore_eos=True)
    picked = [(p, ids) for p, ids in zip(PROMPTS, plain) if p[-1] != ids[0]][:4]
    for prompt, ids in picked:
        words = [ids[:2], ids[3:4]]
        (got,) = engine_greedy(engine, [prompt], bad_words_token_ids=words, ignore_eos=True)
        assert got != ids and ids[3] not in got
        assert all(got[k:k + 2] != ids[:2] for k in range(len(got) - 1))
        assert got == hf_greedy_with(hf_model, prompt, bad_words_ids=words, eos_token_id=None)


def test_logprobs_beside_penalties_are_the_models_own_as_transformers_reports_them(engine, hf_model):
    """With a repetition penalty and a logit bias choosing the tokens, each token's logprob and
    its top 2 are the model's own distribution (vLLM's default, raw logprobs), as transformers'
    `output_logits` report it, within 1e-4; the tokens are transformers' generate()'s."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=2, repetition_penalty=1.5,
                            logit_bias={"65": 4.0}, ignore_eos=True)
    results = engine.generate([{"prompt_token_ids": p} for p in PICKED[:3]], params)
    for prompt, r in zip(PICKED[:3], results):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                    pad_token_id=VOCAB - 2, eos_token_id=None, repetition_penalty=1.5,
                                    sequence_bias=[[[65], 4.0]], output_logits=True, return_dict_in_generate=True)
        assert out.sequences[0, len(prompt):].tolist() == r.token_ids
        raw = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
        want = raw[torch.arange(STEPS), torch.tensor(r.token_ids)]
        assert torch.allclose(torch.tensor([lp["logprob"] for lp in r.logprobs]), want, atol=1e-4)
        for step, lp in enumerate(r.logprobs):
            top = raw[step].topk(2)
            assert set(lp["top"]) == set(top.indices.tolist()), step
            assert torch.allclose(torch.tensor([lp["top"][t] for t in top.indices.tolist()]), top.values, atol=1e-4)


def test_min_tokens_delays_an_eos_the_model_is_pushed_to(engine, hf_model):
    """EOS favoured by +50 ends every request at once; min_tokens 7 holds it back for 7 tokens
    (transformers' min_new_tokens), then it ends the request."""
    push = {str(EOS): 50.0}
    assert all(len(ids) == 1 for ids in engine_greedy(engine, PICKED, logit_bias=push))
    got = engine_greedy(engine, PICKED, logit_bias=push, min_tokens=7)
    assert all(len(ids) == 8 and ids[-1] == EOS for ids in got)
    assert got == [hf_greedy_with(hf_model, p, sequence_bias=[[[EOS], 50.0]], min_new_tokens=7, eos_token_id=EOS)
                   for p in PICKED]


def test_greedy_with_presence_and_frequency_penalties_follows_openais_formula(engine, hf_model):
    """Step by step on transformers' logits: mu[j] - c[j] * frequency - (c[j] > 0) * presence,
    c counting the output so far, then the largest."""
    presence, frequency = 0.8, 0.6
    got = engine_greedy(engine, PICKED[:3], presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    for prompt, ids in zip(PICKED[:3], got):
        out: list[int] = []
        with torch.inference_mode():
            for _ in range(STEPS):
                mu = hf_model(torch.tensor([prompt + out])).logits[0, -1].clone()
                for token, count in Counter(out).items():
                    mu[token] -= count * frequency + presence
                out.append(int(mu.argmax()))
        assert ids == out


# -- stop strings with min_tokens and include_stop_str_in_output ---------------------------------
TEXT_PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):",
                "Q: What is the capital of France?\nA:"]


ASCII = {str(t): 6.0 for t in (32, 97, 98, 99)}       # pushes the output to " abc": a token is a character


def stop_cases(engine) -> list[tuple[str, list[int], str]]:
    """(prompt, its greedy output, a two-character string the output holds at least twice)."""
    cases = []
    for prompt in TEXT_PROMPTS:
        full = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                        logit_bias=ASCII))[0]
        text = full.text
        assert len(text) == len(full.token_ids)
        stop = next((text[j:j + 2] for j in range(2, len(text) - 1) if text.find(text[j:j + 2]) + 2 <= j), None)
        if stop is not None:
            cases.append((prompt, full.token_ids, stop))
    assert len(cases) >= 2, "too few outputs repeat"
    return cases


def stops_at(text: str, stop: str, min_tokens: int) -> int:
    """vLLM's rule: the first token, from the min_tokens-th on, whose text ends the stop string."""
    return next(e for e in range(max(min_tokens, 1) - 1, len(text)) if text[:e + 1].endswith(stop))


def run_stop(engine, prompt: str, stop: str, min_tokens: int, include: bool):
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logit_bias=ASCII,
                                                    stop=[stop], min_tokens=min_tokens,
                                                    include_stop_str_in_output=include))[0]


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_skips_a_stop_string_that_ends_before_them_and_the_text_may_keep_it(engine, include):
    """The oracle: the same greedy output without a stop (a stop changes no token, only where
    the output ends) and vLLM's rule for where it ends. A stop string ending before min_tokens
    does not count; the next one does; include_stop_str_in_output keeps it at the end."""
    for prompt, ids, stop in stop_cases(engine):
        text = engine.tokenizer.decode(ids)
        first = stops_at(text, stop, 0)
        for min_tokens in (0, first + 2):
            at = stops_at(text, stop, min_tokens)
            r = run_stop(engine, prompt, stop, min_tokens, include)
            assert r.finish_reason == "stop" and r.token_ids == ids[:at + 1], (prompt, stop, min_tokens)
            assert r.text == text[:at + 1 - (0 if include else len(stop))]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 48])
def test_the_routers_text_ends_where_the_engine_stopped(engine, include, chunk):
    """The router's incremental detokenizer, fed the engine's tokens `chunk` at a time as the
    events bring them, gives the engine's own text."""
    for prompt, ids, stop in stop_cases(engine):
        text = engine.tokenizer.decode(ids)
        for min_tokens in (0, stops_at(text, stop, 0) + 2):
            r = run_stop(engine, prompt, stop, min_tokens, include)
            detok = Detokenizer(engine.tokenizer, [stop], min_tokens, include)
            got = "".join(detok.push(r.token_ids[i:i + chunk], i + chunk >= len(r.token_ids))
                          for i in range(0, len(r.token_ids), chunk))
            assert got == r.text, (prompt, min_tokens)
