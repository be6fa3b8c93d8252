"""Samples of one prompt forked from a carrier's KV (issue 14, item 3), on the engine alone.

A carrier computes (or receives) the prompt's KV once; each fork shares its full blocks, gets a
copy of the partial one, and samples its first token from its own decode step. The oracle is the
same engine running each sample as a request of its own (n=1): greedy forks equal it token for
token; a seeded fork j equals n=1 with `sample_seed(seed, j)`. The block pool's invariants hold
throughout, and every block comes back.
"""
from __future__ import annotations

import dataclasses

import pytest

from common import assert_all_blocks_free
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.messages import Fork
from workers.sequence import SamplingParams, sample_seed

CARRIER = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny"))


def prompt_of(length: int) -> list[int]:
    return [(7 * i + 3) % 200 + 1 for i in range(length)]


def alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([{"prompt_token_ids": prompt}], params)[0].token_ids


def run(engine) -> dict[str, list]:
    """Steps until nothing is left: each request's tokens, and "reasons": (id, finish reason)."""
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                outs.setdefault("reasons", []).append((o.request_id, o.finish_reason))
    return outs


def seeded_forks(tag: str, n: int) -> list[Fork]:
    return [Fork(f"{tag}-{j}", dataclasses.replace(SEEDED, seed=sample_seed(SEEDED.seed, j))) for j in range(n)]


def check_pool(engine) -> None:
    """Every block's refcount is the number of block tables holding it."""
    held: dict[int, int] = {}
    for table in engine.kv._block_ids.values():
        for b in table:
            held[b] = held.get(b, 0) + 1
    for b in engine.kv.pool.blocks:
        assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id, 0))


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 37])
def test_forks_equal_their_samples_run_alone(engine, length):
    # Lengths around the block size (16): the partial block is copied, or there is none.
    prompt = prompt_of(length)
    want_greedy = alone(engine, prompt, GREEDY)
    forks = [Fork(f"g{length}-{j}", GREEDY) for j in range(4)]
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id=f"c{length}", forks=forks)
    outs = run(engine)
    assert outs[f"c{length}"] == [] and (f"c{length}", "forked") in outs["reasons"]
    assert [outs[f.rid] for f in forks] == [want_greedy] * 4
    assert_all_blocks_free(engine)

    forks = seeded_forks(f"s{length}", 4)
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id=f"d{length}", forks=forks)
    outs = run(engine)
    got = [outs[f.rid] for f in forks]
    assert got == [alone(engine, prompt, f.params) for f in forks]
    assert got[0] == alone(engine, prompt, SEEDED)             # sample 0 is the request with n=1
    assert len({tuple(x) for x in got}) == 4                    # four streams of their own
    assert_all_blocks_free(engine)


def test_a_fork_shares_the_full_blocks_and_copies_the_partial_one(engine):
    prompt = prompt_of(40)                                      # 39 tokens of KV: 2 full blocks + 7
    forks = [Fork(f"share-{j}", GREEDY) for j in range(3)]
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id="share", forks=forks)
    engine.step()                                               # the carrier's prompt, then the forks
    kv = engine.kv
    tables = [kv._block_ids[f.rid] for f in forks]
    assert len({t[0] for t in tables}) == len({t[1] for t in tables}) == 1     # shared full blocks
    assert len({t[2] for t in tables}) == 3                                     # a tail each
    assert kv.pool.blocks[tables[0][0]].ref_cnt == 3
    assert len(engine._copies) == 3
    check_pool(engine)
    out = engine.step()                                         # the copies run before this forward
    assert not engine._copies and len(out) == 3
    check_pool(engine)
    outs = run(engine)
    assert all(len(outs[f.rid]) == GREEDY.max_tokens - 1 for f in forks)
    assert_all_blocks_free(engine)


def test_an_aborted_fork_never_starts_and_an_aborted_carrier_starts_none(engine):
    prompt = prompt_of(20)
    forks = [Fork(f"ab-{j}", GREEDY) for j in range(3)]
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id="ab", forks=forks)
    assert engine.abort("ab-1")
    outs = run(engine)
    assert "ab-1" not in outs and outs["ab-0"] == outs["ab-2"] == alone(engine, prompt, GREEDY)
    assert_all_blocks_free(engine)

    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id="ab2",
                       forks=[Fork(f"ab2-{j}", GREEDY) for j in range(3)])
    assert engine.abort("ab2")
    assert not engine.abort("ab2-0")                            # gone with its carrier
    assert run(engine) == {} and not engine._forking
    assert_all_blocks_free(engine)


def test_forks_without_a_free_seat_wait_and_still_equal_their_samples():
    # Two seats: the carrier forks two samples from its KV; the other two wait as requests of
    # their own (the prefix cache serves them the shared blocks) and give the same tokens.
    engine = LLMEngine(EngineConfig(model="tiny", scheduler=SchedulerConfig(max_num_seqs=2)))
    prompt = prompt_of(37)
    forks = seeded_forks("seat", 4)
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id="seat", forks=forks)
    outs = run(engine)
    assert [outs[f.rid] for f in forks] == [alone(engine, prompt, f.params) for f in forks]
    assert_all_blocks_free(engine)


def test_forks_from_received_kv_equal_their_samples_run_alone(engine):
    # The decode side: a carrier reserves blocks, the prompt's KV arrives (copied here from a
    # prefill-only run on another engine, as the transport would), and the forks start from it.
    decode = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(enable_prefix_caching=False)))
    prompt = prompt_of(45)
    engine.add_request(prompt_token_ids=prompt, params=CARRIER, request_id="held", prefill_only=True)
    first = run(engine)["held"]
    src = engine.held_block_ids("held")
    forks = seeded_forks("recv", 3)
    dst = decode.reserve("carrier", prompt, first, CARRIER, forks=forks)
    assert dst is not None and len(dst) == len(src)
    for (k, v), (dk, dv) in zip(engine.runner.kv_caches, decode.runner.kv_caches):
        dk[dst] = k[src]
        dv[dst] = v[src]
    assert engine.release("held")
    forked = decode.commit_received("carrier")
    assert forked is not None and forked.finished and forked.finish_reason == "forked"
    outs = run(decode)
    assert [outs[f.rid] for f in forks] == [alone(engine, prompt, f.params) for f in forks]
    assert_all_blocks_free(decode)
    assert_all_blocks_free(engine)


def test_a_carrier_is_only_a_prompt():
    engine = LLMEngine(EngineConfig(model="tiny"))
    with pytest.raises(ValueError, match="carrier"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=CARRIER, prefill_only=True, forks=[Fork("x", GREEDY)])
    with pytest.raises(ValueError, match="distinct"):
        engine.add_request(prompt_token_ids=[1, 2, 3], params=CARRIER, forks=[Fork("x", GREEDY), Fork("x", GREEDY)])
    assert_all_blocks_free(engine)
