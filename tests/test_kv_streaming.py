"""A long prompt's KV streamed to its decode worker while it is prefilled (workers/kv_stream.py,
Worker._copy_streamed), on real worker actors through shared memory, the test in the router's
place: the prefill worker's words name its blocks chunk by chunk; the decode worker copies them
before the held KV's word comes, and its tokens are the single engine's. Reordered words, an
abort mid-stream, words that stop and a held word that does not fit end cleanly: every block
back on both sides."""
from __future__ import annotations

import random

import pytest

from common import wait_for
from test_transfer_faults import P_ID, Side, assert_clean, params

CHUNK = 32                                   # the prefill's token budget per step: 5 chunks below
LONG = 150                                   # tokens: 9 full blocks of 16 and one partial


def _prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 200), k=LONG)


@pytest.fixture(scope="module")
def stream_pool(ray_session):
    from cluster.run.launcher import ClusterSpec, launch, shutdown
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1,
                       engine={"cache": {"num_blocks": 64}, "scheduler": {"max_num_batched_tokens": CHUNK}},
                       num_cpus_per_worker=0.5, lease_s=60, transfer_timeout_s=5, kv_transport="shm")
    workers, _ = launch(spec)
    try:
        yield Side(workers[0].handle), Side(workers[1].handle)
    finally:
        shutdown(workers)


def reference(prompt: list[int]) -> list[int]:
    """The offline single engine's greedy tokens, its prompt computed in the same chunks."""
    from workers.config import EngineConfig, SchedulerConfig
    from workers.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny", scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK)))
    return engine.generate([{"prompt_token_ids": prompt}], params())[0].token_ids


def prefilled(P: Side, rid: str, prompt: list[int]):
    """Prefill on P: (its words while computing, its held event)."""
    from router.dispatch import _computed_so_far
    from workers import messages as msg
    P.submit(msg.PrefillOp(rid, prompt, params()))
    held = P.wait_event(lambda e: e.rid == rid and (isinstance(e, msg.ErrorEvent) or e.held or e.finished))
    assert isinstance(held, msg.TokenEvent) and held.held and held.kv is not None, held
    words = [e.kv for e in P.events if e.rid == rid and _computed_so_far(e)]
    return words, held


def blocks(side: Side, ids: list[int]):
    return side.on(lambda w, ids: [(k[ids].clone(), v[ids].clone()) for k, v in w.engine.runner.kv_caches], ids)


def reserved(D: Side, rid: str) -> list[int]:
    return D.on(lambda w, rid: w.engine.kv.block_ids(w.engine._seqs[rid]) if rid in w.engine._seqs else [], rid)


def same(a, b) -> bool:
    return all(bool((ka == kb).all()) and bool((va == vb).all()) for (ka, va), (kb, vb) in zip(a, b))


def test_the_prompt_streams_chunk_by_chunk_and_decodes_as_the_single_engine(stream_pool):
    """Each chunk's word names more blocks, each a prefix of the held KV's; the decode worker has
    copied every block they name before the held word is sent; then it decodes the single
    engine's tokens, and both workers get every block back."""
    from workers import messages as msg
    P, D = stream_pool
    prompt = _prompt(1)
    before = D.stats().kv_transfer
    words, held = prefilled(P, "s1", prompt)
    counts = [len(w.block_ids) for w in words]
    assert len(words) >= 3 and counts == sorted(set(counts)) and counts[-1] < len(held.kv.block_ids), counts
    assert all(w.block_ids == held.kv.block_ids[:len(w.block_ids)] for w in words)
    D.submit(msg.DecodeOp("s1", prompt, params(), [], P_ID, kv=words[0], streaming=True))
    for w in words[1:]:
        D.submit(msg.KVMoreOp("s1", w))
    named = words[-1].block_ids
    theirs = blocks(P, named)
    wait_for(lambda: reserved(D, "s1"), lambda dst: len(dst) == len(held.kv.block_ids)
             and same(blocks(D, dst[:len(named)]), theirs), 30)
    D.submit(msg.KVMoreOp("s1", held.kv, held.tokens))
    ev = D.wait_event(lambda e: e.rid == "s1" and (isinstance(e, msg.ErrorEvent) or e.finished))
    assert isinstance(ev, msg.TokenEvent), ev
    assert held.tokens + D.tokens("s1") == reference(prompt)
    P.submit(msg.AbortOp("s1"))                     # the router's release after the first decode token
    assert_clean(P, D)
    after = D.stats().kv_transfer
    assert (after.count, after.failures) == (before.count + 1, before.failures)


def test_words_that_come_before_their_decode_op_are_kept_for_it(stream_pool):
    """The actor's threads may reorder two calls: a word and even the held word sent before the
    DecodeOp still make a complete, correct handoff."""
    from workers import messages as msg
    P, D = stream_pool
    prompt = _prompt(2)
    words, held = prefilled(P, "s2", prompt)
    D.submit(msg.KVMoreOp("s2", words[-1]))
    D.submit(msg.KVMoreOp("s2", held.kv, held.tokens))
    D.submit(msg.DecodeOp("s2", prompt, params(), [], P_ID, kv=words[0], streaming=True))
    ev = D.wait_event(lambda e: e.rid == "s2" and (isinstance(e, msg.ErrorEvent) or e.finished))
    assert isinstance(ev, msg.TokenEvent), ev
    assert held.tokens + D.tokens("s2") == reference(prompt)
    P.submit(msg.AbortOp("s2"))
    assert_clean(P, D)


def test_an_abort_mid_stream_frees_the_reservation_and_is_no_failure(stream_pool):
    from workers import messages as msg
    P, D = stream_pool
    prompt = _prompt(3)
    before = D.stats().kv_transfer
    words, _ = prefilled(P, "s3", prompt)
    D.submit(msg.DecodeOp("s3", prompt, params(), [], P_ID, kv=words[0], streaming=True))
    wait_for(D.stats, lambda s: s.receiving == 1, 30)
    for side in (D, P):
        side.submit(msg.AbortOp("s3"))
    assert_clean(P, D)
    D.drain()
    assert not [e for e in D.events if e.rid == "s3"]
    assert D.stats().kv_transfer.failures == before.failures


@pytest.mark.parametrize("case", ["silence", "misfit", "misfit-first"])
def test_a_stream_whose_words_stop_or_do_not_fit_fails_retryably_and_frees_everything(stream_pool, case):
    """No word within the transfer timeout (5 s here), or a held word with the wrong number of
    output tokens (sent once the pull is under way, or before its DecodeOp, which meets it while
    it waits for room): a retryable error (the router runs the request again), counted as a
    failed pull, and every block back once the router aborts it on the prefill worker; never a
    decode with the tokens the word brought."""
    from workers import messages as msg
    P, D = stream_pool
    prompt = _prompt({"silence": 4, "misfit": 5, "misfit-first": 6}[case])
    rid = f"s-{case}"
    before = D.stats().kv_transfer
    words, held = prefilled(P, rid, prompt)
    misfit = msg.KVMoreOp(rid, held.kv, held.tokens * 2)
    if case == "misfit-first":
        D.submit(misfit)
    D.submit(msg.DecodeOp(rid, prompt, params(), [], P_ID, kv=words[0], streaming=True))
    if case == "misfit":
        wait_for(D.stats, lambda s: s.receiving == 1, 30)
        D.submit(misfit)
    ev = D.wait_event(lambda e: e.rid == rid, 60)
    assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "KV transfer failed" in ev.error, ev
    P.submit(msg.AbortOp(rid))
    assert_clean(P, D)
    assert D.stats().kv_transfer.failures == before.failures + 1
