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

Who may join: the receiver makes a secret per sender (`secret_for`), which reaches the sender
only through the Ray call that asks it to send (KVSendRequest, then KVPeer). Every key of the
pair lives under `kv/<secret>/<sender>-><receiver>`, so a client of the store that guesses
worker names and transfer ids (sequential) names nothing of ours; and since a TCPStore client can
list the keys (`list_keys`), every value the two sides act on carries an HMAC under the secret:
the hellos (a generation whose hello does not verify is ignored), `gave_up`, `skipped` and
`abandoned`. A stranger can neither fail a transfer nor open one as its sender. The store listens
only on the worker's bind address (`listen_store`: loopback in a local cluster). Gloo's and
NCCL's own sockets do not authenticate: docs/ARCHITECTURE.md, "Trust boundaries", says what must stay private.

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

import hashlib
import hmac
import os
import secrets
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
    secret: str                             # the receiver's for this sender (`secret_for`), through Ray


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
    secret: str                             # the pair's (its keys' namespace and MAC key)


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


def listen_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (given a host, TCPStore itself still binds every
    interface): on a socket bound here, which the store takes over (it closes it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen(512)
        store = dist.TCPStore(host, sock.getsockname()[1], None, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def _mac(secret: str, what: str) -> str:
    """The pair's tag of `what`: only the two ends, who hold the secret, can make it."""
    return hmac.new(secret.encode(), what.encode(), hashlib.sha256).hexdigest()[:32]


def _signed(store: dist.Store, key: str, secret: str, value: str = "1") -> bool:
    """`key` holds `value` signed with the pair's secret (not a stranger's write)."""
    try:
        return bool(store.check([key])) and hmac.compare_digest(
            store.get(key), f"{value}:{_mac(secret, f'{key}={value}')}".encode())
    except Exception:
        return False


def _namespace(secret: str, sender: str, receiver: str) -> str:
    return f"kv/{secret}/{sender}->{receiver}"


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


def _mark(store: dist.Store, key: str, secret: str, value: str = "1") -> None:
    """Best effort, signed with the pair's secret: the peer reads it if it can."""
    try:
        store.set(key, f"{value}:{_mac(secret, f'{key}={value}')}")
    except Exception:
        pass


def _check_gave_up(store: dist.Store, side: str, transfer_id: int, peer: str, secret: str) -> None:
    """Raise when the peer (`side`) already failed this (named) transfer (its signed word only)."""
    if transfer_id and _signed(store, f"gave_up/{side}", secret, str(transfer_id)):
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
        self._secrets: dict[str, str] = {}                      # sender id -> its pair's secret (receiver)
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._mutex = threading.Lock()

    @abstractmethod
    def _new_group(self, store: dist.Store, rank: int, timeout: timedelta) -> Group:
        """A two-rank group over `store`; rendezvous must finish within `timeout`."""

    @property
    def store_addr(self) -> str:
        """Where senders rendezvous with this worker (give it to them in a KVPeer)."""
        return f"{self.host}:{self._serve().port}"

    def secret_for(self, sender: str) -> str:
        """(Receiver) the secret of the pair with `sender`, made here once, unguessable: give it
        to that sender only, through Ray (KVSendRequest), never through the store."""
        with self._mutex:
            return self._secrets.setdefault(sender, secrets.token_hex(16))

    def peer_for(self, sender: str) -> KVPeer:
        """This receiver as `sender` must address it."""
        return KVPeer(self.worker_id, self.store_addr, self.secret_for(sender))

    def send_blocks(self, peer: KVPeer, kv_caches: KVCaches, block_ids: list[int],
                    timeout_s: float = 30.0, transfer_id: int = 0, faults: FaultPlan | None = None) -> int:
        """Send these blocks to `peer`, which receives them into its own block ids. Returns bytes.
        `faults`: the plan's `send` rules act at their points (tests, drills)."""
        return self._transfer(peer.worker_id, _SENDER, kv_caches, block_ids, timeout_s, transfer_id,
                              peer.store_addr, faults, secret=peer.secret)

    def refuse(self, peer: KVPeer, kv_caches: KVCaches, timeout_s: float = 30.0, transfer_id: int = 0) -> None:
        """Tell `peer`, waiting in recv for this transfer, that there is nothing to send: its recv
        raises KVTransferRefused at once, and the pair stays usable."""
        self._transfer(peer.worker_id, _SENDER, kv_caches, [], timeout_s, transfer_id, peer.store_addr,
                       None, refused=True, secret=peer.secret)

    def recv_blocks(self, peer: str, kv_caches: KVCaches, block_ids: list[int],
                    timeout_s: float = 30.0, transfer_id: int = 0, faults: FaultPlan | None = None) -> int:
        """Receive blocks from the prefill worker `peer` into these block ids. Returns bytes.
        On an error the blocks may hold part of the payload: the caller must not use them.
        `faults`: the plan's `recv` rules act at their points (tests, drills)."""
        self._serve()
        return self._transfer(peer, _RECEIVER, kv_caches, block_ids, timeout_s, transfer_id, None, faults,
                              secret=self.secret_for(peer))

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
                self._server = listen_store(self.host, timedelta(seconds=_STORE_TIMEOUT_S))
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

    def _gave_up(self, peer: str, rank: int, pair: _Pair | None, transfer_id: int, secret: str) -> None:
        """After a failure: bump the pair's epoch and record the transfer id (best effort, bounded)."""
        if rank == _RECEIVER:
            signals = dist.PrefixStore(_namespace(self.secret_for(peer), peer, self.worker_id), self._server)
        elif pair is not None:              # a client of the receiver's store
            signals = pair.signals
            pair.store.set_timeout(timedelta(seconds=_TELL_PEER_S))
        else:                               # a sender that never connected: its generation says so
            return
        try:
            if pair is not None:
                signals.add("epoch", 1)
            if transfer_id:
                _mark(signals, f"gave_up/{_SIDES[rank]}", secret, str(transfer_id))
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
                  refused: bool = False, secret: str = "") -> int:
        if not secret:
            raise ValueError("a KV transfer needs its pair's secret (the receiver's secret_for)")
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
                if pair is None or pair.addr != addr or pair.layout != layout or pair.secret != secret:
                    self._drop(key, failed=False)
                    pair = self._connect(peer, rank, layout, addr, deadline, transfer_id, secret)
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
                self._gave_up(peer, rank, self._drop(key, failed=True), transfer_id, secret)
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
                 transfer_id: int, secret: str) -> _Pair:
        def hello(gen: int) -> bytes:       # signed: who, for which generation and transfer
            h = {"worker_id": self.worker_id, "backend": self.backend, "transfer_id": transfer_id, "gen": gen,
                 "layout": {f.name: getattr(layout, f.name) for f in fields(layout)}}
            return msgpack.packb({**h, "mac": _mac(secret, f"hello/{rank}/{msgpack.packb(h).hex()}")})

        def verified(raw: bytes, side: int, gen: int) -> dict | None:
            """The other side's hello, if it is theirs (signed with the secret) for this generation."""
            try:
                h = msgpack.unpackb(raw)
                mac = h.pop("mac")
                ok = hmac.compare_digest(mac, _mac(secret, f"hello/{side}/{msgpack.packb(h).hex()}"))
            except Exception:
                return None
            return h if ok and h.get("gen") == gen else None

        if rank == _SENDER:
            host, port = addr.rsplit(":", 1)
            _wait_listening(host, int(port), deadline)
            store = dist.TCPStore(host, int(port), None, False, _remaining(deadline), wait_for_workers=False)
            store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))   # later reads (NCCL's) are not ours
            base = dist.PrefixStore(_namespace(secret, self.worker_id, peer), store)
            _check_gave_up(base, "recv", transfer_id, peer, secret)     # the receiver failed it before we came
            gen = base.add("gen", 1)        # each connect opens a fresh generation of keys
            pair_store = dist.PrefixStore(str(gen), base)
            pair_store.set(f"hello/{rank}", hello(gen))
            try:
                # In slices: a receiver that gives up on this transfer, or skips this generation
                # (it moved on to a later transfer), ends this attempt at once.
                while not _waited(pair_store, f"hello/{_RECEIVER}", deadline):
                    _check_gave_up(base, "recv", transfer_id, peer, secret)
                    if _signed(pair_store, "skipped", secret, str(gen)):
                        raise KVTransferError(f"{peer} moved on from transfer {transfer_id}")
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"timed out waiting for {peer} to join")
                theirs = verified(pair_store.get(f"hello/{_RECEIVER}"), _RECEIVER, gen)
                if theirs is None:
                    raise KVTransferError(f"the answer to transfer {transfer_id} is not {peer}'s (not signed with "
                                          "the pair's secret)")
            except Exception:
                _mark(pair_store, "abandoned", secret, str(gen))   # a receiver arriving later skips this generation
                if transfer_id:
                    _mark(base, "gave_up/send", secret, str(transfer_id))
                raise
        else:
            store = self._server
            base = dist.PrefixStore(_namespace(secret, peer, self.worker_id), store)
            # Join the newest generation not joined before (a sender that timed out and retried may
            # have opened several while we were away) whose hello is the sender's own (signed), if it
            # came for this transfer and is still there; mark the sender's others skipped (telling
            # one that still waits), and ignore anything unsigned (a stranger's).
            theirs = None
            while theirs is None:
                joined, skipped = self._gens.get(peer, 0), 0
                latest = base.add("gen", 0)
                for g in range(latest, max(joined, latest - 64), -1):
                    pair_store = dist.PrefixStore(str(g), base)
                    if not pair_store.check([f"hello/{_SENDER}"]):
                        continue
                    h = verified(pair_store.get(f"hello/{_SENDER}"), _SENDER, g)
                    if h is None:
                        continue
                    if theirs is None and h.get("transfer_id") == transfer_id and not _signed(
                            pair_store, "abandoned", secret, str(g)):
                        theirs, gen = h, g
                    else:
                        _mark(pair_store, "skipped", secret, str(g))
                        skipped = max(skipped, g)
                if theirs is None and skipped:  # the sender's connects run one at a time: older ones are over
                    self._gens[peer] = skipped
                if theirs is not None:
                    self._gens[peer] = gen
                    pair_store = dist.PrefixStore(str(gen), base)
                    break
                _check_gave_up(base, "send", transfer_id, peer, secret)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"timed out waiting for {peer} to connect")
                _waited(base, f"{latest + 1}/hello/{_SENDER}", deadline)
            pair_store.set(f"hello/{rank}", hello(gen))
        # Both sides read both hellos, so both refuse a mismatch before any group exists.
        if theirs["backend"] != self.backend:
            raise KVLayoutMismatch(f"KV transport differs: {self.backend} here vs {theirs['backend']} "
                                   f"on {peer}: use the same --kv-transport on both pools")
        layout.check_compatible(KVLayout(**theirs["layout"]), peer)
        # Both sides read the epoch after both hellos: after any failure either side saw before.
        epoch = base.add("epoch", 0)
        group = self._new_group(dist.PrefixStore("group", pair_store), rank, _remaining(deadline))
        self.num_connects += 1
        return _Pair(group, store, addr, layout, torch.empty(0, dtype=torch.uint8, device=self.device), base, epoch,
                     secret)

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
