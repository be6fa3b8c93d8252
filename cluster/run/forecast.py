"""The controller's long time scale: a forecast of the next long interval's arrivals and
lengths, from which it keeps a floor under each pool ahead of demand (plain Python, no Ray, no
torch: the serving loop and `pdcluster simulate` run it alike).

Each long interval feeds one value of the arrival rate, the mean prompt tokens and the mean
output tokens to a damped Holt filter (exponential smoothing of a level and a trend; the trend
damped so that a rise is not extrapolated without end): simple, robust to a noisy interval, and
it follows an hour-scale rise and fall with a lag of about one interval where the last value
lags by one interval and a mean by many. The floor is what the forecast needs of each pool at
its target load, so a pool grows before the reactive policy sees it short, and never shrinks
below what the next interval will need.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass


class Holt:
    """Damped Holt (level + trend) smoothing of one series; `forecast(h)` is h intervals ahead,
    never below 0."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, phi: float = 0.9):
        if not (0 < alpha <= 1 and 0 <= beta <= 1 and 0 < phi <= 1):
            raise ValueError(f"Holt needs 0 < alpha <= 1, 0 <= beta <= 1, 0 < phi <= 1, got {alpha}, {beta}, {phi}")
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self.level: float | None = None
        self.trend = 0.0
        self.n = 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.level is None:
            self.level = x
            return
        prev = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (prev + self.phi * self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.phi * self.trend

    def forecast(self, h: int = 1) -> float:
        if self.level is None:
            return 0.0
        damped = sum(self.phi ** i for i in range(1, h + 1))
        return max(0.0, self.level + damped * self.trend)


@dataclass(frozen=True, slots=True)
class Outlook:
    """What the forecast says of the next long interval."""
    arrival_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    peak_rate: float = 0.0              # its bursts: the rate times the peak-to-mean ratio of prompt work lately


class Forecast:
    """The three series of the long time scale. `observe` once per long interval (with its rate
    and means); `outlook` is None until `min_intervals` have been seen."""

    def __init__(self, min_intervals: int = 2, **holt):
        self.rate, self.prompt, self.output = Holt(**holt), Holt(**holt), Holt(**holt)
        self.burst = Holt(alpha=0.3, beta=0.0)     # the peak-to-mean ratio: a level, no trend
        self.min_intervals = min_intervals

    def observe(self, arrival_rate: float, mean_prompt_tokens: float, mean_output_tokens: float,
                peak_rate: float | None = None) -> None:
        """One long interval: its mean arrival rate and lengths, and its busiest short part's
        (`peak_rate`: interval_summary's)."""
        self.rate.add(arrival_rate)
        if arrival_rate > 0:                       # an idle interval says nothing of lengths
            self.prompt.add(mean_prompt_tokens)
            self.output.add(mean_output_tokens)
            if peak_rate is not None:
                self.burst.add(max(1.0, peak_rate / arrival_rate))

    def outlook(self, ahead: int = 1) -> Outlook | None:
        """The next `ahead` intervals' peak forecast arrivals (a rise: the last of them), with the
        lengths forecast for the first."""
        if self.rate.n < self.min_intervals or self.prompt.level is None:
            return None
        rate = max(self.rate.forecast(h) for h in range(1, ahead + 1))
        burst = self.burst.forecast() if self.burst.level is not None else 1.0
        return Outlook(rate, self.prompt.forecast(), self.output.forecast(), rate * max(1.0, burst))


RISE_SHARE = 0.1            # arrivals rise while the last shrink hold's mean rate passes the one before by this share


BURST_S = 1.0               # a long interval's bursts: its busiest part this long (a TTFT target's length)


def interval_summary(arrivals, start: float, length: float, burst_s: float = BURST_S):
    """(arrival rate, mean prompt tokens, mean output tokens, the prompt tokens per second of its
    busiest `burst_s`, as an arrival rate of mean prompts) of the arrivals (rows of (time, prompt
    tokens, output tokens, ...)) within [start, start + length)."""
    parts = [0] * max(1, round(length / burst_s))
    n = prompt = output = 0
    for row in arrivals:
        t = row[0]
        if start <= t < start + length:
            n += 1
            prompt += row[1]
            output += row[2]
            parts[min(len(parts) - 1, int((t - start) // burst_s))] += row[1]
    mean_prompt = prompt / n if n else 0.0
    peak = max(parts) / burst_s / mean_prompt if n else 0.0
    return n / length, mean_prompt, output / n if n else 0.0, peak


def floor_sizes(o: Outlook | None, prefill_tokens_per_s: float, decode_tokens_per_s: float,
                prefill_target: float, decode_target: float) -> tuple[int, int]:
    """Workers each pool needs for the outlook's arrivals: at its target load, and at full load
    for their bursts (`peak_rate`) (0, 0 without an outlook)."""
    if o is None or o.arrival_rate <= 0:
        return 0, 0
    p = o.mean_prompt_tokens / max(1e-9, prefill_tokens_per_s)
    d = o.mean_output_tokens / max(1e-9, decode_tokens_per_s)
    return (math.ceil(max(o.arrival_rate * p / prefill_target, o.peak_rate * p) - 1e-9),
            math.ceil(max(o.arrival_rate * d / decode_target, o.peak_rate * d) - 1e-9))


class LongScale:
    """A controller loop's long time scale: at each call it feeds the forecast every long interval
    that has ended (from a request log's arrivals, oldest first) and gives, per pool, the floor
    (the outlook `ahead` intervals on: what a worker asked for now would start into) and what a
    shrink keeps (the outlook's peak over the next `keep_s`: a shrink undone sooner is waste)."""

    def __init__(self, interval_s: float, start: float, ahead: int = 2, keep_s: float = 300.0,
                 ttft_s: float = BURST_S):
        self.interval_s, self.ahead = interval_s, ahead
        self.burst_s = self.ttft_s = ttft_s           # bursts measured over a TTFT target's length
        self.keep_ahead = max(ahead, math.ceil(keep_s / interval_s))
        self.forecast = Forecast()
        self.rates: deque[float] = deque(maxlen=2 * self.keep_ahead)   # the last long intervals' arrival rates
        self.until = start + interval_s

    def floors(self, now: float, arrivals, prefill_tokens_per_s: float, decode_tokens_per_s: float,
               prefill_target: float, decode_target: float) -> tuple[tuple[int, int], tuple[int, int]]:
        """((prefill, decode) floor, (prefill, decode) kept by a shrink)."""
        while now >= self.until:
            summary = interval_summary(arrivals, self.until - self.interval_s, self.interval_s, self.burst_s)
            self.forecast.observe(*summary)
            self.rates.append(summary[0])
            self.until += self.interval_s
        rates = (prefill_tokens_per_s, decode_tokens_per_s, prefill_target, decode_target)
        return (floor_sizes(self._cleared(self.forecast.outlook(self.ahead)), *rates),
                floor_sizes(self._cleared(self.forecast.outlook(self.keep_ahead)), *rates))

    def rising(self) -> bool:
        """Whether arrivals are on a rise: the mean rate of the last `keep_s` of long intervals
        more than RISE_SHARE over that of the `keep_s` before (a shrink then waits: a rise takes
        the worker back within the shrink hold). Over minutes, not the forecast's trend: an
        Azure trace's rate swings by a fifth from one minute to the next inside an hour-scale
        rise, and the trend turned down for minutes at a time halfway up it."""
        k = self.keep_ahead
        if len(self.rates) < 2 * k:
            return False
        rates = list(self.rates)
        return sum(rates[-k:]) > (1 + RISE_SHARE) * sum(rates[-2 * k:-k])

    def _cleared(self, o: Outlook | None) -> Outlook | None:
        """A burst's prompts arrive over `burst_s` and each may take its TTFT target after: the
        pool clears them within burst_s + TTFT, so it needs their rate times that share."""
        if o is None:
            return None
        return dataclasses.replace(o, peak_rate=o.peak_rate * self.burst_s / (self.burst_s + self.ttft_s))
