"""Admission: which requests the front door lets in (plain Python: no Ray, no torch).

    queue  a bounded number of requests in flight (`max_pending`), then 429;
    slo    (the default) also refuses, at once, a request that would miss its SLO, with 429 and
           a Retry-After of when it would fit (Mooncake's early rejection): a request let in only
           to miss its SLO costs the ones that could have met theirs, so under overload goodput
           falls while throughput holds.

A refusal is a failure to every client that counts non-200 answers (vLLM's benchmark client,
GuideLLM): a closed loop of clients that the server serves within its targets must never see
one. So the predictions lean on what the router observes, and are checked against it:

- TTFT: the larger of two estimates of the wait for the work ahead, plus the request's own
  prefill. The line's drain: the requests admitted and still without a first token, at the rate
  first tokens came out per second the line was not empty (`DrainRate`), with the prefill of the
  prompts it was measured on swapped for the line's at the cost model's price, and while the line is
  saturated no faster than requests end (Little's law; whatever holds first tokens back, a
  prefill queue, the decode gate, full decode seats, a slow step, is in that rate), for as much
  of the line as was there when that rate was measured (batched prefills drain a longer line
  faster: a burst after a quiet spell is priced by its prefill work, not as one prefill after
  another at the quiet spell's pace). And the
  prefill work: the prompt tokens queued over the prefill pool at the step cost model's
  throughput (workers/cost_model.py StepFit, shared with the pool controller), which knows a
  burst's cost before any of it is served. A bias learnt online, measured minus predicted TTFT
  over admitted requests, smoothed, adds what neither sees (the router, the event path); it is
  additive, never a factor, so a short queue's overhead is never multiplied into a long queue's
  prediction. A request is let in while its prediction, plus the 95th percentile of how far
  measured TTFTs ran over predictions of about its size lately (`margin`, also additive: a factor
  of measured over predicted multiplied the bias's fixed overhead, and refused requests of a
  64-client closed loop whose measured TTFTs were all within the target), is within its target.
- TPOT: the gap between first and second token (the handoff, and any wait for a decode seat)
  of the requests that had it lately, against what the request's TPOT budget leaves it after
  its decode at the pace measured lately; only while other requests are on their way to a
  handoff or in one (a request alone meets no queue there).

Refusals are checked: some of the requests the predictions would refuse are let in instead,
probes, at most `explore_share` of the requests let in, and the router records whether each met
its targets (what llm-d's predictor does with its exploration share); the probes' share that met
is the share of refusals that would have met. Probes also inform the bias and the margin, where
admitted requests alone (those predicted to meet) would never show a pessimistic prediction.
And the predictions answer to the record: a would-be refusal is let in when the loads the
router served lately within their targets say its load is served (`ServedRecord`).
Only work already in the cluster refuses a request; until the line has drained a few requests
and the fit has enough steps, only the queue bound applies. Under pressure lower priorities go
first: a request of priority p > 0 (vLLM's sense: larger is less urgent) is let in only while
its predicted TTFT is within `ttft_s * shed_ratio ** p`.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.picker import slot_ends
from router.pools import PoolRegistry
from router.slo import SLOTargets
from workers.cost_model import BatchShape, StepFit
from workers.names import COLOCATED, DECODE, DISAGGREGATED, PREFILL

QUEUE, SLO = ADMISSION_POLICIES = ("queue", "slo")
TTFT, TPOT = TARGETS = ("ttft", "tpot")


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str = ""                      # why not, for the 429's message
    code: str = ""                        # "ttft" or "tpot": the SLO it would miss (a probe's too)
    retry_after_s: float = 0.0
    predicted_ttft_s: float = math.nan    # nan: no prediction (no cost model, no drain seen yet)
    probe: bool = False                   # admitted although predicted to miss (its outcome is recorded)
    ttft_limit_s: float = math.nan        # the TTFT it was admitted against (priority applied)
    on_record: bool = False               # predicted to miss, let in: the record shows this load served (ServedRecord)
    seat_s: float = 0.0                   # the prediction's floor: the wait for a decode seat and its own prefill


WAITING, HANDOFF, DECODING, ENDED = range(4)     # a Ticket's stages
BANDS = (1 / 8, 1 / 4, 1 / 2, 1.0)   # `margin`'s bands of predictions: upper edges, in TTFT targets
MARGIN_MIN_ERRORS = 20  # errors a band needs lately before its margin counts
SATURATED = 0.9         # a line not empty this share of the time: requests end at the service's pace
QUIET_S = 1.0           # nothing in flight this long: the next request starts a burst from quiet
BURST_S = 0.5           # for this long, the decode workers idle at its start share its prefill (local prefill)
RECORD_MISS_SHARE = 1 / 20   # ServedRecord: misses at a lighter load, against those met at a heavier one
RECORD_STRETCH = 1.125       # ServedRecord: a load this much heavier than one met counts as served
REFUSAL_SHARE = 3.0          # RefusalPace: refusals a second at most this many times the requests served,
REFUSAL_FLOOR_PER_S = 20.0   # and never fewer than this,
REFUSAL_MAX_HOLD_S = 1.0     # each held at most this long (and no longer than the TTFT target),
REFUSALS_HELD_MAX = 1024     # and at most this many held past their turn at once


class Ticket:
    """One admitted request's place in the router's counts: waiting for its first token, then
    in its handoff (first token out, second not yet), then decoding."""
    __slots__ = ("prompt_tokens", "work", "predicted_ttft_s", "bias", "stage", "started_at", "first_at",
                 "second_at", "tokens", "max_tokens", "load", "served", "local", "batch", "seat")

    def __init__(self, prompt_tokens: int, predicted_ttft_s: float, bias: float,
                 load: tuple[int, int, int] = (0, 0, 0), started_at: float = math.nan, max_tokens: int = 0,
                 seat: float = 0.0):
        self.prompt_tokens, self.predicted_ttft_s, self.stage = prompt_tokens, predicted_ttft_s, WAITING
        self.work = prompt_tokens         # the tokens its prefill computes: the prompt, less what a cache holds (`placed`)
        self.started_at = started_at      # when its run started (the router's clock)
        self.max_tokens = max_tokens      # the most tokens it may generate (0: not told)
        self.bias = bias                  # the bias in its prediction (it has moved by its first token)
        self.first_at = self.second_at = math.nan
        self.tokens = 0
        self.load = load                  # ServedRecord's load as its run started
        self.served: list | None = None   # its entry in the ServedRecord, from its first token
        self.local = False                # prefilled on its decode worker, past the prefill pool's line
        self.batch = 0                    # the router's requests past their first token at its second
        self.seat = seat                  # its prediction's floor (Verdict.seat_s; 0: none)


class Pledge:
    """Requests let in and counted in the line at once, before their runs start: a response
    begins after its handler returns, when other handlers may have run, and the tickets were
    taken only then (`started`), so a burst's requests were all checked against the line as
    it was before any of them (vLLM's 256-client closed loop: every one of the first round let
    in, to first tokens up to 3 s). Redeemed when the first of its runs starts, or when the
    response ends without one (`redeem`, idempotent)."""
    __slots__ = ("requests", "prompt_tokens")

    def __init__(self, requests: int, prompt_tokens: int):
        self.requests, self.prompt_tokens = requests, prompt_tokens


class DrainRate:
    """How fast the line of requests waiting for their first token drains: first tokens per
    second of time the line was not empty, over the last `window_s` (long enough that a burst of
    fast first tokens while decode seats were free, which the full seats then hold back, counts
    as the burst it was); with fewer than `min_events` first tokens in it, the last rate
    measured (a service rate stays one when the line empties), None before any. Counting only
    busy time makes it the service's rate, not the arrivals': at light load each request's own
    wait is the time, so a line of one predicts about one recent TTFT, where first tokens per
    wall second would predict a second per request at one request per second.

    `length` is the line's mean length over the same busy time: the rate holds for lines about
    that long. The engine serves a line's prompts together (a step takes many), so a longer
    line drains faster than this rate says, up to what the prefill work allows: a rate measured
    with a line of two, times a burst of fifty, predicts fifty prefills one after another."""

    def __init__(self, window_s: float = 10.0, min_events: int = 8):
        self.window_s, self.min_events = window_s, min_events
        self.last: float | None = None
        self.length = 1.0                 # the line's mean length over the busy time behind `last`
        self.busy_share = 0.0             # of the window's time, the share the line was not empty
        self.busy_s = 0.0                 # seconds the line was not empty, since the start
        self.area = 0.0                   # the line's length integrated over time, since the start
        self.since = 0.0                  # when the line's length last changed
        self.tokens = 0                   # prompt tokens of the first tokens, since the start
        self.prompt = 0.0                 # the mean prompt of the first tokens behind `last`
        self.marks: deque[tuple[float, float, float, int]] = deque()   # (when, busy_s, area, tokens) at each first token

    def line(self, now: float, waiting: int) -> None:
        """The line is about to change length; it held `waiting` until now."""
        if waiting > 0:
            self.busy_s += max(0.0, now - self.since)
            self.area += waiting * max(0.0, now - self.since)
        self.since = now

    def first(self, now: float, prompt_tokens: int = 0) -> None:
        self.tokens += prompt_tokens
        self.marks.append((now, self.busy_s, self.area, self.tokens))

    def per_s(self, now: float, waiting: int) -> float | None:
        while self.marks and self.marks[0][0] < now - self.window_s:
            self.marks.popleft()
        n = len(self.marks)
        if n < self.min_events:
            return self.last
        open_s = max(0.0, now - self.since) if waiting > 0 else 0.0
        busy = self.busy_s + open_s - self.marks[0][1]
        area = self.area + waiting * open_s - self.marks[0][2]
        self.busy_share = busy / max(now - self.marks[0][0], 1e-3)
        self.last = (n - 1) / max(busy, 1e-3)
        self.prompt = (self.tokens - self.marks[0][3]) / (n - 1)
        self.length = max(1.0, area / busy) if busy > 0 else 1.0
        return self.last


class ServedRecord:
    """What the router saw served lately, by load: a check on the predictions that needs no
    model. A load is (requests in flight, their prompt tokens, the prompt tokens in the prefill
    pool's line), each counted with the request itself, as its run starts; an outcome is the
    request's TTFT (when its first token comes) and whether its TPOT met the target (when it
    ends; before that, while its tokens so far have come within the target's pace, it counts as
    met, `_on_pace`). Requests prefilled on their decode workers are not recorded (`passed_line`).

    The record says a load is served when lately at least `min_met` requests met their targets
    under a load as heavy in all three counts, or within RECORD_STRETCH of it (so that a closed
    loop held back by the predictions climbs to its size round by round, not only by probes),
    and those that missed under a load about as light or lighter (within RECORD_STRETCH above
    it) are at most RECORD_MISS_SHARE of them (a stray miss, a pause, does not undo a loop's
    hundreds; a load heavier than any served, or one that loads about as light missed at, is
    the predictions' to judge). A TTFT miss counts by the line alone, what a first token waits
    behind; a TPOT miss by the requests in flight and their tokens, what a decode step carries.
    Misses counted only when lighter in every count, and the load without the line, let a
    sustained overload in on the record: met requests about as heavy outnumbered the misses
    that were lighter in every count, the line requests let in on the record at the edge of
    what the line serves missed there, and at 3x the served rate on the live cluster the record
    let in 228-304 of the 419-599 requests served, which made most of the 38-60 TTFT misses
    (fast local prefills, recorded then, added met ones at every load). A request the predictions
    would refuse is let in when the record says its load is served: a closed loop of clients
    never carries more than its first round did, so once the server has served a round within
    its targets, nothing of that loop is refused whatever the predictions say (in
    tests/test_admission.py, a loop whose cost model overprices prefill 13x: 48,000 refusals
    after its first 5 s without the record, none with it). The first round itself is the
    predictions' (`_prefill_workers`)."""

    def __init__(self, window_s: float = 20.0, size: int = 512, min_met: int = 3):
        self.window_s, self.min_met = window_s, min_met
        self.entries: deque[list] = deque(maxlen=size)   # [when, *load, ttft, its Ticket, tpot met or None]

    def first(self, now: float, load: tuple[int, int, int], ttft_s: float, ticket: Ticket | None = None) -> list:
        """A first token: its entry, whose last item the router sets when the request ends."""
        entry = [now, *load, ttft_s, ticket, None]
        self.entries.append(entry)
        return entry

    def serves(self, now: float, load: tuple[int, int, int], ttft_limit_s: float, tpot_s: float = 0.0) -> bool:
        entries = self.entries
        while entries and entries[0][0] < now - self.window_s:
            entries.popleft()
        met = missed = 0
        in_flight, tokens, line = load
        reach = (in_flight / RECORD_STRETCH, tokens / RECORD_STRETCH, line / RECORD_STRETCH)
        near = (in_flight * RECORD_STRETCH, tokens * RECORD_STRETCH, line * RECORD_STRETCH)
        for _, n, k, q, ttft, ticket, tpot_met in entries:
            if (ttft > ttft_limit_s and q <= near[2]) or (tpot_met is False and n <= near[0] and k <= near[1]):
                missed += 1
            elif ttft <= ttft_limit_s and (tpot_met or tpot_met is None and _on_pace(ticket, now, tpot_s)):
                met += n >= reach[0] and k >= reach[1] and q >= reach[2]
        return met >= self.min_met and missed <= RECORD_MISS_SHARE * met


def _on_pace(t: Ticket | None, now: float, tpot_s: float) -> bool:
    """Whether a request still decoding has met the TPOT target so far: past its handoff, its
    tokens after the first came at the target's pace or faster, counting the time since the
    last one (a stall counts as it runs). Only its end said so before, and a closed loop's
    first round from quiet ends together: a 64-client loop whose first round all met its TTFT
    (0.7 s at most) had 4 of its second round refused at about 1 s, before any of the first had
    ended, on a bias and a margin learnt from that round (first tokens served in 0.05 s)."""
    return t is not None and t.tokens >= 2 and now - t.first_at <= tpot_s * (t.tokens - 1)


class SLOAdmission:
    def __init__(self, pools: PoolRegistry, mode: str, fit: StepFit, slo: SLOTargets, max_num_batched_tokens: int,
                 shed_ratio: float = 0.75, bias_weight: float = 0.05,
                 window_s: float = 5.0, explore_share: float = 0.02, margin_window_s: float = 15.0,
                 local_prefill: bool = False, clock=time.monotonic):
        if not 0 <= explore_share <= 1:
            raise ValueError(f"explore_share must be in [0, 1] (0: no probes), got {explore_share}")
        self.pools, self.fit, self.slo, self.clock = pools, fit, slo, clock
        self.prefill_role = PREFILL if mode == DISAGGREGATED else COLOCATED
        self.seat_role = DECODE if mode == DISAGGREGATED else COLOCATED     # the pool whose seats requests hold
        # Local prefill (disaggregated): a decode worker that was idle a moment ago takes a
        # burst's prompts while the prefill pool has a queue (`_prefill_workers`).
        self.local_prefill = local_prefill and mode == DISAGGREGATED
        self._empty_since = -math.inf           # when this router last had nothing in flight
        self._burst: tuple[float, set[str]] = (-math.inf, set())   # (until, the decode workers idle at its start)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shed_ratio, self.weight, self.explore_share = shed_ratio, bias_weight, explore_share
        self.probe_credit = 0.0           # grows by explore_share per request let in; a probe takes 1
        self.bias = 0.0                   # measured TTFT - predicted, smoothed (seconds)
        # Per band of predictions (BANDS), (when, measured - predicted TTFT) lately, and the band's
        # margin as last computed (None: to compute again).
        self.errors: list[deque[tuple[float, float]]] = [deque(maxlen=200) for _ in range(len(BANDS) + 1)]
        self._margins: list[float | None] = [None] * (len(BANDS) + 1)
        # (when, measured TTFT - floor) of the requests whose prediction the floor set (the wait
        # for a decode seat), lately, and their margin as last computed (`seat_margin`).
        self.seat_errors: deque[tuple[float, float]] = deque(maxlen=200)
        self._seat_margin: float | None = None
        self.margin_window_s = margin_window_s
        self.waiting = self.waiting_tokens = self.in_handoff = self.decoding = 0
        # The line's prefill work: the tokens its prompts' prefills compute (each prompt less the
        # leading blocks the worker it went to holds in its prefix cache, `placed`), and of it,
        # the prompts prefilled on their decode workers.
        self.waiting_work = self.local_tokens = 0
        self.past_first_tokens = 0        # prompt tokens of the requests in flight past their first token
        self.record = ServedRecord()
        self.on_record = 0                # requests predicted to miss and let in on the record
        self._line: dict[Ticket, None] = {}   # the tickets waiting for a first token, oldest first
        self._seated: dict[Ticket, None] = {}  # the tickets past their first token (on a decode worker)
        # Disaggregated with the decode gate: how many decode seats must free before a request
        # arriving now passes the gate (router/dispatch.py Dispatcher.seats_to_free), told how
        # many of this router's requests let in have not reached a decode seat yet; None: no
        # gate. (Colocated, the workers' sequence slots: `_slot_wait`.)
        self.seats_to_free: Callable[[int], float] | None = None
        # Colocated: a worker's seconds per decoding step lately (router/dispatch.py
        # Dispatcher.worker_pace), None before any: what a wait for its sequence slots is priced at.
        self.worker_pace: Callable[[str], float | None] = lambda worker_id: None
        self.drain = DrainRate(2 * window_s)   # first tokens per busy second
        self.completions: deque[float] = deque()   # when requests that had a first token ended, lately
        self.gaps: deque[tuple[float, float]] = deque()   # (when, first-to-second-token gap) lately
        self._gap: float | None = 0.0     # handoff_wait() of `gaps` (None: to compute again)
        # (when, seconds per token after the second, the requests past their first token meanwhile), lately
        self.paces: deque[tuple[float, float, float]] = deque()
        self._pace: tuple[float, float] | None = None   # (decode_pace, the batch it ran at) as last measured
        self._pace_stale = False          # a pace came or left since _pace was measured
        self.window_s = window_s
        self.probes = {t: [0, 0] for t in TARGETS}     # target -> [met, missed]

    # -- the router's counts ------------------------------------------------------------------------
    def started(self, prompt_tokens: int, predicted_ttft_s: float = math.nan, max_tokens: int = 0,
                seat_s: float = 0.0) -> Ticket:
        now = self.clock()
        self.drain.line(now, self.waiting)
        self.waiting += 1
        self.waiting_tokens += prompt_tokens
        self.waiting_work += prompt_tokens
        t = Ticket(prompt_tokens, predicted_ttft_s, self.bias, self._load(), now, max_tokens, seat_s)
        self._line[t] = None
        return t

    def overdue(self) -> bool:
        """Whether a request let in has waited past the TTFT target without its first token: a
        miss the record will hear of only when that token comes."""
        oldest = next(iter(self._line), None)
        return oldest is not None and self.clock() - oldest.started_at > self.slo.ttft_s

    @property
    def in_flight(self) -> int:
        return self.waiting + self.in_handoff + self.decoding

    @property
    def in_flight_tokens(self) -> int:
        return self.waiting_tokens + self.past_first_tokens

    def _load(self, arriving_tokens: int | None = None) -> tuple[int, int, int]:
        """The load ServedRecord judges: with a request of `arriving_tokens` about to come, or as
        it stands (a request just counted in)."""
        if arriving_tokens is None:
            return self.in_flight, self.in_flight_tokens, self.queued_tokens()
        return self.in_flight + 1, self.in_flight_tokens + arriving_tokens, self.queued_tokens() + arriving_tokens

    def pledge(self, prompt_tokens: int, requests: int = 1) -> Pledge:
        """Requests just let in, in the line until their runs start (Pledge)."""
        self.drain.line(self.clock(), self.waiting)
        self.waiting += requests
        self.waiting_tokens += prompt_tokens
        self.waiting_work += prompt_tokens
        return Pledge(requests, prompt_tokens)

    def redeem(self, p: Pledge | None) -> None:
        """The pledge's runs start (each takes its ticket), or its response ended without them."""
        if p is None or not p.requests:
            return
        self.drain.line(self.clock(), self.waiting)
        self.waiting -= p.requests
        self.waiting_tokens -= p.prompt_tokens
        self.waiting_work -= p.prompt_tokens
        p.requests = p.prompt_tokens = 0
        self._emptied()

    def passed_line(self, t: Ticket) -> None:
        """The request's prompt went to its decode worker (a local prefill), not to the prefill
        pool's line: its tokens leave the work a new request waits behind (`queued_tokens`), and
        its first token says nothing of that line, so its TTFT does not correct the predictions.
        With local prefills counted in the line and learned from, the predictions were a mix of
        two kinds of request: the line priced as if the prefill pool computed it all, a bias
        pulled below zero by the fast local ones, and a margin, the 95th percentile of the mix,
        that let in requests whose line then ran past the target (106-155 of the 700-740 served
        at 3x capacity missed their TTFT)."""
        if t.stage == WAITING and not t.local:
            t.local = True
            self.local_tokens += t.work

    def placed(self, t: Ticket, work: int, local: bool = False) -> None:
        """The request's prompt went to a worker that computes `work` of its tokens (the rest
        are in that worker's prefix cache), on its decode worker past the prefill pool's line
        when `local` (`passed_line`). The line's prefill work counts what the workers compute,
        as the step cost model's samples do: counted as whole prompts, a closed loop whose
        prompts the caches held (vLLM's client sends the same prompts each run at its default
        seed) was priced at 128 tokens a prompt by a fit made on their 1-16-token tails, 2.1 s
        of prefill ahead where the workers served the line within 0.15 s, and 110-400 of the
        640 requests of a met 64-client loop (colocated) were refused."""
        if t.stage != WAITING:
            return
        work = max(0, min(work, t.prompt_tokens))
        self.waiting_work += work - t.work
        if t.local:
            self.local_tokens += work - t.work
        t.work = work
        if local:
            self.passed_line(t)

    def progress(self, t: Ticket, tokens_out: int, ttft_s: float = math.nan) -> None:
        """The request has `tokens_out` tokens out (call after each token event)."""
        t.tokens = max(t.tokens, tokens_out)
        if t.stage == WAITING and tokens_out >= 1:
            self._leave(t)
            t.stage = HANDOFF
            self._seated[t] = None
            t.first_at = self.clock()
            self.past_first_tokens += t.prompt_tokens
            self.in_handoff += 1
            self.drain.first(t.first_at, t.work)
            # The floor is the gate's wait, which a prompt prefilled on its decode worker waits too.
            if 0 < t.seat >= t.predicted_ttft_s and ttft_s >= 0:     # the floor set its prediction
                self.seat_errors.append((t.first_at, ttft_s - t.seat))
                self._seat_margin = None
            if not t.local:
                self._learn(t.predicted_ttft_s, t.bias, ttft_s)
                if ttft_s >= 0:
                    t.served = self.record.first(t.first_at, t.load, ttft_s, t)
        if t.stage == HANDOFF and tokens_out >= 2:
            self._leave(t)
            t.stage = DECODING
            self.decoding += 1
            now = self.clock()
            t.second_at = now
            t.batch = len(self._seated)
            self.gaps.append((now, now - t.first_at))
            self._gap = None

    def ended(self, t: Ticket) -> None:
        if t.stage in (HANDOFF, DECODING):
            self.completions.append(self.clock())
            self.past_first_tokens -= t.prompt_tokens
        if t.served is not None:            # its TPOT (none with one token: met)
            t.served[-1] = t.tokens < 2 or (self.clock() - t.first_at) / (t.tokens - 1) <= self.slo.tpot_s
        if t.stage == DECODING and t.tokens > 2:
            now = self.clock()
            self.paces.append((now, (now - t.second_at) / (t.tokens - 2), (t.batch + len(self._seated)) / 2))
            while self.paces[0][0] < now - self.window_s:     # (read only while handoffs wait: kept short here)
                self.paces.popleft()
            self._pace_stale = True
        self._leave(t)
        self._seated.pop(t, None)
        t.stage = ENDED
        self._emptied()

    def _emptied(self) -> None:
        if not self.in_flight:
            self._empty_since = self.clock()

    def _leave(self, t: Ticket) -> None:
        if t.stage == WAITING:
            self.drain.line(self.clock(), self.waiting)
            self._line.pop(t, None)
            self.waiting -= 1
            self.waiting_tokens -= t.prompt_tokens
            self.waiting_work -= t.work
            if t.local:
                self.local_tokens -= t.work
        elif t.stage == HANDOFF:
            self.in_handoff -= 1
        elif t.stage == DECODING:
            self.decoding -= 1

    def _learn(self, predicted_ttft_s: float, bias: float, ttft_s: float) -> None:
        """A first token came: `ttft_s` measured against `predicted_ttft_s`, which had `bias` in
        it. The error is the prediction's before that bias, not before today's: with the bias as
        it stands when the token comes (a queue's wait later), a bias that had grown meanwhile
        made its own errors look larger and grew on them, and a 45-client closed loop at 0.54 s
        swung it between -0.37 and +0.53 s every two seconds, refusing hundreds each swing."""
        if not predicted_ttft_s >= 0 or not ttft_s >= 0:
            return
        raw = predicted_ttft_s - bias                    # the prediction before its bias
        band = self._band(raw)
        self.errors[band].append((self.clock(), ttft_s - predicted_ttft_s))
        self._margins[band] = None
        error = min(max(ttft_s - raw, -self.slo.ttft_s), self.slo.ttft_s)   # one outlier moves it little
        self.bias += self.weight * (error - self.bias)

    def _band(self, work_s: float) -> int:
        return bisect.bisect_right(BANDS, work_s / self.slo.ttft_s)

    def margin(self, work_s: float) -> float:
        """How far measured TTFTs have lately run over predictions of about `work_s` before their
        bias (the work ahead and the request's own prefill): the 95th percentile of measured
        minus predicted over the last `margin_window_s`, among the predictions in its band
        (BANDS: within a factor of two, in shares of the TTFT target), or the nearest band below
        it with `MARGIN_MIN_ERRORS` such errors (0 with none; within [-1/2, 2] x the TTFT
        target). A request is let in while its prediction plus this is
        within its target, so that under overload nearly all of those let in meet it (a
        prediction right on average still misses half the time at the edge); predictions that
        ran pessimistic lately let more in. By band, because a prediction's error grows with
        what it predicts: a long line's errors (seconds, after a burst) are not a short line's,
        and a light load after an overload was refused while its requests were served in 20 ms
        (half of vLLM's Poisson load after its 256-client closed loop, for six seconds). The
        errors age out: a margin that a transient set high lets in only requests predicted far
        below the target, which add no errors to its band, so without the window it would not
        come down (served, the first seconds of a jump to 3x load left it at its bound to the end
        of the run)."""
        if math.isnan(work_s):
            return 0.0
        horizon = self.clock() - self.margin_window_s
        for band in range(self._band(work_s), -1, -1):
            errors = self.errors[band]
            while errors and errors[0][0] < horizon:
                errors.popleft()
                self._margins[band] = None
            if len(errors) < MARGIN_MIN_ERRORS:
                continue
            if self._margins[band] is None:
                target = self.slo.ttft_s
                self._margins[band] = min(2 * target, max(-target / 2, _p95(errors)))
            return self._margins[band]
        return 0.0

    def seat_margin(self) -> float:
        """How far measured TTFTs ran over the floor lately, where the floor (the wait for a
        decode seat and the prompt's own prefill, `_predict`) set the prediction: the 95th
        percentile over the last `window_s`, with at least `MARGIN_MIN_ERRORS` of them (else
        0), within [0, 2] x the TTFT target. Not the bands' margin: those errors are taken
        against predictions the line set too, whose drains, overpriced at a sustained overload,
        kept the margin at -0.14 s while requests predicted by their seat at 0.83-0.89 s came
        at 1.18-1.24 s (29 of the 39 let in in one second missed). A shorter window than the
        bands': the floor sets predictions by the hundred a second at an overload, and hardly
        ever below it (the gate full in 9 of 640 checks at 1x), so over 15 s a burst's errors
        outlived it: 12-15 s after a 256-client loop, its floor's errors (first tokens 1-2 s
        past floors the burst set) put this margin at its bound, and 94 requests of the Poisson
        load after it were refused the moments the gate filled, while the first tokens of those
        seconds came within 0.73 s."""
        horizon = self.clock() - self.window_s
        while self.seat_errors and self.seat_errors[0][0] < horizon:
            self.seat_errors.popleft()
            self._seat_margin = None
        if self._seat_margin is None:
            self._seat_margin = (0.0 if len(self.seat_errors) < MARGIN_MIN_ERRORS else
                                 min(2 * self.slo.ttft_s, max(0.0, _p95(self.seat_errors))))
        return self._seat_margin

    def probed(self, target: str, met: bool) -> None:
        """A probe's outcome: it met its targets or not (the router judges it when it ends)."""
        self.probes[target][0 if met else 1] += 1

    # -- predictions --------------------------------------------------------------------------------
    def predict_ttft(self, prompt_tokens: int) -> tuple[float, float]:
        """(seconds until the first token of a new prompt, of which for the work ahead of it): the
        larger of the line's drain and the prefill work queued, then its own prefill and the
        bias; at least the wait for a decode seat and its own prefill after it (`seat_wait`);
        (nan, nan) while no estimate is known."""
        return self._predict(prompt_tokens)[:2]

    def _predict(self, prompt_tokens: int) -> tuple[float, float, float]:
        """predict_ttft's pair and its floor: the wait for a decode seat and the prompt's own
        prefill, a wait no bias shortens (the bias, learnt on the line's overpriced drains at
        -0.1 to -0.25 s, took that much off seat waits that were right, and let in requests that
        then missed by as much)."""
        ahead = math.nan
        rate = self.drain_rate(self.waiting_work / self.waiting if self.waiting else prompt_tokens)
        prefill = self._prefill_rate()
        if rate is not None:
            # The drain covers a line as long as the one it was measured on; the rest of a longer
            # line (a burst after a quiet spell) is the prefill work's to price, where known.
            ahead = (self.waiting if prefill is None else min(self.waiting, self.drain.length)) / rate
        own = each = 0.0
        if prefill is not None:
            workers = self._prefill_workers()
            if not workers:
                return math.nan, math.nan, 0.0
            queued = self.queued_tokens() / workers
            mean_prompt = self.waiting_work / self.waiting if self.waiting else prompt_tokens
            mean_rate = prefill(mean_prompt)
            work = queued / mean_rate if queued else 0.0
            ahead = work if math.isnan(ahead) else max(ahead, work)
            own = prompt_tokens / prefill(prompt_tokens)
            each = mean_prompt / workers / mean_rate
        seat = self.seat_wait(each)
        floor = seat + own if seat > 0 else 0.0
        if math.isnan(ahead):
            return (floor, seat, floor) if seat > 0 else (math.nan, math.nan, 0.0)
        return max(own, ahead + own + self.bias, floor), max(ahead, seat), floor

    def seat_wait(self, prefill_s: float = 0.0) -> float:
        """Seconds until the decode gate (colocated: a sequence slot, `_slot_wait`) lets a
        request arriving now start its prefill: the
        decode seats that must free first (`seats_to_free`), each freed when a request of this
        router on a decode worker ends, its tokens left times the decode pace at the seats'
        batch (`_seat_pace`); past as many as are seated, a round of their mean length more for
        each; with none seated yet, the requests waiting for their first tokens take the seats
        first. The requests held at the gate before it pass as the seats before its own free,
        and queue for their prefills (`prefill_s` each, one after another: the pool's time per
        prompt): when its seat frees
        in a wave with theirs, it starts once they are prefilled (a wave of seats that freed
        together let 13-50 requests through at once, and those at its end, predicted at
        0.9-0.98 s by their seat alone, came at 1.05-1.2 s). 0 without the gate, with
        room at it, or before a pace is measured. The line's drain rate cannot see it: at a
        sustained overload of 64-token requests (vLLM's client, Poisson at 3x, 1P+1D) the decode
        batch filled and emptied in waves; each time a wave's first tokens had come out, the line
        was empty, the next second's arrivals (140-170 a second where 70 were served) were let
        in, and waited for seats that would free only as that wave ended, past the target."""
        if self.seat_role == COLOCATED:
            return self._slot_wait(prefill_s)
        need = 0 if self.seats_to_free is None else math.ceil(self.seats_to_free(self.waiting + self.in_handoff))
        # None seated yet (a burst after a lull: the gate let a wave through, still in its
        # prefills), the seats go to the line's requests, each for all its tokens: read as 0,
        # every arrival of an overload's first second was let in behind the wave.
        holders = self._seated or self._line
        if need <= 0 or not holders:
            return 0.0
        pace = self._holders_pace(holders)
        if pace is None:
            return 0.0
        rounds, k = divmod(need - 1, len(holders))
        # the k soonest to free (checked on every arrival while the gate is full: no full sort)
        soonest = heapq.nsmallest(k + 1, (max(0, t.max_tokens - t.tokens) for t in holders))
        more = rounds * statistics.fmean(t.max_tokens for t in holders) if rounds else 0.0
        return _after(pace, [left + more for left in soonest], prefill_s)

    def _holders_pace(self, holders) -> float | None:
        """`_seat_pace` at the batch and mean context of `holders` (tickets)."""
        return self._seat_pace(len(holders), statistics.fmean(t.prompt_tokens + t.tokens for t in holders))

    def _slot_wait(self, prefill_s: float) -> float:
        """Colocated (no decode gate): seconds until a request arriving now gets a sequence slot
        on the worker where it would start soonest (router/placement.py picks that worker once
        its two sampled ones are full): each worker's slots that must free first (its report's
        sequences and queue, what this router sent it since, and the request itself, past its
        limit: router/picker.py `slot_ends`), each a step of that worker away per token (its
        steps lately, `worker_pace`; before any, the decode pace, `_seat_pace`), the prompts
        queued there before it prefilled one after another as their slots free (`prefill_s` the
        pool's time per prompt: the worker's is that times the workers). 0 while any worker has
        a slot free, or before a pace is known. Once a burst fills every slot, the next
        arrivals queue inside the workers until sequences end, a wait neither the line's drain
        (measured while slots were free) nor the prefill's price sees: at the jump to 3x load
        (vLLM's client, two workers of 128 slots), 209 let in in the first second filled them,
        and 150-180 let in over the next second, predicted at 0.1-0.8 s, came at about 2.5 s.
        Priced on the pool's soonest slots, not each worker's, it let in requests that then
        waited for the later slots of a worker whose batch had filled later (0.2-0.6 s
        predicted, 1.05-1.8 s served); priced at the requests' pace as they ended, the pace of
        a batch still filling and of steps not yet slowed by the overload's own work on shared
        cores (21 ms a token, at steps of 57-92 ms then), 0.8 s for waits of 1.7-1.9 s."""
        workers = self.pools.active(COLOCATED)
        if not workers:
            return 0.0
        waits = [slot_ends(m.report, len(m.unreported)) for m in workers]
        if not all(waits):
            return 0.0
        decode_pace: list[float | None] = []   # read once, only for a worker with no steps seen yet
        best = math.inf
        for m, ends in zip(workers, waits):
            pace = self.worker_pace(m.worker_id)
            if pace is None:
                if not decode_pace:
                    holders = self._seated or self._line
                    decode_pace.append(self._holders_pace(holders) if holders else None)
                pace = decode_pace[0]
            if pace is None:
                return 0.0
            best = min(best, _after(pace, ends, prefill_s * len(workers)))
        return best

    def drain_rate(self, prompt_tokens: float | None = None) -> float | None:
        """The line's drain rate, no more than the rate requests end while the line has been full
        nearly all the time (saturated, first tokens can outrun the ends only while seats are
        free, and a line let in at that pace waits for the seats: a burst of first tokens after a
        lull would otherwise let in a burst that the full decode batch then holds); for a line of
        `prompt_tokens` prompts when given (`_reprice`: a line saturated by long prompts' prefills
        ends them at that pace too, and the short prompts after it do not)."""
        now = self.clock()
        rate = self.drain.per_s(now, self.waiting)
        n = self._recent_completions(now)
        if rate is not None and n >= self.drain.min_events and self.drain.busy_share >= SATURATED:
            rate = min(rate, (n - 1) / max(now - self.completions[0], 1e-3))
        if rate is not None and prompt_tokens is not None and self.drain.prompt > 0:
            rate = self._reprice(rate, prompt_tokens)
        return rate

    def _reprice(self, rate: float, prompt_tokens: float) -> float:
        """`rate` was measured on requests of `drain.prompt` tokens each: each one's time in the
        drain holds its prompt's prefill, priced by the cost model over the prefill pool; that
        prefill is swapped for a `prompt_tokens` one's and the rest (whatever else holds first
        tokens back) kept. Without it a line measured on 2,048-token prompts priced the 128-token
        ones after it at the long ones' pace (0.85 s predicted, 0.31 s served)."""
        prefill = self._prefill_rate()
        workers = self._prefill_workers()
        if prefill is None or not workers:
            return rate

        def share(n: float) -> float:
            return n / (workers * prefill(n))
        per = 1 / rate - share(self.drain.prompt) + share(prompt_tokens)
        return 1 / max(per, share(prompt_tokens))

    def _prefill_workers(self) -> int:
        """The workers a queue of prompts is prefilled on: the prefill pool (none: nothing can
        be priced), and with local prefill, for BURST_S from the first request after QUIET_S
        with nothing in flight, the decode workers that reported nothing running then. A burst
        to a quiet cluster (a closed loop's first round) is shared by its decode workers, each
        taking prompts while the prefill pool has a queue (router/placement.py) until its batch
        fills with the burst's own; a decode worker with a batch takes a prompt only when
        delaying its batch costs less than the queue, a share not priced here. The prefill worker
        alone, priced at the pace of the one-prompt steps it had served, predicted 1.0 s for the
        47th of vLLM's 64 clients and 50 were refused; the two workers served all 64 within 0.35
        s. Only from quiet: a decode worker idle between the waves of an overload, counted, let
        in a wave each time it emptied (3x goodput 0.72 of the peak, from 0.87)."""
        workers = len(self._prefilling())
        if workers and self.local_prefill and self.pools.active(PREFILL):
            now = self.clock()
            decode = self.pools.active(DECODE)
            if not self.in_flight and now - self._empty_since >= QUIET_S:
                self._burst = (now + BURST_S, {m.worker_id for m in decode if m.report is None or not m.report.running})
            until, idle = self._burst
            if now <= until:
                workers += sum(m.worker_id in idle for m in decode)
        return workers

    def _prefilling(self) -> list:
        """The workers that compute prompts: the prefill (or colocated) pool, or, disaggregated
        with no active prefill worker, the decode workers, which then serve requests whole."""
        return self.pools.active(self.prefill_role) or (self.pools.active(DECODE) if self.prefill_role == PREFILL
                                                         else [])

    def _prefill_rate(self):
        """Prompt tokens per second of a prefill worker at a prompt length (a function), from the
        model of prefill steps (StepFit.prefill_model), else as measured on the steps served;
        None while neither is known."""
        cost = self.fit.prefill_model()
        if cost is not None:
            return lambda n: cost.prefill_tokens_per_s(n, self.max_num_batched_tokens)
        measured = self.fit.prefill_throughput()
        return None if measured is None else (lambda n: measured)

    def queued_tokens(self) -> int:
        """Prompt tokens to compute ahead of a new request: the prefill work of this router's
        admitted prompts without a first token (`placed`; but those prefilled on their decode
        workers, `passed_line`), or, when more, what the prefill workers report queued (other
        routers send there too; the reports lag this router's own sends, which its count has
        at once)."""
        reported = sum(m.report.queued_prefill_tokens for m in self._prefilling() if m.report is not None)
        return max(self.waiting_work - self.local_tokens, reported)

    def handoff_wait(self) -> float:
        """Seconds between first and second token lately: the median over the requests that had
        their second token in the window (0 with fewer than 5: too few to tell)."""
        now = self.clock()
        while self.gaps and self.gaps[0][0] < now - self.window_s:
            self.gaps.popleft()
            self._gap = None
        if self._gap is None:
            self._gap = statistics.median(g for _, g in self.gaps) if len(self.gaps) >= 5 else 0.0
        return self._gap

    def served_per_s(self) -> float | None:
        """Requests that had a first token ended per second lately (None with fewer than the line's
        drain needs to count)."""
        n = self._recent_completions(self.clock())
        return n / self.drain.window_s if n >= self.drain.min_events else None

    def _recent_completions(self, now: float) -> int:
        """How many requests that had a first token ended within the drain's window (older ends
        leave `completions`)."""
        while self.completions and self.completions[0] < now - self.drain.window_s:
            self.completions.popleft()
        return len(self.completions)

    def decode_pace(self) -> float | None:
        """Seconds per token after the second, lately: the median over the requests that ended in
        the window with more than two tokens; with fewer than 5, the pace last measured (None
        before any). A pace stays one through a quiet spell: forgotten after 5 s of quiet, the
        seat wait was 0 through the first second of an overload after a 7 s lull (vLLM's client
        starting its next run), while the gate held 57 requests for seats that a wave of 129
        let in meanwhile freed only 1.4 s later."""
        horizon = self.clock() - self.window_s
        while self.paces and self.paces[0][0] < horizon:
            self.paces.popleft()
            self._pace_stale = True
        if len(self.paces) >= 5 and self._pace_stale:
            self._pace = statistics.median(p for _, p, _ in self.paces), statistics.median(b for _, _, b in self.paces)
            self._pace_stale = False
        return None if self._pace is None else self._pace[0]

    def _seat_pace(self, batch: int, context: float) -> float | None:
        """The decode pace while `batch` requests of about `context` tokens each hold the decode
        seats: the pace lately (`decode_pace`), its step priced again at that batch by the step
        cost model (the decode step's part that grows with the rows; as measured without a fitted
        decode step). Unscaled, the seat wait at the start of an overload after a lighter spell
        used the light spell's pace (vLLM's client, Poisson at 1x then 3x, 1P+1D: 20 ms a token
        where the full batch ran at 30-32), predicted 0.82 s for seats that freed at 1.2-1.3 s,
        and 43 of the 52 let in in that half second missed."""
        pace = self.decode_pace()
        cost = self.fit.current()
        if pace is None or cost is None:
            return pace
        workers = max(1, len(self.pools.active(self.seat_role)))

        def step(rows: float) -> float:
            n = max(1, round(rows / workers))
            return cost.step_s(BatchShape(num_decode=n, decode_context=round(n * context)))
        then = step(self._pace[1])
        return pace if then <= 0 else pace * step(batch) / then

    def handoff_budget(self, max_tokens: int) -> float:
        """The longest first-to-second-token gap with which a request of `max_tokens` still meets
        the TPOT target: its TPOT is (gap + (max_tokens - 2) x pace) / (max_tokens - 1), with the
        decode pace as measured lately, but never more than half the target (what it assumes
        before any is measured): the rule answers for the handoff, and a decode pool that runs
        slower than its target is the TTFT line's and the decode gate's to price, not a reason
        to refuse everything at light load."""
        pace = self.decode_pace()
        pace = self.slo.tpot_s / 2 if pace is None else min(pace, self.slo.tpot_s / 2)
        return self.slo.tpot_s * (max_tokens - 1) - pace * max(0, max_tokens - 2)

    def check(self, prompt_tokens: int, max_tokens: int, priority: int = 0) -> Verdict:
        """Admit, or say why not. Only work already in the pools refuses a request: one that would
        miss on its own (a prompt longer than the TTFT target allows) is let in, since coming
        back later would not help it. A batch of prompts comes as their total `prompt_tokens`
        (its last first token waits for all of them). A would-be refusal may be let in as a probe
        (`_refuse`)."""
        ttft, ahead, floor = self._predict(prompt_tokens)
        limit = self.slo.ttft_s * (self.shed_ratio ** min(priority, 50) if priority > 0 else 1.0)
        # The margin, learnt on the line's predictions, lowers none of the seat wait's floor, as
        # the bias does not: at -0.5 s (the line's drains overpriced lately) it let in seat waits
        # of 1.2-1.4 s through the first second of an overload, and each missed by about that.
        # The floor takes the larger of that margin and its own (`seat_margin`) when above 0.
        margin = self.margin(ttft - self.bias)
        floor_likely = floor + max(0.0, margin, self.seat_margin()) if floor > 0 else 0.0
        likely = max(ttft + margin, floor_likely)
        if ahead > 0 and likely > limit:
            return self._refuse(Verdict(
                False, f"its predicted time to first token is {ttft:.2f}s ({likely:.2f}s at the 95th percentile of "
                       f"the predictions' errors), over the {limit:.2f}s this server admits at priority {priority}",
                TTFT, retry_after_s=likely - limit, predicted_ttft_s=ttft, ttft_limit_s=limit, seat_s=floor), prompt_tokens,
                on_record=floor_likely <= limit)
        # The gap lately counts only while work is on its way to the handoff or in it (as for the
        # TTFT): a request alone meets no queue there, and refusing it helps nobody.
        wait = self.handoff_wait() if ahead > 0 or self.in_handoff > 0 else 0.0
        budget = self.handoff_budget(max_tokens) if max_tokens > 1 and wait > 0 else math.inf
        if wait > budget:
            return self._refuse(Verdict(
                False, f"the gap between first and second token is {wait:.2f}s lately (the handoff to the decode "
                       f"pool), over the {budget:.2f}s that this request's {max_tokens} tokens leave it at the "
                       f"TPOT target", TPOT,
                retry_after_s=wait - budget, predicted_ttft_s=ttft, ttft_limit_s=limit, seat_s=floor), prompt_tokens)
        self.probe_credit = min(1.0, self.probe_credit + self.explore_share)
        return Verdict(True, predicted_ttft_s=ttft, ttft_limit_s=limit, seat_s=floor)

    def _refuse(self, v: Verdict, prompt_tokens: int, on_record: bool = True) -> Verdict:
        """A would-be refusal: let in when the record shows its load served (ServedRecord), no
        request let in waits past the TTFT target (`overdue`), and (`on_record`) its wait for a
        decode seat, with the margin its predictions' errors leave lately, does not pass the
        target (the record vouches for loads, not for seats that free only later: it let in
        requests whose seat wait was 1.1 s, and each missed by about that; and, with the seat
        wait alone checked, 17 of the 21 let in during one half second of a sustained overload
        came on the record at seat waits of 0.6-0.9 s, a margin of +0.32 s, and 13 missed); else a probe when the credit allows, so that probes stay within
        `explore_share` of the requests let in (a closed loop's clients retry at once: a share of
        the refusals would fill the server with probes). The record hears of a TTFT miss only at
        its first token: at the start of a sustained overload (vLLM's client, Poisson at 3x,
        1P+1D) it let in 403 requests in the seconds before the misses reached it, and 189 of
        the 772 served missed their TTFT, 168 in the first five seconds."""
        if on_record and not self.overdue() and self.record.serves(self.clock(), self._load(prompt_tokens), v.ttft_limit_s,
                                                                     self.slo.tpot_s):
            self.on_record += 1
            return dataclasses.replace(v, admit=True, retry_after_s=0.0, on_record=True)
        if self.probe_credit >= 1.0:
            self.probe_credit -= 1.0
            return dataclasses.replace(v, admit=True, retry_after_s=0.0, probe=True)
        return v


def _after(pace: float, lefts: list[float], prefill_s: float) -> float:
    """Seconds until the last of the seats (or slots) that free after `lefts` tokens each,
    soonest first, lets a request start, at `pace` seconds a token: those before it let through
    requests that are prefilled one after another (`prefill_s` each) as their seats free, and
    it starts once its own seat is free and they are prefilled."""
    prefilled = 0.0
    for left in lefts[:-1]:
        prefilled = max(prefilled, pace * left) + prefill_s
    return max(pace * lefts[-1], prefilled)


def _p95(errors) -> float:
    """The 95th percentile of (when, error) pairs' errors (the margins')."""
    ranked = sorted(e for _, e in errors)
    return ranked[int(0.95 * (len(ranked) - 1))]


class RefusalPace:
    """When a full server's 429s go out: at most `per_s` a second, each held for its turn at most
    `max_hold_s`; one whose turn is further off is held `max_hold_s` and takes no turn. A client
    that sends its next request the moment it is refused (a closed loop: vLLM's benchmark client,
    most load tools) otherwise turns each refusal into another request: 256 such clients sent
    1,900 a second, and the router's parsing and refusing them, with the clients' own sending,
    took the cores the requests let in needed (78 served in 7.5 s, each past its TTFT target,
    where paced at 500 a second they were 1,189 in 24 s, at 0.34 s median TTFT). Paced, they come
    back at the pace the refusals go out; past the turns, at most once per `max_hold_s` each (a
    refusal that went at once past its turn let such a loop spin: 256 clients of one decode
    worker were refused ~650 a second, 2,424 of 2,560 in 3.7 s). An open loop's arrivals do not
    slow down for a held answer, so the bound keeps the connections held to its rate times
    `max_hold_s`; with that bound at most the TTFT target (the server sets it so), a 429 comes
    no later than the first token would have been due. A flood past `max_held` refusals held
    past their turn at once is answered at once: the connections (file descriptors) held stay
    bounded whatever comes."""

    def __init__(self, per_s: float, max_hold_s: float = REFUSAL_MAX_HOLD_S, max_held: int = REFUSALS_HELD_MAX):
        if not per_s > 0 or not max_hold_s >= 0 or max_held < 0:
            raise ValueError(f"RefusalPace needs per_s > 0, max_hold_s >= 0 and max_held >= 0, got {per_s}, "
                             f"{max_hold_s}, {max_held}")
        self.gap_s, self.max_hold_s, self.max_held = 1 / per_s, max_hold_s, max_held
        self.next = -math.inf             # when the next refusal may go out
        self.held: deque[float] = deque()  # when the refusals held past their turn go out, in order

    def hold(self, now: float, served_per_s: float | None = None) -> float:
        """Seconds a refusal made at `now` waits (0: it goes at once). With the rate requests are
        served lately (`served_per_s`), the pace is at most REFUSAL_SHARE times it (at least
        REFUSAL_FLOOR_PER_S): a closed loop's refused clients come back at once, so each of their
        refusals sheds nothing, and at the fixed pace alone a 32-client loop of 512-token prompts
        was refused 500 times a second, the router's work on them slowing the workers until the
        predictions refused the whole loop (3,992 of 4,036 requests in 8 s beside a busy core).
        The share leaves an open loop at three times what is served (two refused for each one
        served) its turns with room to spare, so they seldom wait."""
        gap_s = self.gap_s
        if served_per_s is not None:
            gap_s = max(gap_s, 1 / max(REFUSAL_FLOOR_PER_S, REFUSAL_SHARE * served_per_s))
        at = max(now, self.next)
        if at - now > self.max_hold_s:
            while self.held and self.held[0] <= now:
                self.held.popleft()
            if len(self.held) >= self.max_held:
                return 0.0
            self.held.append(now + self.max_hold_s)
            return self.max_hold_s
        self.next = at + gap_s
        return at - now


class DecodeGate:
    """Holds a new request before its prefill while the decode pool is full, so that the wait
    falls before its first token (TTFT) rather than between its first and second (TPOT): a
    prompt prefilled only to wait for a decode seat has given its client a token and then a
    stall, which counts in every TPOT of it (a closed-loop client's, vLLM's benchmark's).

    `ahead` are the requests let through that have not reached a decode worker yet (queued for
    prefill, prefilling, or in their handoff). A decode worker's `capacity` is the sequences it
    ran when it last reported handoffs waiting for room (`LoadReport.pending`): its seats at
    the TPOT target, the memory and the sequence limit, as they stand. A request passes while
    fewer are ahead than the seats free over the pool (capacity less running) plus `limit`, the
    pipeline that keeps seats filled as they free: the rate requests reached decode over the
    last `rate_window_s`, times `window_s`, and at least `per_worker` per worker of either
    pool. A decode worker never seen full has the capacity `seats` (the engine's sequence
    limit, which no worker exceeds), or, without it, none: while any has none nothing is held.
    A prefill-bound pool thus keeps its own queue, up to the seats. Plain Python: the
    dispatcher holds the waiting requests and asks `opens` on each decode report and each
    request that reaches decode."""

    def __init__(self, seats: int | None = None, window_s: float = 0.25, per_worker: int = 1,
                 rate_window_s: float = 5.0, clock=time.monotonic):
        if window_s < 0 or per_worker < 1 or rate_window_s <= 0 or (seats is not None and seats < 1):
            raise ValueError("DecodeGate needs seats >= 1 (or None), window_s >= 0, per_worker >= 1 and "
                             "rate_window_s > 0")
        self.seats = seats
        self.window_s, self.per_worker, self.rate_window_s, self.clock = window_s, per_worker, rate_window_s, clock
        self.ahead: set[str] = set()
        self.arrivals: deque[float] = deque()     # when requests reached decode, over rate_window_s
        self.capacity: dict[str, int] = {}        # decode worker -> its seats, when last seen full
        self.line: deque[tuple[str, object]] = deque()   # held requests (rid, the caller's item), oldest first

    def limit(self, num_workers: int) -> int:
        now = self.clock()
        while self.arrivals and self.arrivals[0] < now - self.rate_window_s:
            self.arrivals.popleft()
        rate = len(self.arrivals) / self.rate_window_s
        return max(self.per_worker * num_workers, math.ceil(rate * self.window_s))

    def observe(self, worker_id: str, report) -> None:
        """A decode worker's report (workers/messages.py LoadReport): full (handoffs waiting
        for room), it shows its capacity; holding more than its known capacity with none
        waiting, it had more seats than that (shorter contexts, memory freed), at least as many
        as it holds."""
        held = report.running + report.receiving
        if report.pending > 0:
            self.capacity[worker_id] = held
        elif held > self.capacity.get(worker_id, self.seats or math.inf):
            self.capacity[worker_id] = held

    def forget(self, worker_id: str) -> None:
        """The worker left or restarted: its seats are unknown again."""
        self.capacity.pop(worker_id, None)

    def opens(self, decode: dict, num_prefill: int = 0) -> bool:
        """Whether a request may start now, given the active decode workers' latest reports
        (worker id -> LoadReport, None before the first; only `running` and `routers` are
        read, and `observe` reads `pending` and `receiving` too) and the prefill pool's size."""
        return len(self.ahead) < self._room(decode, num_prefill)

    def _room(self, decode: dict, num_prefill: int) -> float:
        """How many requests may be ahead now: unbounded with no decode worker (the dispatcher
        waits for one, or fails the request) or one whose capacity is unknown."""
        if not decode:
            return math.inf
        free, routers = 0, 1
        for worker_id, report in decode.items():
            cap = self.capacity.get(worker_id, self.seats)
            if cap is None or report is None:
                return math.inf
            free += max(0, cap - report.running)
            routers = max(routers, report.routers)
        # Several routers send to these seats: each lets through its share (its pipeline, from
        # its own arrivals, is its own already).
        return free / routers + self.limit(len(decode) + num_prefill)

    def hold(self, rid: str, item: object) -> None:
        """A request that may not start now waits in line (`item`: what its caller resumes)."""
        self.line.append((rid, item))

    def release(self, decode: dict, num_prefill: int = 0, dropped=lambda item: False) -> list:
        """The held requests' items that may start now, in order (each now ahead); those
        `dropped` (their client left) leave the line."""
        out, room = [], self._room(decode, num_prefill)
        while self.line:
            rid, item = self.line[0]
            if not dropped(item):
                if len(self.ahead) >= room:
                    break
                self.enter(rid)
                out.append(item)
            self.line.popleft()
        return out

    def seats_to_free(self, decode: dict, num_prefill: int = 0, let_in: int = 0) -> float:
        """How many more requests must reach their decode seats (or end) before one arriving now
        passes (as `opens` reads the reports): the line held here and itself, past the room for
        more ahead; 0 when it would pass at once. `let_in`: the requests the router let in that
        have not reached a decode seat (SLO admission's count); those of them not here yet are
        before it too. A burst's handlers run before their requests reach the gate: counted only
        once here, the gate had room for each of the first 172 of a 256-client loop's first round
        (room for about 130: the 128 seats and the pipeline), and most past it missed their TTFT."""
        unseen = max(0, let_in - len(self.ahead) - len(self.line))
        return max(0.0, len(self.line) + unseen + 1 - (self._room(decode, num_prefill) - len(self.ahead)))

    def enter(self, rid: str) -> None:
        self.ahead.add(rid)

    def leave(self, rid: str, reached_decode: bool = False) -> bool:
        """The request reached a decode worker (its first token from there), or ended before;
        idempotent. True when it was ahead (room for the next one)."""
        if rid not in self.ahead:
            return False
        self.ahead.discard(rid)
        if reached_decode:
            self.arrivals.append(self.clock())
        return True
