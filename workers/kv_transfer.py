"""KV-cache handoff between a prefill worker (sender) and a decode worker (receiver).

Each (prefill, decode) pair gets its own two-rank process group, made lazily on the first
transfer through a rendezvous in a TCPStore that the receiving side hosts, so pools grow
and shrink without a global world. Gloo moves CPU tensors, NCCL moves CUDA tensors; the
code path is the same, only the group's constructor differs.

    prefill, rank 0                                decode, rank 1 (hosts the store)
    connect  gen = add("gen", 1), set hello/0      wait for an unused gen, set hello/1
             both read the other's hello and check layout + backend (mismatch: both raise)
             ProcessGroup{Gloo,NCCL}(PrefixStore(pair), rank, 2)
    header   send [count, transfer_id]         ──▶ recv      both check both headers
             pack meanwhile; recv              ◀── send
    payload  send the packed buffer            ──▶ recv, index_copy_ into its own block ids
             buffer = [layer, k|v, block, slot, kv_head, head_dim]

Transfers on one pair must be issued in the same order on both sides; `transfer_id` lets
the caller make a reordering an error instead of swapped KV.

Failures, and how the other side learns of them (keys in the pair's part of the receiver's store):

- A side whose transfer breaks destroys its group (Gloo closes its sockets only then), so a
  peer blocked in the header or the payload fails at once, not at its deadline.
- It bumps the pair's `epoch`; each side compares it with the one it connected at before each
  transfer, so a failure seen by one side only (the receiver failing after the sender finished,
  or the reverse) rebuilds the pair on both sides at the next transfer, instead of failing it
  on a stale group.
- It records the transfer id it gave up on (`gave_up/send`, `gave_up/recv`; ids > 0 only, the
  worker's are unique per pair): a peer that had not connected for that transfer yet, or is
  waiting to, fails at once. A receiver also joins only a generation opened for its transfer
  by a sender still waiting (`abandoned`), and marks the others `skipped`, which ends them.

Every error raised carries `point`: where the transfer was (connect, before_header,
mid_payload, after_payload). A `FaultPlan` (workers/faults.py) passed per call fails or stalls
a transfer at those points, for tests and drills.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, ClassVar

import msgpack
import torch
import torch.distributed as dist

from workers.faults import FaultPlan
from workers.messages import TransferHeader
from workers.names import AUTO, GLOO, NCCL, SHM, TRANSPORTS

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]      # per layer (k, v): [blocks, slot, head, dim]
Group = Any                                             # a c10d backend: ProcessGroupGloo / ProcessGroupNCCL

_SENDER, _RECEIVER = 0, 1
_TAG_HEADER, _TAG_PAYLOAD = 1, 2          # NCCL ignores tags: there the issue order matches ops
_STORE_TIMEOUT_S = 300.0                  # the store's default; every wait here passes its own
_NCCL_WATCHDOG_S = 600.0                  # NCCL's watchdog bound; each op waits with a shorter deadline
_TELL_PEER_S = 2.0                        # telling the peer of a failure: best effort, bounded
_SIDES = {_SENDER: "send", _RECEIVER: "recv"}


class KVLayoutMismatch(ValueError):
    """The two sides' caches differ in shape or dtype (or transport): no transfer is possible."""


class KVTransferMismatch(ValueError):
    """The two sides disagree on a transfer (block count or transfer id); the pair stays usable."""


class KVTransferRefused(KVTransferMismatch):
    """The sender holds no KV for this transfer (released, aborted, lease expired): it said so in
    its header at once, instead of leaving the receiver to wait out its timeout."""


class KVTransferError(RuntimeError):
    """The peer vanished or the connection broke; the pair's group has been dropped. `point`:
    where the transfer was (connect, before_header, mid_payload, after_payload)."""
    point: str | None = None


class KVTransferTimeout(KVTransferError, TimeoutError):
    """The transfer (connect included) did not finish within its timeout."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str                              # torch dtype name, e.g. "float32"

    @classmethod
    def of(cls, kv_caches: KVCaches) -> KVLayout:
        k = kv_caches[0][0]
        _, block_size, num_kv_heads, head_dim = k.shape
        layout = cls(len(kv_caches), block_size, num_kv_heads, head_dim, str(k.dtype).removeprefix("torch."))
        assert all(t.shape == k.shape and t.dtype == k.dtype for kv in kv_caches for t in kv), \
            "every layer's K and V cache must have the same shape and dtype"
        return layout

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.torch_dtype.itemsize)

    def check_compatible(self, other: KVLayout, peer: str = "peer") -> None:
        diffs = [f"{f.name} {getattr(self, f.name)} here vs {getattr(other, f.name)} on {peer}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise KVLayoutMismatch(f"KV cache layouts differ ({'; '.join(diffs)}): both workers must "
                                   "serve the same model with the same block size and dtype")


@dataclass(frozen=True, slots=True)
class KVPeer:
    """A receiving (decode) worker as its senders address it."""
    worker_id: str
    store_addr: str                         # "host:port", that worker's `transport.store_addr`


@dataclass(frozen=True, slots=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    connect_s: float                        # 0 when the pair's group was cached
    pack_s: float                           # sender: index_select into the buffer
    wire_s: float                           # header + payload, including waiting for the peer
    unpack_s: float                         # receiver: index_copy_ into the cache


@dataclass(slots=True)
class _Pair:
    group: Group
    store: dist.Store                       # kept alive: NCCL creates communicators through it
    addr: str | None
    layout: KVLayout
    staging: torch.Tensor                   # uint8, grown on demand, reused across transfers
    signals: dist.Store                     # the directed pair's keys in the receiver's store
    epoch: int                              # the pair's failure count when this group was built


def _wait_listening(host: str, port: int, deadline: float) -> None:
    """Wait until something listens on host:port. TCPStore's client retries on a backoff that
    overshoots its timeout by seconds; plain connects keep a missing peer within the deadline."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens on {host}:{port}") from None
            time.sleep(0.05)


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _waited(store: dist.Store, key: str, deadline: float, slice_s: float = 0.02) -> bool:
    """Wait up to `slice_s` (not past the deadline) for `key`; False when it is not there yet.
    `check` and a sleep, not a short `wait`: each timed-out `wait` logs a c10d warning line, which
    would flood a worker's log while a peer takes its time."""
    try:
        if store.check([key]):
            return True
    except Exception:                        # a broken store: the next call fails with the reason
        return False
    time.sleep(max(min(slice_s, deadline - time.monotonic()), 0.0))
    return False


def _mark(store: dist.Store, key: str, value: str = "1") -> None:
    """Best effort: the peer reads it if it can."""
    try:
        store.set(key, value)
    except Exception:
        pass


def _check_gave_up(store: dist.Store, side: str, transfer_id: int, peer: str) -> None:
    """Raise when the peer (`side`) already failed this (named) transfer."""
    key = f"gave_up/{side}"
    if transfer_id and store.check([key]) and int(store.get(key)) == transfer_id:
        raise KVTransferError(f"{peer} gave up on transfer {transfer_id}")


class KVTransport(ABC):
    backend: ClassVar[str]
    device_type: ClassVar[str]

    def __init__(self, worker_id: str, device: torch.device | str | None = None, host: str | None = None):
        self.worker_id = worker_id
        self.device = torch.device(device or self.device_type)
        if self.device.type != self.device_type:
            raise ValueError(f"{self.backend} moves {self.device_type} tensors, not {self.device}")
        self.host = host or "127.0.0.1"                          # the worker passes its node's address
        self.num_connects = 0                                   # pair groups built (a reconnect metric)
        self.last_stats: TransferStats | None = None
        self._server: dist.TCPStore | None = None
        self._pairs: dict[tuple[str, int], _Pair] = {}          # (peer id, my rank) -> group
        self._gens: dict[str, int] = {}                         # sender id -> last generation joined
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._mutex = threading.Lock()

    @abstractmethod
    def _new_group(self, store: dist.Store, rank: int, timeout: timedelta) -> Group:
        """A two-rank group over `store`; rendezvous must finish within `timeout`."""

    @property
    def store_addr(self) -> str:
        """Where senders rendezvous with this worker (give it to them in a KVPeer)."""
        return f"{self.host}:{self._serve().port}"

    def send_blocks(self, peer: KVPeer, kv_caches: KVCaches, block_ids: list[int],
                    timeout_s: float = 30.0, transfer_id: int = 0, faults: FaultPlan | None = None) -> int:
        """Send these blocks to `peer`, which receives them into its own block ids. Returns bytes.
        `faults`: the plan's `send` rules act at their points (tests, drills)."""
        return self._transfer(peer.worker_id, _SENDER, kv_caches, block_ids, timeout_s, transfer_id,
                              peer.store_addr, faults)

    def refuse(self, peer: KVPeer, kv_caches: KVCaches, timeout_s: float = 30.0, transfer_id: int = 0) -> None:
        """Tell `peer`, waiting in recv for this transfer, that there is nothing to send: its recv
        raises KVTransferRefused at once, and the pair stays usable."""
        self._transfer(peer.worker_id, _SENDER, kv_caches, [], timeout_s, transfer_id, peer.store_addr,
                       None, refused=True)

    def recv_blocks(self, peer: str, kv_caches: KVCaches, block_ids: list[int],
                    timeout_s: float = 30.0, transfer_id: int = 0, faults: FaultPlan | None = None) -> int:
        """Receive blocks from the prefill worker `peer` into these block ids. Returns bytes.
        On an error the blocks may hold part of the payload: the caller must not use them.
        `faults`: the plan's `recv` rules act at their points (tests, drills)."""
        self._serve()
        return self._transfer(peer, _RECEIVER, kv_caches, block_ids, timeout_s, transfer_id, None, faults)

    def close(self, peer: str) -> None:
        """Forget the groups with `peer`; the next transfer reconnects."""
        for key in ((peer, _SENDER), (peer, _RECEIVER)):
            with self._lock_for(key):
                self._drop(key, failed=False)

    def shutdown(self) -> None:
        for peer, _ in list(self._pairs):
            self.close(peer)
        self._server = None

    # -- internals -----------------------------------------------------------------------------
    def _serve(self) -> dist.TCPStore:
        """The store senders rendezvous in, started on first use on a free port."""
        with self._mutex:
            if self._server is None:
                self._server = dist.TCPStore(self.host, 0, None, True, timedelta(seconds=_STORE_TIMEOUT_S),
                                             wait_for_workers=False)
            return self._server

    def _lock_for(self, key: tuple[str, int]) -> threading.Lock:
        with self._mutex:
            return self._locks.setdefault(key, threading.Lock())

    def _drop(self, key: tuple[str, int], failed: bool) -> _Pair | None:
        pair = self._pairs.pop(key, None)
        if pair is not None:
            try:   # abort unblocks a broken NCCL communicator; shutdown lets a healthy one finish
                pair.group.abort() if failed else pair.group.shutdown()
            except Exception:
                pass
            pair.group = None               # its last reference: Gloo closes the sockets now
        return pair

    def _gave_up(self, peer: str, rank: int, pair: _Pair | None, transfer_id: int) -> None:
        """After a failure: bump the pair's epoch and record the transfer id (best effort, bounded)."""
        if rank == _RECEIVER:
            signals = dist.PrefixStore(f"kv/{peer}->{self.worker_id}", self._server)
        elif pair is not None:              # a client of the receiver's store
            signals = pair.signals
            pair.store.set_timeout(timedelta(seconds=_TELL_PEER_S))
        else:                               # a sender that never connected: its generation says so
            return
        try:
            if pair is not None:
                signals.add("epoch", 1)
            if transfer_id:
                signals.set(f"gave_up/{_SIDES[rank]}", str(transfer_id))
        except Exception:                   # the peer's store is gone: so is its side of the pair
            pass

    def _stale(self, pair: _Pair, rank: int, deadline: float) -> bool:
        """The peer dropped the pair after a failure since this group was built (one store
        round trip: local on the receiver, to the receiver on the sender, within the deadline)."""
        if rank == _RECEIVER:
            return pair.signals.add("epoch", 0) != pair.epoch
        pair.store.set_timeout(_remaining(deadline))
        try:
            return pair.signals.add("epoch", 0) != pair.epoch
        finally:
            pair.store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))

    def _transfer(self, peer: str, rank: int, kv_caches: KVCaches, block_ids: list[int],
                  timeout_s: float, transfer_id: int, addr: str | None, faults: FaultPlan | None = None,
                  refused: bool = False) -> int:
        start = time.monotonic()
        deadline = start + timeout_s
        layout = KVLayout.of(kv_caches)
        _check_block_ids(kv_caches, block_ids, unique=rank == _RECEIVER)
        key = (peer, rank)
        at = ["connect"]                    # where the transfer is: _move advances it
        with self._lock_for(key):
            try:
                pair = self._pairs.get(key)
                connect_s = 0.0
                if pair is not None and self._stale(pair, rank, deadline):
                    self._drop(key, failed=True)
                    pair = None
                if pair is None or pair.addr != addr or pair.layout != layout:
                    self._drop(key, failed=False)
                    pair = self._connect(peer, rank, layout, addr, deadline, transfer_id)
                    self._pairs[key] = pair
                    connect_s = time.monotonic() - start
                stats = self._move(pair, rank, kv_caches, block_ids, transfer_id, deadline, connect_s, faults, at,
                                   refused)
            except (KVLayoutMismatch, KVTransferMismatch) as e:
                e.point = "refused" if isinstance(e, KVTransferRefused) else at[0]
                raise                       # both sides refused the same way; nothing is broken
            except Exception as e:          # torch's DistError family, gloo's RuntimeErrors, InjectedFault
                # Gloo closes its sockets (so the peer fails at once instead of at its deadline) only
                # when the group is destroyed: drop every reference, the failed frames' included.
                pair = None
                traceback.clear_frames(e.__traceback__)
                self._gave_up(peer, rank, self._drop(key, failed=True), transfer_id)
                elapsed = time.monotonic() - start
                me, arrow = self.worker_id, "->" if rank == _SENDER else "<-"
                message = str(e).lower()
                if time.monotonic() >= deadline - 0.01 or "timed out" in message or "timeout" in message:
                    error = KVTransferTimeout(
                        f"KV transfer {me} {arrow} {peer} timed out after {elapsed:.2f}s at {at[0]} "
                        f"(timeout {timeout_s}s): is {peer} alive and calling its side?")
                else:
                    error = KVTransferError(f"KV transfer {me} {arrow} {peer} failed after {elapsed:.2f}s "
                                            f"at {at[0]}: {(str(e).splitlines() or [type(e).__name__])[0]}")
                error.point = at[0]
                raise error from e
        self.last_stats = stats
        return stats.num_bytes

    def _connect(self, peer: str, rank: int, layout: KVLayout, addr: str | None, deadline: float,
                 transfer_id: int) -> _Pair:
        hello = {"worker_id": self.worker_id, "backend": self.backend, "transfer_id": transfer_id,
                 "layout": {f.name: getattr(layout, f.name) for f in fields(layout)}}
        if rank == _SENDER:
            host, port = addr.rsplit(":", 1)
            _wait_listening(host, int(port), deadline)
            store = dist.TCPStore(host, int(port), None, False, _remaining(deadline), wait_for_workers=False)
            store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))   # later reads (NCCL's) are not ours
            base = dist.PrefixStore(f"kv/{self.worker_id}->{peer}", store)
            _check_gave_up(base, "recv", transfer_id, peer)     # the receiver failed it before we came
            gen = base.add("gen", 1)        # each connect opens a fresh generation of keys
            pair_store = dist.PrefixStore(str(gen), base)
            pair_store.set(f"hello/{rank}", msgpack.packb(hello))
            try:
                # In slices: a receiver that gives up on this transfer, or skips this generation
                # (it moved on to a later transfer), ends this attempt at once.
                while not _waited(pair_store, f"hello/{_RECEIVER}", deadline):
                    _check_gave_up(base, "recv", transfer_id, peer)
                    if pair_store.check(["skipped"]):
                        raise KVTransferError(f"{peer} moved on from transfer {transfer_id}")
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"timed out waiting for {peer} to join")
            except Exception:
                _mark(pair_store, "abandoned")   # a receiver arriving later skips this generation
                if transfer_id:
                    _mark(base, "gave_up/send", str(transfer_id))
                raise
            theirs = msgpack.unpackb(pair_store.get(f"hello/{_RECEIVER}"))
        else:
            store = self._server
            base = dist.PrefixStore(f"kv/{peer}->{self.worker_id}", store)
            # Join the newest generation not joined before (a sender that timed out and retried may
            # have opened several while we were away), if its sender came for this transfer and is
            # still there; else skip it (telling a sender that still waits) and wait for a newer one.
            while True:
                while not _waited(base, f"{self._gens.get(peer, 0) + 1}/hello/{_SENDER}", deadline):
                    _check_gave_up(base, "send", transfer_id, peer)
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"timed out waiting for {peer} to connect")
                gen = base.add("gen", 0)
                self._gens[peer] = gen
                pair_store = dist.PrefixStore(str(gen), base)
                pair_store.wait([f"hello/{_SENDER}"], _remaining(deadline))     # set right after the add
                theirs = msgpack.unpackb(pair_store.get(f"hello/{_SENDER}"))
                if theirs.get("transfer_id") == transfer_id and not pair_store.check(["abandoned"]):
                    break
                _mark(pair_store, "skipped")
            pair_store.set(f"hello/{rank}", msgpack.packb(hello))
        # Both sides read both hellos, so both refuse a mismatch before any group exists.
        if theirs["backend"] != self.backend:
            raise KVLayoutMismatch(f"KV transport differs: {self.backend} here vs {theirs['backend']} "
                                   f"on {peer}: use the same --kv-transport on both pools")
        layout.check_compatible(KVLayout(**theirs["layout"]), peer)
        # Both sides read the epoch after both hellos: after any failure either side saw before.
        epoch = base.add("epoch", 0)
        group = self._new_group(dist.PrefixStore("group", pair_store), rank, _remaining(deadline))
        self.num_connects += 1
        return _Pair(group, store, addr, layout, torch.empty(0, dtype=torch.uint8, device=self.device), base, epoch)

    def _move(self, pair: _Pair, rank: int, kv_caches: KVCaches, block_ids: list[int], transfer_id: int,
              deadline: float, connect_s: float, faults: FaultPlan | None, at: list[str],
              refused: bool = False) -> TransferStats:
        other, group, layout = 1 - rank, pair.group, pair.layout

        def reach(point: str) -> None:      # record where we are; let the fault plan act there
            at[0] = point
            if faults and faults.hit(_SIDES[rank], point) and time.monotonic() >= deadline:
                raise TimeoutError(f"timed out: stalled at {point} past the deadline")
        n = len(block_ids)
        nbytes = n * layout.bytes_per_block
        if pair.staging.numel() < nbytes:
            pair.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf = pair.staging[:nbytes]
        packed = buf.view(layout.torch_dtype).view(layout.num_layers, 2, n, layout.block_size,
                                                   layout.num_kv_heads, layout.head_dim)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        count = TransferHeader.REFUSED if refused else n
        mine = torch.tensor(TransferHeader(count, transfer_id).as_ints(), dtype=torch.int64, device=self.device)
        theirs = torch.empty_like(mine)
        t0 = time.perf_counter()
        pack_s = unpack_s = 0.0
        # NCCL runs p2p ops in issue order, so the two sides' sequences mirror each other
        # (both sending first would leave both blocked in send).
        reach("before_header")
        if rank == _SENDER:
            header = group.send([mine], other, _TAG_HEADER)
            if n:                                               # hidden under the header's round trip
                pack_s = self._copy_blocks(kv_caches, idx, packed, pack=True)
            header.wait(_remaining(deadline))
            group.recv([theirs], other, _TAG_HEADER).wait(_remaining(deadline))
            if refused:                                         # said; nothing follows
                return TransferStats(0, 0, connect_s, 0.0, time.perf_counter() - t0, 0.0)
            _check_headers(mine, theirs)
            reach("mid_payload")                                # the receiver has the header, no payload
            if n:
                group.send([buf], other, _TAG_PAYLOAD).wait(_remaining(deadline))
        else:
            group.recv([theirs], other, _TAG_HEADER).wait(_remaining(deadline))
            group.send([mine], other, _TAG_HEADER).wait(_remaining(deadline))
            _check_headers(theirs, mine)
            at[0] = "mid_payload"
            if n:
                group.recv([buf], other, _TAG_PAYLOAD).wait(_remaining(deadline))
                # The fault point sits halfway through the copy: the blocks hold part of the payload.
                unpack_s = self._copy_blocks(kv_caches, idx, packed, pack=False,
                                             midway=lambda: reach("mid_payload"))
            else:
                reach("mid_payload")
        reach("after_payload")
        wire_s = time.perf_counter() - t0 - pack_s - unpack_s
        return TransferStats(n, nbytes, connect_s, pack_s, wire_s, unpack_s)

    def _copy_blocks(self, kv_caches: KVCaches, idx: torch.Tensor, packed: torch.Tensor, pack: bool,
                     midway=None) -> float:
        """Gather the blocks into the buffer (pack) or scatter the buffer into them; seconds.
        `midway()` runs once half the caches (layers 0..L/2-1, K and V; K of layer 0 when L is 1)
        are copied."""
        t0 = time.perf_counter()
        parts = [(cache, packed[layer, i]) for layer, kv in enumerate(kv_caches) for i, cache in enumerate(kv)]
        for i, (cache, part) in enumerate(parts):
            if midway is not None and i == len(parts) // 2:
                self._sync()
                midway()
            if pack:
                torch.index_select(cache, 0, idx, out=part)
            else:
                cache.index_copy_(0, idx, part)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _check_headers(sender: torch.Tensor, receiver: torch.Tensor) -> None:
    s, r = TransferHeader.from_ints(sender.tolist()), TransferHeader.from_ints(receiver.tolist())
    if s.num_blocks == TransferHeader.REFUSED and s.transfer_id == r.transfer_id:
        raise KVTransferRefused(f"transfer {s.transfer_id}: the sender no longer holds this KV (released, aborted "
                                "or its lease expired)")
    if s != r:
        raise KVTransferMismatch(f"sender has {s.num_blocks} blocks for transfer {s.transfer_id}, receiver "
                                 f"expects {r.num_blocks} for transfer {r.transfer_id}: reserve one block per "
                                 "sent block and issue transfers in the same order on both sides")


def _check_block_ids(kv_caches: KVCaches, block_ids: list[int], unique: bool) -> None:
    num_blocks = kv_caches[0][0].shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} outside this cache's {num_blocks} blocks")
    if unique and len(set(block_ids)) != len(block_ids):
        raise ValueError("receiving block ids repeat: each received block needs its own block")


class GlooTransport(KVTransport):
    backend = GLOO
    device_type = "cpu"

    def _new_group(self, store: dist.Store, rank: int, timeout: timedelta) -> Group:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Bind to the address we advertise, not whatever the hostname resolves to (often a
        # loopback alias in containers, unreachable from other nodes).
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)


class NcclTransport(KVTransport):
    backend = NCCL
    device_type = "cuda"

    def __init__(self, worker_id: str, device: torch.device | str | None = None, host: str | None = None):
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("the nccl KV transport needs CUDA and a torch build with NCCL: "
                             "use --kv-transport gloo (or auto) on CPU")
        # NCCL's default on an async error is to kill the process; a decode worker must outlive
        # a prefill peer that died mid-transfer, so only abort the communicator (read per group).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        device = torch.device(device or "cuda")
        super().__init__(worker_id, torch.device("cuda", device.index if device.index is not None
                                                 else torch.cuda.current_device()), host)

    def _new_group(self, store: dist.Store, rank: int, timeout: timedelta) -> Group:
        # The communicator itself is created by the first send/recv (the header), right after
        # this rendezvous; each op then waits with its own deadline, under the watchdog's bound.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=max(_NCCL_WATCHDOG_S, timeout.total_seconds()))
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, 2, opts)


def transport_backend(kind: str, device: torch.device | str) -> str:
    """The backend for `--kv-transport kind` with the KV cache on `device`."""
    device = torch.device(device)
    if kind == AUTO:                        # on CPU, for peers on other nodes (same-node ones: kv_shm)
        return NCCL if device.type == "cuda" else GLOO
    if kind == SHM:
        raise ValueError("--kv-transport shm copies through shared memory between workers of one node; "
                         "it has no transport across nodes: use auto to fall back to gloo there")
    if kind == NCCL and device.type != "cuda":
        raise ValueError(f"--kv-transport nccl moves CUDA tensors but the KV cache is on {device}: "
                         "use gloo or auto")
    if kind == GLOO and device.type != "cpu":
        raise ValueError(f"--kv-transport gloo moves CPU tensors but the KV cache is on {device}: "
                         "use nccl or auto")
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown --kv-transport {kind!r}: expected one of {TRANSPORTS}")
    return kind


def make_transport(kind: str, device: torch.device | str, worker_id: str, host: str | None = None) -> KVTransport:
    cls = {GLOO: GlooTransport, NCCL: NcclTransport}[transport_backend(kind, device)]
    return cls(worker_id, device, host)
