"""The request lifecycle across the pools: pick, prefill, hand off, decode, stream, retry.

One pump per worker long-polls its events (tokens, "KV held", errors) and its load report, and
routes each event to the request's queue. A request's coroutine walks:

    disaggregated:  pick prefill ─▶ first token (TTFT) + KV held ─▶ pick decode ─▶ tokens ─▶ done
    colocated:      pick worker ─▶ tokens ─▶ done

A failed KV handoff or a dead worker re-runs the request from its prefill (up to `max_retries`),
then fails it with a clear error; a cancelled request (client gone) is aborted on every worker
that knows it, so its blocks come back.

Workers are reached through handles (`handle.method.remote(...)` returns an awaitable); the
messages are workers/messages.py's dataclasses, encoded there.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from router.metrics import Metrics
from router.picker import Picker, WorkerLoad, decode_load, prefill_load
from router.protocol import APIError, GenerationRequest
from workers import messages as msg
from workers.names import COLOCATED, DECODE, MODES, ROLES, first_role

log = logging.getLogger("pdcluster.router")


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    role: str
    handle: object
    report: msg.LoadReport | None = None             # the latest, None before the first poll
    assigned: set = field(default_factory=set)        # requests open on this worker (for failover)
    unreported: dict = field(default_factory=dict)    # rid -> (prompt tokens, sent at): not yet in a report
    alive: bool = True

    def sent(self, rid: str, num_tokens: int) -> None:
        self.assigned.add(rid)
        self.unreported[rid] = (num_tokens, time.monotonic())

    def reported(self, report: msg.LoadReport, polled_at: float) -> None:
        """A report covers what was sent before the poll that carried it was issued."""
        self.report = report
        for rid in [r for r, (_, t) in self.unreported.items() if t < polled_at]:
            del self.unreported[rid]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What the HTTP layer streams: new tokens of one request, and whether it ended."""
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None


class RequestFailed(Exception):
    pass


class Dispatcher:
    def __init__(self, workers: list[WorkerState], mode: str, metrics: Metrics, policy: str = "p2c",
                 max_retries: int = 2, seed: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.workers = {w.worker_id: w for w in workers}
        self.mode, self.metrics, self.max_retries = mode, metrics, max_retries
        self.prefill_picker = Picker(policy, seed)
        self.decode_picker = Picker(policy, None if seed is None else seed + 1)
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._pumps: list[asyncio.Task] = []
        self._count_pools()

    def _count_pools(self) -> None:
        for role in ROLES:
            self.metrics.pool_size.labels(role).set(len(self._alive(role)))

    def start(self) -> None:
        self._pumps = [asyncio.get_running_loop().create_task(self._pump(w)) for w in self.workers.values()]

    async def stop(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    # -- the pumps -----------------------------------------------------------------------------
    async def _pump(self, w: WorkerState) -> None:
        while w.alive:
            polled_at = time.monotonic()
            try:
                reply = msg.decode(await w.handle.poll.remote(0.5), msg.PollReply)
            except asyncio.CancelledError:
                raise
            except Exception as e:                       # the actor died: fail over its requests
                log.error("worker %s is gone: %s", w.worker_id, e)
                w.alive = False
                self._count_pools()
                for rid in list(w.assigned):
                    self._deliver(msg.ErrorEvent(rid, f"worker {w.worker_id} failed", retryable=True))
                return
            w.reported(reply.load, polled_at)
            self.metrics.observe_load(reply.load)
            self.metrics.observe_samples(w.worker_id, w.role, reply.samples)
            for ev in reply.events:
                self._deliver(ev)

    def _deliver(self, ev: msg.Event) -> None:
        q = self._queues.get(ev.rid)
        if q is not None:
            q.put_nowait(ev)

    # -- one request ---------------------------------------------------------------------------
    def _alive(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def _pick(self, role: str) -> WorkerState:
        pool = self._alive(role)
        if not pool:
            raise RequestFailed(f"no live {role} worker")
        if role == DECODE:
            loads = [WorkerLoad(w.worker_id, decode_load(w.report, len(w.unreported))) for w in pool]
            return self.workers[self.decode_picker.pick(loads)]
        loads = [WorkerLoad(w.worker_id, prefill_load(w.report, sum(n for n, _ in w.unreported.values())))
                 for w in pool]
        return self.workers[self.prefill_picker.pick(loads)]

    async def generate(self, req: GenerationRequest):
        """Async iterator of TokenEvents; raises RequestFailed when retries run out."""
        base = f"r{next(self._ids)}-{time.monotonic_ns() % 10**8}"
        for attempt in range(self.max_retries + 1):
            rid = f"{base}.{attempt}"
            q: asyncio.Queue = asyncio.Queue()
            self._queues[rid] = q
            involved: list[WorkerState] = []
            finished = retry = False
            try:
                async for ev in self._attempt(req, rid, q, involved):
                    if ev is None:
                        retry = True
                        break
                    finished = ev.finished
                    yield ev
                if not retry:
                    return
            finally:
                self._queues.pop(rid, None)
                for w in involved:
                    w.assigned.discard(rid)
                    if w.alive and not finished:
                        # Cancelled, failed or retried: free whatever it still holds there
                        # (idempotent on the worker). A finished request holds nothing.
                        w.handle.submit.remote(msg.encode(msg.AbortOp(rid)))
            log.warning("request %s: retrying from prefill (attempt %d)", base, attempt + 1)
        raise RequestFailed(f"request failed after {self.max_retries + 1} attempts")

    async def _attempt(self, req: GenerationRequest, rid: str, q: asyncio.Queue, involved: list):
        """Yields TokenEvents; yields None once to ask for a retry."""
        role = first_role(self.mode)
        w = self._pick(role)
        involved.append(w)
        w.sent(rid, len(req.prompt_token_ids))
        op = msg.GenerateOp if role == COLOCATED else msg.PrefillOp
        w.handle.submit.remote(msg.encode(op(rid, req.prompt_token_ids, req.params, req.priority)))
        first_tokens: list[int] = []
        while True:
            ev = await q.get()
            if _wants_retry(ev):
                yield None
                return
            if ev.tokens or ev.finished:
                first_tokens += ev.tokens
                yield TokenEvent(ev.tokens, ev.finished, ev.reason, ev.logprobs)
            if ev.finished:
                return
            if ev.held:
                break
        # The prefill worker holds the KV: hand it to a decode worker, which pulls when it has room.
        d = self._pick(DECODE)
        involved.append(d)
        d.sent(rid, 1)
        d.handle.submit.remote(msg.encode(msg.DecodeOp(rid, req.prompt_token_ids, req.params, first_tokens,
                                                       w.worker_id, req.priority)))
        while True:
            ev = await q.get()
            if _wants_retry(ev):
                yield None
                return
            yield TokenEvent(ev.tokens, ev.finished, ev.reason, ev.logprobs)
            if ev.finished:
                return


def _wants_retry(ev: msg.Event) -> bool:
    """A retryable failure (handoff, dead worker) asks for a retry; any other error is final."""
    if not isinstance(ev, msg.ErrorEvent):
        return False
    if ev.retryable:
        return True
    raise APIError(400, ev.error)
