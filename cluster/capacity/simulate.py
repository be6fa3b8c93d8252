"""`pdcluster simulate`: the whole cluster as a discrete-event simulation on a virtual clock.

What runs is the serving code: each simulated worker is an `EngineCore` (the real scheduler and
KV cache manager: chunking, prefix caching, the watermark, preemption), the router's `Picker`
chooses workers on the same load signals, and admission turns requests away past
`max_pending` as the HTTP layer does. Only the model is replaced: a step takes the cost model's
time for its batch shape, and a KV handoff takes bytes over the link's bandwidth plus latency.

Events, in virtual seconds:

    arrival ─▶ pick (prefill | colocated) ─▶ worker inbox ─▶ step starts (schedule_step)
    step ends (finish_step) ─▶ tokens to the request; a held prompt ─▶ pick decode ─▶ reserve
    (waits for room, as a real decode worker does) ─▶ transfer on the decode worker's link
    ─▶ commit there, release on the prefill side ─▶ decode steps ─▶ finished

A worker applies its inbox between steps, as the real worker loop does, so a request that
arrives mid-step waits for the next one. The result is `pdcluster bench`'s summary with its
field names, so a simulated run and a real one compare line by line.
"""
from __future__ import annotations

import bisect
import dataclasses
import gc
import heapq
import itertools
import math
from itertools import accumulate
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.loadtest.loadgen import RequestResult
from cluster.run.spec import check_pools
from router.admission import DecodeGate
from router.picker import decode_load, prefill_load, slots_past
from router.placement import Placement
from router.slo import SLOTargets
from workers import messages as msg
from workers.config import EngineConfig
from workers.cost_model import BatchShape, CostModel
from workers.engine_core import EngineCore, KVCacheLayout
from workers.names import AUTO, COLOCATED, DECODE, DISAGGREGATED, P2C, PREFILL
from workers.scheduler import SchedulerOutput
from workers.sequence import SamplingParams, Sequence

FILLER_TOKEN = 0            # every generated token (outputs end by length: ignore_eos)


@dataclass(slots=True)
class SimRequest:
    """One request of a simulated workload. Its prompt's ids are given, or, for synthetic
    prompts, made when it is dispatched (an hour of traffic holds hundreds of millions of
    prompt tokens; only those in flight need to exist): `prefix` then the request's own two
    ids (its first own block shares nothing: block hashes chain), padded to `prompt_len`."""
    arrival_s: float                 # virtual seconds from the start
    prompt_token_ids: list[int] | None
    output_len: int
    prompt_len: int = 0              # synthetic: tokens in all
    uid: int = 0                     # synthetic: makes its own ids
    prefix: list[int] | None = None  # synthetic: shared leading ids (one list for all who share it)
    ttft_slo_s: float | None = None  # its own targets, as a request's ttft_slo_ms / tpot_slo_ms (None:
    tpot_slo_s: float | None = None  # the cluster's `slo`)

    def __post_init__(self):
        if self.prompt_token_ids is not None:
            self.prompt_len = len(self.prompt_token_ids)

    def ids(self) -> list[int]:
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        own = self.prompt_len - len(self.prefix or ())
        ids = [1 + self.uid % 30000, 1 + self.uid // 30000] + [0] * (own - 2)
        return self.prefix + ids if self.prefix else ids

    @classmethod
    def synthetic(cls, arrival_s: float, prompt_len: int, output_len: int, uid: int,
                  prefix: list[int] | None = None) -> SimRequest:
        if prompt_len - len(prefix or ()) < 2:
            raise ValueError(f"a synthetic prompt needs 2 tokens of its own, got {prompt_len} with a "
                             f"{len(prefix or ())}-token prefix")
        return cls(arrival_s, None, output_len, prompt_len, uid, prefix)

    def at(self, arrival_s: float) -> SimRequest:
        return dataclasses.replace(self, arrival_s=arrival_s)


@dataclass(slots=True)
class SimCluster:
    """The cluster's shape and its costs: one cost model per pool (a pool's workers share a
    tensor-parallel degree; `gpus` per worker is that degree)."""
    mode: str = DISAGGREGATED
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 2
    prefill_cost: CostModel | None = None
    decode_cost: CostModel | None = None        # colocated workers use prefill_cost
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = P2C
    max_pending: int = 512
    seed: int = 0
    request_overhead_s: float = 0.0             # router + HTTP time before a request reaches a worker,
    request_overhead_per_token_s: float = 0.0   # and its part per prompt token
    # A CPU machine whose workers and router share its cores (a profile of this machine): steps
    # slow down when more is runnable than there are cores. None: every worker has its device.
    shared_cores: float | None = None
    # What runs beside the engines' steps on shared cores (the router, the client, the workers'
    # other threads), in CPU-seconds per request and per streamed token (a profile measures both).
    background_cpu_per_request_s: float = 0.0
    background_cpu_per_token_s: float = 0.0
    # Of the cores the busy workers go without, the share that falls on a prefill step when
    # prefill and decode workers both step (a profile measures it; 0.5: evenly).
    prefill_wait_share: float = 0.5
    decode_gate: bool = True                    # disaggregated: the router's decode gate (router/admission.py)
    # Disaggregated: prefill on the decode worker up to this many tokens; "auto": as the decode
    # pool's cost model says (router/placement.py, as serve's router decides); 0: never.
    local_prefill_max_tokens: int | str = 0
    slo: SLOTargets = field(default_factory=SLOTargets)   # the requests' default TTFT and TPOT targets

    def __post_init__(self):
        check_pools(self.mode, self.num_prefill, self.num_decode, self.num_colocated)
        if not 0 < self.prefill_wait_share < 1:
            raise ValueError(f"prefill_wait_share must be in (0, 1), not {self.prefill_wait_share}")
        if self.prefill_cost is None or (self.mode == DISAGGREGATED and self.decode_cost is None):
            raise ValueError("a cost model for every pool is needed")

    @property
    def num_gpus(self) -> int:
        if self.mode == COLOCATED:
            return self.num_colocated * self.prefill_cost.tp
        return self.num_prefill * self.prefill_cost.tp + self.num_decode * self.decode_cost.tp


class SimEngine(EngineCore):
    """A worker's engine with the cost model in place of the model.

    A steady decode batch (every running sequence decoding, nothing that could be admitted,
    room for the next k tokens of each) goes through k steps that differ only in their
    context, so the simulator takes them as one run: `steady_run` finds k, `advance` applies
    k tokens per sequence through the same KV verb (`append_slots`) a step uses. Without it, a
    simulated hour would cost a Python step per token per sequence.
    """

    def __init__(self, engine: EngineConfig, cost: CostModel, clock, vocab_size: int, max_model_len: int):
        block = engine.cache.block_size
        layout = KVCacheLayout(cost.kv_bytes_per_token, block, max(1, cost.kv_capacity_tokens // block), 0)
        super().__init__(engine.scheduler, layout, min(max_model_len, layout.max_resident_tokens), vocab_size,
                         engine.cache.enable_prefix_caching, clock=clock)
        budget = engine.scheduler.max_num_batched_tokens     # the deadline policy's first estimate
        self.scheduler.prefill_s_per_token = cost.step_s(BatchShape(1, budget, budget * budget)) / budget

    def _check_ids(self, ids, name: str) -> None:
        """The simulator makes its own token ids; checking each would cost a pass per prompt."""

    def _execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int], None]:
        seqs = sampled(out)
        return seqs, [FILLER_TOKEN] * len(seqs), None

    def steady_run(self, limit: int) -> tuple[int, int, int]:
        """(k, rows, summed context of the first step): the steps (up to `limit`) the running
        batch can take as plain decode steps with nothing else changing; k = 0 when the next
        step is anything else."""
        s, kv = self.scheduler, self.kv
        running = s.running
        if not running or s.swapped or len(running) > s.cfg.max_num_batched_tokens:
            return 0, 0, 0
        k, context, max_len = limit, 0, self.max_model_len
        for seq in running:
            c, n = seq.num_computed_tokens, len(seq.token_ids)
            if c != n - 1 or c < seq.num_prompt_tokens:
                return 0, 0, 0                            # prefilling (a chunk or a recompute)
            left = seq.params.max_tokens - (n - seq.num_prompt_tokens)
            if left < k:
                k = left
            if max_len - n < k:
                k = max_len - n
            context += n
        if s.waiting and self._admissible(s.waiting[0]):
            return 0, 0, 0                                # the next step admits it
        bs, free = kv.block_size, kv.num_free_blocks
        if len(running) * (-(-k // bs) + 1) > free:       # the bound is short: count exactly
            have = [(seq.num_computed_tokens, kv.num_blocks_of(seq)) for seq in running]

            def fits(k: int) -> bool:                     # blocks never come back during a run
                return sum(-(-(c + k) // bs) - b for c, b in have) <= free
            if not fits(k):
                lo, hi = 0, k                             # fits(lo), not fits(hi)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                k = lo
        return (k, len(running), context) if k >= 2 else (0, 0, 0)

    def _admissible(self, seq: Sequence) -> bool:
        s = self.scheduler
        budget = s.cfg.max_num_batched_tokens - len(s.running)
        if len(s.running) >= s.cfg.max_num_seqs or budget <= 0:
            return False
        computed, num_cached = self.kv.get_computed_blocks(seq)
        n = min(seq.num_tokens - num_cached, budget)
        return self.kv.can_allocate(seq, n, computed, num_cached, s.watermark_blocks)

    def run_batch(self) -> tuple[int, int]:
        """(rows, summed context) of the running batch's next decode step."""
        running = self.scheduler.running
        return len(running), sum(len(seq.token_ids) for seq in running)

    def advance(self, k: int) -> list[tuple[str, bool]]:
        """k decode steps of the running batch: (request id, finished) per sequence."""
        out = []
        kv, finish, filler, max_len = self.kv, self.scheduler.finish, [FILLER_TOKEN] * k, self.max_model_len
        for seq in list(self.scheduler.running):
            ok = kv.append_slots(seq, k)
            assert ok, seq                                # steady_run checked the room
            seq.num_computed_tokens += k
            tokens = seq.token_ids
            tokens += filler
            n = len(tokens)
            done = n - seq.num_prompt_tokens >= seq.params.max_tokens or n >= max_len
            if done:
                finish(seq, "length")
                self._seqs.pop(seq.seq_id, None)
            out.append((seq.seq_id, done))
        return out


def sampled(out: SchedulerOutput) -> list[Sequence]:
    """The sequences a step samples for: those whose scheduled tokens reach their last."""
    return [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]


class _Rate:
    """Events per second over the last `window_s` of simulated time: counts stamped with their
    time, forgotten as they age out in the order stamped (a steady run stamps its steps when it
    ends, after stamps of other workers' later steps: those age out a little late)."""
    __slots__ = ("window_s", "_stamps", "_total")

    def __init__(self, window_s: float):
        self.window_s, self._stamps, self._total = window_s, deque(), 0

    def add(self, at: float, n: int) -> None:
        self._stamps.append((at, n))
        self._total += n

    def rate(self, now: float) -> float:
        stamps, start = self._stamps, now - self.window_s
        while stamps and stamps[0][0] < start:
            self._total -= stamps.popleft()[1]
        return self._total / self.window_s


class _RouterView:
    """A prefill worker's queue as the router sees it (router/pools.py `Member`, read through
    router/events.py `EventStream`): the report of its latest frame plus the prompts sent since
    the frame before it (a frame's report covers what was sent before the router's read for it
    began, which is when the frame before arrived). A worker sends a frame after each step and,
    with nothing to say, every FRAME_WAIT_S; so a prompt sent to an idle prefill worker counts as
    queued from its send until the second frame after it, which may be the next prompt's step or
    the wait's end: a queue that is gone, which the router's local-prefill rule still sees."""
    __slots__ = ("frame_at", "covered_at", "reported", "sent")

    def __init__(self):
        self.frame_at, self.covered_at, self.reported = 0.0, 0.0, 0
        self.sent: deque = deque()            # (sent at, prompt tokens), oldest first

    def send(self, now: float, num_tokens: int, queued_now: Callable[[], int]) -> None:
        """A prompt of `num_tokens` sent at `now` (`queued_now()`, here and below: the prompt
        tokens that truly wait now, which a frame with nothing else to say reports; asked only
        when such a frame is due)."""
        self._wait_frames(now, queued_now)
        self.sent.append((now, num_tokens))

    def frame(self, now: float, queued: int) -> None:
        """The frame a step sends as it ends, its report saying `queued` tokens wait."""
        self._wait_frames(now, lambda: queued)
        self._frame(now, queued)

    def queued(self, now: float, queued_now: Callable[[], int]) -> int:
        """Prompt tokens the router counts as waiting at `now`."""
        self._wait_frames(now, queued_now)
        return self.reported + sum(n for _, n in self.sent)

    def _wait_frames(self, now: float, queued_now: Callable[[], int]) -> None:
        """The frames sent for want of anything else since the last one: only the last two
        matter (the later's report, and the sends the earlier one covers)."""
        waits = math.floor((now - self.frame_at) / FRAME_WAIT_S)
        if waits >= 1:
            self.frame_at += (waits - 1) * FRAME_WAIT_S
            self._frame(self.frame_at + FRAME_WAIT_S, queued_now())

    def _frame(self, at: float, queued: int) -> None:
        self.covered_at, self.frame_at, self.reported = self.frame_at, at, queued
        while self.sent and self.sent[0][0] < self.covered_at:
            self.sent.popleft()


class SimWorker:
    __slots__ = ("worker_id", "role", "engine", "cost", "busy", "inbox", "inbox_tokens", "inbox_prompts",
                 "waiting_room", "receiving", "link_free_at", "steps", "busy_s", "run", "run_id", "run_start",
                 "step_end", "run_left", "run_streamed", "seen")

    def __init__(self, worker_id: str, role: str, engine: SimEngine, cost: CostModel):
        self.worker_id, self.role, self.engine, self.cost = worker_id, role, engine, cost
        self.busy = False
        self.inbox: list = []               # callables applied between steps
        self.inbox_tokens = 0               # prompt tokens in the inbox (sent, not yet in a report)
        self.inbox_prompts = 0              # and the prompts they are
        self.waiting_room: deque = deque()  # decode: handoffs waiting for blocks (rid, request, prefill worker)
        self.receiving = 0                  # decode: reserved, KV in flight
        self.link_free_at = 0.0             # decode: its link carries one transfer at a time
        self.steps = 0
        self.busy_s = 0.0
        self.run: list[float] | None = None   # a steady run in progress: its steps' end times
        self.run_id = 0                       # which scheduled end of a run is current
        self.run_start = 0.0
        self.run_left = 0                     # steps of the run whose times are not worked out yet
        self.run_streamed = 0                 # the run's steps whose tokens count as streamed
        self.step_end = 0.0                   # when its current single step ends
        self.seen = _RouterView()             # a prefill worker as the router's stream shows it

    def report(self) -> msg.LoadReport:
        """Its report without `ends_in` (a heap over its running sequences: `_SimView.slot_ends`
        asks for them only when a slot is wanted)."""
        return self.engine.load_report(self.worker_id, self.role, self.steps, 0, len(self.waiting_room),
                                       self.receiving, ends=False)

    def seats(self) -> _Seats:
        """The part of its report the decode gate reads, without building the report."""
        return _Seats(len(self.engine.scheduler.running), len(self.waiting_room), self.receiving)


class _Seats(NamedTuple):
    running: int
    pending: int
    receiving: int
    routers: int = 1               # one router: the simulator's


@dataclass(slots=True)
class _Tracked:
    """What the client of one request sees (every token's time only when ITLs are asked for:
    TTFT and TPOT need the first, the last and the count)."""
    request: SimRequest
    sent_s: float
    times: list[float] | None = None
    first_s: float = 0.0
    last_s: float = 0.0
    count: int = 0
    end_s: float | None = None
    error: str = ""


MAX_RUN = 4096          # steps of one steady run at most (a run is cut anyway when work arrives)
RUN_CHUNK = 64          # a run's step times are worked out this many at a time (most runs are cut early)
FRAME_WAIT_S = 0.5     # a worker's event stream sends a frame at least this often (workers/outboxes.py)
# The router's share of shared cores follows the tokens it streamed over this much time before
# (its CPU goes per token out and per request, not per step).
STREAM_WINDOW_S = 0.5
MIN_CORE_SHARE = 0.1     # a busy worker's engine thread gets at least this much of a core


class Simulator:
    def __init__(self, cluster: SimCluster, vocab_size: int = 32000, max_model_len: int = 1 << 30,
                 record_itl: bool = True):
        self.c = cluster
        self.record_itl = record_itl
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self.num_events = 0
        self.num_runs = 0                   # steady decode runs taken whole
        self.num_handoffs = 0               # prompts' KV received by a decode worker
        self.num_local_prefills = 0         # prompts prefilled on their decode worker (bench's local_prefills)
        clock = lambda: self.now                                     # noqa: E731
        if cluster.mode == COLOCATED:
            roles = [(f"{COLOCATED}-{i}", COLOCATED, cluster.prefill_cost) for i in range(cluster.num_colocated)]
        else:
            roles = ([(f"{PREFILL}-{i}", PREFILL, cluster.prefill_cost) for i in range(cluster.num_prefill)] +
                     [(f"{DECODE}-{i}", DECODE, cluster.decode_cost) for i in range(cluster.num_decode)])
        self.workers = {wid: SimWorker(wid, role, SimEngine(cluster.engine, cost, clock, vocab_size, max_model_len),
                                       cost) for wid, role, cost in roles}
        self.pools = {role: [w for w in self.workers.values() if w.role == role] for role in (PREFILL, DECODE,
                                                                                                COLOCATED)}
        self.pool_ids = {role: [w.worker_id for w in pool] for role, pool in self.pools.items()}
        # Where requests start and decode: the router's own code (router/placement.py), on the
        # simulated workers' reports. Its index of the workers' caches (prefix-aware picking,
        # local prefill) is kept as the router keeps it: its own choices, the workers' cache
        # events after each step.
        bs = cluster.engine.cache.block_size
        self.placement = Placement(cluster.mode, cluster.policy, cluster.seed, bs, cluster.local_prefill_max_tokens)
        if self.placement.local_prefill_max_tokens == AUTO:
            self.placement.price_local_prefill(lambda: cluster.decode_cost,
                                               cluster.engine.scheduler.max_num_batched_tokens, cluster.slo.tpot_s)
        self.view = _SimView(self.workers, self.pool_ids, bs, clock)
        self.prefix_index = self.placement.prefix_index
        if self.prefix_index is not None:
            for w in self.workers.values():
                w.engine.kv.pool.record_events()
                self.prefix_index.set_capacity(w.worker_id, w.engine.kv.pool.num_blocks)
        self._local: set[str] = set()        # prefilled on their decode worker, before their first token
        self._held_at: dict[str, float] = {}    # held, not yet received by their decode worker
        self._tracked: dict[str, _Tracked] = {}
        self._params: dict[int, SamplingParams] = {}
        self.in_flight = 0
        # Requests in and tokens out to clients, counted on shared cores: the background's CPU follows them.
        self._shared = cluster.shared_cores is not None
        self._arrived, self._streamed = _Rate(STREAM_WINDOW_S), _Rate(STREAM_WINDOW_S)
        share = cluster.prefill_wait_share
        self._wait_weight = {PREFILL: share, DECODE: 1 - share, COLOCATED: 0.5}
        # The router's decode gate: new requests held before their prefill while decode is full.
        self.gate = (DecodeGate(cluster.engine.scheduler.max_num_seqs, clock=clock)
                     if cluster.mode == DISAGGREGATED and cluster.decode_gate else None)

    # -- the event loop ------------------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def run(self, requests: list[SimRequest]) -> tuple[list[RequestResult], float]:
        """Serve `requests` (arrival times from 0); returns bench's per-request results and the
        run's duration (first send to last completion, as bench measures it)."""
        for i, r in enumerate(requests):
            self._at(r.arrival_s, self._arrive, f"r{i}", r)
        events = self._events
        # Millions of short-lived objects and no cycles worth chasing mid-run: the cyclic
        # collector's passes over the live heap would cost more than the run itself.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while events:
                t, _, fn, args = heapq.heappop(events)
                self.now = t
                self.num_events += 1
                fn(*args)
        finally:
            if collecting:
                gc.enable()
        results = [self._result(self._tracked[f"r{i}"]) for i in range(len(requests))]
        return results, self.now

    def _result(self, tr: _Tracked) -> RequestResult:
        r = tr.request
        out = RequestResult(prompt_len=r.prompt_len, start=tr.sent_s, error=tr.error)
        if tr.end_s is None or tr.error:
            out.error = tr.error or "the simulation ended before this request did"
            return out
        out.success, out.output_len = True, tr.count
        out.ttft, out.latency = tr.first_s - tr.sent_s, tr.end_s - tr.sent_s
        if tr.times is not None:
            out.itl = [b - a for a, b in zip(tr.times, tr.times[1:])]
        return out

    # -- the router ------------------------------------------------------------------------------
    def _arrive(self, rid: str, r: SimRequest) -> None:
        self._tracked[rid] = _Tracked(r, self.now, [] if self.record_itl else None)
        if self._shared:
            self._arrived.add(self.now, 1)
        if self.in_flight >= self.c.max_pending:
            self._tracked[rid].error = f"HTTP 429: {self.c.max_pending} requests in flight"
            return
        self.in_flight += 1
        c = self.c
        delay = c.request_overhead_s + c.request_overhead_per_token_s * r.prompt_len
        if delay:
            self._at(self.now + delay, self._dispatch, rid, r)
        else:
            self._dispatch(rid, r)

    def _dispatch(self, rid: str, r: SimRequest) -> None:
        gate = self.gate
        if gate is not None:
            if gate.line or not gate.opens(*self._gate_view()):
                gate.hold(rid, (rid, r))
                return
            gate.enter(rid)
        self._start(rid, r)

    def _gate_view(self) -> tuple[dict, int]:
        return {w.worker_id: w.seats() for w in self.pools[DECODE]}, len(self.pools[PREFILL])

    def _open_gate(self) -> None:
        """Start the held requests, in order, while the gate opens (router/dispatch.py)."""
        if self.gate.line:
            for rid, r in self.gate.release(*self._gate_view()):
                self._start(rid, r)

    def _leave_gate(self, rid: str, reached_decode: bool = False) -> None:
        if self.gate is not None and self.gate.leave(rid, reached_decode):
            self._open_gate()

    def _start(self, rid: str, r: SimRequest) -> None:
        params = self._params.get(r.output_len)
        if params is None:                  # one per length: the engine never changes them
            params = self._params[r.output_len] = SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                 ignore_eos=True)
        ids = r.ids()
        start = self.placement.start(ids)
        worker_id, local = self.placement.first(start, self.view)
        w, uncached = self.workers[worker_id], start.uncached_on(worker_id)
        whole = local or self.c.mode == COLOCATED        # prefilled where it decodes: no handoff
        if local:
            self._local.add(rid)
            self.num_local_prefills += 1
        slo = self.c.slo

        def submit(engine=w.engine):
            try:
                engine.add_request(prompt_token_ids=ids, params=params, request_id=rid,
                                   arrival_time=self._tracked[rid].sent_s, prefill_only=not whole,
                                   ttft_left_s=r.ttft_slo_s or slo.ttft_s, tpot_s=r.tpot_slo_s or slo.tpot_s)
            except ValueError as e:                  # too long for this model: a 400 in the real server
                self._fail(rid, f"HTTP 400: {e}")
        self._submit(w, submit, uncached)

    def _submit(self, w: SimWorker, fn, num_tokens: int = 0) -> None:
        w.inbox.append(fn)
        w.inbox_tokens += num_tokens
        w.inbox_prompts += num_tokens > 0
        if w.role == PREFILL:
            w.seen.send(self.now, num_tokens, lambda: self.view.prefill_queued(w))
        self._wake(w)

    def _wake(self, w: SimWorker) -> None:
        """New work for `w`: an idle worker steps now; a steady run ends at its next step's end
        (as the real loop takes commands between steps)."""
        if not w.busy:
            w.busy = True                 # claimed now; the step starts after this instant's events
            self._at(self.now, self._start_step, w)
        elif w.run is not None:
            done = min(len(w.run), bisect.bisect_left(w.run, self.now) + 1)   # steps ended by the next boundary
            if done < len(w.run) or w.run_left:
                del w.run[done:]
                w.run_left = 0
                w.run_id += 1
                self._at(w.run[-1], self._end_run, w, w.run_id)

    def _fail(self, rid: str, error: str) -> None:
        tr = self._tracked[rid]
        tr.error, tr.end_s = error, self.now
        self.in_flight -= 1
        self._leave_gate(rid)

    def _tokens(self, rid: str, times: list[float], finished: bool) -> None:
        tr = self._tracked[rid]
        if not tr.count:
            tr.first_s = times[0]
            if rid in self._local:                # prefilled on its decode worker: it has its seat
                self._local.discard(rid)
                self._leave_gate(rid, reached_decode=True)
        tr.count += len(times)
        tr.last_s = times[-1]
        if self._shared:
            self._streamed.add(times[-1], len(times))
        if tr.times is not None:
            tr.times.extend(times)
        if finished:
            tr.end_s = self.now
            self.in_flight -= 1
            self._finished(tr)
            self._leave_gate(rid)

    def _finished(self, tr: _Tracked) -> None:
        """A request's last token went out (a hook for the controlled simulator)."""

    # -- workers ---------------------------------------------------------------------------------
    def _start_step(self, w: SimWorker) -> None:
        if self.prefix_index is not None:
            stored, evicted = w.engine.kv.pool.take_events()
            self.prefix_index.remove(w.worker_id, evicted)
            self.prefix_index.add(w.worker_id, stored)
        inbox, w.inbox, w.inbox_tokens, w.inbox_prompts = w.inbox, [], 0, 0
        for fn in inbox:
            fn()
        if w.waiting_room:
            self._reserve(w)
        if self.gate is not None and w.role == DECODE:     # the router hears its report
            self.gate.observe(w.worker_id, w.seats())
            self._open_gate()
        engine = w.engine
        k, rows, context = engine.steady_run(MAX_RUN)
        if k:
            first = min(k, RUN_CHUNK)
            times = w.cost.decode_run_s(rows, context, first)
            slow = self._slowdown(w)
            ends = list(accumulate((t * slow for t in times) if slow != 1.0 else times, initial=self.now))
            w.run_start = ends.pop(0)
            w.run, w.run_left, w.run_streamed = ends, k - first, 0
            self.num_runs += 1
            w.run_id += 1
            self._at(ends[-1], self._end_run, w, w.run_id)
            return
        out = engine.schedule_step() if engine.has_unfinished() else None
        if out is None or out.is_empty:
            w.busy = False
            self._idle(w)
            return
        dt = w.cost.step_s(engine.last_shape)
        dt *= self._slowdown(w)
        if engine.last_shape.num_decode and self.placement.paces_role(w.role):
            self.placement.observe_decode_steps(w.worker_id, dt)     # (the router hears of it as it ends)
        w.steps += 1
        w.busy_s += dt
        w.step_end = self.now + dt
        self._at(w.step_end, self._end_step, w, out)

    def _idle(self, w: SimWorker) -> None:
        """`w` has nothing to step (a hook for the controlled simulator)."""

    def _slowdown(self, w: SimWorker) -> float:
        """How much slower `w`'s step starting now runs on shared cores. The background (the
        router, the client, the workers' other threads: its CPU per request and per token times
        the requests and tokens of the last STREAM_WINDOW_S) is many short bursts, each under a
        fair share of a core, so the scheduler gives it what it asks (at most half the cores
        here); the busy workers' engine threads, each wanting a core, go without the cores that
        leaves them short, split by role (`prefill_wait_share`: a long prefill step waits more
        than a decode step's short ones; evenly, each runs busy / (cores - background) slower).
        Served at 26 req/s on 2 cores (1P+1D, 256 -> 48 tokens), the background took 0.7 of a
        core and the prefill steps ran 1.57x their CPU time, the decode steps 1.33x; the fair
        share of the runnable ((busy + background) / cores, 1.35x both) left TTFT a third low."""
        c = self.c
        cores = c.shared_cores
        if cores is None:
            return 1.0
        now, weight = self.now, self._wait_weight
        busy, weights = 0, 0.0
        for x in self.workers.values():
            if x.busy:
                busy += 1
                weights += weight[x.role]
        background = (c.background_cpu_per_request_s * self._arrived.rate(now) +
                      c.background_cpu_per_token_s * self._streamed.rate(now))
        short = busy - (cores - min(cores / 2, background))
        if short <= 0:
            return 1.0
        return 1 / max(MIN_CORE_SHARE, 1 - short * weight[w.role] / weights)

    def _end_step(self, w: SimWorker, out: SchedulerOutput) -> None:
        seqs = sampled(out)
        now = [self.now]
        for o in w.engine.finish_step(out, seqs, [FILLER_TOKEN] * len(seqs), None):
            self._tokens(o.request_id, now, o.finished)
            if o.held:
                self._hand_off(o.request_id, w)
        if w.role == PREFILL:                               # the step's samples and words: a frame
            w.seen.frame(self.now, self.view.prefill_queued(w))
        self._start_step(w)

    def _end_run(self, w: SimWorker, run_id: int) -> None:
        if run_id != w.run_id:
            return                                      # this run was cut short: a later event ends it
        if w.run_left:                                  # not cut: work out its next steps' times
            ends, engine = w.run, w.engine
            rows, context = engine.run_batch()
            self._stream_run(w, ends, rows)             # (the steps so far have ended)
            more = min(w.run_left, RUN_CHUNK)
            times = w.cost.decode_run_s(rows, context + len(ends) * rows, more)
            slow = self._slowdown(w)                    # the cores' load as this chunk starts
            ends.extend(accumulate((t * slow for t in times) if slow != 1.0 else times, initial=ends[-1]))
            del ends[-more - 1]                         # the initial value, repeated
            w.run_left -= more
            self._at(ends[-1], self._end_run, w, run_id)
            return
        ends, w.run = w.run, None
        w.steps += len(ends)
        w.busy_s += ends[-1] - w.run_start
        observe, rows, start = w.engine.scheduler.observe_step, len(w.engine.scheduler.running), w.run_start
        for end in ends:                                # each step timed, as a step taken alone is
            observe(rows, end - start, rows)
            start = end
        self._stream_run(w, ends, rows)
        if self.placement.paces_role(w.role):
            self.placement.observe_decode_steps(w.worker_id, (ends[-1] - w.run_start) / len(ends), len(ends))
        tracked, first, last = self._tracked, ends[0], ends[-1]
        for rid, finished in w.engine.advance(len(ends)):
            tr = tracked[rid]                           # _tokens, inline: per sequence per run
            if not tr.count:
                tr.first_s = first
            tr.count += len(ends)
            tr.last_s = last
            if tr.times is not None:
                tr.times += ends
            if finished:
                tr.end_s = last
                self.in_flight -= 1
                self._finished(tr)
        self._start_step(w)

    def _stream_run(self, w: SimWorker, ends: list[float], rows: int) -> None:
        """A steady run's tokens of its ended steps, not yet counted, into the tokens streamed
        (what the background's share follows on shared cores): as each chunk of it ends, and as
        the run ends, so that other workers' steps meanwhile see them."""
        if not self._shared:
            return
        streamed, since = self._streamed, self.now - STREAM_WINDOW_S
        for end in ends[w.run_streamed:]:
            if end >= since:
                streamed.add(end, rows)
        w.run_streamed = len(ends)

    # -- the KV handoff --------------------------------------------------------------------------
    def _hand_off(self, rid: str, prefill: SimWorker) -> None:
        d = self.workers[self.placement.decode(self.view)]
        self._held_at[rid] = self.now
        seq = prefill.engine._seqs[rid]
        d.waiting_room.append((rid, seq, prefill))
        if not d.busy:
            self._reserve(d)
        else:
            self._wake(d)                                # a steady run stops to take it

    def _reserve(self, d: SimWorker) -> None:
        """Reserve blocks for waiting handoffs in order, while they fit; start their transfers."""
        while d.waiting_room:
            rid, seq, prefill = d.waiting_room[0]
            blocks = d.engine.reserve(rid, seq.prompt_token_ids, seq.output_token_ids, seq.params,
                                      arrival_time=seq.arrival_time, num_receiving=d.receiving, tpot_s=seq.tpot_s)
            if blocks is None:
                return
            d.waiting_room.popleft()
            d.receiving += 1
            # The send starts beside the prefill worker's steps (workers/worker.py: the held
            # block ids are known when it holds the request) and moves only the blocks the
            # decode worker's prefix cache lacks (`blocks`).
            num_kv, bs = seq.num_tokens - 1, d.engine.kv.block_size
            missing = num_kv - (-(-num_kv // bs) - len(blocks)) * bs
            start = max(self.now, d.link_free_at)
            d.link_free_at = start + d.cost.handoff_s(missing)
            self._at(d.link_free_at, self._received, rid, prefill, d)

    def _received(self, rid: str, prefill: SimWorker, d: SimWorker) -> None:
        self.placement.observe_handoff(self.now - self._held_at.pop(rid))
        self.num_handoffs += 1
        d.receiving -= 1
        prefill.engine.release(rid)
        if prefill.engine.scheduler.waiting:
            self._submit(prefill, lambda: None)       # its freed blocks may admit waiting prompts
        elif not prefill.busy:
            self._idle(prefill)
        self._submit(d, lambda: d.engine.commit_received(rid))
        self._leave_gate(rid, reached_decode=True)


class _SimView:
    """The simulated pools as placement sees them (router/placement.py `PoolView`): a prefill
    worker's queue as the router's stream shows it (`_RouterView`); the decode side's reports
    fresh (what was sent is in them: pending, receiving)."""

    def __init__(self, workers: dict, pool_ids: dict[str, list[str]], block_size: int, clock):
        self.workers, self.pool_ids, self.block_size, self.now = workers, pool_ids, block_size, clock

    def active(self, role: str) -> list[str]:
        return self.pool_ids[role]

    def prefill_queued(self, w: SimWorker) -> int:
        """Prompt tokens that wait at `w` in truth: in its engine, and in its inbox."""
        return prefill_load(w.report(), w.inbox_tokens)

    def prefill_load(self, worker_id: str) -> float:
        w = self.workers[worker_id]
        if w.role == PREFILL:                  # as the router's stream shows it
            return w.seen.queued(self.now(), lambda: self.prefill_queued(w))
        return self.prefill_queued(w)

    def decode_load(self, worker_id: str) -> float:
        return decode_load(self.workers[worker_id].report(), 0)

    def decoding(self, worker_id: str) -> tuple[int, int]:
        r = self.workers[worker_id].report()
        return r.running, r.kv_blocks_used * self.block_size

    def slot_ends(self, worker_id: str) -> list[int]:
        """router/picker.py `slot_ends` of its report and its inbox, the ends read only when
        past its limit."""
        w = self.workers[worker_id]
        s = w.engine.scheduler
        need = len(s.running) + len(s.waiting) + w.inbox_prompts + 1 - s.cfg.max_num_seqs
        return slots_past(need, w.engine.ends_in(need)) if need > 0 else []


def utilization(sim: Simulator) -> dict[str, float]:
    """Per pool: the fraction of the run its workers spent stepping."""
    if sim.now <= 0:
        return {}
    return {role: sum(w.busy_s for w in pool) / (len(pool) * sim.now) for role, pool in sim.pools.items() if pool}
