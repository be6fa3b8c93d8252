"""The KV handoff at the engine level: a prefill engine holds a prompt's blocks, a decode
engine reserves its own, the blocks are copied across, and decoding continues. The oracle is
the single-engine path (itself checked against transformers in test_hf_parity)."""
from __future__ import annotations

import pytest
import torch

from common import PROMPTS, SHARED_PREFIX_PROMPTS, assert_all_blocks_free
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams, SequenceStatus

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def copy_blocks(src: LLMEngine, src_ids: list[int], dst: LLMEngine, dst_ids: list[int]) -> None:
    """Stands in for the transport: same data, different block ids on each side."""
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        dk[torch.tensor(dst_ids)] = sk[torch.tensor(src_ids)]
        dv[torch.tensor(dst_ids)] = sv[torch.tensor(src_ids)]


def handoff(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
            resume_from: list[list[int]] | None = None) -> list[list[int]]:
    """Prefill on one engine, copy the KV, decode on the other; `resume_from`: per prompt, the
    output tokens a client already has (a resumed request), continued from."""
    resume_from = resume_from or [[] for _ in prompts]
    seqs = [prefill.add_request(prompt_token_ids=p, params=params, prefill_only=True, output_token_ids=r)
            for p, r in zip(prompts, resume_from)]
    while prefill.has_unfinished():
        prefill.step()
    # Held for a decode worker, or finished by the token prefill sampled (its last one).
    assert all(s.status is SequenceStatus.HELD or s.finish_reason == "length" for s in seqs)
    outputs = {s.seq_id: list(s.output_token_ids) for s in seqs if s.status is not SequenceStatus.HELD}
    held = {s.seq_id for s in seqs if s.status is SequenceStatus.HELD}
    for s in seqs:
        if s.status is not SequenceStatus.HELD:
            continue
        dst = decode.reserve(s.seq_id, s.prompt_token_ids, s.output_token_ids, params)
        assert dst is not None
        src = prefill.held_block_ids(s.seq_id)
        assert len(src) == -(-(s.num_tokens - 1) // prefill.kv.block_size) >= len(dst)
        # The leading blocks decode's prefix cache holds are not received: only the rest.
        copy_blocks(prefill, src[len(src) - len(dst):], decode, dst)
        decode.commit_received(s.seq_id)
        assert prefill.release(s.seq_id)
        outputs[s.seq_id] = list(s.output_token_ids)          # resumed from + the token prefill sampled
    finished = set()
    while decode.has_unfinished():
        for o in decode.step():
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    assert finished == held                                     # every handed-off sequence ended on decode
    return [outputs[s.seq_id] for s in seqs]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_handoff_matches_single_engine(block_size):
    prompts = PROMPTS[:8] + SHARED_PREFIX_PROMPTS[:4]
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=block_size, num_blocks=4096 // block_size))
    single = LLMEngine(cfg).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    got = handoff(prefill, decode, prompts)
    assert got == [r.token_ids for r in single]
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


def test_reserve_applies_backpressure_and_abort_frees():
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=20))
    decode = LLMEngine(cfg)
    prompt = list(range(200))                                   # 13 blocks
    first = decode.reserve("a", prompt, [5], GREEDY)
    assert first is not None and len(first) == 13
    assert decode.reserve("b", prompt, [5], GREEDY) is None   # no room: wait
    assert decode.abort("a")                                    # e.g. the transfer failed
    assert decode.reserve("b", prompt, [5], GREEDY) is not None
    assert decode.abort("b")
    assert_all_blocks_free(decode)


def test_only_the_blocks_decode_lacks_are_received():
    """A prompt whose leading full blocks decode's prefix cache holds (a handoff of the same
    prefix arrived before) reserves, and so receives, only the rest; the output still equals
    the single engine's (what decode computes on reads the reused blocks)."""
    bs = 16
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=bs, num_blocks=256))
    shared = list(range(5, 5 + 4 * bs))
    prompts = [shared + [7, 8, 9], shared + list(range(200, 240))]
    single = LLMEngine(cfg).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    assert handoff(prefill, decode, prompts[:1]) == [single[0].token_ids]
    s = prefill.add_request(prompt_token_ids=prompts[1], params=GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    dst = decode.reserve(s.seq_id, s.prompt_token_ids, s.output_token_ids, GREEDY)
    src = prefill.held_block_ids(s.seq_id)
    assert len(src) - len(dst) == 4                           # the shared prefix: not received
    copy_blocks(prefill, src[4:], decode, dst)
    decode.commit_received(s.seq_id)
    assert prefill.release(s.seq_id)
    out = list(s.output_token_ids)
    while decode.has_unfinished():
        out += [t for o in decode.step() for t in o.new_token_ids]
    assert out == single[1].token_ids
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


def test_reserve_waits_while_one_more_sequence_would_break_a_tpot_target():
    """The decode worker has timed its decode steps (2 ms + 1 ms per row here): a handoff whose
    sequence would make the step longer than the tightest TPOT target among the running ones
    and its own waits (None: backpressure); one that fits is taken, and any is when nothing runs
    or nobody has a target."""
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=256))
    prompt = list(range(40))

    def timed() -> LLMEngine:
        engine = LLMEngine(cfg)
        for i in range(40):
            rows = 1 + i % 6
            engine.scheduler.decode_steps.observe(rows, 0.002 + 0.001 * rows)
        return engine

    def admit(engine, rid: str, tpot_s) -> bool:
        if engine.reserve(rid, prompt, [5], GREEDY, tpot_s=tpot_s) is None:
            return False
        engine.commit_received(rid)
        return True
    decode = timed()
    assert all(admit(decode, rid, 0.0075) for rid in "abcd")    # 4 rows: 6 ms <= 7.5 ms
    assert admit(decode, "e", 0.5)                              # 5 rows: 7 ms, within the running ones' 7.5
    assert not admit(decode, "f", 0.5)                          # 6 rows: 8 ms > 7.5 ms
    assert not admit(decode, "g", None)                         # the running ones' targets hold
    for rid in "de":
        decode.abort(rid)
    assert not admit(decode, "h", 0.0055)                       # 4 rows: 6 ms > its own 5.5 ms
    assert admit(decode, "i", 0.0065)
    free = timed()                                              # no targets: only seats and blocks
    assert all(admit(free, str(i), None) for i in range(10))


def test_reserved_blocks_are_not_prefix_hits_until_committed():
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=64))
    decode = LLMEngine(cfg)
    prompt = list(range(100))
    decode.reserve("a", prompt, [1], GREEDY)
    other = decode.add_request(prompt_token_ids=prompt + [7], params=GREEDY)
    computed, num_cached = decode.kv.get_computed_blocks(other)
    assert num_cached == 0            # the KV has not arrived: nothing to reuse yet
    decode.abort("a")
    decode.abort(other.seq_id)
    assert_all_blocks_free(decode)


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_as_if_never_interrupted(params):
    """A request cut after k tokens (a dead worker, a failed handoff) and resumed elsewhere from
    prompt + those k tokens, on one engine or through a handoff, ends with exactly the tokens of
    the uninterrupted run: greedy, and seeded (the draw at each position depends on the seed
    and the position only)."""
    prompts = PROMPTS[:6]
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=256))
    full = [r.token_ids for r in LLMEngine(cfg).generate([{"prompt_token_ids": p} for p in prompts], params)]
    cuts = [1, 2, 5, 11, 17, 23]                                # 23 of 24: one token left
    resume_from = [f[:k] for f, k in zip(full, cuts)]
    other = LLMEngine(cfg)
    seqs = [other.add_request(prompt_token_ids=p, params=params, output_token_ids=r)
            for p, r in zip(prompts, resume_from)]
    while other.has_unfinished():
        other.step()
    assert [s.output_token_ids for s in seqs] == full
    assert all(s.finish_reason == "length" for s in seqs)      # max_tokens counts the resumed ones
    assert handoff(LLMEngine(cfg), LLMEngine(cfg), prompts, params, resume_from) == full
    assert_all_blocks_free(other)


def test_seeded_output_is_the_same_through_a_handoff():
    prompts = PROMPTS[:6]
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=256))
    single = [r.token_ids for r in LLMEngine(cfg).generate([{"prompt_token_ids": p} for p in prompts], SEEDED)]
    assert len({tuple(t[:2]) for t in single}) > 1 and any(t[0] != t[1] for t in single)
    assert handoff(LLMEngine(cfg), LLMEngine(cfg), prompts, SEEDED) == single


def test_nothing_left_to_generate_is_refused():
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64)))
    with pytest.raises(ValueError, match="nothing left to generate"):
        engine.add_request(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3), output_token_ids=[4, 5, 6])
    with pytest.raises(ValueError, match="output_token_ids"):
        engine.add_request(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3), output_token_ids=[10**6])
