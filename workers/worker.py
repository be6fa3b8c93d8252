"""The worker actor: one engine, a role, and typed messages in and out. A shell over parts
with one job each:

    router ──submit(Op)──▶ EngineLoop (engine_loop.py: the thread that owns the engine)
                               │ steps while there is work; builds the LoadReport
                               ▼
                           Outboxes (outboxes.py: one per router) ──poll() / ZeroMQ stream──▶ router
    decode worker ──send_kv / lend_kv──▶ KVSender (kv_sender.py: the prefill side of the handoff)
    DecodeOp ──▶ KVReceiver (kv_receiver.py: the decode side) ──▶ a KVMover per prefill peer
                 (kv_movers.py: shared memory on one node, else the transport: Gloo or NCCL)
    routers' leases: RouterLeases (leases.py); the handoff's phases: HandoffBook (handoff.py)

The messages are workers/messages.py's dataclasses. The loop thread owns the handoff book's
decisions and the engine; the KV sides carry them out (a send or pull runs on a Ray or pull
thread beside the engine's steps, so it never waits behind a step: the held block ids are in
the book from the moment the request is held). Only the blocks the decode worker's prefix
cache lacks are moved.

Metrics: the load report carries gauges and cumulative counters; per-step and per-transfer
samples (step time, batch size, tokens, queue times, KV transfer seconds) wait in a bounded
buffer of each outbox until it is next read, and the router turns them into Prometheus histograms.

Roles: `prefill` runs requests to their first token and holds the KV under a lease;
`decode` reserves blocks (only when it has room), pulls the KV from the prefill worker,
then decodes; `colocated` runs whole requests (chunked prefill mixes into decode steps).

Ray stays out of this module's logic: the launcher wraps `Worker` with ray.remote, and peers
are looked up by name in workers/peers.py.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from workers.config import EngineConfig
from workers.device import resolve_device
from workers.engine import LLMEngine
from workers.engine_loop import EngineLoop
from workers.faults import FaultPlan
from workers import heap
from workers.handoff import HandoffBook, Outcome
from workers.kv_movers import LocalKV
from workers.kv_receiver import KVReceiver
from workers.kv_sender import KVSender
from workers.kv_shm import ORDERED
from workers.leases import RouterLeases
from workers.messages import (AbortOp, DecodeOp, ErrorEvent, GenerateOp, HeldKV, KVMoreOp, LoadReport, PrefillOp,
                              TokenEvent, WorkerInfo, decode)
from workers.names import AUTO, ROLES, SHM, owner_of
from workers.node import node_ip
from workers.outboxes import MAX_ROUTERS, Outboxes
from workers.tensor_parallel import RankLost
from workers.traces import WorkerTraces

log = logging.getLogger("pdcluster.worker")
REPORT_EVERY_S = 0.01               # the load report's freshness (polls read the latest)
__all__ = ["MAX_ROUTERS", "REPORT_EVERY_S", "Worker", "WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker takes part in its cluster (the engine's own settings are its EngineConfig)."""
    kv_transport: str = AUTO         # workers/names.py TRANSPORTS
    num_threads: int = 1             # torch's intra-op threads
    lease_s: float = 30.0            # a held prompt's KV waits this long for its decode worker's pull
    transfer_timeout_s: float = 30.0  # any wait on a peer in a handoff
    cluster_id: str = "default"      # peers are named actors of this cluster (workers/peers.py)
    router_lease_s: float = 10.0     # a router silent this long has its requests here ended
    freeze_heap: bool = False        # in a process of its own: its start-up heap out of the collector's walks (workers/heap.py)


class Worker:
    def __init__(self, worker_id: str, role: str, engine_cfg: EngineConfig, settings: WorkerSettings = WorkerSettings(),
                 placement=None):
        """`placement`: a tensor-parallel worker's placement group (its ranks start in it)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        s = settings
        torch.set_num_threads(s.num_threads)
        self.worker_id, self.role, self.cluster_id = worker_id, role, s.cluster_id
        faults = FaultPlan.from_env()                 # PDCLUSTER_KV_FAULTS (workers/faults.py); off when unset
        on_cpu = resolve_device(engine_cfg.device).type == "cpu"
        if s.kv_transport == SHM and not on_cpu:
            raise ValueError("--kv-transport shm shares CPU memory; this worker's KV cache is on a GPU: use auto or nccl")
        # Same-node peers copy out of this cache; a tensor-parallel worker's ranks' caches are
        # mapped here, where the handoff moves their KV.
        if on_cpu and (s.kv_transport in (AUTO, SHM) or engine_cfg.tensor_parallel_size > 1):
            engine_cfg = dataclasses.replace(engine_cfg, cache=dataclasses.replace(engine_cfg.cache, shared_memory=True))
        self.engine = LLMEngine(engine_cfg, placement)
        self.handoffs = HandoffBook(s.lease_s)        # its decisions are the loop thread's
        self.leases = RouterLeases(s.router_lease_s)
        self.accepting = True                         # False while the leading router drains it
        self.steps = 0
        self._lease_expiries = self._lease_aborts = 0   # (loop thread)
        self._announced: dict[str, int] = {}          # full blocks announced per prompt mid-prefill
        self._stopped = threading.Event()             # watch() returns on it
        self.loop = EngineLoop(f"engine-{worker_id}", self._turn, s.transfer_timeout_s)
        self.kv = LocalKV(worker_id, self.engine, s.kv_transport, s.transfer_timeout_s, faults)
        self.sender = KVSender(self.kv, self.handoffs, self.loop.call, self._apply)
        self.engine.kv.pool.record_events()
        self.outboxes = Outboxes(worker_id)
        self.traces = WorkerTraces(worker_id)         # (loop thread)
        self.receiver = KVReceiver(self.kv, self.handoffs, s.cluster_id, self.loop.call, self._apply,
                                   self.outboxes.publish, self.traces)
        self.outboxes.set_load(self._report_now())
        self._reported_at = time.monotonic()
        self._holds_heap = s.freeze_heap
        if self._holds_heap:
            heap.hold()
        self.loop.start()

    @property
    def faults(self) -> FaultPlan:
        return self.kv.faults

    @faults.setter
    def faults(self, plan: FaultPlan) -> None:
        self.kv.faults = plan

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
        arrived = time.time() if getattr(op, "trace", "") else 0.0      # traced: when it came
        self.loop.call(lambda: self._handle(op, arrived))

    def poll(self, timeout_s: float = 1.0) -> bytes:
        """Long poll of the outbox of requests without an owner tag: an encoded PollReply with
        the events since the last call, a fresh load report and the metric samples since the
        last call. (Routers read a stream of their own instead: `stream_events`.)"""
        return self.outboxes.poll(timeout_s)

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
        if len(client_key) != 40:
            raise ValueError("stream_events needs the reader's CURVE public key (40 characters of z85)")
        if owner and self.outboxes.get(owner) is None and self.leases.num_live >= MAX_ROUTERS:
            raise RuntimeError(f"worker {self.worker_id} streams to {MAX_ROUTERS} routers already, the most it takes")
        if owner:
            self.leases.renew(owner)
        box = self.outboxes.get(owner) or self.loop.ask(lambda: self._open_outbox(owner))
        return self.outboxes.stream(owner, client_key, box)

    def heartbeat(self, owner: str) -> bool:
        """A router is alive: its lease here runs on. False when it had lapsed: its requests here
        were ended (each with a retryable error in its outbox), and it resumes them."""
        return self.leases.renew(owner)

    def holds(self, rid: str) -> bool:
        """Whether the request is here, in the engine or in a handoff (a router whose request
        has been silent for long asks: see the dispatcher's `_next_event`). Answered on the loop
        thread, after every command that came before."""
        return self.loop.ask(lambda: rid in self.engine.request_ids() or rid in self.handoffs.rids())

    def leave(self, owner: str) -> None:
        """A router stops (cleanly): whatever it still has here ends now, as at a lapse but not
        counted as one, and its outbox closes."""
        self.leases.drop(owner)

        def gone():
            self._end_owner(owner, lapsed=False)
            self.outboxes.close(owner)
        self.loop.call(gone)

    def watch(self) -> None:
        """Returns when this worker shuts down. A router keeps one call pending: Ray fails it at
        once when the process dies, which the event stream alone would not say."""
        self._stopped.wait()

    def stats(self) -> LoadReport:
        """A load report built now on the loop thread, so it counts everything the worker has
        already said in its events (a poll carries the latest periodic one, up to
        REPORT_EVERY_S old). For tools and tests."""
        return self.loop.ask(self._report_now)

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
            self.outboxes.set_load(self._report_now())
            return True
        return self.loop.ask(flip)

    def set_accepting(self, accepting: bool) -> None:
        """The leading router drains this worker (False) or takes it back (True). While draining,
        new requests (of any router) are refused with a retryable error, so that a router that
        did not know resumes them elsewhere, and the drain completes; what runs, finishes."""
        def flip():
            self.accepting = accepting
            self.outboxes.set_load(self._report_now())
        self.loop.ask(flip)

    def profile(self, repeats: int = 1, timeout_s: float = 600.0, decode: bool = True) -> list[list[float]]:
        """Time this worker's own engine over the step grid (workers/step_profile.py; its decode
        shapes too when `decode`), for the step cost model of the pool controller and SLO
        admission: [seconds, *BatchShape] per step. Only before it serves (an idle engine); the
        engine's counters are left as they were, so metrics see no trace of it."""
        from workers.step_profile import profile_steps

        def run() -> list[list[float]]:
            if self.engine.has_unfinished():
                raise RuntimeError(f"worker {self.worker_id} is serving: profile it before it takes requests")
            stats = copy.deepcopy(self.engine.scheduler.stats)
            try:
                samples = profile_steps(self.engine, repeats, progress=lambda _line: None, decode=decode)
            finally:
                self.engine.scheduler.stats = stats
            return [[t, *dataclasses.astuple(shape)] for shape, t in samples]
        return self.loop.ask(run, timeout_s)

    def shutdown(self) -> None:
        """Stop the loop and close the transport's connections (the launcher then kills the actor)."""
        self.outboxes.stop()
        self._stopped.set()
        self.loop.stop()
        self.kv.close()
        self.engine.close()
        self.receiver.movers.close()
        if self._holds_heap:
            self._holds_heap = False
            heap.release()

    # -- the KV handoff (workers/kv_sender.py, kv_receiver.py) ----------------------------------
    def send_kv(self, payload: bytes) -> int:
        """Send a held request's prompt KV to the decode worker that asked (an encoded
        KVSendRequest; the receiver waits in recv with the same transfer id). Returns bytes."""
        return self.sender.send(payload)

    def kv_segment(self) -> list[dict] | None:
        """Where this worker's KV cache lives, for a decode worker on the same node that wants
        to copy out of it (workers/kv_shm.py): a segment per tensor-parallel rank, in rank
        order; None when it is not in shared memory."""
        return self.kv.segments

    def lend_kv(self, rid: str, skip: int = 0) -> tuple[list[int], float, int] | None:
        """A same-node decode worker copies a held request's KV itself: (the block ids after the
        first `skip`, the loan's deadline on this node's monotonic clock, this process's id), or
        None when nothing is held. Its release_kv ends the loan; past the deadline the blocks
        are freed and its copy must be dropped."""
        return self.sender.lend(rid, skip)

    def release_kv(self, request_id: str) -> None:
        """The decode worker has the KV (or gave up): free our copy (full blocks stay cached)."""
        self.sender.release(request_id)

    def forget_peer(self, peer_id: str) -> None:
        """A peer died or was restarted: drop the transport's pairs with its old process and its
        old cache's mapping (the next transfer builds new ones)."""
        self.receiver.movers.forget(peer_id)

    # -- the loop thread -----------------------------------------------------------------------
    def _turn(self) -> bool:
        """One turn's chores after the commands, and a step while there is work (whether it stepped)."""
        for rid in self.handoffs.expired():
            log.warning("worker %s: KV lease of %s expired before a decode worker pulled it", self.worker_id, rid)
            self.engine.release(rid)
        for owner in self.leases.lapsed():
            self._end_owner(owner)
        for owner in self.leases.forgotten():
            self.outboxes.close(owner)
        self.receiver.admit()
        stepped = self.engine.has_unfinished()
        if stepped:
            try:
                self._step()
            except RankLost as e:     # the group is broken: a restart (Ray's) builds a new one
                log.error("worker %s: %s; ending the process", self.worker_id, e)
                os._exit(1)
        stored, evicted = self.engine.kv.pool.take_events()
        if stored or evicted:
            self.outboxes.cache_changes(stored, evicted)
        # The report walks the waiting queue: build it at most every REPORT_EVERY_S, not every
        # step (polls come every 0.5 s; an idle loop turns every 0.05 s anyway).
        now = time.monotonic()
        if now - self._reported_at >= REPORT_EVERY_S:
            self.outboxes.set_load(self._report_now())
            self._reported_at = now
        return stepped

    def _step(self) -> None:
        traces = self.traces
        traced = bool(traces)
        wall0 = time.time() if traced else 0.0
        t0 = time.monotonic()
        cpu0 = time.thread_time()                      # (the CPU's interval inside the wall's)
        outputs = self.engine.step()
        step_cpu_s = time.thread_time() - cpu0
        step_s = time.monotonic() - t0
        if traced:
            wall1 = wall0 + step_s
            traces.steps(self.engine.last_scheduled, wall0, wall1)
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
            trace = traces.output(o.request_id, o.finished, wall1) if traced else None
            events.append(TokenEvent(o.request_id, o.new_token_ids, o.finished, o.finish_reason,
                                     o.new_logprobs, o.held, o.prompt_logprobs, kv, trace))
        if shared is not None:
            events += self._announce(shared)
        samples = None
        if shape.num_seqs:
            samples = {"step_s": [step_s], "step_cpu_s": [step_cpu_s], "batch_size": [shape.num_seqs],
                       "step_tokens": [shape.num_tokens],
                       "queue_s": shape.queue_times_s,
                       "step_shape": [[step_s, *dataclasses.astuple(self.engine.last_shape)]]}
        self.outboxes.publish(events, samples)

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

    def _open_outbox(self, owner: str):
        return self.outboxes.open(owner, lambda: self.engine.kv.pool.cached)

    def _end_owner(self, owner: str, lapsed: bool = True) -> None:
        """A router's lease lapsed (or it left): end its requests here, wherever they are, and
        free their blocks (a send or pull under way frees them when it ends). Each gets a
        retryable error in its outbox, which a router that was only slow reads and resumes."""
        rids = {rid for rid in (*self.engine.request_ids(), *self.handoffs.rids()) if owner_of(rid) == owner}
        if lapsed or rids:
            log.warning("worker %s: router %s %s; ending its %d requests", self.worker_id, owner,
                        "missed its lease" if lapsed else "left", len(rids))
        for rid in rids:
            self.traces.forget(rid)
            self._apply(rid, self.handoffs.abort(rid), abort=True)
            self.outboxes.publish([ErrorEvent(rid, f"router {owner} missed its lease on worker {self.worker_id}",
                                              retryable=True, cause="lease_expired")])
        if lapsed:
            self._lease_expiries += 1
            self._lease_aborts += len(rids)

    def _report_now(self) -> LoadReport:
        """Built on the loop thread (the engine's state is read nowhere else)."""
        h = self.handoffs
        report = self.engine.load_report(self.worker_id, self.role, self.steps, h.num_held, h.num_pending,
                                         h.num_receiving, self.receiver.totals())
        report.routers, report.lease_expiries, report.lease_aborts = (self.leases.num_live, self._lease_expiries,
                                                                      self._lease_aborts)
        report.accepting = self.accepting
        return report

    def _handle(self, op, arrived: float = 0.0) -> None:
        if isinstance(op, AbortOp):
            self.traces.forget(op.rid)
            self.receiver.abort(op.rid)
            self._apply(op.rid, self.handoffs.abort(op.rid), abort=True)
            return
        if isinstance(op, KVMoreOp):
            self.receiver.more(op)
            return
        if owner := owner_of(op.rid):       # a router's request: it has an outbox and a lease
            self._open_outbox(owner)
            self.leases.renew(owner)
        if not self.accepting:
            self.outboxes.publish([ErrorEvent(op.rid, f"worker {self.worker_id} is draining", retryable=True,
                                              cause="worker_draining")])
            return
        decodes = isinstance(op, DecodeOp)
        self.traces.begin(op.rid, op.trace, "decode" if decodes else "prefill", arrived,
                          decodes_here=not decodes and not isinstance(op, PrefillOp))
        try:
            if decodes:
                self.receiver.wait_for_room(op)
            else:
                self.engine.add_request(prompt_token_ids=op.prompt_token_ids, params=op.params, request_id=op.rid,
                                        priority=op.priority, prefill_only=isinstance(op, PrefillOp),
                                        output_token_ids=op.output_token_ids, forks=op.forks,
                                        ttft_left_s=op.ttft_left_s, tpot_s=op.tpot_s)
        except ValueError as e:
            self.traces.forget(op.rid)
            self.outboxes.publish([ErrorEvent(op.rid, str(e))])

    def _apply(self, rid: str, outcome: Outcome, abort: bool = False) -> None:
        """Carry out what the handoff book decided for a request's blocks."""
        if outcome is Outcome.FREE:
            self.engine.abort(rid) if abort else self.engine.release(rid)
        elif outcome is Outcome.COMMIT:
            forked = self.engine.commit_received(rid)
            if forked is not None:                      # a carrier: its forks run from here
                self.outboxes.publish([TokenEvent(rid, [], True, forked.finish_reason,
                                                  trace=self.traces.output(rid, True, time.time()))])
        elif outcome is Outcome.NOTHING and abort:
            self.engine.abort(rid)                      # not in a handoff: queued or running here
