"""Admission: which requests the front door lets in (plain Python: no Ray, no torch).

    queue  a bounded number of requests in flight (`max_pending`), then 429;
    slo    (the default) also refuses, at once, a request that would miss its SLO, with 429 and
           a Retry-After of when it would fit (Mooncake's early rejection): a request let in only
           to miss its SLO costs the ones that could have met theirs, so under overload goodput
           falls while throughput holds.

The predictions, from what the router itself knows and the step cost model fitted on the
workers' own steps (workers/cost_model.py StepFit, shared with the pool controller):

- TTFT: the prompt tokens of the requests admitted and still without a first token, spread over
  the prefill pool, plus the new prompt, at the pool's prefill throughput. The router's count
  holds every request ahead wherever it waits (a worker's queue, a resume, a call in transit),
  where the workers' reports would miss some. Corrected online: the ratio of each admitted
  request's measured TTFT to its prediction, smoothed, scales the next predictions (what the step
  model leaves out: the router, contention, the steps' mix).
- TPOT: the decode pool's room (sequences it runs within the TPOT target at this context, by the
  cost model), and the handoffs waiting between first and second token against the rate they
  complete at: the wait must fit in half the request's TPOT budget.

Only work already in the cluster refuses a request; until the fit has enough steps, only the
queue bound applies. Under pressure lower priorities go first: a request of priority p > 0
(vLLM's sense: larger is less urgent) is let in only while its predicted TTFT is within
`ttft_s * shed_ratio ** p`.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from router.pools import PoolRegistry
from router.slo import SLOTargets
from workers.cost_model import StepFit
from workers.names import COLOCATED, DECODE, DISAGGREGATED, PREFILL

QUEUE, SLO = ADMISSION_POLICIES = ("queue", "slo")


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str = ""                      # why not, for the 429's message
    code: str = ""                        # "ttft" or "tpot": the SLO it would miss
    retry_after_s: float = 0.0
    predicted_ttft_s: float = math.nan    # nan: no prediction (no cost model yet)


WAITING, HANDOFF, DECODING, ENDED = range(4)     # a Ticket's stages


class Ticket:
    """One admitted request's place in the router's counts: waiting for its first token, then
    in its handoff (first token out, second not yet), then decoding."""
    __slots__ = ("prompt_tokens", "predicted_ttft_s", "stage")

    def __init__(self, prompt_tokens: int, predicted_ttft_s: float):
        self.prompt_tokens, self.predicted_ttft_s, self.stage = prompt_tokens, predicted_ttft_s, WAITING


class SLOAdmission:
    def __init__(self, pools: PoolRegistry, mode: str, fit: StepFit, slo: SLOTargets, max_num_batched_tokens: int,
                 max_num_seqs: int, shed_ratio: float = 0.75, correction_weight: float = 0.1,
                 handoff_window_s: float = 5.0, clock=time.monotonic):
        self.pools, self.fit, self.slo, self.clock = pools, fit, slo, clock
        self.prefill_role = PREFILL if mode == DISAGGREGATED else COLOCATED
        self.decode_role = DECODE if mode == DISAGGREGATED else COLOCATED
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.shed_ratio, self.weight, self.handoff_window_s = shed_ratio, correction_weight, handoff_window_s
        self.correction = 1.0             # measured TTFT / predicted, smoothed
        self.waiting = self.waiting_tokens = self.in_handoff = 0
        self.handoffs: deque[float] = deque()   # when recent handoffs completed

    # -- the router's counts ------------------------------------------------------------------------
    def started(self, prompt_tokens: int, predicted_ttft_s: float = math.nan) -> Ticket:
        self.waiting += 1
        self.waiting_tokens += prompt_tokens
        return Ticket(prompt_tokens, predicted_ttft_s)

    def progress(self, t: Ticket, tokens_out: int, ttft_s: float = math.nan) -> None:
        """The request has `tokens_out` tokens out (call after each token event)."""
        if t.stage == WAITING and tokens_out >= 1:
            self._leave(t)
            t.stage = HANDOFF
            self.in_handoff += 1
            self._learn(t.predicted_ttft_s, ttft_s)
        if t.stage == HANDOFF and tokens_out >= 2:
            self._leave(t)
            t.stage = DECODING
            self.handoffs.append(self.clock())

    def ended(self, t: Ticket) -> None:
        self._leave(t)
        t.stage = ENDED

    def _leave(self, t: Ticket) -> None:
        if t.stage == WAITING:
            self.waiting -= 1
            self.waiting_tokens -= t.prompt_tokens
        elif t.stage == HANDOFF:
            self.in_handoff -= 1

    def _learn(self, predicted_ttft_s: float, ttft_s: float) -> None:
        if not predicted_ttft_s > 0 or not ttft_s > 0:
            return
        raw = predicted_ttft_s / self.correction          # the prediction before correction
        ratio = min(20.0, max(0.25, ttft_s / raw))
        self.correction += self.weight * (ratio - self.correction)

    # -- predictions --------------------------------------------------------------------------------
    def predict_ttft(self, prompt_tokens: int) -> tuple[float, float]:
        """(seconds until the first token of a new prompt, of which for the work ahead of it):
        the prompts admitted and still without a first token, spread over the prefill pool, and
        its own, at the pool's throughput (the cost model's, else as measured on the steps
        served), corrected; (nan, nan) while neither is known."""
        workers = len(self.pools.active(self.prefill_role))
        cost = self.fit.current()
        if cost is not None:
            def rate(n: float) -> float:
                return cost.prefill_tokens_per_s(n, self.max_num_batched_tokens)
        else:
            measured = self.fit.prefill_throughput()
            if measured is None:
                return math.nan, math.nan

            def rate(n: float) -> float:
                return measured
        if not workers:
            return math.nan, math.nan
        queued = self.queued_tokens() / workers
        mean_prompt = self.waiting_tokens / self.waiting if self.waiting else prompt_tokens
        ahead = queued / rate(mean_prompt) if queued else 0.0
        own = prompt_tokens / rate(prompt_tokens)
        return (ahead + own) * self.correction, ahead * self.correction

    def queued_tokens(self) -> int:
        """Prompt tokens ahead of a new request: this router's admitted prompts without a first
        token, or, when more, what the prefill workers report queued (other routers send there
        too; the reports lag this router's own sends, which its count has at once)."""
        reported = sum(m.report.queued_prefill_tokens for m in self.pools.active(self.prefill_role)
                       if m.report is not None)
        return max(self.waiting_tokens, reported)

    def handoff_wait(self) -> float:
        """Seconds the handoffs waiting now take to clear at the rate they completed lately (0
        with none waiting, or too few completed to tell). The rate is the completions' own, from
        the oldest in the window to now, not over the whole window: a burst that began a moment
        ago (the first requests, or the first after a quiet spell) keeps its rate instead of
        having it diluted by the quiet seconds before it."""
        now = self.clock()
        while self.handoffs and self.handoffs[0] < now - self.handoff_window_s:
            self.handoffs.popleft()
        if not self.in_handoff or len(self.handoffs) < 5:
            return 0.0
        return self.in_handoff / ((len(self.handoffs) - 1) / max(now - self.handoffs[0], 1e-3))

    def decode_room(self, context: float) -> tuple[int, int]:
        """(sequences the decode pool holds or has coming, sequences it runs within the TPOT
        target at this context); (0, 0) without a cost model."""
        cost = self.fit.current()
        workers = self.pools.active(self.decode_role)
        if cost is None or not workers:
            return 0, 0
        held = sum(m.decode_sequences() for m in workers)
        return held, len(workers) * cost.decode_batch_at(context, self.slo.tpot_s, self.max_num_seqs)

    def check(self, prompt_tokens: int, max_tokens: int, priority: int = 0,
              longest_prompt: int | None = None) -> Verdict:
        """Admit, or say why not. Only work already in the pools refuses a request: one that would
        miss on its own (a prompt longer than the TTFT target allows) is let in, since coming
        back later would not help it. A batch of prompts comes as their total `prompt_tokens`
        (its last first token waits for all of them) and its `longest_prompt` (the context of
        each of its sequences in the decode pool)."""
        ttft, ahead = self.predict_ttft(prompt_tokens)
        limit = self.slo.ttft_s * (self.shed_ratio ** min(priority, 50) if priority > 0 else 1.0)
        if ahead > 0 and ttft > limit:
            return Verdict(False, f"its predicted time to first token is {ttft:.2f}s, over the "
                                  f"{limit:.2f}s this server admits at priority {priority}", "ttft",
                           retry_after_s=ttft - limit, predicted_ttft_s=ttft)
        context = prompt_tokens if longest_prompt is None else longest_prompt
        held, room = self.decode_room(context + max_tokens / 2)
        if room and held >= room:
            # A sequence ends every (its output x TPOT) on average: room comes back about then.
            return Verdict(False, f"the decode pool holds {held} sequences, all it runs within the "
                                  f"{self.slo.tpot_s * 1000:g} ms TPOT target", "tpot",
                           retry_after_s=max_tokens * self.slo.tpot_s / max(1, held), predicted_ttft_s=ttft)
        wait, budget = self.handoff_wait(), self.slo.tpot_s * (max_tokens - 1) / 2
        if max_tokens > 1 and wait > budget:
            return Verdict(False, f"{self.in_handoff} handoffs are waiting for the decode pool, {wait:.2f}s of "
                                  f"them at the rate they complete, over this request's {budget:.2f}s share "
                                  "of its TPOT budget", "tpot", retry_after_s=wait - budget, predicted_ttft_s=ttft)
        return Verdict(True, predicted_ttft_s=ttft)


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
