"""The shared-memory KV handoff's pieces (workers/kv_shm.py) between two real processes: a
child owns a cache in a memfd, this process maps it and copies blocks out of it. The oracle is
the child's own tensors (sent over a pipe); no Ray."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from workers import cpu_kernels
from workers.kv_shm import KVSegment, PeerCaches, SharedKVCache, _runs, copy_blocks, copy_heads
from workers.kv_transfer import KVLayoutMismatch

LAYERS, SHAPE = 3, (12, 4, 2, 8)          # blocks, block size, kv heads, head dim


class _Block:
    def __init__(self, block_id: int):
        self.block_id = block_id


def _owner(conn) -> None:
    cache = SharedKVCache(LAYERS, SHAPE, torch.float32)
    g = torch.Generator().manual_seed(7)
    for k, v in cache.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    cache.bump([_Block(b) for b in (1, 2, 5)])
    conn.send((cache.segment("node-a").to_dict(), [(k.clone(), v.clone()) for k, v in cache.kv_caches]))
    while (cmd := conn.recv()) is not None:          # ("bump", ids) | ("write", block, value)
        if cmd[0] == "bump":
            cache.bump([_Block(b) for b in cmd[1]])
        else:
            for k, v in cache.kv_caches:
                k[cmd[1]].fill_(cmd[2])
                v[cmd[1]].fill_(cmd[2])
        conn.send("done")


@pytest.fixture
def owner():
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_owner, args=(child_conn,), daemon=True)
    child.start()
    assert conn.poll(60), "the owner did not start"
    segment, tensors = conn.recv()
    yield conn, KVSegment(**segment), tensors, child
    if child.is_alive():
        conn.send(None)
        child.join(10)


def mine(num_blocks: int = 6):
    return [(torch.zeros(num_blocks, *SHAPE[1:]), torch.zeros(num_blocks, *SHAPE[1:])) for _ in range(LAYERS)]


def test_blocks_copied_out_of_a_peers_cache_are_its_blocks(owner):
    """Scattered and consecutive ids on both sides (runs of several blocks and of one), a
    receiver with fewer blocks than the owner; the blocks not named stay untouched."""
    conn, segment, theirs, _ = owner
    peers = PeerCaches()
    caches, generations = peers.open("p", segment, mine())
    dst = mine()
    src_ids, dst_ids = [7, 8, 9, 0, 11], [1, 2, 3, 5, 0]
    nbytes = copy_blocks(caches, src_ids, dst, dst_ids)
    assert nbytes == len(src_ids) * 2 * LAYERS * SHAPE[1] * SHAPE[2] * SHAPE[3] * 4
    for (dk, dv), (tk, tv) in zip(dst, theirs):
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(dk[d], tk[s]) and torch.equal(dv[d], tv[s])
        assert not dk[4].any() and not dv[4].any()
    assert generations.tolist() == [0, 1, 1, 0, 0, 1] + [0] * 6
    peers.close_all()


def test_allocation_counts_are_seen_live_and_a_mapping_outlives_its_owner(owner):
    conn, segment, theirs, child = owner
    peers = PeerCaches()
    caches, generations = peers.open("p", segment, mine())
    conn.send(("bump", [5, 6]))
    assert conn.recv() == "done"
    assert generations[[5, 6]].tolist() == [2, 1]
    conn.send(("write", 3, 42.0))
    assert conn.recv() == "done"
    assert bool((caches[0][0][3] == 42.0).all())            # one memory, not a copy
    conn.send(None)
    child.join(10)
    assert not child.is_alive()
    dst = mine()
    copy_blocks(caches, [3, 4], dst, [0, 1])                 # the owner is gone; its bytes are not
    assert bool((dst[2][1][0] == 42.0).all()) and torch.equal(dst[1][0][1], theirs[1][0][4])
    peers.close_all()


def test_a_cache_of_another_layout_is_refused(owner):
    _, segment, _, _ = owner
    other = [(torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 16)) for _ in range(LAYERS)]
    with pytest.raises(KVLayoutMismatch, match="head_dim"):
        PeerCaches().open("p", segment, other)


def test_a_segment_that_does_not_exist_cannot_be_mapped(owner):
    _, segment, _, _ = owner
    gone = KVSegment(segment.node, segment.pid, segment.fd + 100, segment.num_blocks, segment.layout, segment.nonce)
    with pytest.raises(OSError):
        PeerCaches().open("p", gone, mine())


def test_runs_group_steps_of_one_on_both_sides():
    assert _runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert _runs([], []) == []
    with pytest.raises(ValueError):
        copy_blocks(mine(), [1, 2], mine(), [1])


def _filled(num_blocks: int, heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, SHAPE[1], heads, SHAPE[3], generator=g),
             torch.randn(num_blocks, SHAPE[1], heads, SHAPE[3], generator=g)) for _ in range(LAYERS)]


@pytest.mark.parametrize("src_split,dst_split", [((4,), (4,)), ((2, 2), (4,)), ((4,), (1, 3)), ((1, 3), (2, 2))])
def test_copies_between_caches_split_by_heads_are_the_blocks_heads(src_split, dst_split):
    """copy_heads (in the C++ call where it builds) against plain indexing of one whole-head
    cache: every destination part gets its heads of the named blocks, in runs and alone, with a
    fault hook midway; blocks not named stay zero."""
    whole = _filled(10, 4, 3)
    src, first = [], 0
    for n in src_split:
        src.append((first, [(k[:, :, first:first + n].clone(), v[:, :, first:first + n].clone()) for k, v in whole]))
        first += n
    dst, first = [], 0
    for n in dst_split:
        dst.append((first, [(torch.zeros(8, SHAPE[1], n, SHAPE[3]), torch.zeros(8, SHAPE[1], n, SHAPE[3]))
                            for _ in range(LAYERS)]))
        first += n
    src_ids, dst_ids = [2, 3, 4, 9, 0], [5, 6, 7, 0, 3]
    halfway = []
    copy_heads(src, src_ids, dst, dst_ids, midway=lambda: halfway.append(True))
    assert halfway == [True]
    for d0, caches in dst:
        for (dk, dv), (wk, wv) in zip(caches, whole):
            n = dk.shape[2]
            for s, d in zip(src_ids, dst_ids):
                assert torch.equal(dk[d], wk[s][:, d0:d0 + n]) and torch.equal(dv[d], wv[s][:, d0:d0 + n])
            for d in set(range(8)) - set(dst_ids):
                assert not dk[d].any() and not dv[d].any()


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ kernels do not build here")
def test_the_copy_kernel_refuses_blocks_outside_either_cache_and_mismatched_tensors():
    k = cpu_kernels.load()
    a, b = torch.zeros(4, 2, 3), torch.zeros(6, 2, 3)
    for runs in ([3, 0, 2], [0, 5, 2], [-1, 0, 1], [0, 0, 0]):
        with pytest.raises(RuntimeError, match="outside the caches"):
            k.copy_block_runs([a], [b], runs)
    with pytest.raises(RuntimeError, match="differ past their blocks"):
        k.copy_block_runs([a], [torch.zeros(6, 3, 3)], [0, 0, 1])
    with pytest.raises(RuntimeError, match="triples"):
        k.copy_block_runs([a], [b], [0, 0])
    assert not b.any()                       # refused before any byte moved
    assert k.copy_block_runs([torch.ones(4, 2, 3)], [b], [1, 4, 2]) == 2 * 6 * 4 and b[4:].eq(1).all() and not b[:4].any()
