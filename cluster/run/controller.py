"""The pool-ratio controller's policy: a plain function from what the cluster measured to one
action (plain Python, no Ray, no torch: the serving loop and `pdcluster simulate` run it alike).

Like Dynamo's planner it sizes each pool from demand over capacity, in workers' worth of work:

    prefill need = (arrival rate x prompt tokens + queued prompt tokens / backlog_s)
                   / prefill tokens per second per worker
    decode need  = max(arrival rate x output tokens / decode tokens per second per worker
                       (its capacity at the TPOT target),
                       KV blocks in use now / one worker's blocks)
                   + waiting handoffs x output tokens / backlog_s / decode tokens per second

(the KV term: sequences hold their blocks until they end, so a pool whose KV is full has no
room for more whatever its compute load says; the cost model prices capacity from the KV a
batch needs, and this is its measured check)

A pool's load is its need over its size, and each pool has a target load: decode's capacity is
already priced at the TPOT target and its batch smooths arrival bursts over each request's
life, so it runs at up to 0.75 (short replies smooth less: the handoff and bursts eat into
their TPOT); prefill's capacity is raw throughput and a burst queues in front of the TTFT
target at once, so it keeps more headroom (0.65: the Azure traces' 2-second peaks run ~1.5x
their mean). Unlike the planner the policy does not chase every estimate (its users report
oscillation, scale-downs that break the SLO and rebalances over the GPU budget):

- a pool is short when its load is above `grow_at` (demand beyond its capacity), or when its
  SLO attainment is below `min_attainment` while all of these hold: its load is at least
  `slo_load_floor` of its target (well under its target a pool has the headroom the policy
  sizes for: misses come from bursts beyond any sizing or from elsewhere, and a worker more
  would not stop them), its backlog is at most `slo_backlog_share` of its need, and the last
  change is `slo_hold_s` old (a backlog left by a burst or by the split before explains the
  misses, and it counts in the load already);
- a short pool is sized in one change to its target load (at least one worker more): `count`
  workers move, or are added under the budget;
- workers leave a pool only while the rest stay under `shrink_below` (the survivors' predicted
  load stays under 80 %) and at or under their own target, or, when both pools are past their
  targets, only as far as evens the two out (load over target; the receiver's without its
  backlog, which passes); never from a short pool;
- hysteresis: between its target and `grow_at` a pool neither grows nor gives; and attainment
  never undoes attainment: after a move for attainment, only a load above `grow_at` moves
  workers back (attainment may correct a move made on the predicted loads, once; so under a
  steady load the moves stop);
- elastic size (`min_workers` set): a pool below the forecast's floor (`Signals.floor_*`: what
  the next long interval's forecast arrivals need at its target load, cluster/run/forecast.py)
  grows to it ahead of demand (unless it shrank within `shrink_hold_s` and is under its target:
  a floor recomputed after a shrink does not undo it); and when nothing is short, the pool furthest under its target
  that has not grown for `shrink_hold_s` gives the workers its survivors can do without (the
  same test as a donor's: they stay at or under their target and under `shrink_below`, backlog
  included), a quarter of the pool at most at once, never below the floor nor below what the
  forecast needs over the next minutes (`Signals.keep_*`), nor the total below `min_workers`,
  and not while arrivals rise (`Signals.rising`: a dip in a rise is a burst's gap, and the
  rise takes the worker back within the shrink hold); within `shrink_hold_s` of its own shrink
  a pool is short only past `grow_at`, not the elastic headroom;
- the mixed role (`mixed` set): when splitting does not pay, every prefill worker moves to the
  decode pool and, with no prefill pool, the decode workers serve whole requests
  (router/placement.py); it pays when the TPOT predicted on mixed workers
  (`Signals.mixed_tpot`: their decode step stretched by the time their prompts take, plus a
  long prompt's stall spread over a reply) is at most `mixed_ok` of the target, the whole
  load on one pool stays within the decode pool's target, no attainment is short, and demand
  is not rising (the last change grew the prefill pool within `shrink_hold_s`, or the
  forecast's floor is above it) and, once mixed workers had to split, under `MIXED_BELOW` of
  the demand they split at (`Signals.split_need`: a prediction that failed at a load is not
  trusted again near it); mixed, the cluster splits again (as many prefill
  workers as the prompts need at their target) when that prediction passes `split_at` of the
  target or attainment falls short at a load past the attainment floor, and grows, shrinks
  and keeps the forecast's floor as one pool;
- one change per decision, none while a worker is between roles or starting, and none within
  `cooldown_s` of the last;
- at least one worker per pool (the prefill pool: none, mixed), never more workers than the
  budget;
- every decision carries its reason, and `code`, the reason's kind (a metric label).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from workers.cost_model import BatchShape
from workers.names import DECODE, PREFILL

# Actions: move workers between the pools (they drain, flip, rejoin), or grow or shrink a pool.
NONE, TO_PREFILL, TO_DECODE, ADD_PREFILL, ADD_DECODE, REMOVE_PREFILL, REMOVE_DECODE = (
    "none", "to_prefill", "to_decode", "add_prefill", "add_decode", "remove_prefill", "remove_decode")
# What each action does to the pools' sizes, per worker: (prefill, decode).
SIZE_CHANGE = {TO_PREFILL: (1, -1), TO_DECODE: (-1, 1), ADD_PREFILL: (1, 0), ADD_DECODE: (0, 1),
               REMOVE_PREFILL: (-1, 0), REMOVE_DECODE: (0, -1), NONE: (0, 0)}
# Decision.code: every value decide() gives.
CODES = ("changing_roles", "cooldown", "over_budget", "both_short", "prefill_short_load", "prefill_short_slo",
         "decode_short_load", "decode_short_slo", "no_undo", "no_spare", "forecast_floor", "shrink",
         "slo_not_capacity", "balanced", "mixed", "split_tpot", "split_slo", "mixed_short", "rising")
POOLS = (PREFILL, DECODE)
COOLDOWN_S = 30.0       # the default: no change within this long of the last one
SHRINK_HOLD_S = 300.0   # the default: no pool shrinks within this long of its growth
BACKLOG_S = 30.0
MIXED_BELOW = 0.8       # after a split, the mixed move waits for this share of the demand it split at
MIN_JUDGED = 20         # finished requests an attainment needs to count
QUANTILES = tuple((i + 0.5) / 20 for i in range(20))   # the prompt lengths a capacity is priced at


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    max_workers: int                      # the budget: prefill + decode workers, never above
    cooldown_s: float = COOLDOWN_S        # no change within this long of the last one
    grow_at: float = 1.0                  # a pool is short when its demand exceeds this share of its capacity
    shrink_below: float = 0.8             # workers leave a pool only if the rest stay under this share
    prefill_target_load: float = 0.65     # a short pool is sized to its target, and a donor gives
    decode_target_load: float = 0.75      # only what keeps it at or under its own
    min_attainment: float = 0.9           # below this (TTFT or TPOT), the pool behind it is short ...
    slo_load_floor: float = 0.9           # ... if its load is at least this share of its target,
    slo_backlog_share: float = 0.2        # its backlog at most this share of its need,
    slo_hold_s: float = 30.0              # and the last change this old (the pools settled)
    backlog_s: float = BACKLOG_S          # a backlog is work to clear within this long
    min_workers: int | None = None        # elastic: the total shrinks to no fewer (None: it never shrinks)
    shrink_hold_s: float = SHRINK_HOLD_S  # elastic: no pool shrinks within this long of its growth
    elastic_grow_at: float = 0.85         # elastic, below the budget: a pool is short past this load
    mixed: bool = False                   # the controller may run with no prefill pool (the mixed role)
    mixed_ok: float = 0.7                 # mixed pays while the TPOT predicted for it is at most this share of
    split_at: float = 1.0                 # the target; mixed, past this share the pools split again

    def __post_init__(self):
        if self.max_workers < 2:
            raise ValueError(f"the worker budget must be at least 2 (one per pool), got {self.max_workers}")
        if not max(self.prefill_target_load, self.decode_target_load) < self.elastic_grow_at <= self.grow_at:
            raise ValueError(f"elastic_grow_at must be above both target loads and at most grow_at, "
                             f"got {self.elastic_grow_at}")
        if self.min_workers is not None and not 2 <= self.min_workers <= self.max_workers:
            raise ValueError(f"min_workers must be within 2..max_workers ({self.max_workers}), got {self.min_workers}")
        if not 0 < self.mixed_ok < self.split_at:
            raise ValueError(f"the mixed role needs 0 < mixed_ok < split_at (hysteresis), got "
                             f"{self.mixed_ok}, {self.split_at}")
        if self.cooldown_s < 0 or self.slo_hold_s < 0 or self.backlog_s <= 0:
            raise ValueError("cooldown_s and slo_hold_s must be >= 0, backlog_s > 0")
        for t in (self.prefill_target_load, self.decode_target_load):
            if not 0 < t <= self.shrink_below < self.grow_at:
                raise ValueError("the controller needs 0 < target load <= shrink_below < grow_at (hysteresis), "
                                 f"got {t}, {self.shrink_below}, {self.grow_at}")

    @classmethod
    def sized(cls, max_workers: int, cooldown_s: float = COOLDOWN_S, min_workers: int | None = None,
              shrink_hold_s: float = SHRINK_HOLD_S, mixed: bool = False) -> ControllerConfig:
        """The defaults for a budget, and, elastic (`min_workers` given), targets nearer capacity:
        there the forecast's floor (bursts at full load) and the recent peak a shrink keeps hold
        the headroom that a fixed size's targets must (measured: BENCHMARKS.md, the controller
        against Dynamo's planner)."""
        if min_workers is None:
            return cls(max_workers, cooldown_s, mixed=mixed)
        return cls(max_workers, cooldown_s, prefill_target_load=0.8, decode_target_load=0.85, shrink_below=0.9,
                   min_workers=min_workers, shrink_hold_s=shrink_hold_s, elastic_grow_at=0.9, mixed=mixed)

    def target(self, pool: str) -> float:
        return self.prefill_target_load if pool == PREFILL else self.decode_target_load


@dataclass(frozen=True, slots=True)
class Signals:
    """What the cluster measured over the last window."""
    now: float
    num_prefill: int
    num_decode: int
    arrival_rate: float                   # requests/s
    mean_prompt_tokens: float             # uncached prompt tokens per request
    mean_output_tokens: float             # expected: max_tokens asked x the share of it replies use
    prefill_tokens_per_s: float           # one prefill worker's capacity (measured or predicted)
    decode_tokens_per_s: float            # one decode worker's capacity at the TPOT target
    queued_prefill_tokens: int = 0        # waiting now, over the prefill pool
    ttft_attainment: float = math.nan     # share of the judged requests within the TTFT target
    tpot_attainment: float = math.nan     # (judged: sent since the pools last changed; nan: too few)
    draining: int = 0                     # workers between roles now
    waiting_handoffs: int = 0             # prefilled requests waiting for room on a decode worker now
    decode_kv_usage: float = 0.0          # share of the decode pool's KV blocks in use now
    floor_prefill: int = 0                # the forecast's floor under each pool (cluster/run/forecast.py)
    floor_decode: int = 0
    keep_prefill: int = 0                 # the fewest a shrink leaves each pool: the forecast's floor over
    keep_decode: int = 0                  # the next minutes (a shrink undone soon after costs a start-up)
    prefill_grew_at: float = -math.inf    # when each pool last grew (workers added or moved in)
    decode_grew_at: float = -math.inf
    prefill_shrank_at: float = -math.inf  # when each pool last shrank (workers removed or moved out)
    decode_shrank_at: float = -math.inf
    long_prompt_tokens: float = 0.0       # the 90th percentile of the window's prompt tokens
    short_output_tokens: float = 0.0      # the 10th percentile of the window's expected output (0: the mean)
    decode_context: float = 0.0           # a decode step's mean context (`Observed`; 0: prompt + output / 2)
    mixed_tpot: float = math.inf          # the TPOT predicted on mixed workers over the target (`mixed_tpot`;
                                          # inf: not priced, the mixed role never pays)
    split_need: float = math.inf          # the arrivals' whole need (workers' worth, no backlog) when mixed
                                          # workers last split (`steady_need`)
    rising: bool = False                  # arrivals rise over the last minutes (cluster/run/forecast.py LongScale.rising)


@dataclass(frozen=True, slots=True)
class Decision:
    action: str
    reason: str
    prefill_load: float = 0.0             # demand / capacity of each pool as it stands
    decode_load: float = 0.0
    count: int = 1                        # workers moved, added or removed (0 with NONE)
    code: str = ""                        # the reason's kind, a metric label (one of CODES)


def window_start(prompts, outputs, now: float, interval_s: float, window_s: float, since: float = -math.inf,
                 factor: float = 1.5, min_samples: int = 20) -> float:
    """Where the window of signals starts: `window_s` back, but not before `since` (the last
    shift the caller saw), and at the last interval when the load just shifted: when the mean
    of `prompts` or of `outputs` (each an iterable of (time, tokens) at arrival) over the last
    `interval_s` differs from the rest of the window by more than `factor` either way (each side
    with `min_samples`). The window's older part would hold the old phase against the new one."""
    start, recent = max(now - window_s, since), now - interval_s
    if recent <= start:
        return start
    for rows in (prompts, outputs):
        a, b = [], []
        for t, x in rows:
            if t >= recent:
                b.append(x)
            elif t >= start:
                a.append(x)
        if len(a) >= min_samples and len(b) >= min_samples:
            ma, mb = sum(a) / len(a), sum(b) / len(b)
            if ma > 0 and mb > 0 and not 1 / factor <= mb / ma <= factor:
                return recent
    return start


@dataclass(frozen=True, slots=True)
class Observed:
    """The request side of the signals, over the window."""
    start: float                          # where the window starts
    shifted: bool                         # it starts at the last interval: the load just shifted
    arrival_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_attainment: float
    tpot_attainment: float
    long_prompt_tokens: float = 0.0       # the 90th percentile of the window's prompt tokens
    prompt_quantiles: tuple = ()          # the window's prompt tokens at QUANTILES (prefill_rate prices them)
    short_output_tokens: float = 0.0      # the 10th percentile of the output expected (asked x the share used)
    decode_context: float = 0.0           # a decode step's mean context (`decode_context`; 0: no arrivals)


def decode_context(rows, used: float) -> float:
    """The mean context of the sequences a decode step carries, from arrivals' (prompt tokens,
    max_tokens asked) `rows`, each reply expected at `used` of what it asks: a request decodes
    for as many steps as its reply has tokens, so a step holds each request in proportion to its
    reply, at its prompt and half its reply on average. Output-weighted: sum(p*o + o*o/2) /
    sum(o) (the mean prompt plus half the mean reply when every reply is as long; more when
    replies vary, since the long ones are most of what is decoding: with half the replies at 10
    tokens and half at 1,000 after 100-token prompts, 595 tokens against the means' 353). 0
    without rows."""
    weight = weighted = 0.0
    for prompt, asked in rows:
        o = used * asked
        weight += o
        weighted += o * (prompt + o / 2)
    return weighted / weight if weight > 0 else 0.0


def observe(log, now: float, interval_s: float, window_s: float, since: float = -math.inf,
            settled: float = -math.inf, min_judged: int = MIN_JUDGED) -> Observed:
    """What the recent requests say (`log`: a router.slo.RequestLog, the serving router's or the
    simulator's; the same reading for both), over the window that `window_start` gives.

    Output lengths are what the arrivals ask for (max_tokens), times the share of it that the
    replies finished lately used: waiting for the new requests' replies would lag a shift by a
    reply's length, and a pool sized on the old phase's replies meanwhile is what a shift must
    not do. Attainment judges the pools as they are: requests sent since `settled` (the last
    change took effect) that finished within the window, and at least `min_judged` of them, else
    NaN (a backlog left by the split before would blame the new one)."""
    arrivals = log.arrivals
    start = window_start(((a[0], a[1]) for a in arrivals), ((a[0], a[2]) for a in arrivals), now, interval_s,
                         window_s, since)
    recent = [a for a in arrivals if a[0] >= start]
    n = len(recent)
    finished = [f for f in log.finishes if f[0] >= now - window_s]
    lately = [f for f in finished if f[0] >= start] or finished
    asked = sum(f[3] for f in lately)
    used = sum(f[2] for f in lately) / asked if asked else 1.0
    judged = [f for f in finished if f[1] >= settled]
    k = len(judged) if len(judged) >= min_judged else 0
    prompts = sorted(a[1] for a in recent)
    return Observed(start=start, shifted=start == now - interval_s, arrival_rate=n / max(1e-9, now - start),
                    mean_prompt_tokens=sum(prompts) / n if n else 0.0,
                    long_prompt_tokens=prompts[min(n - 1, int(0.9 * n))] if n else 0.0,
                    prompt_quantiles=tuple(prompts[int(q * n)] for q in QUANTILES) if n else (),
                    mean_output_tokens=used * sum(a[2] for a in recent) / n if n else 0.0,
                    short_output_tokens=used * sorted(a[2] for a in recent)[int(0.1 * n)] if n else 0.0,
                    decode_context=decode_context(((a[1], a[2]) for a in recent), used),
                    ttft_attainment=sum(f[4] for f in judged) / k if k else math.nan,
                    tpot_attainment=sum(f[5] for f in judged) / k if k else math.nan)


def prefill_rate(cost, quantiles, mean_prompt: float, budget: int) -> float:
    """One worker's prompt tokens per second over the window's prompt lengths rather than at
    their mean: each length at its own pace (steps full of it, `budget` tokens a step; a long
    prompt's attention grows with its square, a short one shares a step's fixed cost with
    fewer tokens), so the capacity is the tokens over the time of the lengths as they come:
    sum(n) / sum(n / rate(n)) over `quantiles` (equally likely lengths; `Observed`), or the
    mean's rate without them. `cost`: workers/cost_model.py CostModel."""
    qs = [max(1, round(n)) for n in quantiles]
    if not qs:
        return cost.prefill_tokens_per_s(mean_prompt or 1, budget)
    return sum(qs) / sum(n / cost.prefill_tokens_per_s(n, budget) for n in qs)


def mixed_size(s: Signals, cfg: ControllerConfig) -> int:
    """The workers the mixed TPOT is priced on: the cluster's, or, where the whole load asks for
    more, as many as carry it at the decode target (within the budget). A pool short of workers
    predicts a TPOT past the target by its load alone, which more mixed workers mend (it grows,
    `mixed_short`) and a split does not: only a TPOT past it at the size it would grow to splits.
    Priced at the workers there are, the conversation trace's rise split the mixed pool at 1.05
    of the target (BENCHMARKS.md, the mixed role)."""
    total = s.num_prefill + s.num_decode
    wanted_now = math.ceil(sum(needs(s, cfg.backlog_s)) / cfg.decode_target_load - 1e-9)
    return max(total, min(wanted_now, cfg.max_workers))


def with_mixed_tpot(cost, s: Signals, cfg: ControllerConfig, tpot_s: float, budget: int) -> Signals:
    """`s` with its mixed TPOT priced (`mixed_tpot` at `mixed_size`): the last signal serve's
    loop and the simulator read, from the others."""
    return dataclasses.replace(s, mixed_tpot=mixed_tpot(cost, s, tpot_s, budget, mixed_size(s, cfg)))


def mixed_tpot(cost, s: Signals, tpot_s: float, budget: int, workers: int = 0) -> float:
    """The TPOT a request would see on mixed workers, over the target: the decode step of a
    mixed worker's batch, stretched by the share of its time its prompts take (the whole load
    spread over `workers`, 0: all the cluster's; `mixed_size`), plus one long prompt's stall spread over a reply
    (what the 90th-percentile prompt's chunks, of at most the scheduler's `budget` tokens, add
    to the steps they ride in, over a short reply's tokens after the first: the 10th
    percentile, since attainment is judged request by request and a short reply meets a long
    prompt's steps with few tokens to spread them over). The batch: each worker's
    arrivals running for their output at the target pace (Little's law), at the window's decode
    context (`decode_context`); the prompts priced at `s.prefill_tokens_per_s`
    (the window's lengths, `prefill_rate`). Infinite when the prompts alone take every worker's
    time. `cost`: workers/cost_model.py CostModel."""
    workers = max(1, workers or s.num_prefill + s.num_decode)
    share = s.arrival_rate * s.mean_prompt_tokens / max(1e-9, s.prefill_tokens_per_s) / workers
    if share >= 1:
        return math.inf
    rows = max(1, math.ceil(s.arrival_rate / workers * s.mean_output_tokens * tpot_s))
    ctx = max(1, round(s.decode_context or s.mean_prompt_tokens + s.mean_output_tokens / 2))
    decode = BatchShape(num_decode=rows, decode_context=rows * ctx)
    n = max(1, round(s.long_prompt_tokens or s.mean_prompt_tokens))
    step, stall = cost.step_s(decode), 0.0
    for done in range(0, n, budget):
        k = min(budget, n - done)
        stall += cost.step_s(decode + BatchShape(1, k, k * k, k * done)) - step
    return (step / (1 - share) + stall / max(1.0, (s.short_output_tokens or s.mean_output_tokens) - 1)) / tpot_s


def steady_need(s: Signals, backlog_s: float = BACKLOG_S) -> float:
    """Both pools' need from the arrivals alone (workers' worth, `needs` less the backlogs): what
    the mixed move compares with the demand mixed workers last split at (a backlog left by
    mixed workers falling behind clears after the split, and must not make the demand look
    lower then)."""
    return sum(needs(s, backlog_s)) - sum(backlog_needs(s, backlog_s))


def backlog_needs(s: Signals, backlog_s: float = BACKLOG_S) -> tuple[float, float]:
    """(prefill, decode) backlog in workers' worth: work to clear within `backlog_s`."""
    return (s.queued_prefill_tokens / backlog_s / max(1e-9, s.prefill_tokens_per_s),
            s.waiting_handoffs * s.mean_output_tokens / backlog_s / max(1e-9, s.decode_tokens_per_s))


def needs(s: Signals, backlog_s: float = BACKLOG_S) -> tuple[float, float]:
    """(prefill, decode) demand in workers' worth: what each pool must clear per second over one
    worker's capacity, arrivals and backlog; decode's at least the KV its sequences hold."""
    bp, bd = backlog_needs(s, backlog_s)
    decode = max(s.arrival_rate * s.mean_output_tokens / max(1e-9, s.decode_tokens_per_s),
                 s.decode_kv_usage * s.num_decode)
    return s.arrival_rate * s.mean_prompt_tokens / max(1e-9, s.prefill_tokens_per_s) + bp, decode + bd


def loads(s: Signals, backlog_s: float = BACKLOG_S) -> tuple[float, float]:
    """(prefill, decode) demand over each pool's capacity."""
    p, d = needs(s, backlog_s)
    return p / max(1, s.num_prefill), d / max(1, s.num_decode)


def with_peaks(s: Signals, peaks: PeakNeeds, cfg: ControllerConfig) -> Signals:
    """`s` with what a shrink keeps raised to carry the recent peak needs (after adding `s`'s)."""
    peaks.add(s, cfg.backlog_s)
    p, d = peaks.keep(cfg)
    return dataclasses.replace(s, keep_prefill=max(s.keep_prefill, p), keep_decode=max(s.keep_decode, d))


class PeakNeeds:
    """Each pool's highest need (workers' worth, `needs`) over the last `span_s` (serve's loop and
    the simulator's: the shrink hold, 5 minutes by default): a shrink keeps
    enough workers to carry it at the pool's target, so that a load that dipped for a window or
    two does not take workers the next burst needs back (a change undone costs a start-up)."""

    def __init__(self, span_s: float = 300.0):
        self.span_s = span_s
        self.rows: deque = deque()                  # (time, prefill need, decode need)

    def add(self, s: Signals, backlog_s: float = BACKLOG_S) -> None:
        self.rows.append((s.now, *needs(s, backlog_s)))
        while self.rows and self.rows[0][0] < s.now - self.span_s:
            self.rows.popleft()

    def keep(self, cfg: ControllerConfig) -> tuple[int, int]:
        if not self.rows:
            return 0, 0
        p = max(r[1] for r in self.rows)
        d = max(r[2] for r in self.rows)
        return math.ceil(p / cfg.prefill_target_load - 1e-9), math.ceil(d / cfg.decode_target_load - 1e-9)


def _decide_mixed(s: Signals, cfg: ControllerConfig, last_change_at: float, need: dict,
                  grow_at: float) -> Decision:
    """decide() with no prefill pool: the decode workers serve whole requests, one pool carrying
    both needs at the decode pool's target. It splits again when long prompts stall its steps
    or attainment falls short under load; else it is sized as one pool (see the module's rules)."""
    n, total = s.num_decode, s.num_prefill + s.num_decode
    whole = need[PREFILL] + need[DECODE]
    load = whole / max(1, n)
    target = cfg.decode_target_load
    atts = {"TTFT": s.ttft_attainment, "TPOT": s.tpot_attainment}
    short_att = [f"{k} attainment {v:.2f}" for k, v in atts.items() if v < cfg.min_attainment]
    txt = f"mixed load {load:.2f} on {n}"

    def done(action: str, code: str, reason: str, count: int = 0) -> Decision:
        return Decision(action, reason, need[PREFILL] / max(1, n), need[DECODE] / max(1, n), count, code)
    split = None
    if s.mixed_tpot > cfg.split_at:
        split = ("split_tpot", f"the TPOT predicted mixed is {s.mixed_tpot:.2f} of the target (prompts "
                               f"{s.mean_prompt_tokens:.0f} tokens on average, {s.long_prompt_tokens:.0f} at the 90th "
                               f"percentile)")
    elif (short_att and load >= cfg.slo_load_floor * target and s.now - last_change_at >= cfg.slo_hold_s):
        split = ("split_slo", f"{', '.join(short_att)} at {txt}")
    if split is not None and n >= 2:
        k = min(n - 1, max(1, math.ceil(need[PREFILL] / cfg.prefill_target_load - 1e-9)))
        return done(TO_PREFILL, split[0], f"{split[1]}: {k} of {n} mixed workers to prefill (split again)", k)
    if total > cfg.max_workers:
        k = givable(cfg, DECODE, whole, n, total - cfg.max_workers)
        if not k:
            return done(NONE, "over_budget", f"over the budget by {total - cfg.max_workers}, nothing to spare ({txt})")
        return done(REMOVE_DECODE, "over_budget", f"over the budget: {k} leave ({txt})", k)
    if load > (cfg.grow_at if s.now - s.decode_shrank_at < cfg.shrink_hold_s else grow_at):   # as decide()'s
        if total < cfg.max_workers:
            k = min(wanted(whole, n, target) - n, cfg.max_workers - total)
            return done(ADD_DECODE, "mixed_short", f"mixed workers short ({txt}): {k} more toward load {target:.2f}", k)
        return done(NONE, "mixed_short", f"mixed workers short ({txt}), at the budget")
    if cfg.min_workers is not None:
        floor = s.floor_prefill + s.floor_decode
        recent = s.now - max(s.prefill_shrank_at, s.decode_shrank_at) < cfg.shrink_hold_s
        if n < floor and total < cfg.max_workers and (not recent or load >= target):
            k = min(floor - n, cfg.max_workers - total)
            return done(ADD_DECODE, "forecast_floor", f"below the forecast's floor ({n} < {floor}): {k} more ({txt})", k)
        if total > cfg.min_workers and s.now - max(s.decode_grew_at, s.prefill_grew_at) >= cfg.shrink_hold_s:
            room = min(total - cfg.min_workers, n - max(1, floor, s.keep_prefill + s.keep_decode), max(1, n // 4))
            k = givable(cfg, DECODE, whole, n, room) if room > 0 else 0
            if k and s.rising:
                return done(NONE, "rising", f"mixed workers could spare {k}, but the arrivals rise ({txt})")
            if k:
                return done(REMOVE_DECODE, "shrink", f"mixed workers need fewer: {k} leave (load {load:.2f} -> "
                                                     f"{whole / (n - k):.2f})", k)
    if short_att:
        return done(NONE, "slo_not_capacity", f"{', '.join(short_att)} at {txt}: not acted on")
    return done(NONE, "balanced", f"mixed, balanced ({txt})")


def wanted(need: float, size: int, target: float) -> int:
    """The size of a short pool: its load at `target`, and at least one worker more."""
    return max(size + 1, math.ceil(need / target - 1e-9))


def givable(cfg: ControllerConfig, donor: str, need_o: float, n_o: int, up_to: int,
            to: tuple[str, float, int] | None = None) -> int:
    """Workers (at most `up_to`) the `donor` pool can give: one always stays, the rest stay under
    `shrink_below`, and at or under the donor's target, or (given `to`, the receiver's pool,
    steady need and size) no further past it than the receiver would be past its own."""
    k = 0
    while k < up_to and n_o - (k + 1) >= 1:
        after = need_o / (n_o - (k + 1))
        if after >= cfg.shrink_below:
            break
        if after > cfg.target(donor):
            if to is None:
                break
            pool, need_r, n_r = to
            if after / cfg.target(donor) > need_r / (n_r + k + 1) / cfg.target(pool):
                break
        k += 1
    return k


def decide(s: Signals, cfg: ControllerConfig, last_change_at: float = -math.inf,
           last: Decision | None = None) -> Decision:
    """The one change to make now (of `count` workers), with its reason. `last_change_at` and
    `last`: when the last change (not NONE) was decided, and the decision."""
    n = dict(zip(POOLS, (s.num_prefill, s.num_decode)))
    need = dict(zip(POOLS, needs(s, cfg.backlog_s)))
    backlog = dict(zip(POOLS, backlog_needs(s, cfg.backlog_s)))
    steady = {k: need[k] - backlog[k] for k in POOLS}      # what the arrivals alone need
    load = {k: need[k] / max(1, n[k]) for k in POOLS}
    slo = {PREFILL: ("TTFT", s.ttft_attainment), DECODE: ("TPOT", s.tpot_attainment)}
    loads_txt = f"loads {load['prefill']:.2f} / {load['decode']:.2f}"

    def done(action: str, code: str, reason: str, count: int = 0) -> Decision:
        return Decision(action, reason, load[PREFILL], load[DECODE], count, code)
    if s.draining:
        return done(NONE, "changing_roles", f"{s.draining} worker(s) changing roles")
    if s.now - last_change_at < cfg.cooldown_s:
        return done(NONE, "cooldown", "cooldown")
    total = s.num_prefill + s.num_decode
    # Elastic, with room to grow: a worker more costs only its GPU-time, and it serves only after
    # its start-up, so a pool grows before its load reaches its capacity.
    grow_at = cfg.elastic_grow_at if cfg.min_workers is not None and total < cfg.max_workers else cfg.grow_at
    if s.num_prefill == 0:
        return _decide_mixed(s, cfg, last_change_at, need, grow_at)

    shrank_at = {PREFILL: s.prefill_shrank_at, DECODE: s.decode_shrank_at}

    def why_short(pool: str) -> tuple[str, str] | None:
        """(code, reason) when `pool` is short, else None. A pool that shrank within the shrink
        hold is short only past `grow_at` (its capacity, by default), not the elastic headroom:
        what it gave back, a burst under its capacity does not take again (a worker that starts
        minutes later serves the burst's queue, not the burst)."""
        name, att = slo[pool]
        if load[pool] > (cfg.grow_at if s.now - shrank_at[pool] < cfg.shrink_hold_s else grow_at):
            return f"{pool}_short_load", f"{pool} short (load {load[pool]:.2f})"
        if (att < cfg.min_attainment and load[pool] >= cfg.slo_load_floor * cfg.target(pool)
                and s.now - last_change_at >= cfg.slo_hold_s and backlog[pool] <= cfg.slo_backlog_share * need[pool]):
            return f"{pool}_short_slo", f"{pool} short ({name} attainment {att:.2f} at load {load[pool]:.2f})"
        return None
    short = {pool: why_short(pool) for pool in POOLS}

    if total > cfg.max_workers:                   # the budget went down: shed what the pools can spare
        over = total - cfg.max_workers
        free = {pool: 0 if short[pool] else givable(cfg, pool, need[pool], n[pool], over) for pool in POOLS}
        pool = max(POOLS, key=lambda k: (free[k], -load[k]))
        if not free[pool]:
            return done(NONE, "over_budget", f"over the budget by {over}, nothing to spare ({loads_txt})")
        return done(REMOVE_PREFILL if pool == PREFILL else REMOVE_DECODE, "over_budget",
                    f"over the budget by {over}: {free[pool]} from {pool} ({loads_txt})", free[pool])

    if short[PREFILL] and short[DECODE]:
        if total < cfg.max_workers:
            pool = max(POOLS, key=lambda k: load[k] / cfg.target(k))
            k = min(wanted(need[pool], n[pool], cfg.target(pool)) - n[pool], cfg.max_workers - total)
            return done(ADD_PREFILL if pool == PREFILL else ADD_DECODE, "both_short",
                        f"both pools short ({loads_txt}): {k} more {pool}", k)
        return done(NONE, "both_short", f"both pools short ({loads_txt}), at the budget")

    for pool, other, add, move in ((PREFILL, DECODE, ADD_PREFILL, TO_PREFILL),
                                   (DECODE, PREFILL, ADD_DECODE, TO_DECODE)):
        if not short[pool]:
            continue
        code, why = short[pool]
        want = wanted(need[pool], n[pool], cfg.target(pool)) - n[pool]
        if total < cfg.max_workers:
            k = min(want, cfg.max_workers - total)
            return done(add, code, f"{why}: {k} more toward load {cfg.target(pool):.2f}", k)
        if (code.endswith("_slo") and last is not None and last.code.endswith("_slo")
                and last.action == (TO_DECODE if move == TO_PREFILL else TO_PREFILL)):
            return done(NONE, "no_undo", f"{why}, but the last change, for attainment too, moved workers the "
                                         "other way: only a load above capacity moves them back")
        k = givable(cfg, other, need[other], n[other], want, (pool, steady[pool], n[pool]))
        if not k:
            return done(NONE, "no_spare", f"{why}, but {other} cannot spare a worker (load {load[other]:.2f}) "
                                          "within the budget")
        return done(move, code, f"{why}: {k} from {other} (load {load[other]:.2f} -> "
                                f"{need[other] / (n[other] - k):.2f}, {pool} -> {need[pool] / (n[pool] + k):.2f})", k)

    if cfg.mixed:
        whole = (need[PREFILL] + need[DECODE]) / total
        # not while demand rises (the last change grew the prefill pool within the shrink hold, or
        # the forecast wants it larger): a rise would split it again within minutes, each time
        # draining the workers it moves
        # and, once mixed workers had to split, only under a fifth less demand than they split at
        rising = ((last is not None and SIZE_CHANGE[last.action][0] > 0 and s.now - last_change_at < cfg.shrink_hold_s)
                  or s.floor_prefill > s.num_prefill or steady[PREFILL] + steady[DECODE] >= MIXED_BELOW * s.split_need)
        if (s.mixed_tpot <= cfg.mixed_ok and whole <= cfg.decode_target_load and not rising
                and not any(att < cfg.min_attainment for _, att in slo.values())):
            return done(TO_DECODE, "mixed", f"splitting does not pay: the whole load on {total} mixed workers "
                                            f"is {whole:.2f} of them, the TPOT predicted for them "
                                            f"{s.mixed_tpot:.2f} of the target; {s.num_prefill} prefill "
                                            f"worker(s) to decode, which serve requests whole ({loads_txt})",
                        s.num_prefill)

    # Elastic size: the forecast's floor ahead of demand, then what demand no longer needs.
    if cfg.min_workers is not None:
        floor = {PREFILL: s.floor_prefill, DECODE: s.floor_decode}
        shrank = {PREFILL: s.prefill_shrank_at, DECODE: s.decode_shrank_at}
        # A pool that shrank lately under its target is falling demand's: the floor (recomputed
        # each long interval) does not undo that shrink; only a load past grow_at does.
        under = [pool for pool in POOLS if n[pool] < floor[pool]
                 and (s.now - shrank[pool] >= cfg.shrink_hold_s or load[pool] >= cfg.target(pool))]
        if under and total < cfg.max_workers:
            pool = max(under, key=lambda k: floor[k] - n[k])
            k = min(floor[pool] - n[pool], cfg.max_workers - total)
            return done(ADD_PREFILL if pool == PREFILL else ADD_DECODE, "forecast_floor",
                        f"{pool} below the forecast's floor ({n[pool]} < {floor[pool]}): {k} more ({loads_txt})", k)
        grew = {PREFILL: s.prefill_grew_at, DECODE: s.decode_grew_at}
        keep = {PREFILL: s.keep_prefill, DECODE: s.keep_decode}
        if total > cfg.min_workers:
            for pool in sorted(POOLS, key=lambda k: load[k] / cfg.target(k)):
                if s.now - grew[pool] < cfg.shrink_hold_s:
                    continue                      # a pool that grew lately keeps what it got
                # gradual (a quarter of the pool at most), and never below what the next minutes need
                room = min(total - cfg.min_workers, n[pool] - max(1, floor[pool], keep[pool]),
                           max(1, n[pool] // 4))
                k = givable(cfg, pool, need[pool], n[pool], room) if room > 0 else 0
                if k and s.rising:
                    return done(NONE, "rising", f"{pool} could spare {k}, but the arrivals rise ({loads_txt})")
                if k:
                    return done(REMOVE_PREFILL if pool == PREFILL else REMOVE_DECODE, "shrink",
                                f"{pool} needs fewer: {k} leave (load {load[pool]:.2f} -> "
                                f"{need[pool] / (n[pool] - k):.2f}; {loads_txt})", k)

    # Nothing short. An SLO missed at a low load, or with a backlog, is reported, not acted on.
    for pool in POOLS:
        name, att = slo[pool]
        if att < cfg.min_attainment:
            return done(NONE, "slo_not_capacity", f"{name} attainment {att:.2f} at {pool} load {load[pool]:.2f} "
                                                  f"(backlog {backlog[pool]:.2f} of {need[pool]:.2f}): not acted on "
                                                  f"({loads_txt})")
    return done(NONE, "balanced", f"balanced ({loads_txt})")
