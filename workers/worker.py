"""The worker actor: one engine, a role, a loop thread, and typed messages in and out.

    router ──submit(Op)──▶ inbox ──▶ engine loop thread ──▶ events ──poll() → PollReply──▶ router
                                                    (the router's stream: a thread polls and pushes
                                                     each reply over ZeroMQ, router/events.py)
                                        │  (steps while there is work; builds the LoadReport)
    decode worker ──send_kv(KVSendRequest)──▶ this thread reads held blocks ──▶ transport ──▶ peer
    decode worker on this node ──lend_kv──▶ block ids; it copies them out of this worker's cache

The messages are workers/messages.py's dataclasses; the handoff's phases and leases live in
workers/handoff.py (the loop thread owns that book; this module carries out its decisions).

Metrics: the load report carries gauges and cumulative counters; per-step and per-transfer
samples (step time, batch size, tokens, queue times, KV transfer seconds) wait in a bounded
buffer until the next poll drains them, and the router turns them into Prometheus histograms.

Roles: `prefill` runs requests to their first token and holds the KV under a lease;
`decode` reserves blocks (only when it has room), pulls the KV from the prefill worker,
then decodes; `colocated` runs whole requests (chunked prefill mixes into decode steps).

A pull never waits for the prefill worker's engine loop: the held block ids are in the handoff
book from the moment the request is held, and the send (or the loan, through shared memory on
one node: workers/kv_shm.py) starts on a Ray thread beside the engine's steps. Only the blocks
the decode worker's prefix cache lacks are moved.

The engine is touched only by the loop thread; other threads hand it closures through the
inbox. Ray stays out of this module's logic: the launcher wraps `Worker` with ray.remote, and
peers arrive as opaque handles whose methods are called with `.remote`.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from workers.config import EngineConfig
from workers.device import resolve_device
from workers.engine import LLMEngine
from workers.faults import FaultPlan
from workers.handoff import HandoffBook, HandoffError, Outcome
from workers.kv_shm import ORDERED, KVSegment, PeerCaches, copy_heads, whole_heads
from workers.kv_cache_manager import cdiv
from workers.kv_stream import CopyPlan, KVFeed, StreamEnded, newer
from workers.messages import (WorkerInfo, SAMPLE_KINDS, AbortOp, DecodeOp, ErrorEvent, GenerateOp, HeldKV, KVMoreOp,
                              KVSendRequest, LoadReport, PollReply, PrefillOp, TokenEvent, TransferTotals, decode,
                              encode)
from workers.leases import RouterLeases
from workers.names import AUTO, ROLES, SHM, owner_of
from workers.node import bind_host, node_id, node_ip
from workers.tensor_parallel import RankLost

log = logging.getLogger("pdcluster.worker")
MAX_SAMPLES = 4096                  # per kind between polls; older ones are dropped
REPORT_EVERY_S = 0.01               # the load report's freshness (polls read the latest)
# Owners with a stream at once: each has a socket and a sender thread here, and keeps one `watch`
# call pending, which holds one of the actor's threads (launcher: max_concurrency=32).
MAX_ROUTERS = 8


class _Outbox:
    """What one router has not read yet: its own requests' events, and every metric sample and
    prefix-cache change (each router keeps its own view of every worker). The owner "" is the
    outbox of requests without an owner tag, read by `poll` and by a stream asked for without
    an owner; it gets samples and cache changes only once someone reads it (`fed`), so that
    they do not pile up where no router looks."""

    def __init__(self, owner: str, cached: list[bytes] = ()):
        self.fed = bool(owner)
        self.events: list = []
        self.samples = {k: deque(maxlen=MAX_SAMPLES) for k in SAMPLE_KINDS}
        self.cache: dict[bytes, bool] = dict.fromkeys(cached, True)   # hash -> held now, or evicted
        self.address: str | None = None           # its ZeroMQ stream, once asked for
        self.closed = False


class _StreamKeys:
    """The event streams' security: a ZeroMQ context of this worker's own, its CURVE server
    keypair, and a ZAP handler (pyzmq's, on a thread) that admits on each stream's socket (its
    ZAP domain) only the client key its router gave when asking for it (`readers`)."""

    def __init__(self):
        import zmq
        from zmq.auth.thread import ThreadAuthenticator
        self.context = zmq.Context()
        self.public, self.secret = zmq.curve_keypair()
        self.readers: dict[str, bytes] = {}             # ZAP domain -> the admitted client key (z85)
        self.auth = ThreadAuthenticator(self.context)
        self.auth.start()

    def callback(self, domain: str, key: bytes) -> bool:
        """(the ZAP thread) Whether the CURVE client `key` (z85) may read the stream `domain`."""
        return self.readers.get(domain) == key

    def close(self) -> None:
        try:
            self.auth.stop()
        except Exception:
            pass


class Worker:
    def __init__(self, worker_id: str, role: str, engine_cfg: EngineConfig, transport: str = "auto",
                 num_threads: int = 1, lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 cluster_id: str = "default", placement=None, router_lease_s: float = 10.0):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        torch.set_num_threads(num_threads)
        self.worker_id, self.role, self.cluster_id = worker_id, role, cluster_id
        self.faults = FaultPlan.from_env()            # PDCLUSTER_KV_FAULTS (workers/faults.py); off when unset
        on_cpu = resolve_device(engine_cfg.device).type == "cpu"
        if transport == SHM and not on_cpu:
            raise ValueError("--kv-transport shm shares CPU memory; this worker's KV cache is on a GPU: use auto or nccl")
        # Same-node peers copy out of this cache; a tensor-parallel worker's ranks' caches are
        # mapped here, where the handoff moves their KV.
        if on_cpu and (transport in (AUTO, SHM) or engine_cfg.tensor_parallel_size > 1):
            engine_cfg = dataclasses.replace(engine_cfg, cache=dataclasses.replace(engine_cfg.cache, shared_memory=True))
        self.engine = LLMEngine(engine_cfg, placement)    # placement: a tensor-parallel worker's group
        self.transfer_timeout_s = transfer_timeout_s
        self.handoffs = HandoffBook(lease_s)          # touched by the loop thread only
        self._transport_kind = transport
        self._transport = None
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        # One outbox per router (its owner tag), and each router's lease (workers/leases.py)
        self._outboxes: dict[str, _Outbox] = {"": _Outbox("")}
        self.leases = RouterLeases(router_lease_s)
        self._lease_expiries = self._lease_aborts = 0
        self.accepting = True                         # False while the leading router drains it
        self._stop = False
        self._stopped = threading.Event()             # watch() returns on it
        self._streams: _StreamKeys | None = None      # the event streams' CURVE keys and ZAP handler
        self._peer_locks: dict[str, threading.Lock] = {}
        self._peer_caches = PeerCaches()              # same-node prefill peers' caches, mapped
        self._segments, self._parts = self._own_caches()
        self._shared_peers: dict[str, object] = {}    # peer id -> its mapped caches, or None: not shared
        self._shm_lock = threading.Lock()
        self._transfer_ids = 0
        self._transfer_totals = TransferTotals()
        # A long prompt's KV streamed while it is prefilled (workers/kv_stream.py). Prefill side:
        # the full blocks announced so far per request mid-prompt. Decode side: each streamed
        # pull's feed, and words that came before their DecodeOp (the actor's threads may
        # reorder two calls), with when they came.
        self._announced: dict[str, int] = {}
        self._feeds: dict[str, KVFeed] = {}
        self._early_words: dict[str, tuple[float, KVMoreOp]] = {}
        self.engine.kv.pool.record_events()
        self.steps = 0
        self._load, self._reported_at = self._report(), time.monotonic()
        self._loop = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)
        self._loop.start()

    # -- called by the router / launcher (any thread) -----------------------------------------
    def ready(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.worker_id, self.role, e.max_model_len, e.layout.num_blocks, e.layout.block_size,
                          e.layout.bytes_per_token * e.layout.block_size, e.runner.backend.name, str(e.device),
                          node_ip(), os.getpid(), e.cfg.tensor_parallel_size, e.ranks.pids if e.ranks else [],
                          self.leases.lease_s, self.cluster_id, dataclasses.asdict(e.cfg), self.leases.num_live,
                          MAX_ROUTERS)

    def submit(self, payload: bytes) -> None:
        """An encoded GenerateOp | PrefillOp | DecodeOp | KVMoreOp | AbortOp; results come back as events."""
        op = decode(payload, (GenerateOp, PrefillOp, DecodeOp, KVMoreOp, AbortOp))
        self._call_in_loop(lambda: self._handle(op))

    def poll(self, timeout_s: float = 1.0) -> bytes:
        """Long poll of the outbox of requests without an owner tag: an encoded PollReply with
        the events since the last call, a fresh load report and the metric samples since the
        last call. (Routers read a stream of their own instead: `stream_events`.)"""
        box = self._outboxes[""]
        box.fed = True
        return encode(self._take_reply(box, timeout_s))

    def _take_reply(self, box: _Outbox, timeout_s: float) -> PollReply:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not box.events and not self._stop and not box.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            events, box.events = box.events, []
            samples = {k: list(q) for k, q in box.samples.items()}
            for q in box.samples.values():
                q.clear()
            load = self._load
            changes, box.cache = box.cache, {}
        return PollReply(events, load, samples, [h for h, held in changes.items() if held],
                         [h for h, held in changes.items() if not held])

    def _requeue(self, box: _Outbox, reply: PollReply) -> None:
        """Put an unsent reply's contents back, before anything newer: the next poll or frame
        carries them."""
        with self._cv:
            box.events[:0] = reply.events
            for kind, values in reply.samples.items():
                box.samples[kind].extendleft(reversed(values))
            older = {**dict.fromkeys(reply.cache_evicted, False), **dict.fromkeys(reply.cache_stored, True)}
            box.cache = {**older, **box.cache}
            self._cv.notify_all()

    def stream_events(self, owner: str = "", client_key: str = "") -> tuple[str, str]:
        """Push poll replies of `owner`'s outbox over ZeroMQ from now on (a PUSH socket on this
        worker's bind address; the router connects a PULL socket, router/events.py): one frame
        per poll, so at least one every half second, while a reader is connected (without one,
        events wait for the next reader or poll). The socket is a CURVE server: only a reader
        holding the secret key of `client_key` (the router's CURVE public key, z85, given in this
        Ray call) completes the handshake (this worker's ZAP handler admits that key alone, the
        latest asked with, for this owner's socket); the traffic is encrypted. Returns (the
        address, this worker's CURVE public key, z85); asked again, the same socket (one reader
        per owner: its router; a replacement connects to it). Renews the owner's lease; a new
        owner's outbox starts with the prefix cache's every block, so a router that joins late
        knows what this worker holds."""
        import zmq
        if len(client_key) != 40:
            raise ValueError("stream_events needs the reader's CURVE public key (40 characters of z85)")
        if owner and owner not in self._outboxes and self.leases.num_live >= MAX_ROUTERS:
            raise RuntimeError(f"worker {self.worker_id} streams to {MAX_ROUTERS} routers already, the most it takes")
        if owner:
            self.leases.renew(owner)
        box = self._outboxes.get(owner) or self._in_loop(lambda: self._open_outbox(owner))
        box.fed = True
        with self._cv:
            keys = self._stream_keys()
            domain = f"stream/{owner or '-'}"
            keys.readers[domain] = client_key.encode()
            if box.address is None:
                sock = keys.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.curve_secretkey = keys.secret
                sock.curve_publickey = keys.public
                sock.curve_server = True
                sock.zap_domain = domain.encode()
                keys.auth.configure_curve_callback(domain, keys)
                host = bind_host()
                port = sock.bind_to_random_port(f"tcp://{host}")
                box.address = f"tcp://{host}:{port}"
                threading.Thread(target=self._push_events, args=(box, sock), daemon=True,
                                 name=f"events-{self.worker_id}-{owner or 'any'}").start()
            return box.address, keys.public.decode()

    def _stream_keys(self) -> _StreamKeys:
        """(holding the lock) This worker's CURVE keypair and ZAP handler, made on first use."""
        if self._streams is None:
            self._streams = _StreamKeys()
        return self._streams

    def heartbeat(self, owner: str) -> bool:
        """A router is alive: its lease here runs on. False when it had lapsed: its requests here
        were ended (each with a retryable error in its outbox), and it resumes them."""
        return self.leases.renew(owner)

    def holds(self, rid: str) -> bool:
        """Whether the request is here, in the engine or in a handoff (a router whose request
        has been silent for long asks: see the dispatcher's `_next_event`). Answered on the loop
        thread, after every command that came before."""
        return self._in_loop(lambda: rid in self.engine.request_ids() or rid in self.handoffs.rids())

    def leave(self, owner: str) -> None:
        """A router stops (cleanly): whatever it still has here ends now, as at a lapse but not
        counted as one, and its outbox closes."""
        self.leases.drop(owner)

        def gone():
            self._end_owner(owner, lapsed=False)
            self._close_outbox(owner)
        self._call_in_loop(gone)

    def _open_outbox(self, owner: str) -> _Outbox:
        """(loop thread) `owner`'s outbox, made on its first request or stream."""
        box = self._outboxes.get(owner)
        if box is None:
            box = _Outbox(owner, list(self.engine.kv.pool.cached))
            with self._cv:
                self._outboxes = {**self._outboxes, owner: box}     # readers iterate without the lock
        return box

    def _push_events(self, box: _Outbox, sock) -> None:
        import zmq
        try:
            while not self._stop and not box.closed:
                if not sock.poll(500, zmq.POLLOUT):         # no reader connected
                    continue
                reply = self._take_reply(box, 0.5)
                try:
                    sock.send(encode(reply), zmq.NOBLOCK, copy=False)
                except zmq.Again:                            # the reader left meanwhile
                    self._requeue(box, reply)
        finally:
            sock.close()

    def watch(self) -> None:
        """Returns when this worker shuts down. A router keeps one call pending: Ray fails it at
        once when the process dies, which the event stream alone would not say."""
        self._stopped.wait()

    def stats(self) -> LoadReport:
        """A load report built now on the loop thread, so it counts everything the worker has
        already said in its events (a poll carries the latest periodic one, up to
        REPORT_EVERY_S old). For tools and tests."""
        return self._in_loop(self._report)

    def set_role(self, role: str) -> bool:
        """Take another role, weights and cache kept (the controller's flip, after a drain).
        Only a worker that holds nothing changes: no sequence running or waiting, no KV held for
        a handoff or being received. Returns whether it changed."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")

        def flip() -> bool:
            h = self.handoffs
            if role != self.role and (self.engine.has_unfinished() or h.num_held or h.num_pending or h.num_receiving):
                return False
            self.role = role
            report = self._report()
            with self._cv:
                self._load = report
            return True
        return self._in_loop(flip)

    def set_accepting(self, accepting: bool) -> None:
        """The leading router drains this worker (False) or takes it back (True). While draining,
        new requests (of any router) are refused with a retryable error, so that a router that
        did not know resumes them elsewhere, and the drain completes; what runs, finishes."""
        def flip():
            self.accepting = accepting
            report = self._report()
            with self._cv:
                self._load = report
        self._in_loop(flip)

    def profile(self, repeats: int = 1, timeout_s: float = 600.0) -> list[list[float]]:
        """Time this worker's own engine over the step grid (workers/step_profile.py), for the
        pool controller's cost model: [seconds, *BatchShape] per step. Only before it serves (an
        idle engine); the engine's counters are left as they were, so metrics see no trace of it."""
        from workers.step_profile import profile_steps

        def run() -> list[list[float]]:
            if self.engine.has_unfinished():
                raise RuntimeError(f"worker {self.worker_id} is serving: profile it before it takes requests")
            stats = copy.deepcopy(self.engine.scheduler.stats)
            try:
                samples = profile_steps(self.engine, repeats, progress=lambda _line: None)
            finally:
                self.engine.scheduler.stats = stats
            return [[t, *dataclasses.astuple(shape)] for shape, t in samples]
        return self._in_loop(run, timeout_s)

    def shutdown(self) -> None:
        """Stop the loop and close the transport's connections (the launcher then kills the actor)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            transport = self._transport
        self._stopped.set()
        self._loop.join(timeout=5)
        if self._streams is not None:
            self._streams.close()
        if transport is not None:
            transport.shutdown()
        self.engine.close()
        with self._shm_lock:
            self._peer_caches.close_all()

    # -- KV handoff: the prefill side ---------------------------------------------------------
    def send_kv(self, payload: bytes) -> int:
        """Send a held request's prompt KV to the decode worker that asked (an encoded
        KVSendRequest; the receiver waits in recv with the same transfer id). Returns bytes."""
        from workers.kv_transfer import KVPeer
        req = decode(payload, KVSendRequest)
        block_ids = self.handoffs.start_send(req.rid)      # None: released, aborted, expired
        peer = KVPeer(req.peer_id, req.store_addr, req.secret)
        if block_ids is None:
            self._get_transport().refuse(peer, self._wire_caches(0), self.transfer_timeout_s, req.transfer_id)
            raise HandoffError(f"request {req.rid}: no KV held here (released, aborted or its lease expired)")
        try:
            ids = list(block_ids[req.skip:])
            caches = self._wire_caches(len(ids))
            if caches is not self.engine.runner.kv_caches:      # tensor parallel: gather the ranks' heads
                gathered = list(range(len(ids)))
                copy_heads(self._parts, ids, [(0, caches)], gathered)
                ids = gathered
            return self._get_transport().send_blocks(peer, caches, ids, self.transfer_timeout_s, req.transfer_id,
                                                     self.faults)
        finally:
            self._call_in_loop(lambda: self._apply(req.rid, self.handoffs.end_send(req.rid)))

    def kv_segment(self) -> list[dict] | None:
        """Where this worker's KV cache lives, for a decode worker on the same node that wants
        to copy out of it (workers/kv_shm.py): a segment per tensor-parallel rank, in rank
        order; None when it is not in shared memory."""
        return self._segments

    def _own_caches(self) -> tuple[list[dict] | None, list]:
        """This worker's KV cache segments (None: not in shared memory) and its cache by KV heads
        (kv_shm.HeadParts): its own, then each other rank's, mapped here for writing, so the
        handoff moves a tensor-parallel worker's KV without a call to its ranks."""
        runner, ranks = self.engine.runner, self.engine.ranks
        if runner.shared_kv is None:
            return None, [(0, runner.kv_caches)]
        segments = [runner.shared_kv.segment(node_id()).to_dict()]
        parts = [(0, runner.kv_caches)]
        if ranks is not None:
            import ray
            segments += ray.get([r.kv_segment.remote() for r in ranks.ranks], timeout=self.transfer_timeout_s)
            for r, seg in enumerate(segments[1:], start=1):
                caches, _ = self._peer_caches.open(f"{self.worker_id}#{r}", KVSegment(**seg), runner.kv_caches,
                                                   writable=True)
                parts.append((seg["first_head"], caches))
        return segments, parts

    def lend_kv(self, rid: str, skip: int = 0) -> tuple[list[int], float, int] | None:
        """A same-node decode worker copies a held request's KV itself: (the block ids after the
        first `skip`, the loan's deadline on this node's monotonic clock, this process's id), or
        None when nothing is held. Its release_kv ends the loan; past the deadline the blocks
        are freed and its copy must be dropped."""
        self.faults.hit("send", "before_header")
        lent = self.handoffs.lend(rid, self.transfer_timeout_s)
        if lent is None:
            return None
        block_ids, deadline = lent
        return list(block_ids[skip:]), deadline, os.getpid()

    def forget_peer(self, peer_id: str) -> None:
        """A peer died or was restarted: drop the transport's pairs with its old process and its
        old cache's mapping (the next transfer builds new ones)."""
        with self._cv:
            transport = self._transport
        if transport is not None:
            transport.close(peer_id)
        with self._shm_lock:
            self._shared_peers.pop(peer_id, None)
            self._peer_caches.close(peer_id)

    def release_kv(self, request_id: str) -> None:
        """The decode worker has the KV (or gave up): free our copy (full blocks stay cached)."""
        self._call_in_loop(lambda: self._apply(request_id, self.handoffs.release(request_id)))

    # -- the loop thread -----------------------------------------------------------------------
    def _call_in_loop(self, fn) -> None:
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify_all()

    def _in_loop(self, fn, timeout_s: float | None = None):
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:     # handed back to the caller's thread
                fut.set_exception(e)
        self._call_in_loop(run)
        return fut.result(timeout=timeout_s or self.transfer_timeout_s)

    def _run(self) -> None:
        while not self._stop:
            with self._cv:
                commands, self._inbox = self._inbox, deque()
            for fn in commands:
                try:
                    fn()
                except Exception:
                    log.exception("worker %s: command failed", self.worker_id)
            for rid in self.handoffs.expired():
                log.warning("worker %s: KV lease of %s expired before a decode worker pulled it",
                            self.worker_id, rid)
                self.engine.release(rid)
            for owner in self.leases.lapsed():
                self._end_owner(owner)
            for owner in self.leases.forgotten():
                self._close_outbox(owner)
            self._admit_pending()
            if self.engine.has_unfinished():
                try:
                    self._step()
                except RankLost as e:     # the group is broken: a restart (Ray's) builds a new one
                    log.error("worker %s: %s; ending the process", self.worker_id, e)
                    os._exit(1)
            else:
                with self._cv:
                    if not self._inbox and not self._stop:
                        # Idle: a command wakes us; the timeout only paces lease expiry and retries
                        # of pending reservations (room appears through commands: aborts, commits).
                        self._cv.wait(0.05)
            stored, evicted = self.engine.kv.pool.take_events()
            if stored or evicted:
                with self._cv:                           # the latest word on a hash wins
                    for box in self._fed():
                        box.cache.update(dict.fromkeys(evicted, False))
                        box.cache.update(dict.fromkeys(stored, True))
            # The report walks the waiting queue: build it at most every REPORT_EVERY_S, not
            # every step (polls come every 0.5 s; an idle loop turns every 0.05 s anyway).
            now = time.monotonic()
            if now - self._reported_at >= REPORT_EVERY_S:
                report = self._report()
                with self._cv:
                    self._load, self._reported_at = report, now

    def _step(self) -> None:
        t0 = time.monotonic()
        outputs = self.engine.step()
        step_s = time.monotonic() - t0
        self.steps += 1
        shape = self.engine.last_step
        events = []
        shared = self.engine.runner.shared_kv if ORDERED else None
        for o in outputs:
            kv = None
            if o.held:
                ids = self.engine.held_block_ids(o.request_id)
                self.handoffs.hold(o.request_id, ids)
                if shared is not None:
                    kv = HeldKV(list(ids), shared.generations[ids].tolist(), shared.nonce)
            events.append(TokenEvent(o.request_id, o.new_token_ids, o.finished, o.finish_reason,
                                     o.new_logprobs, o.held, o.prompt_logprobs, kv))
        if shared is not None:
            events += self._announce(shared)
        with self._cv:
            if shape.num_seqs:
                step_shape = [step_s, *dataclasses.astuple(self.engine.last_shape)]
                for box in self._fed():
                    samples = box.samples
                    samples["step_s"].append(step_s)
                    samples["batch_size"].append(shape.num_seqs)
                    samples["step_tokens"].append(shape.num_tokens)
                    samples["queue_s"].extend(shape.queue_times_s)
                    samples["step_shape"].append(step_shape)
            for ev in events:
                self._route(ev)
            self._cv.notify_all()

    def _announce(self, shared) -> list[TokenEvent]:
        """A word for each prompt the step left mid-prefill with more full blocks than it had
        announced: where they lie, so that its decode worker copies them meanwhile."""
        announced, self._announced = self._announced, {}
        events = []
        for seq in self.engine.prefilling:
            ids = self.engine.computed_block_ids(seq)
            self._announced[seq.seq_id] = len(ids)
            if len(ids) > announced.get(seq.seq_id, 0):
                events.append(TokenEvent(seq.seq_id, [], kv=HeldKV(ids, shared.generations[ids].tolist(),
                                                                   shared.nonce)))
        return events

    def _emit(self, event) -> None:
        with self._cv:
            self._route(event)
            self._cv.notify_all()

    def _fed(self):
        """(holding the lock) The outboxes that get every sample and cache change."""
        return [box for box in self._outboxes.values() if box.fed]

    def _route(self, event) -> None:
        """(holding the lock) Into its owner's outbox; an owner gone for good reads nothing."""
        box = self._outboxes.get(owner_of(event.rid))
        if box is not None:
            box.events.append(event)

    def _end_owner(self, owner: str, lapsed: bool = True) -> None:
        """(loop thread) A router's lease lapsed (or it left): end its requests here, wherever
        they are, and free their blocks (a send or pull under way frees them when it ends). Each
        gets a retryable error in its outbox, which a router that was only slow reads and
        resumes."""
        rids = {rid for rid in (*self.engine.request_ids(), *self.handoffs.rids()) if owner_of(rid) == owner}
        if lapsed or rids:
            log.warning("worker %s: router %s %s; ending its %d requests", self.worker_id, owner,
                        "missed its lease" if lapsed else "left", len(rids))
        for rid in rids:
            self._apply(rid, self.handoffs.abort(rid), abort=True)
            self._emit(ErrorEvent(rid, f"router {owner} missed its lease on worker {self.worker_id}",
                                  retryable=True, cause="lease_expired"))
        if lapsed:
            with self._cv:
                self._lease_expiries += 1
                self._lease_aborts += len(rids)

    def _close_outbox(self, owner: str) -> None:
        """(loop thread) A router gone for good: its outbox and stream end."""
        with self._cv:
            box = self._outboxes.get(owner)
            if box is not None:
                box.closed = True
                self._outboxes = {o: b for o, b in self._outboxes.items() if o != owner}
                self._cv.notify_all()

    def _report(self) -> LoadReport:
        """Built on the loop thread (the engine's state is read nowhere else)."""
        h = self.handoffs
        with self._cv:
            totals = dataclasses.replace(self._transfer_totals)
            expiries, aborts = self._lease_expiries, self._lease_aborts
        report = self.engine.load_report(self.worker_id, self.role, self.steps, h.num_held, h.num_pending,
                                         h.num_receiving, totals)
        report.routers, report.lease_expiries, report.lease_aborts = self.leases.num_live, expiries, aborts
        report.accepting = self.accepting
        return report

    # -- commands (loop thread) ----------------------------------------------------------------
    def _handle(self, op) -> None:
        if isinstance(op, AbortOp):
            self._early_words.pop(op.rid, None)
            if (feed := self._feeds.get(op.rid)) is not None:
                feed.end(f"request {op.rid} was aborted", aborted=True)
            self._apply(op.rid, self.handoffs.abort(op.rid), abort=True)
            return
        if isinstance(op, KVMoreOp):
            self._more_kv(op)
            return
        if owner := owner_of(op.rid):       # a router's request: it has an outbox and a lease
            self._open_outbox(owner)
            self.leases.renew(owner)
        if not self.accepting:
            self._emit(ErrorEvent(op.rid, f"worker {self.worker_id} is draining", retryable=True,
                                  cause="worker_draining"))
            return
        try:
            if isinstance(op, DecodeOp):
                if op.streaming and op.kv is None:
                    raise ValueError("a streaming DecodeOp names the blocks computed so far (kv)")
                self.handoffs.wait_for_room(op.rid, op)
                if (early := self._early_words.pop(op.rid, None)) is not None:
                    self._more_kv(early[1])
            else:
                self.engine.add_request(prompt_token_ids=op.prompt_token_ids, params=op.params, request_id=op.rid,
                                        priority=op.priority, prefill_only=isinstance(op, PrefillOp),
                                        output_token_ids=op.output_token_ids, forks=op.forks,
                                        ttft_left_s=op.ttft_left_s, tpot_s=op.tpot_s)
        except ValueError as e:
            self._emit(ErrorEvent(op.rid, str(e)))

    def _more_kv(self, op: KVMoreOp) -> None:
        """The router's next word on a streamed pull: to the op still waiting for room (the held
        KV's word makes it an ordinary DecodeOp), or to the pull under way, or kept a while for
        the DecodeOp it came before."""
        final = op.output_token_ids is not None
        waiting = self.handoffs.pending_op(op.rid)
        if waiting is not None:
            if newer(op.kv, final, waiting.kv, not waiting.streaming):
                waiting.kv = op.kv
                if final:
                    waiting.output_token_ids, waiting.streaming = list(op.output_token_ids), False
            return
        feed = self._feeds.get(op.rid)
        if feed is None:             # before its DecodeOp, or after its pull ended
            now = time.monotonic()
            self._early_words = {r: w for r, w in self._early_words.items() if now - w[0] < self.transfer_timeout_s}
            known = self._early_words.get(op.rid)
            if known is None or newer(op.kv, final, known[1].kv, known[1].output_token_ids is not None):
                self._early_words[op.rid] = (now, op)
            return
        if final and not feed.final:
            try:
                self.engine.receive_token(op.rid, op.output_token_ids)
            except (KeyError, ValueError, AssertionError) as e:
                feed.end(f"the held KV's word does not fit its reservation: {e}")
                return
        feed.tell(op.kv, final)

    def _apply(self, rid: str, outcome: Outcome, abort: bool = False) -> None:
        """Carry out what the handoff book decided for a request's blocks."""
        if outcome is Outcome.FREE:
            self.engine.abort(rid) if abort else self.engine.release(rid)
        elif outcome is Outcome.COMMIT:
            forked = self.engine.commit_received(rid)
            if forked is not None:                      # a carrier: its forks run from here
                self._emit(TokenEvent(rid, [], True, forked.finish_reason))
        elif outcome is Outcome.NOTHING and abort:
            self.engine.abort(rid)                      # not in a handoff: queued or running here

    def _admit_pending(self) -> None:
        """Reserve blocks for waiting decode requests, oldest first, while there is room."""
        def reserve(op: DecodeOp):
            return self.engine.reserve(op.rid, op.prompt_token_ids, op.output_token_ids, op.params, op.priority,
                                       num_receiving=self.handoffs.num_receiving, forks=op.forks, tpot_s=op.tpot_s,
                                       token_to_come=op.streaming)
        bs = self.engine.kv.block_size
        for op, dst in self.handoffs.admit(reserve):
            self.handoffs.start_transfer(op.rid)
            num_kv = len(op.prompt_token_ids) + len(op.output_token_ids) - 1 + op.streaming
            skip = cdiv(num_kv, bs) - len(dst)
            if op.streaming:
                self._feeds[op.rid] = KVFeed(op.kv)
            threading.Thread(target=self._pull, args=(op, dst, skip), daemon=True, name=f"pull-{op.rid}").start()

    def _pull(self, op: DecodeOp, dst: list[int], skip: int) -> None:
        """Transfer thread: take the KV from the prefill worker into the reserved blocks (`dst`,
        after the `skip` leading blocks this worker's prefix cache holds): out of its cache
        through shared memory when it is on this node (while the prompt is prefilled, for a
        streaming op), else sent over the transport once it is held."""
        rid, prefill_id = op.rid, op.prefill_id
        feed = self._feeds.get(rid)
        point = ["request"]                 # where the pull is (workers/faults.py's FAILURE_POINTS)
        try:
            prefill = _peer(self.cluster_id, prefill_id)
            t0 = time.monotonic()
            busy = None                     # a streamed pull's seconds of copying (it also waits for words)
            shared = self._shared_caches(prefill_id, prefill) if dst else None
            if shared is not None and feed is not None:
                nbytes, busy = self._copy_streamed(op, feed, prefill, shared, dst, skip, point)
            else:
                if feed is not None:        # the KV travels once it is held: wait for that word
                    op = dataclasses.replace(op, kv=self._held_word(feed))
                    t0 = time.monotonic()
                if not dst:                 # every block is in this worker's prefix cache
                    nbytes = 0
                elif shared is not None:
                    nbytes = self._copy_shared(op, prefill, shared, dst, skip, point)
                else:
                    nbytes = self._recv_sent(rid, prefill_id, prefill, dst, skip, point)
            done = time.monotonic()
            point[0] = "before_commit"
            self.faults.hit("recv", "before_commit")
            tail = done - max(t0, feed.final_at or t0) if feed is not None else done - t0
            self._record_transfer(nbytes, done - t0 if busy is None else busy, skip, tail)
        except Exception as e:
            aborted = isinstance(e, StreamEnded) and e.aborted
            if not aborted:             # an abort is the router's doing: nothing failed
                # The transport's errors say where it was; the blocks may hold part of the payload,
                # so the failure path below frees them and the sequence never joins the batch.
                said = getattr(e, "point", None)
                point = said if said == "refused" or point[0] == "request" and said else point[0]
                log.warning("worker %s: KV pull of %s failed at %s: %s", self.worker_id, rid, point, e)
                with self._cv:
                    t = self._transfer_totals
                    t.failures += 1     # a new dict: load reports already built keep theirs
                    t.failures_by_point = {**t.failures_by_point, point: t.failures_by_point.get(point, 0) + 1}
            _release_on(self.cluster_id, prefill_id, rid)
            # (built here: `e` is unbound once this block ends)
            error = None if aborted else ErrorEvent(rid, f"KV transfer failed: {e}", retryable=True,
                                                    cause="handoff_failed")

            def failed():
                self._feeds.pop(rid, None)
                if self.handoffs.finish_transfer(rid, ok=False) is Outcome.FREE:
                    self.engine.abort(rid)
                if error is not None:
                    self._emit(error)
            self._call_in_loop(failed)
            return
        prefill.release_kv.remote(rid)                  # acknowledged: the prefill side frees

        def committed():
            self._feeds.pop(rid, None)
            self._apply(rid, self.handoffs.finish_transfer(rid, ok=True), abort=True)
        self._call_in_loop(committed)

    def _held_word(self, feed: KVFeed) -> HeldKV:
        """A streamed pull's held KV, once the router has said it."""
        kv, final = feed.kv, feed.final
        while not final:
            kv, final = feed.wait(kv, self.transfer_timeout_s)
        return kv

    def _copy_streamed(self, op: DecodeOp, feed: KVFeed, prefill, shared, dst: list[int], skip: int,
                       point: list[str]) -> tuple[int, float]:
        """Copy a prompt's blocks out of a same-node prefill worker's cache as its words name
        them while it is prefilled (workers/kv_stream.py), then what the held KV's word adds or
        changes, checked as `_copy_shared` checks a whole pull. Returns (bytes, seconds copying)."""
        rid, prefill_id = op.rid, op.prefill_id
        segment, parts, generations = self._cache_of(op, prefill, shared)
        plan = CopyPlan(dst, skip)
        kv, final = feed.kv, feed.final
        nbytes, busy = 0, 0.0
        while True:
            t = time.monotonic()
            if kv.segment != segment.nonce:
                raise _refused(f"{prefill_id} restarted while it computed the KV of {rid}")
            src, to, _ = plan.needed(kv)
            if final:
                held = kv.block_ids[skip:]
                if generations[held].tolist() != kv.generations[skip:]:
                    raise _refused(f"{prefill_id} no longer holds the KV of {rid}: its blocks were reused")

                def midway():
                    point[0] = "mid_payload"
                    self.faults.hit("recv", "mid_payload")
                nbytes += copy_heads(parts, src, self._parts, to, midway) if src else 0
                if not src:
                    midway()
                point[0] = "after_payload"
                self.faults.hit("recv", "after_payload")
                if generations[held].tolist() != kv.generations[skip:] or len(held) != len(dst):
                    raise _refused(f"{prefill_id} reused the blocks of {rid} during the copy")
                return nbytes, busy + time.monotonic() - t
            if src:
                nbytes += copy_heads(parts, src, self._parts, to)
                plan.copied(kv, src, generations[src].tolist())
            busy += time.monotonic() - t
            kv, final = feed.wait(kv, self.transfer_timeout_s)

    def _recv_sent(self, rid: str, prefill_id: str, prefill, dst: list[int], skip: int, point: list[str]) -> int:
        """Ask the prefill worker to send over the transport; receive into `dst`. Returns bytes."""
        transport = self._get_transport()
        # One pull at a time per prefill peer, and a shared id: both sides run the pair's
        # transfers in the same order, and a mix-up fails loudly instead of swapping KV.
        with self._peer_lock(prefill_id):
            self._transfer_ids += 1
            tid = self._transfer_ids
            sent = prefill.send_kv.remote(encode(KVSendRequest(rid, self.worker_id, transport.store_addr, tid, skip,
                                                               transport.secret_for(prefill_id))))
            caches = self._wire_caches(len(dst))
            into = dst if caches is self.engine.runner.kv_caches else list(range(len(dst)))
            nbytes = transport.recv_blocks(prefill_id, caches, into, self.transfer_timeout_s, tid, self.faults)
            point[0] = "after_payload"      # every byte is here; the sender must confirm it sent them all
            _wait_ref(sent, self.transfer_timeout_s)
        if into is not dst:                 # tensor parallel: each rank's heads into its cache
            copy_heads([(0, caches)], into, self._parts, dst)
        return nbytes

    def _wire_caches(self, num_blocks: int):
        """The cache the transport moves KV through: this worker's own, or with tensor
        parallelism a buffer of `num_blocks` blocks with every head (gathered from the ranks
        before a send, scattered to them after a receive), so peers of any size meet in one layout."""
        if len(self._parts) == 1:
            if self.engine.ranks is not None:
                raise ValueError("moving a tensor-parallel worker's KV needs its ranks' caches in shared memory "
                                 "(a CPU worker); on GPUs it awaits a transfer per rank")
            return self.engine.runner.kv_caches
        return whole_heads(self._parts, num_blocks)

    def _copy_shared(self, op: DecodeOp, prefill, shared, dst: list[int], skip: int, point: list[str]) -> int:
        """Copy the held blocks out of a same-node prefill worker's cache (workers/kv_shm.py):
        where the held event said they are, checked by their allocation counts after the copy;
        without that (another CPU family), borrowed for the copy. Returns bytes."""
        from workers.kv_transfer import KVTransferTimeout
        rid, prefill_id = op.rid, op.prefill_id
        segment, parts, generations = shared
        if op.kv is not None:
            segment, parts, generations = self._cache_of(op, prefill, shared)
            src, expected, deadline = op.kv.block_ids[skip:], op.kv.generations[skip:], None
        else:
            lent = _wait_ref(prefill.lend_kv.remote(rid, skip), self.transfer_timeout_s)
            if lent is None:
                raise _refused(f"{prefill_id} no longer holds the KV of {rid} (released, aborted or its lease expired)")
            src, deadline, pid = lent
            expected = None
            if pid != segment.pid:          # restarted since we mapped it: map the new process's cache
                shared = self._shared_caches(prefill_id, prefill, refresh=True)
                if shared is None or shared[0].pid != pid:
                    raise _refused(f"{prefill_id} restarted and its new KV cache cannot be mapped")
                segment, parts, generations = shared

        def reused() -> bool:               # a block was handed to other KV since the hold
            return expected is not None and generations[src].tolist() != expected
        if reused():
            raise _refused(f"{prefill_id} no longer holds the KV of {rid}: its blocks were reused")

        def midway():
            point[0] = "mid_payload"
            self.faults.hit("recv", "mid_payload")
        nbytes = copy_heads(parts, src, self._parts, dst, midway)
        point[0] = "after_payload"
        self.faults.hit("recv", "after_payload")
        if reused():
            raise _refused(f"{prefill_id} reused the blocks of {rid} during the copy")
        if deadline is not None and time.monotonic() >= deadline:
            raise KVTransferTimeout(f"the loan of {rid}'s KV from {prefill_id} ended before its copy did")
        return nbytes

    def _cache_of(self, op: DecodeOp, prefill, shared) -> tuple[KVSegment, list, object]:
        """The mapped cache that `op.kv` names: the one mapped, or the prefill worker's new one
        when it restarted since (mapped anew); refused when that is not the one named either."""
        if op.kv.segment == shared[0].nonce:
            return shared
        shared = self._shared_caches(op.prefill_id, prefill, refresh=True)
        if shared is None or shared[0].nonce != op.kv.segment:
            raise _refused(f"{op.prefill_id} restarted since it computed the KV of {op.rid}")
        return shared

    def _shared_caches(self, peer_id: str, peer, refresh: bool = False) -> tuple[KVSegment, list, object] | None:
        """(rank 0's segment, the mapped caches by heads, rank 0's allocation counts) of a
        prefill peer on this node whose cache is in shared memory; None when the KV must travel
        over the transport (asked once per peer)."""
        with self._shm_lock:
            if not refresh and peer_id in self._shared_peers:
                return self._shared_peers[peer_id]
        found = None
        if self.engine.runner.shared_kv is not None:
            segs = _wait_ref(peer.kv_segment.remote(), self.transfer_timeout_s)
            segments = [KVSegment(**seg) for seg in segs or ()]
            if segments and segments[0].node == node_id():
                with self._shm_lock:
                    try:
                        mine = self.engine.runner.kv_caches
                        mapped = [self._peer_caches.open(peer_id if r == 0 else f"{peer_id}#{r}", seg, mine)
                                  for r, seg in enumerate(segments)]
                        found = (segments[0], [(seg.first_head, caches) for seg, (caches, _) in zip(segments, mapped)],
                                 mapped[0][1])
                    except OSError as e:
                        log.warning("worker %s: cannot map %s's KV cache (%s): pulls from it go over %s",
                                    self.worker_id, peer_id, e, self._transport_kind)
        if found is None and self._transport_kind == SHM:
            raise ValueError(f"--kv-transport shm: {peer_id} is not on this node or its KV cache cannot be "
                             "mapped here; use --kv-transport auto to fall back to gloo")
        with self._shm_lock:
            self._shared_peers[peer_id] = found
        return found

    def _peer_lock(self, peer_id: str) -> threading.Lock:
        with self._cv:
            return self._peer_locks.setdefault(peer_id, threading.Lock())

    def _record_transfer(self, nbytes: int, seconds: float, reused: int, tail_s: float) -> None:
        with self._cv:
            t = self._transfer_totals
            t.bytes += nbytes
            t.count += 1
            t.seconds += seconds
            t.blocks_reused += reused
            for box in self._fed():
                box.samples["kv_transfer_s"].append(seconds)
                box.samples["kv_tail_s"].append(tail_s)

    def _get_transport(self):
        with self._cv:
            if self._transport is None:
                from workers.kv_transfer import make_transport
                self._transport = make_transport(self._transport_kind, self.engine.device, self.worker_id,
                                                 host=bind_host())
            return self._transport


def actor_name(cluster_id: str, worker_id: str) -> str:
    return f"pdcluster-{cluster_id}-{worker_id}"


def _peer(cluster_id: str, worker_id: str):
    import ray                     # peers are named actors in the cluster's namespace
    return ray.get_actor(actor_name(cluster_id, worker_id), namespace="pdcluster")


def _refused(message: str) -> Exception:
    from workers.kv_transfer import KVTransferRefused
    e = KVTransferRefused(message)
    e.point = "refused"
    return e


def _release_on(cluster_id: str, worker_id: str, rid: str) -> None:
    """Tell a prefill worker to drop its copy; a peer that is gone has nothing left to free."""
    try:
        _peer(cluster_id, worker_id).release_kv.remote(rid)
    except Exception:
        pass


def _wait_ref(ref, timeout_s: float):
    import ray
    return ray.get(ref, timeout=timeout_s)
