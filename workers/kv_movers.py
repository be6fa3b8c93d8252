"""How a prompt's KV moves into a decode worker: one interface, `KVMover`, and its ways.

    SharedMemoryMover   a prefill worker on this node whose cache is in shared memory: the
                        decode worker copies the blocks out of it itself (workers/kv_shm.py),
                        while the prompt is prefilled too (workers/kv_stream.py)
    TransportMover      any other: the prefill worker sends them over this worker's KVTransport
                        (workers/kv_transfer.py: Gloo between CPUs, NCCL between GPUs)

A new way (RDMA, a KV store) is a new KVMover and a case in `Movers.mover_for`; the decode
side (workers/kv_receiver.py) runs every pull the same way. `LocalKV` is this worker's own
cache as both sides of the handoff read and write it, and its transport.
"""
from __future__ import annotations

import logging
import threading
import time

from workers.faults import FaultPlan
from workers.kv_shm import KVSegment, PeerCaches, copy_heads, whole_heads
from workers.kv_stream import CopyPlan, KVFeed
from workers.messages import DecodeOp, KVSendRequest, encode
from workers.names import SHM
from workers.node import bind_host, node_id
from workers.peers import wait_ref

log = logging.getLogger("pdcluster.worker")


class LocalKV:
    """This worker's KV cache as the handoff moves it: its segments in shared memory (None when
    it is not there), the cache by KV heads (kv_shm.HeadParts: its own, then each other
    tensor-parallel rank's, mapped here for writing, so the handoff moves a tensor-parallel
    worker's KV without a call to its ranks), the transport (made on first use), the fault plan
    and the timeout of every wait on a peer."""

    def __init__(self, worker_id: str, engine, transport_kind: str, timeout_s: float, faults: FaultPlan):
        self.worker_id, self.engine, self.transport_kind = worker_id, engine, transport_kind
        self.timeout_s, self.faults = timeout_s, faults
        self._ranks = PeerCaches()                # the other ranks' caches, mapped for writing
        self._transport = None
        self._lock = threading.Lock()
        self.segments, self.parts = self._own_caches()

    def _own_caches(self) -> tuple[list[dict] | None, list]:
        runner, ranks = self.engine.runner, self.engine.ranks
        if runner.shared_kv is None:
            return None, [(0, runner.kv_caches)]
        segments = [runner.shared_kv.segment(node_id()).to_dict()]
        parts = [(0, runner.kv_caches)]
        if ranks is not None:
            segments += wait_ref([r.kv_segment.remote() for r in ranks.ranks], self.timeout_s)
            for r, seg in enumerate(segments[1:], start=1):
                caches, _ = self._ranks.open(f"{self.worker_id}#{r}", KVSegment(**seg), runner.kv_caches,
                                             writable=True)
                parts.append((seg["first_head"], caches))
        return segments, parts

    def wire_caches(self, num_blocks: int):
        """The cache the transport moves KV through: this worker's own, or with tensor
        parallelism a buffer of `num_blocks` blocks with every head (gathered from the ranks
        before a send, scattered to them after a receive), so peers of any size meet in one layout."""
        if len(self.parts) == 1:
            if self.engine.ranks is not None:
                raise ValueError("moving a tensor-parallel worker's KV needs its ranks' caches in shared memory "
                                 "(a CPU worker); on GPUs it awaits a transfer per rank")
            return self.engine.runner.kv_caches
        return whole_heads(self.parts, num_blocks)

    def transport(self):
        with self._lock:
            if self._transport is None:
                from workers.kv_transfer import make_transport
                self._transport = make_transport(self.transport_kind, self.engine.device, self.worker_id,
                                                 host=bind_host())
            return self._transport

    def forget(self, peer_id: str) -> None:
        """The transport's pairs with a peer's old process go (the next transfer builds new ones)."""
        with self._lock:
            transport = self._transport
        if transport is not None:
            transport.close(peer_id)

    def close(self) -> None:
        with self._lock:
            transport = self._transport
        if transport is not None:
            transport.shutdown()
        self._ranks.close_all()


def refused(message: str) -> Exception:
    """A pull the prefill side cannot serve (the KV is gone or moved): counted at "refused"."""
    from workers.kv_transfer import KVTransferRefused
    e = KVTransferRefused(message)
    e.point = "refused"
    return e


class KVMover:
    """Moves one request's KV from its prefill worker into the blocks reserved here (`dst`,
    after the `skip` leading blocks this worker's prefix cache holds). `point` is a one-element
    list the mover keeps at where it is (workers/faults.py's FAILURE_POINTS), so a failure is
    counted where it happened. Raises on any failure; the blocks may then hold part of the
    payload (the receiver frees them)."""

    streams = False                 # whether it can copy while the prompt is still prefilled
    way = ""                        # how the bytes travel (a traced handoff's `transport`)

    def pull(self, op: DecodeOp, prefill, dst: list[int], skip: int, point: list[str]) -> int:
        """The held KV (`op.kv` when the router named it, else asked of the peer). Returns bytes."""
        raise NotImplementedError

    def pull_streamed(self, op: DecodeOp, prefill, feed: KVFeed, dst: list[int], skip: int,
                      point: list[str]) -> tuple[int, float]:
        """The blocks as the feed's words name them while the prompt is prefilled, then what the
        held KV's word adds. Returns (bytes, seconds copying)."""
        raise NotImplementedError


class TransportMover(KVMover):
    """The prefill worker sends over the transport (Gloo or NCCL), one pull at a time per peer."""

    def __init__(self, local: LocalKV, lock: threading.Lock, next_id):
        self.local, self.lock, self.next_id = local, lock, next_id

    @property
    def way(self) -> str:
        return type(self.local.transport()).__name__.removesuffix("Transport").lower()    # gloo, nccl

    def pull(self, op: DecodeOp, prefill, dst: list[int], skip: int, point: list[str]) -> int:
        local = self.local
        transport = local.transport()
        # One pull at a time per prefill peer, and a shared id: both sides run the pair's
        # transfers in the same order, and a mix-up fails loudly instead of swapping KV.
        with self.lock:
            tid = self.next_id()
            sent = prefill.send_kv.remote(encode(KVSendRequest(op.rid, local.worker_id, transport.store_addr, tid,
                                                               skip, transport.secret_for(op.prefill_id))))
            caches = local.wire_caches(len(dst))
            into = dst if caches is local.engine.runner.kv_caches else list(range(len(dst)))
            nbytes = transport.recv_blocks(op.prefill_id, caches, into, local.timeout_s, tid, local.faults)
            point[0] = "after_payload"      # every byte is here; the sender must confirm it sent them all
            wait_ref(sent, local.timeout_s)
        if into is not dst:                 # tensor parallel: each rank's heads into its cache
            copy_heads([(0, caches)], into, local.parts, dst)
        return nbytes


class SharedMemoryMover(KVMover):
    """Copies out of a same-node prefill worker's cache: where the held event said the blocks
    are, checked by their allocation counts after the copy; without that (another CPU family),
    borrowed for the copy (`lend_kv`)."""

    way = "shm"

    streams = True

    def __init__(self, local: LocalKV, movers: Movers, mapped: tuple[KVSegment, list, object]):
        self.local, self.movers, self.mapped = local, movers, mapped

    def _midway(self, point: list[str]):
        def midway():
            point[0] = "mid_payload"
            self.local.faults.hit("recv", "mid_payload")
        return midway

    def pull(self, op: DecodeOp, prefill, dst: list[int], skip: int, point: list[str]) -> int:
        from workers.kv_transfer import KVTransferTimeout
        rid, prefill_id, faults = op.rid, op.prefill_id, self.local.faults
        segment, parts, generations = self.mapped
        if op.kv is not None:
            segment, parts, generations = self._cache_of(op, prefill)
            src, expected, deadline = op.kv.block_ids[skip:], op.kv.generations[skip:], None
        else:
            lent = wait_ref(prefill.lend_kv.remote(rid, skip), self.local.timeout_s)
            if lent is None:
                raise refused(f"{prefill_id} no longer holds the KV of {rid} (released, aborted or its lease expired)")
            src, deadline, pid = lent
            expected = None
            if pid != segment.pid:          # restarted since we mapped it: map the new process's cache
                mapped = self.movers.shared(prefill_id, prefill, refresh=True)
                if mapped is None or mapped[0].pid != pid:
                    raise refused(f"{prefill_id} restarted and its new KV cache cannot be mapped")
                segment, parts, generations = mapped

        def reused() -> bool:               # a block was handed to other KV since the hold
            return expected is not None and generations[src].tolist() != expected
        if reused():
            raise refused(f"{prefill_id} no longer holds the KV of {rid}: its blocks were reused")
        nbytes = copy_heads(parts, src, self.local.parts, dst, self._midway(point))
        point[0] = "after_payload"
        faults.hit("recv", "after_payload")
        if reused():
            raise refused(f"{prefill_id} reused the blocks of {rid} during the copy")
        if deadline is not None and time.monotonic() >= deadline:
            raise KVTransferTimeout(f"the loan of {rid}'s KV from {prefill_id} ended before its copy did")
        return nbytes

    def pull_streamed(self, op: DecodeOp, prefill, feed: KVFeed, dst: list[int], skip: int,
                      point: list[str]) -> tuple[int, float]:
        rid, prefill_id = op.rid, op.prefill_id
        segment, parts, generations = self._cache_of(op, prefill)
        plan = CopyPlan(dst, skip)
        kv, final = feed.kv, feed.final
        nbytes, busy = 0, 0.0
        while True:
            t = time.monotonic()
            if kv.segment != segment.nonce:
                raise refused(f"{prefill_id} restarted while it computed the KV of {rid}")
            src, to, _ = plan.needed(kv)
            if final:
                held = kv.block_ids[skip:]
                if generations[held].tolist() != kv.generations[skip:]:
                    raise refused(f"{prefill_id} no longer holds the KV of {rid}: its blocks were reused")
                midway = self._midway(point)
                nbytes += copy_heads(parts, src, self.local.parts, to, midway) if src else 0
                if not src:
                    midway()
                point[0] = "after_payload"
                self.local.faults.hit("recv", "after_payload")
                if generations[held].tolist() != kv.generations[skip:] or len(held) != len(dst):
                    raise refused(f"{prefill_id} reused the blocks of {rid} during the copy")
                return nbytes, busy + time.monotonic() - t
            if src:
                nbytes += copy_heads(parts, src, self.local.parts, to)
                plan.copied(kv, src, generations[src].tolist())
            busy += time.monotonic() - t
            kv, final = feed.wait(kv, self.local.timeout_s)

    def _cache_of(self, op: DecodeOp, prefill) -> tuple[KVSegment, list, object]:
        """The mapped cache that `op.kv` names: the one mapped, or the prefill worker's new one
        when it restarted since (mapped anew); refused when that is not the one named either."""
        if op.kv.segment == self.mapped[0].nonce:
            return self.mapped
        mapped = self.movers.shared(op.prefill_id, prefill, refresh=True)
        if mapped is None or mapped[0].nonce != op.kv.segment:
            raise refused(f"{op.prefill_id} restarted since it computed the KV of {op.rid}")
        return mapped


class Movers:
    """The decode side's movers by prefill peer: shared memory where the peer's cache maps here
    (asked once per peer), else the transport. Thread-safe: each pull runs on its own thread."""

    def __init__(self, local: LocalKV):
        self.local = local
        self._caches = PeerCaches()                   # same-node prefill peers' caches, mapped
        self._shared: dict[str, tuple | None] = {}    # peer id -> its mapped caches, or None: not shared
        self._lock = threading.Lock()
        self._peer_locks: dict[str, threading.Lock] = {}
        self._transfer_ids = 0

    def mover_for(self, prefill_id: str, prefill) -> KVMover:
        mapped = self.shared(prefill_id, prefill)
        if mapped is not None:
            return SharedMemoryMover(self.local, self, mapped)
        with self._lock:
            lock = self._peer_locks.setdefault(prefill_id, threading.Lock())
        return TransportMover(self.local, lock, self._next_id)

    def _next_id(self) -> int:
        with self._lock:
            self._transfer_ids += 1
            return self._transfer_ids

    def shared(self, peer_id: str, peer, refresh: bool = False) -> tuple[KVSegment, list, object] | None:
        """(rank 0's segment, the mapped caches by heads, rank 0's allocation counts) of a
        prefill peer on this node whose cache is in shared memory; None when the KV must travel
        over the transport."""
        local = self.local
        with self._lock:
            if not refresh and peer_id in self._shared:
                return self._shared[peer_id]
        found = None
        if local.engine.runner.shared_kv is not None:
            segs = wait_ref(peer.kv_segment.remote(), local.timeout_s)
            segments = [KVSegment(**seg) for seg in segs or ()]
            if segments and segments[0].node == node_id():
                with self._lock:
                    try:
                        mine = local.engine.runner.kv_caches
                        mapped = [self._caches.open(peer_id if r == 0 else f"{peer_id}#{r}", seg, mine)
                                  for r, seg in enumerate(segments)]
                        found = (segments[0], [(seg.first_head, caches) for seg, (caches, _) in zip(segments, mapped)],
                                 mapped[0][1])
                    except OSError as e:
                        log.warning("worker %s: cannot map %s's KV cache (%s): pulls from it go over %s",
                                    local.worker_id, peer_id, e, local.transport_kind)
        if found is None and local.transport_kind == SHM:
            raise ValueError(f"--kv-transport shm: {peer_id} is not on this node or its KV cache cannot be "
                             "mapped here; use --kv-transport auto to fall back to gloo")
        with self._lock:
            self._shared[peer_id] = found
        return found

    def forget(self, peer_id: str) -> None:
        """A peer died or was restarted: its transport pairs and its old cache's mapping go."""
        self.local.forget(peer_id)
        with self._lock:
            self._shared.pop(peer_id, None)
            self._caches.close(peer_id)

    def close(self) -> None:
        with self._lock:
            self._caches.close_all()
