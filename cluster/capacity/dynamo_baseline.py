"""NVIDIA Dynamo's planner as a baseline for pdcluster's controller, written from its published
design (its planner docs and defaults, not its code), in plain Python for the simulator.

Two modes, as Dynamo runs them:

- **The throughput (SLA) planner**, every `interval_s` (180 s by default). Each interval feeds one
  value of the request count, the mean prompt length (ISL) and the mean output length (OSL) to
  a predictor of each (`constant`: the last value; `kalman`: a local linear-trend Kalman filter,
  its one-step-ahead level). Correction factors compare what was observed with the profile:
  p = observed TTFT / the profile's TTFT at the observed ISL, d = observed ITL / the profile's
  ITL at the observed decode concurrency and context. Then

      prefill = ceil(next_requests x next_ISL / interval x min(1, p) / prefill tokens/s per engine at next_ISL)
      decode  = ceil(next_requests x next_OSL / interval / decode tokens/s per engine at context
                     next_ISL + next_OSL / 2 within an ITL of target / d)

  each at least `min_endpoint`; over the GPU budget prefill is scaled down in proportion and
  decode gets what is left. The "profile" here is the simulator's own cost model (what Dynamo's
  profiler would have measured on the same engine), so the planner is priced as exactly as
  pdcluster's controller. A decision made while a change is still under way is dropped, as
  Dynamo drops one while its deployment is not ready.

- **The load-based planner**, every 5 s: per pool, an ordinary least-squares fit over its last
  50 observations (at least 5) of TTFT against a worker's active prefill tokens plus the mean
  ISL (prefill), and of ITL against a worker's KV blocks in use (decode), the latencies as its
  frontend measures them (the requests' own, over the interval) and the loads as the workers
  report them (the pool's mean; Dynamo fits per worker). Each fit, inverted at the SLA,
  gives the load a worker can carry; a pool grows by one when every worker is above it, and
  shrinks by one (when it has more than one) when every worker is below it times (N - 1) / N
  times the scale-down sensitivity (80 %). Disaggregated, a pool grows when its side wants to
  and shrinks only when both sides do.

Everything here is a function of numbers, tested against hand-computed decisions.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

THROUGHPUT, LOAD = "throughput", "load"
PREDICTORS = ("constant", "kalman")


# -- predictors -------------------------------------------------------------------------------------
class ConstantPredictor:
    """The next interval is the last one."""

    def __init__(self):
        self.last: float | None = None

    def add(self, x: float) -> None:
        if self.last is None and not x:
            return                                  # leading zeros are skipped
        self.last = x

    def predict(self) -> float:
        return self.last or 0.0


class KalmanPredictor:
    """A local linear-trend Kalman filter (state: level and trend; level noise `q_level`, trend
    noise `q_trend`, observation noise `r`: Dynamo's defaults 1.0, 0.1 and 10); the prediction
    is the next interval's level, never below 0."""

    def __init__(self, q_level: float = 1.0, q_trend: float = 0.1, r: float = 10.0):
        self.q_level, self.q_trend, self.r = q_level, q_trend, r
        self.x: list[float] | None = None           # [level, trend]
        self.p = [[0.0, 0.0], [0.0, 0.0]]           # its covariance

    def add(self, z: float) -> None:
        if self.x is None:
            if not z:
                return                              # leading zeros are skipped
            self.x, self.p = [z, 0.0], [[self.r, 0.0], [0.0, self.r]]
            return
        (level, trend), ((a, b), (c, d)) = self.x, self.p
        # predict: x = F x, P = F P F' + Q with F = [[1, 1], [0, 1]]
        level, a, b, c = level + trend, a + b + c + d + self.q_level, b + d, c + d
        d += self.q_trend
        # update with z: H = [1, 0]
        s = a + self.r
        k0, k1 = a / s, c / s
        err = z - level
        self.x = [level + k0 * err, trend + k1 * err]
        self.p = [[(1 - k0) * a, (1 - k0) * b], [c - k1 * a, d - k1 * b]]

    def predict(self) -> float:
        if self.x is None:
            return 0.0
        return max(0.0, self.x[0] + self.x[1])


def predictor(name: str):
    if name == "constant":
        return ConstantPredictor()
    if name == "kalman":
        return KalmanPredictor()
    raise ValueError(f"unknown predictor {name!r} (one of {', '.join(PREDICTORS)})")


# -- the throughput planner ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_s: float
    itl_s: float
    max_gpu_budget: int                 # GPUs; -1: none
    interval_s: float = 180.0           # the throughput planner's adjustment interval
    load_interval_s: float = 5.0        # the load-based planner's
    min_endpoint: int = 1               # replicas of each pool at least
    gpus_per_engine: int = 1
    predictor: str = "constant"
    correction: bool = True
    window: int = 50                    # load-based: observations a fit uses ...
    min_observations: int = 5           # ... and needs
    sensitivity: float = 0.8            # load-based: the scale-down sensitivity (80 of 100)

    def __post_init__(self):
        if self.predictor not in PREDICTORS:
            raise ValueError(f"unknown predictor {self.predictor!r} (one of {', '.join(PREDICTORS)})")
        if self.interval_s <= 0 or self.load_interval_s <= 0 or self.min_endpoint < 1 or self.gpus_per_engine < 1:
            raise ValueError("the planner needs positive intervals, min_endpoint >= 1 and gpus_per_engine >= 1")


@dataclass(frozen=True, slots=True)
class Interval:
    """What one adjustment interval observed (interval averages, as Dynamo reads Prometheus)."""
    requests: float                     # arrived in the interval (a count, not a rate)
    isl: float                          # mean prompt tokens
    osl: float                          # mean output tokens
    ttft_s: float                       # mean TTFT of the requests that finished
    itl_s: float                        # mean ITL of the requests that finished
    duration_s: float                   # mean request duration
    num_decode: int                     # decode workers serving in it


class ThroughputPlanner:
    """Dynamo's SLA planner: `observe` an interval, then `plan` the replicas of each pool. The
    profile it reads (`prefill_tokens_per_s(isl)`, `decode_tokens_per_s(context, itl_s)`,
    `ttft_s(isl)`, `itl_s(concurrency, context)`) is per engine."""

    def __init__(self, cfg: PlannerConfig, profile):
        self.cfg, self.profile = cfg, profile
        self.requests, self.isl, self.osl = (predictor(cfg.predictor) for _ in range(3))
        self.p_correction = self.d_correction = 1.0

    def observe(self, o: Interval) -> bool:
        """Feed one interval; False (nothing to plan on) when it saw no traffic (Dynamo skips the
        tick when its averages are NaN)."""
        if not o.requests or any(math.isnan(x) for x in (o.isl, o.osl, o.ttft_s, o.itl_s)):
            return False
        self.requests.add(o.requests)
        self.isl.add(o.isl)
        self.osl.add(o.osl)
        if self.cfg.correction:
            expect_ttft = self.profile.ttft_s(o.isl)
            self.p_correction = o.ttft_s / expect_ttft if expect_ttft > 0 else 1.0
            concurrency = o.requests / max(1, o.num_decode) * o.duration_s / self.cfg.interval_s
            expect_itl = self.profile.itl_s(max(1.0, concurrency), o.isl + o.osl / 2)
            self.d_correction = o.itl_s / expect_itl if expect_itl > 0 else 1.0
        return True

    def plan(self) -> tuple[int, int]:
        """(prefill, decode) replicas for the next interval, within the budget."""
        cfg, prof = self.cfg, self.profile
        n, isl, osl = self.requests.predict(), self.isl.predict(), self.osl.predict()
        load = n * isl / cfg.interval_s * min(1.0, self.p_correction)
        per = prof.prefill_tokens_per_s(max(1.0, isl))
        num_p = max(cfg.min_endpoint, math.ceil(load / per - 1e-9)) if per > 0 else cfg.min_endpoint
        itl = cfg.itl_s / self.d_correction if self.d_correction > 0 else cfg.itl_s
        thpt = prof.decode_tokens_per_s(max(1.0, isl + osl / 2), itl)
        num_d = (max(cfg.min_endpoint, math.ceil(n * osl / cfg.interval_s / thpt - 1e-9)) if thpt > 0
                 else cfg.min_endpoint)
        return within_budget(num_p, num_d, cfg)


def within_budget(num_p: int, num_d: int, cfg: PlannerConfig) -> tuple[int, int]:
    """Dynamo's budget rule: prefill scaled down in proportion (at least min_endpoint, leaving
    decode its min_endpoint), decode what is left."""
    g, budget, m = cfg.gpus_per_engine, cfg.max_gpu_budget, cfg.min_endpoint
    total = (num_p + num_d) * g
    if budget < 0 or total <= budget:
        return num_p, num_d
    if budget < 2 * m * g:
        return 0, 0
    scale = budget / total
    most_p = (budget - m * g) // g
    p = max(m, min(most_p, math.floor(num_p * scale)))
    return p, max(m, (budget - p * g) // g)


# -- the load-based planner ---------------------------------------------------------------------------
class Fit:
    """Ordinary least squares of y on x over the last `window` observations."""

    def __init__(self, window: int):
        self.rows: deque = deque(maxlen=window)

    def add(self, x: float, y: float) -> None:
        self.rows.append((x, y))

    def at_target(self, target: float) -> float | None:
        """The x at which the fit reaches `target` (the load a worker carries within the SLA);
        with no upward slope, the smallest observed load that met it; None: nothing to say."""
        n = len(self.rows)
        if not n:
            return None
        mx = sum(x for x, _ in self.rows) / n
        my = sum(y for _, y in self.rows) / n
        sxx = sum((x - mx) ** 2 for x, _ in self.rows)
        slope = sum((x - mx) * (y - my) for x, y in self.rows) / sxx if sxx > 0 else 0.0
        if slope > 0:
            return (target - (my - slope * mx)) / slope
        met = [x for x, y in self.rows if y <= target]
        return min(met) if met else None


def load_step(loads: list[float], carry: float | None, sensitivity: float) -> int:
    """+1 when every worker's load is above what one carries within the SLA (`carry`), -1 when
    every one is below carry x (N - 1) / N x sensitivity (and N > 1), else 0."""
    n = len(loads)
    if carry is None or not n:
        return 0
    if all(x > carry for x in loads):
        return 1
    if n > 1 and all(x < carry * (n - 1) / n * sensitivity for x in loads):
        return -1
    return 0


class LoadPlanner:
    """Dynamo's load-based planner: per pool, one fit over the pool's workers' observations
    (each worker's averages over an interval), and a step of one worker at most."""

    def __init__(self, cfg: PlannerConfig):
        self.cfg = cfg
        self.prefill, self.decode = Fit(cfg.window), Fit(cfg.window)

    def observe_prefill(self, active_tokens: float, isl: float, ttft_s: float) -> None:
        self.prefill.add(active_tokens + isl, ttft_s)

    def observe_decode(self, kv_blocks: float, itl_s: float) -> None:
        self.decode.add(kv_blocks, itl_s)

    def plan(self, num_p: int, num_d: int, prefill_active: list[float], isl: float,
             decode_blocks: list[float]) -> tuple[int, int]:
        """(prefill, decode) replicas after this interval: each pool's step, a shrink only when
        both want one."""
        cfg = self.cfg
        dp = dd = 0
        if len(self.prefill.rows) >= cfg.min_observations:
            carry = self.prefill.at_target(cfg.ttft_s)
            dp = load_step(prefill_active, None if carry is None else carry - isl, cfg.sensitivity)
        if len(self.decode.rows) >= cfg.min_observations:
            dd = load_step(decode_blocks, self.decode.at_target(cfg.itl_s), cfg.sensitivity)
        if dp < 0 and dd >= 0 or dd < 0 and dp >= 0:     # shrink only when both sides would
            dp, dd = max(dp, 0), max(dd, 0)
        return within_budget(max(cfg.min_endpoint, num_p + dp), max(cfg.min_endpoint, num_d + dd), cfg)
