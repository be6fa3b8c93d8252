"""The worker actor: one engine, a role, a loop thread, and typed messages in and out.

    router ──submit(Op)──▶ inbox ──▶ engine loop thread ──▶ events ──poll() → PollReply──▶ router
                                        │  (steps while there is work; builds the LoadReport)
    decode worker ──send_kv(KVSendRequest)──▶ this thread reads held blocks ──▶ transport ──▶ peer

The messages are workers/messages.py's dataclasses; the handoff's phases and leases live in
workers/handoff.py (the loop thread owns that book; this module carries out its decisions).

Metrics: the load report carries gauges and cumulative counters; per-step and per-transfer
samples (step time, batch size, tokens, queue times, KV transfer seconds) wait in a bounded
buffer until the next poll drains them, and the router turns them into Prometheus histograms.

Roles: `prefill` runs requests to their first token and holds the KV under a lease;
`decode` reserves blocks (only when it has room), pulls the KV from the prefill worker,
then decodes; `colocated` runs whole requests (chunked prefill mixes into decode steps).

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
from workers.engine import LLMEngine
from workers.faults import FaultPlan
from workers.handoff import HandoffBook, HandoffError, Outcome, Phase
from workers.messages import (SAMPLE_KINDS, AbortOp, DecodeOp, ErrorEvent, GenerateOp, KVSendRequest,
                              LoadReport, PollReply, PrefillOp, TokenEvent, TransferTotals, decode, encode)
from workers.names import ROLES

log = logging.getLogger("pdcluster.worker")
MAX_SAMPLES = 4096                  # per kind between polls; older ones are dropped
REPORT_EVERY_S = 0.01               # the load report's freshness (polls read the latest)


class Worker:
    def __init__(self, worker_id: str, role: str, engine_cfg: EngineConfig, transport: str = "auto",
                 num_threads: int = 1, lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 cluster_id: str = "default"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        torch.set_num_threads(num_threads)
        self.worker_id, self.role, self.cluster_id = worker_id, role, cluster_id
        self.faults = FaultPlan.from_env()            # PDCLUSTER_KV_FAULTS (workers/faults.py); off when unset
        self.engine = LLMEngine(engine_cfg)
        self.transfer_timeout_s = transfer_timeout_s
        self.handoffs = HandoffBook(lease_s)          # touched by the loop thread only
        self._transport_kind = transport
        self._transport = None
        self._inbox: deque = deque()
        self._events: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._peer_locks: dict[str, threading.Lock] = {}
        self._transfer_ids = 0
        self._transfer_totals = TransferTotals()
        self._samples = {k: deque(maxlen=MAX_SAMPLES) for k in SAMPLE_KINDS}
        self._cache_events: dict[bytes, bool] = {}   # prefix-cache hash -> held now (stored) or evicted
        self.engine.kv.pool.record_events()
        self.steps = 0
        self._load, self._reported_at = self._report(), time.monotonic()
        self._loop = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)
        self._loop.start()

    # -- called by the router / launcher (any thread) -----------------------------------------
    def ready(self) -> dict:
        e = self.engine
        return {"worker_id": self.worker_id, "role": self.role, "max_model_len": e.max_model_len,
                "num_blocks": e.layout.num_blocks, "block_size": e.layout.block_size,
                "bytes_per_block": e.layout.bytes_per_token * e.layout.block_size,
                "attention_backend": e.runner.backend.name, "device": str(e.device), "node": node_ip(),
                "pid": os.getpid()}

    def submit(self, payload: bytes) -> None:
        """An encoded GenerateOp | PrefillOp | DecodeOp | AbortOp; results come back as events."""
        op = decode(payload, (GenerateOp, PrefillOp, DecodeOp, AbortOp))
        self._call_in_loop(lambda: self._handle(op))

    def poll(self, timeout_s: float = 1.0) -> bytes:
        """Long poll: an encoded PollReply with the events since the last call, a fresh load
        report and the metric samples since the last call."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._events and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            events, self._events = self._events, []
            samples = {k: list(q) for k, q in self._samples.items()}
            for q in self._samples.values():
                q.clear()
            load = self._load
            changes, self._cache_events = self._cache_events, {}
        return encode(PollReply(events, load, samples, [h for h, held in changes.items() if held],
                                [h for h, held in changes.items() if not held]))

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
        self._loop.join(timeout=5)
        if transport is not None:
            transport.shutdown()

    # -- KV handoff: the prefill side ---------------------------------------------------------
    def send_kv(self, payload: bytes) -> int:
        """Send a held request's prompt KV to the decode worker that asked (an encoded
        KVSendRequest; the receiver waits in recv with the same transfer id). Returns bytes."""
        from workers.kv_transfer import KVPeer
        req = decode(payload, KVSendRequest)

        def start():
            if self.handoffs.phase(req.rid) is not Phase.HELD:
                return None                             # released, aborted, expired: say so at once
            self.handoffs.start_send(req.rid)
            return self.engine.held_block_ids(req.rid)
        block_ids = self._in_loop(start)
        peer = KVPeer(req.peer_id, req.store_addr)
        if block_ids is None:
            self._get_transport().refuse(peer, self.engine.runner.kv_caches, self.transfer_timeout_s, req.transfer_id)
            raise HandoffError(f"request {req.rid}: no KV held here (released, aborted or its lease expired)")
        try:
            return self._get_transport().send_blocks(peer, self.engine.runner.kv_caches, block_ids,
                                                     self.transfer_timeout_s, req.transfer_id, self.faults)
        finally:
            self._call_in_loop(lambda: self._apply(req.rid, self.handoffs.end_send(req.rid)))

    def forget_peer(self, peer_id: str) -> None:
        """A peer died or was restarted: drop the transport's pairs with its old process (the
        next transfer builds new ones)."""
        with self._cv:
            transport = self._transport
        if transport is not None:
            transport.close(peer_id)

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
            self._admit_pending()
            if self.engine.has_unfinished():
                self._step()
            else:
                with self._cv:
                    if not self._inbox and not self._stop:
                        # Idle: a command wakes us; the timeout only paces lease expiry and retries
                        # of pending reservations (room appears through commands: aborts, commits).
                        self._cv.wait(0.05)
            stored, evicted = self.engine.kv.pool.take_events()
            if stored or evicted:
                with self._cv:                           # the latest word on a hash wins
                    self._cache_events.update(dict.fromkeys(evicted, False))
                    self._cache_events.update(dict.fromkeys(stored, True))
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
        for o in outputs:
            if o.held:
                self.handoffs.hold(o.request_id)
            events.append(TokenEvent(o.request_id, o.new_token_ids, o.finished, o.finish_reason,
                                     o.new_logprobs, o.held, o.prompt_logprobs))
        with self._cv:
            if shape.num_seqs:
                self._samples["step_s"].append(step_s)
                self._samples["batch_size"].append(shape.num_seqs)
                self._samples["step_tokens"].append(shape.num_tokens)
                self._samples["queue_s"].extend(shape.queue_times_s)
                self._samples["step_shape"].append([step_s, *dataclasses.astuple(self.engine.last_shape)])
            self._events.extend(events)
            self._cv.notify_all()

    def _emit(self, event) -> None:
        with self._cv:
            self._events.append(event)
            self._cv.notify_all()

    def _report(self) -> LoadReport:
        """Built on the loop thread (the engine's state is read nowhere else)."""
        h = self.handoffs
        with self._cv:
            totals = dataclasses.replace(self._transfer_totals)
        return self.engine.load_report(self.worker_id, self.role, self.steps, h.num_held, h.num_pending,
                                       h.num_receiving, totals)

    # -- commands (loop thread) ----------------------------------------------------------------
    def _handle(self, op) -> None:
        if isinstance(op, AbortOp):
            self._apply(op.rid, self.handoffs.abort(op.rid), abort=True)
            return
        try:
            if isinstance(op, DecodeOp):
                self.handoffs.wait_for_room(op.rid, op)
            else:
                self.engine.add_request(prompt_token_ids=op.prompt_token_ids, params=op.params, request_id=op.rid,
                                        priority=op.priority, prefill_only=isinstance(op, PrefillOp),
                                        output_token_ids=op.output_token_ids, forks=op.forks,
                                        ttft_left_s=op.ttft_left_s, tpot_s=op.tpot_s)
        except ValueError as e:
            self._emit(ErrorEvent(op.rid, str(e)))

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
                                       num_receiving=self.handoffs.num_receiving, forks=op.forks, tpot_s=op.tpot_s)
        for op, dst in self.handoffs.admit(reserve):
            self.handoffs.start_transfer(op.rid)
            threading.Thread(target=self._pull, args=(op, dst), daemon=True, name=f"pull-{op.rid}").start()

    def _pull(self, op: DecodeOp, dst: list[int]) -> None:
        """Transfer thread: ask the prefill worker to send, receive into the reserved blocks."""
        rid, prefill_id = op.rid, op.prefill_id
        point = "request"                   # where the pull is (workers/faults.py's FAILURE_POINTS)
        try:
            prefill = _peer(self.cluster_id, prefill_id)
            transport = self._get_transport()
            # One pull at a time per prefill peer, and a shared id: both sides run the pair's
            # transfers in the same order, and a mix-up fails loudly instead of swapping KV.
            with self._peer_lock(prefill_id):
                self._transfer_ids += 1
                tid = self._transfer_ids
                t0 = time.monotonic()
                sent = prefill.send_kv.remote(encode(KVSendRequest(rid, self.worker_id, transport.store_addr, tid)))
                nbytes = transport.recv_blocks(prefill_id, self.engine.runner.kv_caches, dst,
                                               self.transfer_timeout_s, tid, self.faults)
                point = "after_payload"     # every byte is here; the sender must confirm it sent them all
                _wait_ref(sent, self.transfer_timeout_s)
                seconds = time.monotonic() - t0
            point = "before_commit"
            self.faults.hit("recv", "before_commit")
            self._record_transfer(nbytes, seconds)
        except Exception as e:
            # The transport's errors say where it was; the blocks may hold part of the payload,
            # so the failure path below frees them and the sequence never joins the batch.
            if point == "request":
                point = getattr(e, "point", None) or point
            log.warning("worker %s: KV pull of %s failed at %s: %s", self.worker_id, rid, point, e)
            with self._cv:
                t = self._transfer_totals
                t.failures += 1     # a new dict: load reports already built keep theirs
                t.failures_by_point = {**t.failures_by_point, point: t.failures_by_point.get(point, 0) + 1}
            _release_on(self.cluster_id, prefill_id, rid)
            # (built here: `e` is unbound once this block ends)
            error = ErrorEvent(rid, f"KV transfer failed: {e}", retryable=True, cause="handoff_failed")

            def failed():
                if self.handoffs.finish_transfer(rid, ok=False) is Outcome.FREE:
                    self.engine.abort(rid)
                self._emit(error)
            self._call_in_loop(failed)
            return
        prefill.release_kv.remote(rid)                  # acknowledged: the prefill side frees
        self._call_in_loop(lambda: self._apply(rid, self.handoffs.finish_transfer(rid, ok=True), abort=True))

    def _peer_lock(self, peer_id: str) -> threading.Lock:
        with self._cv:
            return self._peer_locks.setdefault(peer_id, threading.Lock())

    def _record_transfer(self, nbytes: int, seconds: float) -> None:
        with self._cv:
            t = self._transfer_totals
            t.bytes += nbytes
            t.count += 1
            t.seconds += seconds
            self._samples["kv_transfer_s"].append(seconds)

    def _get_transport(self):
        with self._cv:
            if self._transport is None:
                from workers.kv_transfer import make_transport
                self._transport = make_transport(self._transport_kind, self.engine.device, self.worker_id,
                                                 host=node_ip())
            return self._transport


def actor_name(cluster_id: str, worker_id: str) -> str:
    return f"pdcluster-{cluster_id}-{worker_id}"


def _peer(cluster_id: str, worker_id: str):
    import ray                     # peers are named actors in the cluster's namespace
    return ray.get_actor(actor_name(cluster_id, worker_id), namespace="pdcluster")


def node_ip() -> str:
    """The address other nodes reach this one at (Ray's view of it)."""
    import ray
    return ray.util.get_node_ip_address()


def _release_on(cluster_id: str, worker_id: str, rid: str) -> None:
    """Tell a prefill worker to drop its copy; a peer that is gone has nothing left to free."""
    try:
        _peer(cluster_id, worker_id).release_kv.remote(rid)
    except Exception:
        pass


def _wait_ref(ref, timeout_s: float):
    import ray
    return ray.get(ref, timeout=timeout_s)
