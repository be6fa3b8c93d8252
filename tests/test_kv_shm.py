"""The shared-memory KV handoff's pieces (workers/kv_shm.py) between two real processes: a
child owns a cache in a memfd, this process maps it and copies blocks out of it. The oracle is
the child's own tensors (sent over a pipe); no Ray."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from workers.kv_shm import KVSegment, PeerCaches, SharedKVCache, _runs, copy_blocks
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
