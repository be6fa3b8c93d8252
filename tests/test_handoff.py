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


def handoff(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [prefill.add_request(prompt_token_ids=p, params=GREEDY, prefill_only=True) for p in prompts]
    while prefill.has_unfinished():
        prefill.step()
    assert all(s.status is SequenceStatus.HELD for s in seqs)
    outputs = {}
    for s in seqs:
        dst = decode.reserve(s.seq_id, s.token_ids, s.num_prompt_tokens, GREEDY)
        assert dst is not None
        src = prefill.held_block_ids(s.seq_id)
        assert len(src) == len(dst) == -(-s.num_prompt_tokens // prefill.kv.block_size)
        copy_blocks(prefill, src, decode, dst)
        decode.commit_received(s.seq_id)
        assert prefill.release(s.seq_id)
        outputs[s.seq_id] = list(s.output_token_ids)          # the first token, from prefill
    finished = set()
    while decode.has_unfinished():
        for o in decode.step():
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    assert finished == set(outputs)
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
    first = decode.reserve("a", prompt + [5], len(prompt), GREEDY)
    assert first is not None and len(first) == 13
    assert decode.reserve("b", prompt + [5], len(prompt), GREEDY) is None   # no room: wait
    assert decode.abort("a")                                    # e.g. the transfer failed
    assert decode.reserve("b", prompt + [5], len(prompt), GREEDY) is not None
    assert decode.abort("b")
    assert_all_blocks_free(decode)


def test_reserved_blocks_are_not_prefix_hits_until_committed():
    cfg = EngineConfig(model="tiny", cache=CacheConfig(block_size=16, num_blocks=64))
    decode = LLMEngine(cfg)
    prompt = list(range(100))
    decode.reserve("a", prompt + [1], len(prompt), GREEDY)
    other = decode.add_request(prompt_token_ids=prompt + [7], params=GREEDY)
    computed, num_cached = decode.kv.get_computed_blocks(other)
    assert num_cached == 0            # the KV has not arrived: nothing to reuse yet
    decode.abort("a")
    decode.abort(other.seq_id)
    assert_all_blocks_free(decode)
