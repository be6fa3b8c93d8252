"""The NCCL KV transport between two real processes on CUDA, with the Gloo path as the oracle.

Skipped without a CUDA GPU (and a torch built with NCCL); `make gpu-check` runs it on one.
Both ends are spawned children (common.Child), so this test process never creates an NCCL
communicator: child A sends (the prefill side), child B receives (the decode side).

On two or more GPUs A uses cuda:0 and B cuda:1, as a prefill and a decode worker would. On one
GPU both use cuda:0, which NCCL refuses as it stands ("Duplicate GPU detected": it maps one rank
to one GPU per host). Each child then gets its own NCCL_HOSTID, so NCCL takes the two processes
for two hosts and moves the bytes through its socket transport over loopback: the transport's
code path (CUDA tensors, p2p send/recv in issue order, header checks, aborts, deadlines) is the
served one, the link is not NVLink. The served cluster sets no such variable: two workers on
one GPU (--gpus-per-worker 0.5) cannot hand KV over NCCL today.

Every transfer's result is compared with the sender's own blocks and with the same transfer
made over Gloo between the same two processes (CPU copies of the same caches).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from common import CHILD_START_S, Child
from workers.faults import FaultPlan
from workers.kv_transfer import KVLayout, KVPeer, make_transport

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and a torch built with NCCL (make gpu-check runs it on one)")

TINY = {"num_layers": 4, "block_size": 16, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32"}
HOST = "127.0.0.1"
MOVE_S = 60.0               # one transfer, the first NCCL connect included (seconds, generous)


def use_single_gpu_nccl_env() -> None:
    """What lets two processes on one GPU form an NCCL pair: a host id of this process's own
    (NCCL then uses its network transport between them), over loopback unless the environment
    names an interface. Read when the process creates its first communicator.
    benchmarks/bench_kv_transfer.py does the same."""
    os.environ["NCCL_HOSTID"] = f"pdcluster-{os.getpid()}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")


def devices() -> tuple[str, str]:
    """(sender's device, receiver's device)."""
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")


def make_caches(num_blocks: int, seed: int, layout: dict, device: str):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
    dtype = getattr(torch, layout["dtype"])
    return [(torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
            for _ in range(layout["num_layers"])]


# -- the children: named operations on their transports and caches ---------------------------------
_WORKERS: dict[str, tuple] = {}


def _op_ping():
    return True


def _op_setup(worker_id, kind, device, num_blocks, seed, layout, one_gpu):
    """A transport of `kind` (nccl on `device`, gloo on the CPU) with caches of this seed."""
    if kind == "nccl" and one_gpu:
        use_single_gpu_nccl_env()
    where = device if kind == "nccl" else "cpu"
    if where.startswith("cuda"):
        torch.cuda.set_device(torch.device(where))
    _WORKERS[worker_id] = (make_transport(kind, where, worker_id, HOST), make_caches(num_blocks, seed, layout, where))
    return _WORKERS[worker_id][0].store_addr


def _op_send(worker_id, peer_id, peer: KVPeer, block_ids, timeout_s, transfer_id=0, faults=None):
    """`peer`: the receiver's KVPeer for this sender (its `peer_for`: address and the pair's secret)."""
    t, caches = _WORKERS[worker_id]
    return t.send_blocks(peer, caches, block_ids, timeout_s, transfer_id,
                         FaultPlan.parse(faults) if faults else None)


def _op_refuse(worker_id, peer_id, peer: KVPeer, timeout_s, transfer_id):
    t, caches = _WORKERS[worker_id]
    t.refuse(peer, caches, timeout_s, transfer_id)


def _op_peer(worker_id, sender):
    """(Receiver) how `sender` addresses it: its store and the pair's secret."""
    return _WORKERS[worker_id][0].peer_for(sender)


def _op_recv(worker_id, peer_id, block_ids, timeout_s, transfer_id=0):
    t, caches = _WORKERS[worker_id]
    return t.recv_blocks(peer_id, caches, block_ids, timeout_s, transfer_id)


def _op_caches(worker_id):
    """CPU copies (a CUDA tensor would cross the pipe by CUDA IPC)."""
    return [(k.cpu(), v.cpu()) for k, v in _WORKERS[worker_id][1]]


def _op_num_connects(worker_id):
    return _WORKERS[worker_id][0].num_connects


def _op_close(worker_id, peer_id):
    _WORKERS[worker_id][0].close(peer_id)


# -- fixtures -------------------------------------------------------------------------------------
def spawn_pair():
    a, b = Child("test_cuda_nccl"), Child("test_cuda_nccl")
    try:
        assert a.call("ping", deadline_s=CHILD_START_S) and b.call("ping", deadline_s=CHILD_START_S)
    except BaseException:
        a.close()
        b.close()
        raise
    return a, b


@pytest.fixture(scope="module")
def pair():
    a, b = spawn_pair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


class Side:
    """One worker in a child: its id, transport kind, and (receivers) store address."""

    def __init__(self, child: Child, worker_id: str, kind: str, device: str, num_blocks: int, seed: int,
                 layout: dict):
        self.child, self.id = child, worker_id
        self.addr = child.call("setup", worker_id, kind, device, num_blocks, seed, layout,
                               devices()[0] == devices()[1], deadline_s=MOVE_S)

    def caches(self):
        return self.child.call("caches", self.id, deadline_s=MOVE_S)

    def peer_for(self, sender: Side) -> KVPeer:
        return self.child.call("peer", self.id, sender.id, deadline_s=MOVE_S)


def move(sender: Side, receiver: Side, src: list[int], dst: list[int], transfer_id: int = 0,
         send_timeout_s: float = MOVE_S, recv_timeout_s: float = MOVE_S):
    """Start the receive, then the send; both results ((status, value, seconds) each)."""
    receiver.child.start("recv", receiver.id, sender.id, dst, recv_timeout_s, transfer_id)
    sender.child.start("send", sender.id, receiver.id, receiver.peer_for(sender), src, send_timeout_s, transfer_id)
    return sender.child.result(send_timeout_s + 30), receiver.child.result(recv_timeout_s + 30)


def assert_ok(*results) -> None:
    for status, value, _ in results:
        assert status == "ok", value


def assert_moved(sent, received, before, src: list[int], dst: list[int]) -> None:
    """The receiver's dst blocks equal the sender's src blocks; every other block is untouched."""
    others = torch.ones(received[0][0].shape[0], dtype=torch.bool)
    others[dst] = False
    for (sk, sv), (rk, rv), (bk, bv) in zip(sent, received, before):
        assert torch.equal(rk[dst], sk[src]) and torch.equal(rv[dst], sv[src])
        assert torch.equal(rk[others], bk[others]) and torch.equal(rv[others], bv[others])


# -- (1) exactness, against the sender's blocks and the Gloo path ------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_moves_exactly_the_blocks_gloo_moves(pair, dtype):
    a, b = pair
    layout = {**TINY, "dtype": dtype}
    dev_a, dev_b = devices()
    p, d = Side(a, f"p-{dtype}", "nccl", dev_a, 64, 1, layout), Side(b, f"d-{dtype}", "nccl", dev_b, 48, 2, layout)
    pg, dg = Side(a, f"pg-{dtype}", "gloo", "cpu", 64, 1, layout), Side(b, f"dg-{dtype}", "gloo", "cpu", 48, 2, layout)
    before = d.caches()
    assert all(torch.equal(x, y) for kv, kvg in zip(before, dg.caches()) for x, y in zip(kv, kvg))
    src, dst = [5, 17, 2, 40, 63, 0, 33], [30, 0, 11, 7, 47, 46, 1]
    sent, got = move(p, d, src, dst)
    assert_ok(sent, got)
    assert_ok(*move(pg, dg, src, dst))
    assert sent[1] == got[1] == len(src) * KVLayout(**layout).bytes_per_block
    received = d.caches()
    assert_moved(p.caches(), received, before, src, dst)
    for (k, v), (kg, vg) in zip(received, dg.caches()):     # NCCL's result is Gloo's, bit for bit
        assert torch.equal(k, kg) and torch.equal(v, vg)


# -- (2) one group per pair, rebuilt after a close ------------------------------------------------------
def test_transfers_reuse_one_group_and_a_closed_pair_reconnects(pair):
    a, b = pair
    dev_a, dev_b = devices()
    p, d = Side(a, "p-reuse", "nccl", dev_a, 64, 3, TINY), Side(b, "d-reuse", "nccl", dev_b, 32, 4, TINY)
    plan = [([1, 2, 3], [4, 5, 6]), ([60], [31]), ([7, 8, 9, 10], [20, 21, 22, 23])]
    for i, (src, dst) in enumerate(plan, start=1):
        before = d.caches()
        assert_ok(*move(p, d, src, dst, transfer_id=i))
        assert_moved(p.caches(), d.caches(), before, src, dst)
    assert a.call("num_connects", p.id) == 1 and b.call("num_connects", d.id) == 1
    a.call("close", p.id, d.id)
    b.call("close", d.id, p.id)
    before = d.caches()
    assert_ok(*move(p, d, [33, 34], [8, 9], transfer_id=4))
    assert_moved(p.caches(), d.caches(), before, [33, 34], [8, 9])
    assert a.call("num_connects", p.id) == 2 and b.call("num_connects", d.id) == 2


# -- (3) refusals, promptly, and the pair survives them ------------------------------------------------
def test_block_count_mismatch_is_refused_on_both_sides_and_the_pair_survives(pair):
    a, b = pair
    dev_a, dev_b = devices()
    p, d = Side(a, "p-count", "nccl", dev_a, 16, 5, TINY), Side(b, "d-count", "nccl", dev_b, 16, 6, TINY)
    assert_ok(*move(p, d, [0], [1], transfer_id=1))          # the group exists: the refusal is NCCL's header
    (s_status, s_value, s_t), (r_status, r_value, r_t) = move(p, d, [0, 1, 2], [5, 6], transfer_id=2)
    assert s_status == "err" and s_value[0] == "KVTransferMismatch" and s_t < 5.0, (s_value, s_t)
    assert r_status == "err" and r_value[0] == "KVTransferMismatch" and r_t < 5.0, (r_value, r_t)
    before = d.caches()
    assert_ok(*move(p, d, [0, 1], [5, 6], transfer_id=3))
    assert_moved(p.caches(), d.caches(), before, [0, 1], [5, 6])
    assert b.call("num_connects", d.id) == 1


def test_a_refusal_ends_the_receivers_wait_at_once(pair):
    a, b = pair
    dev_a, dev_b = devices()
    p, d = Side(a, "p-refuse", "nccl", dev_a, 8, 7, TINY), Side(b, "d-refuse", "nccl", dev_b, 8, 8, TINY)
    assert_ok(*move(p, d, [1], [2], transfer_id=1))
    b.start("recv", d.id, p.id, [3, 4], 30.0, 2)
    a.start("refuse", p.id, d.id, d.peer_for(p), 30.0, 2)
    assert a.result(MOVE_S)[0] == "ok"
    status, value, elapsed = b.result(MOVE_S)
    assert status == "err" and value[0] == "KVTransferRefused" and elapsed < 5.0, (status, value, elapsed)


# -- (4) deadlines over NCCL: a stalled sender, a dead one -------------------------------------------
@pytest.fixture
def fault_pair():
    """Children of each test's own: a transfer that hangs in NCCL must not take others along."""
    a, b = spawn_pair()
    try:
        yield a, b
    finally:
        for c in (a, b):
            if c.proc.is_alive():
                c.close()


RECV_TIMEOUT_S = 3.0
SLACK_S = 5.0               # past its deadline a pull must have failed within this


def test_a_sender_stalled_mid_payload_times_the_receiver_out_and_the_pair_recovers(fault_pair):
    a, b = fault_pair
    dev_a, dev_b = devices()
    p, d = Side(a, "p-stall", "nccl", dev_a, 16, 9, TINY), Side(b, "d-stall", "nccl", dev_b, 16, 10, TINY)
    assert_ok(*move(p, d, [1], [2], transfer_id=1))          # connected: the stall is inside NCCL
    b.start("recv", d.id, p.id, [3], RECV_TIMEOUT_S, 2)
    a.start("send", p.id, d.id, d.peer_for(p), [4], 20.0, 2, "send:mid_payload:delay=8*1")
    status, value, elapsed = b.result(RECV_TIMEOUT_S + SLACK_S + 30)
    assert status == "err" and value[0] == "KVTransferTimeout", \
        f"the pull's {RECV_TIMEOUT_S}s deadline over NCCL: {status} {value} after {elapsed:.1f}s"
    assert elapsed < RECV_TIMEOUT_S + SLACK_S, f"timed out only after {elapsed:.1f}s"
    a.result(30)                                              # whatever it says, it answers
    before = d.caches()
    assert_ok(*move(p, d, [7, 8], [9, 10], transfer_id=3))    # rebuilt on both sides, exact
    assert_moved(p.caches(), d.caches(), before, [7, 8], [9, 10])


def test_a_sender_that_dies_mid_transfer_fails_the_pull_and_the_receiver_lives_on(fault_pair):
    a, b = fault_pair
    dev_a, dev_b = devices()
    p, d = Side(a, "p-dies", "nccl", dev_a, 16, 11, TINY), Side(b, "d-dies", "nccl", dev_b, 16, 12, TINY)
    assert_ok(*move(p, d, [1], [2], transfer_id=1))
    b.start("recv", d.id, p.id, [3], RECV_TIMEOUT_S * 2, 2)
    a.start("send", p.id, d.id, d.peer_for(p), [4], 60.0, 2, "send:mid_payload:delay=60")
    time.sleep(1.0)                                           # header agreed, payload pending
    a.proc.kill()
    status, value, elapsed = b.result(RECV_TIMEOUT_S * 2 + SLACK_S + 30)
    assert status == "err" and value[0] in ("KVTransferError", "KVTransferTimeout"), (status, value)
    assert elapsed < RECV_TIMEOUT_S * 2 + SLACK_S, f"failed only after {elapsed:.1f}s"
    assert b.call("ping", deadline_s=10)                      # the decode side outlived its peer
