"""KV-cache transport over Gloo between two real processes: this test process and one spawned
child, which answers commands over a pipe. Every wait on the child has a deadline."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from common import CHILD_START_S, Child
from workers.kv_transfer import (GlooTransport, KVLayout, KVLayoutMismatch, KVPeer, KVTransferError,
                                 KVTransferMismatch, KVTransferTimeout, NcclTransport, make_transport,
                                 transport_backend)

TINY = {"num_layers": 4, "block_size": 16, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32"}
HOST = "127.0.0.1"


def make_caches(num_blocks: int, seed: int, layout: dict = TINY):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
    dtype = getattr(torch, layout["dtype"])
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layout["num_layers"])]


# -- the child process: a few named operations on its own transports and caches ----------------
_WORKERS: dict[str, tuple[GlooTransport, list]] = {}


def _op_setup(worker_id, num_blocks, seed, layout):
    _WORKERS[worker_id] = (GlooTransport(worker_id, "cpu", HOST), make_caches(num_blocks, seed, layout))
    return _WORKERS[worker_id][0].store_addr


def _op_send(worker_id, peer_id, peer, block_ids, timeout_s, transfer_id=0):
    """`peer`: the receiver's KVPeer for this sender (its `peer_for`: address and the pair's secret)."""
    t, caches = _WORKERS[worker_id]
    assert peer.worker_id == peer_id
    return t.send_blocks(peer, caches, block_ids, timeout_s, transfer_id)


def _op_peer(worker_id, sender):
    """This (receiving) worker as `sender` addresses it."""
    return _WORKERS[worker_id][0].peer_for(sender)


def _op_recv(worker_id, peer_id, block_ids, timeout_s, transfer_id=0):
    t, caches = _WORKERS[worker_id]
    return t.recv_blocks(peer_id, caches, block_ids, timeout_s, transfer_id)


def _op_ping():
    return True


def _op_caches(worker_id):
    return _WORKERS[worker_id][1]


def _op_num_connects(worker_id):
    return _WORKERS[worker_id][0].num_connects


def _op_close(worker_id, peer_id):
    _WORKERS[worker_id][0].close(peer_id)


@pytest.fixture(scope="module")
def child(spawns):
    c = Child("test_kv_transfer")
    try:
        assert c.call("ping", deadline_s=CHILD_START_S)
        yield c
    finally:
        c.close()


def local(worker_id: str, num_blocks: int, seed: int, layout: dict = TINY):
    return GlooTransport(worker_id, "cpu", HOST), make_caches(num_blocks, seed, layout)


def assert_moved(sent, received, before, src: list[int], dst: list[int]) -> None:
    """The receiver's dst blocks equal the sender's src blocks; every other block is untouched."""
    others = torch.ones(received[0][0].shape[0], dtype=torch.bool)
    others[dst] = False
    for (sk, sv), (rk, rv), (bk, bv) in zip(sent, received, before):
        assert torch.equal(rk[dst], sk[src]) and torch.equal(rv[dst], sv[src])
        assert torch.equal(rk[others], bk[others]) and torch.equal(rv[others], bv[others])


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


# -- (1) exactness, both directions ------------------------------------------------------------
def test_child_sends_exactly_the_chosen_blocks(child):
    child.call("setup", "p-exact", 64, 1, TINY)
    d, caches = local("d-exact", 48, 2)
    before = clone(caches)
    src, dst = [5, 17, 2, 40, 63], [30, 0, 11, 7, 47]
    child.start("send", "p-exact", "d-exact", d.peer_for("p-exact"), src, 10.0)
    nbytes = d.recv_blocks("p-exact", caches, dst, timeout_s=10.0)
    status, sent_bytes, _ = child.result()
    assert status == "ok", sent_bytes
    assert nbytes == sent_bytes == len(src) * KVLayout.of(caches).bytes_per_block
    assert_moved(child.call("caches", "p-exact"), caches, before, src, dst)


def test_child_receives_exactly_the_chosen_blocks(child):
    child.call("setup", "d-exact2", 40, 3, TINY)
    p, caches = local("p-exact2", 20, 4)
    before = child.call("caches", "d-exact2")
    src, dst = [19, 0, 3], [2, 39, 20]
    peer = child.call("peer", "d-exact2", "p-exact2")
    child.start("recv", "d-exact2", "p-exact2", dst, 10.0)
    nbytes = p.send_blocks(peer, caches, src, timeout_s=10.0)
    status, got, _ = child.result()
    assert status == "ok", got
    assert nbytes == got
    assert_moved(caches, child.call("caches", "d-exact2"), before, src, dst)


# -- (2) one cached group per pair, several pairs ----------------------------------------------
def test_several_transfers_reuse_the_pair_and_peers_are_separate(child):
    child.call("setup", "p-multi", 64, 5, TINY)
    d0, caches0 = local("d-multi0", 32, 6)
    d1, caches1 = local("d-multi1", 32, 7)
    plan = [(d0, caches0, [1, 2, 3], [4, 5, 6]), (d0, caches0, [60], [31]),
            (d1, caches1, [10, 11], [0, 1]), (d0, caches0, [7, 8, 9, 10], [20, 21, 22, 23]),
            (d1, caches1, [12], [2])]
    for i, (d, caches, src, dst) in enumerate(plan):
        before = clone(caches)
        child.start("send", "p-multi", d.worker_id, d.peer_for("p-multi"), src, 10.0, i)
        d.recv_blocks("p-multi", caches, dst, timeout_s=10.0, transfer_id=i)
        status, value, _ = child.result()
        assert status == "ok", value
        assert_moved(child.call("caches", "p-multi"), caches, before, src, dst)
    # One group per peer, however many transfers.
    assert child.call("num_connects", "p-multi") == 2
    assert (d0.num_connects, d1.num_connects) == (1, 1)

    # After both sides close, the next transfer builds a fresh group and is still exact.
    child.call("close", "p-multi", "d-multi0")
    d0.close("p-multi")
    before = clone(caches0)
    child.start("send", "p-multi", "d-multi0", d0.peer_for("p-multi"), [33, 34], 10.0)
    d0.recv_blocks("p-multi", caches0, [8, 9], timeout_s=10.0)
    assert child.result()[0] == "ok"
    assert_moved(child.call("caches", "p-multi"), caches0, before, [33, 34], [8, 9])
    assert d0.num_connects == 2 and child.call("num_connects", "p-multi") == 3


# -- (3) refusals: both sides, promptly ---------------------------------------------------------
@pytest.mark.parametrize("field,value", [("block_size", 8), ("num_kv_heads", 2), ("dtype", "float16")])
def test_layout_mismatch_is_refused_on_both_sides(child, field, value):
    sender, receiver = f"p-{field}", f"d-{field}"
    child.call("setup", sender, 16, 8, TINY)
    d, caches = local(receiver, 16, 9, {**TINY, field: value})
    child.start("send", sender, receiver, d.peer_for(sender), [0, 1], 20.0)
    t0 = time.monotonic()
    with pytest.raises(KVLayoutMismatch) as here:
        d.recv_blocks(sender, caches, [2, 3], timeout_s=20.0)
    assert time.monotonic() - t0 < 5.0, "a mismatch must be refused, not waited out"
    status, (kind, message, *_), elapsed = child.result()
    assert (status, kind) == ("err", "KVLayoutMismatch") and elapsed < 5.0
    for text in (str(here.value), message):
        assert field in text and str(TINY[field]) in text and str(value) in text


def test_block_count_mismatch_is_refused_on_both_sides_and_the_pair_survives(child):
    child.call("setup", "p-count", 16, 10, TINY)
    d, caches = local("d-count", 16, 11)
    child.start("send", "p-count", "d-count", d.peer_for("p-count"), [0, 1, 2], 10.0)
    with pytest.raises(KVTransferMismatch, match="3 blocks"):
        d.recv_blocks("p-count", caches, [5, 6], timeout_s=10.0)
    status, (kind, *_), elapsed = child.result()
    assert (status, kind) == ("err", "KVTransferMismatch") and elapsed < 5.0
    # Both sides agreed on the refusal, so the same group carries the next transfer.
    before = clone(caches)
    child.start("send", "p-count", "d-count", d.peer_for("p-count"), [0, 1], 10.0)
    d.recv_blocks("p-count", caches, [5, 6], timeout_s=10.0)
    assert child.result()[0] == "ok"
    assert_moved(child.call("caches", "p-count"), caches, before, [0, 1], [5, 6])
    assert d.num_connects == 1


# -- (4) peers that never show up ---------------------------------------------------------------
def _assert_times_out(fn, timeout_s: float, peer: str, slack_s: float = 1.5) -> None:
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout) as e:
        fn()
    elapsed = time.monotonic() - t0
    assert timeout_s - 0.1 <= elapsed <= timeout_s + slack_s, elapsed
    assert peer in str(e.value) and "timed out after" in str(e.value)


def test_receiver_times_out_when_the_sender_never_comes():
    d, caches = local("d-alone", 8, 12)
    _assert_times_out(lambda: d.recv_blocks("p-ghost", caches, [0], timeout_s=2.0), 2.0, "p-ghost")


def test_sender_times_out_when_the_receiver_never_receives():
    d, _ = local("d-idle", 8, 13)                   # hosts the store, never calls recv_blocks
    p, caches = local("p-lonely", 8, 14)
    _assert_times_out(lambda: p.send_blocks(d.peer_for("p-lonely"), caches, [0], timeout_s=2.0),
                      2.0, "d-idle")


def test_sender_times_out_when_nobody_listens():
    with socket.socket() as s:                      # a port that was free a moment ago
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    p, caches = local("p-void", 8, 15)
    _assert_times_out(lambda: p.send_blocks(KVPeer("d-void", f"{HOST}:{port}", "secret"), caches, [0], timeout_s=2.0),
                      2.0, "d-void")


def test_a_receiver_that_stops_receiving_times_out_the_sender_and_the_pair_recovers(child):
    child.call("setup", "p-stall", 16, 16, TINY)
    d, caches = local("d-stall", 16, 17)
    child.start("send", "p-stall", "d-stall", d.peer_for("p-stall"), [1], 10.0)
    d.recv_blocks("p-stall", caches, [2], timeout_s=10.0)
    assert child.result()[0] == "ok"
    child.start("send", "p-stall", "d-stall", d.peer_for("p-stall"), [3], 2.0)     # nobody receives it
    status, (kind, message, *_), elapsed = child.result()
    assert (status, kind) == ("err", "KVTransferTimeout") and elapsed < 3.5, (kind, message, elapsed)
    assert "d-stall" in message
    d.close("p-stall")                                # the orchestrator closes the failed pair
    before = clone(caches)
    child.start("send", "p-stall", "d-stall", d.peer_for("p-stall"), [4, 5], 10.0)
    d.recv_blocks("p-stall", caches, [9, 10], timeout_s=10.0)
    assert child.result()[0] == "ok"
    assert_moved(child.call("caches", "p-stall"), caches, before, [4, 5], [9, 10])


# -- (5) choosing the transport -----------------------------------------------------------------
def test_transport_choice():
    assert transport_backend("auto", "cpu") == "gloo"
    assert transport_backend("auto", "cuda") == "nccl"
    assert transport_backend("auto", torch.device("cuda", 1)) == "nccl"
    assert transport_backend("gloo", "cpu") == "gloo"
    assert transport_backend("nccl", "cuda:0") == "nccl"
    with pytest.raises(ValueError, match="nccl moves CUDA tensors"):
        transport_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="gloo moves CPU tensors"):
        transport_backend("gloo", "cuda")
    with pytest.raises(ValueError, match="unknown --kv-transport 'tcp'"):
        transport_backend("tcp", "cpu")
    t = make_transport("auto", "cpu", "w0", HOST)
    assert isinstance(t, GlooTransport) and t.backend == "gloo" and t.worker_id == "w0"
    with pytest.raises(ValueError, match="nccl"):
        make_transport("nccl", "cpu", "w0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            NcclTransport("w0")


def test_layout_of_and_check_compatible():
    caches = make_caches(3, 0)
    layout = KVLayout.of(caches)
    assert layout == KVLayout(4, 16, 4, 32, "float32")
    assert layout.bytes_per_block == 2 * 4 * 16 * 4 * 32 * 4
    layout.check_compatible(KVLayout(4, 16, 4, 32, "float32"))
    with pytest.raises(KVLayoutMismatch, match=r"head_dim 32 here vs 64 on d0.*dtype float32 here vs bfloat16"):
        layout.check_compatible(KVLayout(4, 16, 4, 64, "bfloat16"), "d0")
    assert issubclass(KVTransferTimeout, KVTransferError) and issubclass(KVTransferTimeout, TimeoutError)


def test_bad_block_ids_are_refused_before_any_connection():
    d, caches = local("d-bad", 8, 18)
    with pytest.raises(ValueError, match="outside"):
        d.recv_blocks("p-any", caches, [8], timeout_s=1.0)
    with pytest.raises(ValueError, match="repeat"):
        d.recv_blocks("p-any", caches, [1, 1], timeout_s=1.0)
