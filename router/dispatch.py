"""The request lifecycle across the pools: pick, prefill, hand off, decode, stream, resume.

A request's coroutine walks:

    disaggregated:  pick prefill ─▶ first token (TTFT) + KV held ─▶ pick decode ─▶ tokens ─▶ done
    colocated:      pick worker ─▶ tokens ─▶ done

Its events come from the worker's stream, which the supervisor reads (router/supervisor.py:
it records each frame's report in the pools, then hands the frame here, `take_frame`, and the
events go to their requests' queues).

The router keeps what it has delivered. A failed KV handoff, a dead worker or a hung one
(the supervisor's `resume_all`) resumes the request: prompt + delivered tokens are prefilled
on a live worker and decoding goes on, so the client never sees a token twice or a gap (seeded
sampling depends on the position only, so it continues the same). After `max_retries` resumes
in a row without progress the request fails with a clear error. A cancelled request (client
gone) is aborted on every worker that knows it, so its blocks come back.

The workers are router/pools.py's registry, which the dispatcher reads (it picks among a role's
active members); what it writes on a member is its own: the requests open there (`sent`,
`assigned`), so that a loss resumes them.

Workers are reached through handles (`handle.method.remote(...)` returns an awaitable); the
messages are workers/messages.py's dataclasses, encoded there.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.admission import DecodeGate
from router.metrics import Metrics
from router.picker import check_local_prefill, decode_load, slot_ends
from router.placement import Placement
from router.pools import DEAD, STOPPED, Member, PoolRegistry
from router.protocol import APIError, GenerationRequest
from workers import messages as msg
from workers.cost_model import BatchShape, StepFit
from workers.names import (COLOCATED, DECODE, DISAGGREGATED, MODES, OWNER_SEP, P2C, PREFILL, owner_tag)
from workers.sequence import SamplingParams

log = logging.getLogger("pdcluster.router")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What the HTTP layer streams: new tokens of one request, and whether it ended."""
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None
    prompt_logprobs: list | None = None   # asked for: with the first event (a resume may send them again)


class RequestFailed(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Resume:
    """An attempt ended by a retryable failure: resume the request (cause: a metrics label)."""
    cause: str
    error: str


@dataclass(frozen=True)
class DispatchSettings:
    policy: str = P2C                  # how a worker is picked (router/picker.py)
    max_retries: int = 2               # resumes in a row without progress before a request fails
    seed: int | None = None            # the pickers' randomness (None: fresh)
    hang_timeout_s: float = 10.0       # a request silent this long: is it still on its worker?
    restart_timeout_s: float = 300.0   # a pick waits this long for a pool's worker on its way (back) in
    block_size: int = 16               # the workers' KV block size (the prefix index hashes blocks)
    # Disaggregated: a request with at most this many prompt tokens to compute (beyond what its
    # decode worker's prefix cache holds) is prefilled there, with no handoff; "auto": as the
    # cost model says, request by request (`price_local_prefill`).
    local_prefill_max_tokens: int | str = 0
    decode_gate: bool = True           # new requests wait before their prefill while the decode pool is full
    decode_seats: int | None = None    # the workers' sequence limit (the gate's capacity before it sees one full)
    router_id: str = "router"


class Dispatcher:
    def __init__(self, pools: PoolRegistry | list[Member], mode: str, metrics: Metrics,
                 settings: DispatchSettings = DispatchSettings()):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        s = self.settings = settings
        check_local_prefill(s.local_prefill_max_tokens)
        self.pools = pools if isinstance(pools, PoolRegistry) else PoolRegistry.of(pools)
        # Every request id starts with this router's owner tag: the workers send its events to
        # this router's stream only, and end its requests when its lease lapses (the
        # supervisor's heartbeats keep it; workers/leases.py).
        self.owner = owner_tag(s.router_id)
        self.mode, self.metrics, self.max_retries = mode, metrics, s.max_retries
        self.hang_timeout_s, self.restart_timeout_s = s.hang_timeout_s, s.restart_timeout_s
        self.request_silence_s = s.hang_timeout_s   # a request silent this long: is it still on its worker?
        # Where requests start and decode (router/placement.py: the simulator's code too).
        self.placement = Placement(mode, s.policy, s.seed, s.block_size, s.local_prefill_max_tokens)
        self.prefix_index = self.placement.prefix_index   # the workers' prefix caches as this router sees them
        self.view = _RegistryView(self.pools, s.block_size)
        # Disaggregated: new requests wait in its line, before their prefill, while the decode
        # pool is full (router/admission.py DecodeGate).
        self.gate = DecodeGate(s.decode_seats) if mode == DISAGGREGATED and s.decode_gate else None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self.pools.listen(self._pool_changed)

    def _pool_changed(self, m: Member, old_state: str, old_role: str) -> None:
        if m.state in (DEAD, STOPPED):
            if self.prefix_index is not None:            # its cache is gone with it
                self.prefix_index.forget(m.worker_id)
            if self.gate is not None:
                self.gate.forget(m.worker_id)
            self.placement.forget(m.worker_id)
        self._open_gate()                                # a decode worker more or less

    def take_frame(self, w: Member, reply: msg.PollReply) -> None:
        """A worker's frame, after the supervisor recorded its report: its prefix-cache changes,
        its requests' events, and what the decode gate learns from a decode worker's report."""
        if self.prefix_index is not None:
            self.prefix_index.set_capacity(w.worker_id, reply.load.kv_blocks_total)
            self.prefix_index.remove(w.worker_id, reply.cache_evicted)
            self.prefix_index.add(w.worker_id, reply.cache_stored)
        for ev in reply.events:
            self._deliver(ev)
        if self.placement.paces_role(w.role):
            for step_s, *shape in reply.samples.get("step_shape", ()):
                if BatchShape(*shape).num_decode:
                    self.placement.observe_decode_steps(w.worker_id, step_s)
        if w.role == DECODE and self.gate is not None:
            self.gate.observe(w.worker_id, reply.load)
            self._open_gate()

    def resume_all(self, w: Member, cause: str, error: str) -> None:
        """Every request of this router open on `w` resumes elsewhere (it died, hung, or lost our
        lease: the supervisor says which)."""
        for rid in list(w.assigned):
            self._deliver(msg.ErrorEvent(rid, error, retryable=True, cause=cause))
        w.assigned.clear()

    # -- the decode gate ------------------------------------------------------------------------
    async def _pass_gate(self, rid: str) -> None:
        """Wait until the decode gate lets a new request start (at once unless the decode pool
        is full); then it counts as ahead until `_leave_gate`. A cancelled wait (the client
        left) just ends: the request's cleanup leaves the gate."""
        if self.gate is None:
            return
        if not self.gate.line and self.gate.opens(*self._gate_view()):
            self.gate.enter(rid)
            return
        fut = asyncio.get_running_loop().create_future()
        self.gate.hold(rid, fut)
        self.metrics.gated.set(len(self.gate.line))
        await fut

    def _open_gate(self) -> None:
        """Let the waiting requests through, in order, while the gate opens."""
        if self.gate is None or not self.gate.line:
            return
        for fut in self.gate.release(*self._gate_view(), dropped=asyncio.Future.cancelled):
            fut.set_result(None)
        self.metrics.gated.set(len(self.gate.line))

    def serves(self) -> bool:
        """Whether the pools can serve as the cluster is shaped (GET /health): each pool has an
        active worker, or, disaggregated, the decode pool has and the prefill pool has none by
        choice (the controller's mixed role: decode workers serve whole requests), not by loss."""
        if self.mode == COLOCATED:
            return bool(self.pools.active(COLOCATED))
        return bool(self.pools.active(DECODE)) and bool(self.pools.active(PREFILL)
                                                        or not self.pools.count(PREFILL, (DEAD,)))

    def seats_to_free(self, let_in: int = 0) -> float:
        """The decode seats that must free before a request arriving now passes the gate (SLO
        admission's wait for a seat), with `let_in` requests let in that have not reached a
        decode seat (DecodeGate.seats_to_free); 0 without the gate."""
        return 0.0 if self.gate is None else self.gate.seats_to_free(*self._gate_view(), let_in)

    def worker_pace(self, worker_id: str) -> float | None:
        """A worker's seconds per step with decoding rows, lately (router/placement.py
        `observe_decode_steps`; colocated workers, and decode workers under AUTO local prefill
        with a TPOT target); None before any."""
        return self.placement.paces.get(worker_id)

    def _gate_view(self) -> tuple[dict, int]:
        """What the gate decides on: the decode workers' reports, the prefill pool's size."""
        return {m.worker_id: m.report for m in self.pools.active(DECODE)}, len(self.pools.active(PREFILL))

    def _leave_gate(self, rid: str, reached_decode: bool = False) -> None:
        if self.gate is not None and self.gate.leave(rid, reached_decode):
            self._open_gate()

    def _deliver(self, ev: msg.Event) -> None:
        q = self._queues.get(ev.rid)
        if q is not None:
            q.put_nowait(ev)

    # -- one request ---------------------------------------------------------------------------
    async def _wait_for(self, role: str) -> None:
        """When none of a pool's workers is active now but one will be (a one-worker pool whose
        worker is restarting, or one on its way in), wait for it (up to the restart timeout)
        rather than fail."""
        deadline = time.monotonic() + self.restart_timeout_s
        while not self.pools.active(role) and self.pools.coming(role) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _pick_decode(self) -> Member:
        await self._wait_for(DECODE)
        try:
            return self.pools[self.placement.decode(self.view)]
        except LookupError as e:
            raise RequestFailed(str(e)) from None

    def price_local_prefill(self, fit: StepFit, max_chunk: int, tpot_s: float | None = None) -> None:
        """With --local-prefill-max-tokens auto: decide with the step cost model `fit` (prompt
        chunks of at most `max_chunk` tokens, the scheduler's budget), keeping the decode
        workers' pace, as their steps report it, within the TPOT target `tpot_s`."""
        self.placement.price_local_prefill(fit.current, max_chunk, tpot_s)

    async def _pick_start(self, rid: str, token_ids: list[int]) -> tuple[Member, type, int]:
        """Where a request (or a resumed one: prompt + delivered tokens) computes its prompt, the
        op that starts it there (router/placement.py): a GenerateOp on a decode worker when it
        has few enough tokens to compute there (local prefill), else the first role's op; and the
        tokens it computes there (the rest in that worker's prefix cache, as far as this router
        knows), which the worker counts until its next report."""
        start = self.placement.start(token_ids)
        for role in self.placement.roles_needed():
            await self._wait_for(role)
        try:
            worker_id, local = self.placement.first(start, self.view)
        except LookupError as e:
            raise RequestFailed(str(e)) from None
        w = self.pools[worker_id]
        if local:
            self.metrics.local_prefills.inc()
        op = msg.GenerateOp if local or self.mode == COLOCATED else msg.PrefillOp
        work = start.uncached_on(worker_id)
        w.sent(rid, work)
        return w, op, work

    def new_base(self) -> str:
        """A new request's id, before each attempt's suffix."""
        return f"{self.owner}{OWNER_SEP}r{next(self._ids)}"

    def open_request(self, rid: str) -> asyncio.Queue:
        """The queue an attempt's events come to (`take_frame` fills it)."""
        q = self._queues[rid] = asyncio.Queue()
        return q

    def close_request(self, rid: str) -> None:
        """An attempt ended: its queue goes, and it leaves the decode gate if it had not yet."""
        self._leave_gate(rid)
        self._queues.pop(rid, None)

    @contextlib.asynccontextmanager
    async def samples(self, reqs: list[GenerationRequest]):
        """Several samples of one prompt (`n` > 1; `reqs`: the prompt with each sample's
        parameters): an async iterator of TokenDeltas per sample, as `generate` gives, all
        started by one carrier (`_SharedStart`): one prefill, one handoff, then each sample
        decodes from the shared KV. A sample whose start fails resumes alone, as any request."""
        shared = _SharedStart(self, reqs)
        try:
            yield [self.generate(r, first=shared.first[j]) for j, r in enumerate(reqs)]
        finally:
            await shared.close()

    async def generate(self, req: GenerationRequest, first: _First | None = None):
        """Async iterator of TokenDeltas; raises RequestFailed when resumes run out. `first`:
        the first attempt is a sample of a shared start (see `samples`)."""
        base = first.base if first is not None else self.new_base()
        delivered: list[int] = []                        # output tokens the client has
        stalled = 0                                      # resumes in a row that got nowhere
        for attempt in itertools.count():
            start = len(delivered)
            if attempt == 0 and first is not None:
                first.taken = True
                rid, q, involved, run = first.rid, first.queue, first.involved, first.run
            else:
                rid, involved, run = f"{base}.{attempt}", [], self.attempt
                q = self.open_request(rid)
            if req.trace is not None:
                req.trace.attempt(rid, attempt)
            finished = False
            resume: _Resume | None = None
            try:
                # aclosing: the attempt ends (its silence timer stops) when it resumes or the
                # client leaves, not when the garbage collector gets to it.
                async with contextlib.aclosing(run(req, rid, q, involved, delivered)) as events:
                    async for ev in events:
                        if isinstance(ev, _Resume):
                            resume = ev
                            break
                        delivered += ev.token_ids
                        finished = ev.finished
                        yield ev
                if resume is None:
                    return
            finally:
                if req.trace is not None:
                    req.trace.attempt_ended(rid, None if resume is None else resume.error)
                self.close_request(rid)
                for w in involved:
                    w.assigned.discard(rid)
                    if w.alive and not finished:
                        # Cancelled, failed or resumed: free whatever it still holds there
                        # (idempotent on the worker). A finished request holds nothing.
                        fire(w.handle.submit.remote(msg.encode(msg.AbortOp(rid))))
            # An attempt that got past its first token made progress: the budget counts the
            # failures in a row without any (a persistent fault), not the faults a long request
            # happens to meet.
            stalled = 0 if len(delivered) - start > 1 else stalled + 1
            if stalled > self.max_retries:
                raise RequestFailed(f"{stalled} attempts in a row failed (last: {resume.error})")
            self.metrics.resumed.labels(resume.cause).inc()
            if req.trace is not None:
                req.trace.resumed(resume.cause, len(delivered), resume.error)
            log.warning("request %s: %s; resuming after %d delivered tokens (attempt %d)", base, resume.error,
                        len(delivered), attempt + 2)

    async def attempt(self, req: GenerationRequest, rid: str, q: asyncio.Queue, involved: list,
                      delivered: list[int], forks: list[msg.Fork] = (), involve: Callable | None = None):
        """Yields TokenDeltas; yields a _Resume once when the attempt failed retryably. Starts
        after the `delivered` output tokens (a resumed request). With `forks` it is the carrier
        of a shared start (`_SharedStart`): the worker that computes or receives its prompt
        starts the forks there (the carrier's KV is not streamed), and `involve(w)` is told of
        that worker, where they run (else it joins `involved`, as every worker this attempt
        uses)."""
        involve = involve or involved.append
        outputs = list(delivered)
        trace = req.trace
        tp = trace.traceparent(rid) if trace is not None else ""
        if not outputs:                      # a new request (a resumed one is already under way)
            t0 = time.time()
            await self._pass_gate(rid)
            if trace is not None:
                trace.gate(rid, t0, time.time())
        silence = _Silence(q, self.request_silence_s)
        try:
            w, op, work = await self._pick_start(rid, req.prompt_token_ids + outputs)
            if not outputs and req.on_placed is not None:
                req.on_placed(work, op is msg.GenerateOp and self.mode != COLOCATED and bool(self.pools.active(PREFILL)))
            (involve if op is msg.GenerateOp else involved.append)(w)
            if trace is not None:
                trace.submitted(rid)
            fire(w.handle.submit.remote(msg.encode(op(rid, req.prompt_token_ids, req.params, req.priority, outputs,
                                                      ttft_left_s=req.ttft_left_s(outputs), tpot_s=req.tpot_s,
                                                      forks=list(forks) if op is msg.GenerateOp else [],
                                                      trace=tp))))
            d = None            # the decode worker, picked early when the prompt's KV streams to it
            while True:
                ev = await self._next_event(q, w, rid, silence)
                if trace is not None and getattr(ev, "trace", None) is not None:
                    trace.worker(ev.trace)
                if (resume := _resume_for(ev)) is not None:
                    yield resume
                    return
                if _computed_so_far(ev):
                    if op is msg.PrefillOp and not forks:
                        d = await self._stream_kv(req, rid, w, d, involved, outputs, ev.kv)
                    continue
                if ev.tokens or ev.finished:
                    if op is msg.GenerateOp:         # prefilled where it decodes: it has its seat
                        self._leave_gate(rid, reached_decode=True)
                    outputs += ev.tokens
                    yield TokenDelta(ev.tokens, ev.finished, ev.reason, ev.logprobs, ev.prompt_logprobs)
                if ev.finished:
                    if d is not None:                # it reserved blocks for a KV that will not come
                        fire(d.handle.submit.remote(msg.encode(msg.AbortOp(rid))))
                    return
                if ev.held:
                    held_kv = ev.kv
                    break
            held_at = time.monotonic()
            # The prefill worker holds the KV: hand it to a decode worker, which pulls when it has
            # room (or, streaming, has copied all but the last chunk's blocks already).
            if d is not None:
                fire(d.handle.submit.remote(msg.encode(msg.KVMoreOp(rid, held_kv, outputs))))
            else:
                d = await self._pick_decode()
                involve(d)
                d.sent(rid, 1)
                fire(d.handle.submit.remote(msg.encode(msg.DecodeOp(rid, req.prompt_token_ids, req.params, outputs,
                                                                    w.worker_id, req.priority, forks=list(forks),
                                                                    tpot_s=req.tpot_s, kv=held_kv, trace=tp))))
            while True:
                ev = await self._next_event(q, d, rid, silence)
                if trace is not None and getattr(ev, "trace", None) is not None:
                    trace.worker(ev.trace)
                if (resume := _resume_for(ev)) is not None:
                    yield resume
                    return
                # Tokens from the decode worker: the KV has left the prefill worker, whose loss no
                # longer concerns this request.
                if held_at is not None:
                    took, held_at = time.monotonic() - held_at, None
                    self.placement.observe_handoff(took)
                    self._leave_gate(rid, reached_decode=True)
                w.assigned.discard(rid)
                yield TokenDelta(ev.tokens, ev.finished, ev.reason, ev.logprobs, ev.prompt_logprobs)
                if ev.finished:
                    return
        finally:
            silence.stop()

    async def _stream_kv(self, req: GenerationRequest, rid: str, w: Member, d: Member | None, involved: list,
                         outputs: list[int], kv: msg.HeldKV) -> Member:
        """The prefill worker `w` computed more of a long prompt (`kv`: its blocks so far): the
        decode worker copies them while the rest is computed. The first such word picks the
        decode worker and reserves there (a DecodeOp that streams); later ones tell it more.
        Returns the decode worker."""
        if d is not None:
            fire(d.handle.submit.remote(msg.encode(msg.KVMoreOp(rid, kv))))
            return d
        d = await self._pick_decode()
        involved.append(d)
        d.sent(rid, 1)
        self.metrics.kv_streamed.inc()
        tp = req.trace.traceparent(rid) if req.trace is not None else ""
        fire(d.handle.submit.remote(msg.encode(msg.DecodeOp(rid, req.prompt_token_ids, req.params, list(outputs),
                                                             w.worker_id, req.priority, tpot_s=req.tpot_s, kv=kv,
                                                             streaming=True, trace=tp))))
        return d

    async def _next_event(self, q: asyncio.Queue, w: Member, rid: str, silence: _Silence) -> msg.Event:
        """The attempt's next event from worker `w`. After `request_silence_s` (the hang timeout) without one
        (`silence` says so on the queue), asks the
        worker whether it still has the request (a request may wait that long in a queue): one
        that does not, once a frame polled after its answer has come and brought nothing, lost
        the request's events (a stream reader that is not ours, a bug): the request resumes.
        A worker that does not answer is left to the pump, which judges it hung."""
        while True:
            ev = await q.get()
            silence.heard()
            if ev is not _SILENT:
                return ev
            try:
                held = await asyncio.wait_for(awaitable(w.handle.holds.remote(rid)), self.hang_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            if held:
                continue
            asked = time.monotonic()
            while w.alive and w.polled_at <= asked and q.empty() and time.monotonic() < asked + self.hang_timeout_s:
                await asyncio.sleep(0.05)
            if q.empty():
                log.warning("request %s: worker %s no longer has it and sent nothing for %gs", rid, w.worker_id,
                            self.request_silence_s)
                return msg.ErrorEvent(rid, f"worker {w.worker_id} lost the request's events", retryable=True,
                                      cause="request_lost")


_SILENT = object()         # on an attempt's queue: no event for request_silence_s


class _Silence:
    """Puts _SILENT on an attempt's queue after `silence_s` without an event read from it: one
    timer per attempt, set again only when it fires (to when the silence could end), not one
    timer per event."""

    def __init__(self, q: asyncio.Queue, silence_s: float):
        self.q, self.silence_s = q, silence_s
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.timer = self.loop.call_at(self.last + silence_s, self._check)

    def heard(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        now = self.loop.time()
        if now >= self.last + self.silence_s:
            if self.q.empty():                 # nothing came (events waiting unread are not silence)
                self.q.put_nowait(_SILENT)
            self.last = now
        self.timer = self.loop.call_at(self.last + self.silence_s, self._check)

    def stop(self) -> None:
        self.timer.cancel()


@dataclass(slots=True)
class _First:
    """A sample's first attempt in a shared start: its id, queue and workers, made up front."""
    base: str
    rid: str
    queue: asyncio.Queue
    involved: list
    run: Callable
    taken: bool = False                  # `generate` started it


class _SharedStart:
    """One carrier starts n samples of a prompt. Disaggregated: the carrier is prefilled on one
    worker and handed to one decode worker with the samples as its forks; colocated: one worker
    computes the prompt and forks them. Each fork shares the prompt's full blocks, copies the
    partial one, and samples its first token itself, with its own seed (workers/engine_core.py
    `_fork`), so the carrier's own token is nobody's. Its events are the carrier's: once it is
    "forked" every sample runs on its own id; if the start fails first, each sample gets the
    failure, retryable, and resumes alone (a prefill of its own)."""
    CARRIER = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)   # held after one token, always

    def __init__(self, dispatcher: Dispatcher, reqs: list[GenerationRequest]):
        self.d, self.req = dispatcher, reqs[0]
        base = dispatcher.new_base()
        self.rid = f"{base}.carrier"
        self.queue = dispatcher.open_request(self.rid)
        self.involved: list[Member] = []
        self.first = [_First(f"{base}-{j}", f"{base}-{j}.0", dispatcher.open_request(f"{base}-{j}.0"), [], self._wait)
                      for j in range(len(reqs))]
        self.forks = [msg.Fork(f.rid, r.params) for f, r in zip(self.first, reqs)]
        self.forked = False
        self.task = asyncio.ensure_future(self._start())

    async def _wait(self, req, rid, q, involved, delivered):
        """A sample's first attempt: its fork's events (an attempt's second half, on its own id)."""
        while True:
            ev = await q.get()
            if isinstance(ev, RequestFailed):
                raise ev
            if (resume := _resume_for(ev)) is not None:
                yield resume
                return
            yield TokenDelta(ev.tokens, ev.finished, ev.reason, ev.logprobs, ev.prompt_logprobs)
            if ev.finished:
                return

    def _involve(self, w: Member) -> None:
        """The samples run on `w` from here (the carrier is sent there): a loss of it fails them,
        their cleanup aborts there, and its load counts them until its next report."""
        self.involved.append(w)
        for f in self.first:
            f.involved.append(w)
            w.sent(f.rid, 0)

    async def _start(self) -> None:
        """The carrier's attempt (a span of its own in a traced request: its work on the workers)."""
        trace = self.req.trace
        if trace is not None:
            trace.attempt(self.rid, 0)
        try:
            await self._carry()
        finally:
            if trace is not None:
                trace.attempt_ended(self.rid)

    async def _carry(self) -> None:
        """The carrier's attempt, as any request's (one token, then held or forked): it ends
        "forked" where its samples run, or the start failed."""
        carrier = dataclasses.replace(self.req, params=self.CARRIER)
        attempt = self.d.attempt(carrier, self.rid, self.queue, self.involved, [], self.forks, self._involve)
        try:
            async with contextlib.aclosing(attempt):     # its silence timer stops when the start ends
                async for delta in attempt:
                    if isinstance(delta, _Resume):
                        return self._fail(msg.ErrorEvent("", delta.error, True, delta.cause))
                    if delta.finished and delta.finish_reason == "forked":
                        self.forked = True
                        for m in self.involved:
                            m.assigned.discard(self.rid)
                        return
                    if delta.finished:    # it ended at its first token (the app shares no start where it could)
                        break
            self._fail(RequestFailed(f"the shared start of {len(self.first)} samples ended early"))
        except APIError as e:                            # refused by the worker: so is every sample
            self._fail(msg.ErrorEvent("", e.message, False, "handoff_failed"))
        except RequestFailed as e:                       # no live worker to start on
            self._fail(e)

    def _fail(self, failure: msg.ErrorEvent | RequestFailed) -> None:
        """Every sample still in its first attempt gets the start's failure (a retryable one
        resumes it alone); one that the carrier had already forked is aborted there by its own
        attempt's cleanup, so it never runs twice."""
        for f in self.first:
            f.queue.put_nowait(failure)

    async def close(self) -> None:
        """Ends the start (if the samples ended first) and frees what it holds: the carrier,
        and any fork whose sample never started its first attempt."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.d.close_request(self.rid)
        for m in self.involved:
            m.assigned.discard(self.rid)
            if m.alive and not self.forked:
                fire(m.handle.submit.remote(msg.encode(msg.AbortOp(self.rid))))
        for f in self.first:
            if not f.taken:
                self.d.close_request(f.rid)
                for m in f.involved:
                    m.assigned.discard(f.rid)
                    if m.alive:
                        fire(m.handle.submit.remote(msg.encode(msg.AbortOp(f.rid))))


class _RegistryView:
    """The pool registry as placement sees it (router/placement.py `PoolView`): each worker's
    last report plus what this router sent it since."""

    def __init__(self, pools: PoolRegistry, block_size: int):
        self.pools, self.block_size = pools, block_size

    def active(self, role: str) -> list[str]:
        return [m.worker_id for m in self.pools.active(role)]

    def prefill_load(self, worker_id: str) -> float:
        return self.pools[worker_id].queued_prefill_tokens()

    def decode_load(self, worker_id: str) -> float:
        m = self.pools[worker_id]
        return decode_load(m.report, len(m.unreported))

    def decoding(self, worker_id: str) -> tuple[int, int]:
        m = self.pools[worker_id]
        r = m.report
        return (r.running if r else 0) + len(m.unreported), r.kv_blocks_used * self.block_size if r else 0

    def slot_ends(self, worker_id: str) -> list[int]:
        m = self.pools[worker_id]
        return slot_ends(m.report, len(m.unreported))


def _computed_so_far(ev: msg.Event) -> bool:
    """A prefill worker's word that a long prompt's prefill got further (no token yet)."""
    return isinstance(ev, msg.TokenEvent) and ev.kv is not None and not (ev.tokens or ev.held or ev.finished)


def _resume_for(ev: msg.Event) -> _Resume | None:
    """A retryable failure (handoff, dead or hung worker) resumes the request; any other error
    is final (a 4xx: the request itself was refused)."""
    if not isinstance(ev, msg.ErrorEvent):
        return None
    if ev.retryable:
        return _Resume(ev.cause or "handoff_failed", ev.error)
    raise APIError(400, ev.error)


def awaitable(ref):
    """A handle's call result as something asyncio.wait_for accepts (a Ray ObjectRef is only
    awaitable; wrapping it makes it a future that can be timed out and cancelled)."""
    async def wait():
        return await ref
    return wait()


def tell(handle, method: str, *args) -> None:
    """`fire` a call, and let a handle that cannot even send it pass too (an actor Ray has
    given up on raises at once)."""
    try:
        fire(getattr(handle, method).remote(*args))
    except Exception as e:
        log.debug("could not call %s: %s", method, e)


def fire(ref) -> None:
    """A call whose answer nobody needs (an abort, a forget): let a failure pass silently (the
    worker may be gone, which is what the call was about)."""
    if hasattr(ref, "future"):
        ref.future().add_done_callback(lambda f: f.exception())
