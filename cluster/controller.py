"""The pool-ratio controller's policy: a plain function from what the cluster measured to one
action (plain Python, no Ray, no torch: the serving loop and `pdcluster simulate` run it alike).

Like Dynamo's planner it sizes each pool from demand over capacity:

    prefill workers needed = arrival rate x prompt tokens / prefill tokens per second per worker
    decode workers needed  = arrival rate x output tokens / decode tokens per second per worker
                             (the decode capacity at the TPOT target)

and corrects both by what it sees (queued prefill work, SLO attainment). Unlike it, the policy
does not chase every estimate (its users report oscillation, scale-downs that break the SLO and
rebalances over the GPU budget):

- one change per decision, and none within `cooldown_s` of the last;
- hysteresis: a pool is short only when it needs more than `grow_at` of its size, and a worker
  may leave a pool only when the rest would run below `shrink_below` of theirs (the survivors'
  predicted load stays under 80 % by default);
- at least one worker per pool, never more workers than the budget;
- every action carries its reason (logged and counted by the caller).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Actions: move one worker between the pools (it drains, flips, rejoins), or grow or shrink a pool.
NONE, TO_PREFILL, TO_DECODE, ADD_PREFILL, ADD_DECODE, REMOVE_PREFILL, REMOVE_DECODE = (
    "none", "to_prefill", "to_decode", "add_prefill", "add_decode", "remove_prefill", "remove_decode")


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    max_workers: int                      # the budget: prefill + decode workers, never above
    cooldown_s: float = 30.0              # no change within this long of the last one
    grow_at: float = 1.0                  # a pool is short when demand exceeds this share of its capacity
    shrink_below: float = 0.8             # a worker may leave if the rest stay under this share
    min_attainment: float = 0.9           # below this (TTFT or TPOT), the pool behind it is short


@dataclass(frozen=True, slots=True)
class Signals:
    """What the cluster measured over the last window."""
    now: float
    num_prefill: int
    num_decode: int
    arrival_rate: float                   # requests/s
    mean_prompt_tokens: float             # uncached prompt tokens per request
    mean_output_tokens: float
    prefill_tokens_per_s: float           # one prefill worker's capacity (measured or predicted)
    decode_tokens_per_s: float            # one decode worker's capacity at the TPOT target
    queued_prefill_tokens: int = 0        # waiting now, over the prefill pool
    ttft_attainment: float = math.nan     # share of the window's requests within the TTFT target
    tpot_attainment: float = math.nan
    draining: int = 0                     # workers between roles now


@dataclass(frozen=True, slots=True)
class Decision:
    action: str
    reason: str
    prefill_load: float = 0.0             # demand / capacity of each pool as it stands
    decode_load: float = 0.0


def loads(s: Signals) -> tuple[float, float]:
    """(prefill, decode) demand over the pool's capacity; the prefill side counts its backlog as
    work to clear within one second on top of the arrivals."""
    prefill_demand = s.arrival_rate * s.mean_prompt_tokens + s.queued_prefill_tokens
    decode_demand = s.arrival_rate * s.mean_output_tokens
    p = prefill_demand / max(1e-9, s.num_prefill * s.prefill_tokens_per_s)
    d = decode_demand / max(1e-9, s.num_decode * s.decode_tokens_per_s)
    return p, d


def decide(s: Signals, cfg: ControllerConfig, last_change_at: float = -math.inf) -> Decision:
    """The one action to take now, with its reason."""
    p, d = loads(s)

    def done(action: str, reason: str) -> Decision:
        return Decision(action, reason, p, d)
    if s.draining:
        return done(NONE, "a worker is changing roles")
    if s.now - last_change_at < cfg.cooldown_s:
        return done(NONE, "cooldown")
    total = s.num_prefill + s.num_decode
    # A pool is short when its demand exceeds its capacity, or when its SLO is being missed.
    p_short = p > cfg.grow_at or s.ttft_attainment < cfg.min_attainment
    d_short = d > cfg.grow_at or s.tpot_attainment < cfg.min_attainment
    # A pool can spare a worker when the others would stay under shrink_below of their capacity.
    p_spare = s.num_prefill > 1 and p * s.num_prefill / (s.num_prefill - 1) < cfg.shrink_below
    d_spare = s.num_decode > 1 and d * s.num_decode / (s.num_decode - 1) < cfg.shrink_below
    for short, other_short, name, other, load, other_load, attainment, spare, add, move in (
            (p_short, d_short, "prefill", "decode", p, d, f"TTFT attainment {s.ttft_attainment:.2f}", d_spare,
             ADD_PREFILL, TO_PREFILL),
            (d_short, p_short, "decode", "prefill", d, p, f"TPOT attainment {s.tpot_attainment:.2f}", p_spare,
             ADD_DECODE, TO_DECODE)):
        if short and not other_short:
            if total < cfg.max_workers:
                return done(add, f"{name} short (load {load:.2f}, {attainment})")
            if spare:
                return done(move, f"{name} short (load {load:.2f}), {other} can spare one (load {other_load:.2f})")
            return done(NONE, f"{name} short, but no worker to spare within the budget")
    if p_short and d_short:
        if total < cfg.max_workers:
            return done(ADD_PREFILL if p >= d else ADD_DECODE, f"both short (loads {p:.2f} / {d:.2f})")
        return done(NONE, "both pools short: at the budget")
    if total > cfg.max_workers:
        return done(REMOVE_PREFILL if p_spare and (p <= d or not d_spare) else REMOVE_DECODE,
                    "over the budget") if (p_spare or d_spare) else done(NONE, "over the budget, nothing to spare")
    return done(NONE, f"balanced (loads {p:.2f} / {d:.2f})")
