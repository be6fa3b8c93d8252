"""Injectable KV-transfer faults: fail or delay a handoff at chosen points, on either side.

Off by default. A plan is a comma-separated list of rules `side:point:action[*times]`:

    side     send (the prefill worker) | recv (the decode worker)
    point    before_header   connected, before the two sides exchange the transfer header
             mid_payload     send: header agreed, payload not sent yet;
                             recv: payload arrived, half of it copied into the reserved blocks
             after_payload   the payload is through on this side (recv: every block written)
             before_commit   recv only: the pull is over, the sequence has not joined the batch
    action   fail            raise InjectedFault there (the transfer breaks, as if the link did)
             delay=SECONDS   stall there; past the transfer's deadline it times out
    *times   how many times the rule acts (default: every time), e.g. `fail*1` so a retry succeeds

    PDCLUSTER_KV_FAULTS="recv:mid_payload:fail*1,send:before_header:delay=2.5"

A worker reads `PDCLUSTER_KV_FAULTS` when it starts (`FaultPlan.from_env`); tests build plans
with `FaultPlan.parse`. Rules are tried in order: the first rule for the point with uses left
acts. Plain Python (no torch, no Ray): the transport and the worker call `hit` at each point.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

ENV_VAR = "PDCLUSTER_KV_FAULTS"
SIDES = ("send", "recv")
POINTS = ("before_header", "mid_payload", "after_payload", "before_commit")
SIDE_POINTS = {"send": POINTS[:3], "recv": POINTS}
# Where a failed pull was when it failed (the decode side's view; a metric label): asking the
# prefill worker, building the pair's group, then the fault points above.
FAILURE_POINTS = ("request", "connect", "refused") + POINTS     # refused: the sender held no KV


class FaultSpecError(ValueError):
    """A malformed fault plan (names the rule and what was expected)."""


class InjectedFault(RuntimeError):
    """A fault the plan injected (the transport reports it as a KVTransferError)."""

    def __init__(self, side: str, point: str):
        super().__init__(f"injected fault at {side}:{point}")
        self.side, self.point = side, point

    def __reduce__(self):                   # crosses processes (Ray) with its fields
        return type(self), (self.side, self.point)


@dataclass(slots=True)
class FaultRule:
    side: str
    point: str
    delay_s: float | None                   # None: fail
    times: int | None = None                # None: every time
    used: int = 0

    def __str__(self) -> str:
        action = "fail" if self.delay_s is None else f"delay={self.delay_s:g}"
        return f"{self.side}:{self.point}:{action}" + ("" if self.times is None else f"*{self.times}")


class FaultPlan:
    """The rules, and how often each point acted (`hits`, "side:point" -> count). Thread-safe:
    pull threads and send calls hit it concurrently."""

    def __init__(self, rules: list[FaultRule] | tuple = ()):
        self.rules = list(rules)
        self.hits: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        rules = []
        for text in (spec or "").split(","):
            if text.strip():
                rules.append(_parse_rule(text.strip()))
        return cls(rules)

    @classmethod
    def from_env(cls, env: dict | None = None) -> FaultPlan:
        """The plan in PDCLUSTER_KV_FAULTS (empty when unset); a malformed one names the variable."""
        spec = (os.environ if env is None else env).get(ENV_VAR, "")
        try:
            return cls.parse(spec)
        except FaultSpecError as e:
            raise FaultSpecError(f"{ENV_VAR}: {e}") from None

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.rules)

    def __repr__(self) -> str:
        return f"FaultPlan({str(self)!r})"

    def hit(self, side: str, point: str) -> float:
        """At `point` on `side`: raise InjectedFault, or stall; returns the seconds stalled
        (0.0 when no rule acts)."""
        if not self.rules:
            return 0.0
        with self._lock:
            rule = next((r for r in self.rules if r.side == side and r.point == point
                         and (r.times is None or r.used < r.times)), None)
            if rule is None:
                return 0.0
            rule.used += 1
            key = f"{side}:{point}"
            self.hits[key] = self.hits.get(key, 0) + 1
        if rule.delay_s is None:
            raise InjectedFault(side, point)
        time.sleep(rule.delay_s)
        return rule.delay_s


def _parse_rule(text: str) -> FaultRule:
    parts = [p.strip() for p in text.split(":")]
    if len(parts) != 3:
        raise FaultSpecError(f"fault rule {text!r}: expected side:point:action, e.g. recv:mid_payload:fail*1")
    side, point, action = parts
    if side not in SIDES:
        raise FaultSpecError(f"fault rule {text!r}: side must be one of {SIDES}, got {side!r}")
    if point not in SIDE_POINTS[side]:
        if point == "before_commit":
            raise FaultSpecError(f"fault rule {text!r}: before_commit is a recv point (the prefill side "
                                 "commits nothing)")
        raise FaultSpecError(f"fault rule {text!r}: point must be one of {SIDE_POINTS[side]}, got {point!r}")
    action, star, times_text = action.partition("*")
    times = None
    if star:
        try:
            times = int(times_text)
        except ValueError:
            times = 0
        if times < 1:
            raise FaultSpecError(f"fault rule {text!r}: *times must be a whole number >= 1, got {times_text!r}")
    if action == "fail":
        return FaultRule(side, point, None, times)
    name, eq, value = action.partition("=")
    if name == "delay" and eq:
        try:
            delay = float(value)
        except ValueError:
            delay = -1.0
        if not 0 <= delay < float("inf"):
            raise FaultSpecError(f"fault rule {text!r}: delay must be a number of seconds >= 0, got {value!r}")
        return FaultRule(side, point, delay, times)
    raise FaultSpecError(f"fault rule {text!r}: action must be fail or delay=SECONDS, got {action!r}")
