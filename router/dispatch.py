"""The request lifecycle across the pools: pick, prefill, hand off, decode, stream, resume.

One pump per worker long-polls its events (tokens, "KV held", errors) and its load report, and
routes each event to the request's queue. A request's coroutine walks:

    disaggregated:  pick prefill ─▶ first token (TTFT) + KV held ─▶ pick decode ─▶ tokens ─▶ done
    colocated:      pick worker ─▶ tokens ─▶ done

The router keeps what it has delivered. A failed KV handoff, a dead worker or a hung one
(no answer to a poll within `hang_timeout_s`) resumes the request: prompt + delivered tokens
are prefilled on a live worker and decoding goes on, so the client never sees a token twice
or a gap (seeded sampling depends on the position only, so it continues the same). After
`max_retries` resumes the request fails with a clear error. A cancelled request (client gone)
is aborted on every worker that knows it, so its blocks come back.

A worker that died or hung is restarted by Ray (the launcher's `restart` kills a hung one so
that Ray restarts it); it rejoins the pools once it answers `ready()` again, and every other
worker forgets its transport pairs with the old process.

Workers are reached through handles (`handle.method.remote(...)` returns an awaitable); the
messages are workers/messages.py's dataclasses, encoded there.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.metrics import Metrics
from router.picker import Picker, decode_load, prefill_load
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
    alive: bool = True                                 # pickable: answering, not lost or restarting

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


@dataclass(frozen=True, slots=True)
class _Resume:
    """An attempt ended by a retryable failure: resume the request (cause: a metrics label)."""
    cause: str
    error: str


class Dispatcher:
    def __init__(self, workers: list[WorkerState], mode: str, metrics: Metrics, policy: str = "p2c",
                 max_retries: int = 2, seed: int | None = None, hang_timeout_s: float = 10.0,
                 restart_timeout_s: float = 300.0, restart: Callable[[object], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.workers = {w.worker_id: w for w in workers}
        self.mode, self.metrics, self.max_retries = mode, metrics, max_retries
        self.hang_timeout_s, self.restart_timeout_s = hang_timeout_s, restart_timeout_s
        self._restart = restart              # kills a hung worker's process so that Ray restarts it
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
        while True:
            polled_at = time.monotonic()
            try:
                raw = await asyncio.wait_for(_awaitable(w.handle.poll.remote(0.5)), self.hang_timeout_s)
                reply = msg.decode(raw, msg.PollReply)
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                self._lost(w, "hung", f"no answer to a poll within {self.hang_timeout_s:g}s")
                if self._restart is not None:
                    self._restart(w.handle)
                if not await self._await_restart(w):
                    return
                continue
            except Exception as e:                       # the actor died (Ray restarts it)
                self._lost(w, "died", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                if not await self._await_restart(w):
                    return
                continue
            w.reported(reply.load, polled_at)
            self.metrics.observe_load(reply.load)
            self.metrics.observe_samples(w.worker_id, w.role, reply.samples)
            for ev in reply.events:
                self._deliver(ev)

    def _lost(self, w: WorkerState, cause: str, detail: str) -> None:
        """Take a dead or hung worker out of the pools and resume everything open on it."""
        log.error("worker %s %s: %s; resuming its %d requests elsewhere", w.worker_id, cause, detail,
                  len(w.assigned))
        w.alive, w.report = False, None
        w.unreported.clear()
        self.metrics.workers_lost.labels(w.role, cause).inc()
        self._count_pools()
        for rid in list(w.assigned):
            self._deliver(msg.ErrorEvent(rid, f"worker {w.worker_id} {cause}", retryable=True, cause=f"worker_{cause}"))
        w.assigned.clear()
        for other in self.workers.values():              # their transport pairs with it are stale
            if other is not w and other.alive:
                _fire(other.handle.forget_peer.remote(w.worker_id))

    async def _await_restart(self, w: WorkerState) -> bool:
        """Wait for the restarted process to load its model; then it rejoins the pools."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.restart_timeout_s:
            try:
                await asyncio.wait_for(_awaitable(w.handle.ready.remote()), self.restart_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:                            # still restarting
                await asyncio.sleep(0.5)
                continue
            w.alive = True
            self.metrics.workers_replaced.labels(w.role).inc()
            self._count_pools()
            log.warning("worker %s is back after %.1fs", w.worker_id, time.monotonic() - t0)
            return True
        log.error("worker %s did not come back within %.0fs; the %s pool stays smaller", w.worker_id,
                  self.restart_timeout_s, w.role)
        return False

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
        ids, ws = [w.worker_id for w in pool], self.workers
        if role == DECODE:
            return ws[self.decode_picker.choose(ids, lambda i: decode_load(ws[i].report, len(ws[i].unreported)))]
        return ws[self.prefill_picker.choose(ids, lambda i: prefill_load(
            ws[i].report, sum(n for n, _ in ws[i].unreported.values())))]

    async def _pick_live(self, role: str) -> WorkerState:
        """Pick from the pool; when all of its workers are being restarted (a one-worker pool
        that lost its worker), wait for one to come back rather than fail the request."""
        deadline = time.monotonic() + self.restart_timeout_s
        while not self._alive(role) and any(w.role == role for w in self.workers.values()) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self._pick(role)

    async def generate(self, req: GenerationRequest):
        """Async iterator of TokenEvents; raises RequestFailed when resumes run out."""
        base = f"r{next(self._ids)}-{time.monotonic_ns() % 10**8}"
        delivered: list[int] = []                        # output tokens the client has
        stalled = 0                                      # resumes in a row that got nowhere
        for attempt in itertools.count():
            rid = f"{base}.{attempt}"
            start = len(delivered)
            q: asyncio.Queue = asyncio.Queue()
            self._queues[rid] = q
            involved: list[WorkerState] = []
            finished = False
            resume: _Resume | None = None
            try:
                async for ev in self._attempt(req, rid, q, involved, delivered):
                    if isinstance(ev, _Resume):
                        resume = ev
                        break
                    delivered += ev.token_ids
                    finished = ev.finished
                    yield ev
                if resume is None:
                    return
            finally:
                self._queues.pop(rid, None)
                for w in involved:
                    w.assigned.discard(rid)
                    if w.alive and not finished:
                        # Cancelled, failed or resumed: free whatever it still holds there
                        # (idempotent on the worker). A finished request holds nothing.
                        _fire(w.handle.submit.remote(msg.encode(msg.AbortOp(rid))))
            # An attempt that got past its first token made progress: the budget counts the
            # failures in a row without any (a persistent fault), not the faults a long request
            # happens to meet.
            stalled = 0 if len(delivered) - start > 1 else stalled + 1
            if stalled > self.max_retries:
                raise RequestFailed(f"{stalled} attempts in a row failed (last: {resume.error})")
            self.metrics.resumed.labels(resume.cause).inc()
            log.warning("request %s: %s; resuming after %d delivered tokens (attempt %d)", base, resume.error,
                        len(delivered), attempt + 2)

    async def _attempt(self, req: GenerationRequest, rid: str, q: asyncio.Queue, involved: list,
                       delivered: list[int]):
        """Yields TokenEvents; yields a _Resume once when the attempt failed retryably. Starts
        after the `delivered` output tokens (a resumed request)."""
        outputs = list(delivered)
        role = first_role(self.mode)
        w = await self._pick_live(role)
        involved.append(w)
        w.sent(rid, len(req.prompt_token_ids) + len(outputs))
        op = msg.GenerateOp if role == COLOCATED else msg.PrefillOp
        _fire(w.handle.submit.remote(msg.encode(op(rid, req.prompt_token_ids, req.params, req.priority, outputs))))
        while True:
            ev = await q.get()
            if (resume := _resume_for(ev)) is not None:
                yield resume
                return
            if ev.tokens or ev.finished:
                outputs += ev.tokens
                yield TokenEvent(ev.tokens, ev.finished, ev.reason, ev.logprobs)
            if ev.finished:
                return
            if ev.held:
                break
        # The prefill worker holds the KV: hand it to a decode worker, which pulls when it has room.
        d = await self._pick_live(DECODE)
        involved.append(d)
        d.sent(rid, 1)
        _fire(d.handle.submit.remote(msg.encode(msg.DecodeOp(rid, req.prompt_token_ids, req.params, outputs,
                                                             w.worker_id, req.priority))))
        while True:
            ev = await q.get()
            if (resume := _resume_for(ev)) is not None:
                yield resume
                return
            # Tokens from the decode worker: the KV has left the prefill worker, whose loss no
            # longer concerns this request.
            w.assigned.discard(rid)
            yield TokenEvent(ev.tokens, ev.finished, ev.reason, ev.logprobs)
            if ev.finished:
                return


def _resume_for(ev: msg.Event) -> _Resume | None:
    """A retryable failure (handoff, dead or hung worker) resumes the request; any other error
    is final (a 4xx: the request itself was refused)."""
    if not isinstance(ev, msg.ErrorEvent):
        return None
    if ev.retryable:
        return _Resume(ev.cause or "handoff_failed", ev.error)
    raise APIError(400, ev.error)


def _awaitable(ref):
    """A handle's call result as something asyncio.wait_for accepts (a Ray ObjectRef is only
    awaitable; wrapping it makes it a future that can be timed out and cancelled)."""
    async def wait():
        return await ref
    return wait()


def _fire(ref) -> None:
    """A call whose answer nobody needs (an abort, a forget): let a failure pass silently (the
    worker may be gone, which is what the call was about)."""
    if hasattr(ref, "future"):
        ref.future().add_done_callback(lambda f: f.exception())
