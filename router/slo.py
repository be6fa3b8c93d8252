"""Service-level objectives: does a finished request meet its TTFT and TPOT targets, and what
fraction of recent requests did (plain Python: the router's metrics and a controller share it).

    TPOT (time per output token) = (e2e - ttft) / (output tokens - 1), as DistServe and
    `vllm bench` define it; a request with one output token meets any TPOT target.

A request is *good* when it meets both targets; attainment is the good fraction, and DistServe's
goodput is the highest request rate at which attainment stays >= 90%.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

ATTAINMENT = 0.9       # the share of requests within both SLOs that a rate must keep (bench --sweep, plan)


@dataclass(frozen=True, slots=True)
class SLOTargets:
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    window_s: float = 60.0           # the sliding window of `SLOWindow`

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SLO {name} must be > 0, got {getattr(self, name)} "
                                 "(pdcluster serve: --slo-ttft-ms, --slo-tpot-ms, --slo-window-s)")


class SLOVerdict(NamedTuple):
    ttft: bool
    tpot: bool

    @property
    def both(self) -> bool:
        return self.ttft and self.tpot


def tpot_s(ttft_s: float, e2e_s: float, num_output_tokens: int) -> float | None:
    """(e2e - ttft) / (output tokens - 1); None for a reply of one token (or none): no gap to time."""
    return (e2e_s - ttft_s) / (num_output_tokens - 1) if num_output_tokens > 1 else None


def judge(targets: SLOTargets, ttft_s: float, e2e_s: float, num_output_tokens: int) -> SLOVerdict:
    """The verdict on one finished request; a one-token reply meets any TPOT target."""
    tpot = tpot_s(ttft_s, e2e_s, num_output_tokens)
    return SLOVerdict(ttft_s <= targets.ttft_s, tpot is None or tpot <= targets.tpot_s)


class SLOWindow:
    """Attainment over the last `window_s` seconds of finished requests (O(1) amortized)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._events: deque[tuple[float, SLOVerdict]] = deque()
        self._met = {"ttft": 0, "tpot": 0, "both": 0}

    def record(self, verdict: SLOVerdict) -> None:
        self._expire()
        self._events.append((self.clock(), verdict))
        self._count(verdict, +1)

    def attainment(self) -> dict[str, float]:
        """{"ttft", "tpot", "both"} -> fraction met; NaN when no request finished in the window."""
        self._expire()
        n = len(self._events)
        return {k: v / n if n else math.nan for k, v in self._met.items()}

    def __len__(self) -> int:
        self._expire()
        return len(self._events)

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._count(self._events.popleft()[1], -1)

    def _count(self, v: SLOVerdict, sign: int) -> None:
        self._met["ttft"] += sign * v.ttft
        self._met["tpot"] += sign * v.tpot
        self._met["both"] += sign * v.both


class RequestLog:
    """Recent requests as the pool controller reads them (cluster/run/controller.py `observe`):
    arrivals (time, prompt tokens, max_tokens asked) and finishes (time, sent at, output tokens,
    max_tokens asked, TTFT met, TPOT met), kept for `horizon_s`. The serving router and the
    simulator each keep one (the simulator on its own clock); the leading router also takes in
    the other routers' (cluster/run/book.py relays them). Not ordered by time once merged: its
    readers filter by time."""

    def __init__(self, horizon_s: float = 300.0, clock=time.monotonic, max_len: int = 200_000):
        self.horizon_s, self.clock = horizon_s, clock
        self.arrivals: deque[tuple[float, int, int]] = deque(maxlen=max_len)
        self.finishes: deque[tuple[float, float, int, int, bool, bool]] = deque(maxlen=max_len)

    def arrived(self, prompt_tokens: int, max_tokens: int) -> None:
        self.arrivals.append((self.clock(), prompt_tokens, max_tokens))
        self._expire()

    def finished(self, sent_at: float, output_tokens: int, max_tokens: int, ttft_met: bool, tpot_met: bool) -> None:
        self.finishes.append((self.clock(), sent_at, output_tokens, max_tokens, ttft_met, tpot_met))
        self._expire()

    def aged_since(self, t: float) -> tuple[list, list]:
        """The arrivals and finishes recorded after `t` (this log's clock), with each time as an
        age (seconds before now): what another process's log can take in (`merge_aged`),
        whatever its clock reads."""
        now = self.clock()
        return ([(now - a[0], *a[1:]) for a in self.arrivals if a[0] > t],
                [(now - f[0], now - f[1], *f[2:]) for f in self.finishes if f[0] > t])

    def merge_aged(self, arrivals: list, finishes: list) -> None:
        """Take in another router's requests (`aged_since`'s lists, aged as of now)."""
        now = self.clock()
        self.arrivals.extend((now - a[0], *a[1:]) for a in arrivals)
        self.finishes.extend((now - f[0], now - f[1], *f[2:]) for f in finishes)
        self._expire()

    def _expire(self) -> None:
        horizon = self.clock() - self.horizon_s
        for q in (self.arrivals, self.finishes):
            while q and q[0][0] < horizon:
                q.popleft()
