"""The live pool registry: every worker with its role and state, in one place (plain Python).

    starting ──ready──▶ active ──drain──▶ draining ──idle, flipped──▶ active in the other role
                         │  ▲                 │   └──idle──▶ stopped (left the cluster)
                    lost │  │ restarted       │ lost
                         ▼  │                 ▼
                         dead ◀───────────────┘   (back from a restart while draining, it holds
                                                   nothing: the flip or the exit completes at once)

The dispatcher only reads it (it picks among the `active` workers of a role); the launcher
adds workers (`starting`, then `active` once they answer `ready()`), the fault handling marks
lost ones `dead` and restarted ones `active` again, and the controller drains workers to flip
or remove them. A draining worker takes no new work; what it holds finishes (a prefill worker's
prompts and their KV handoffs, a decode worker's sequences) before it flips: nothing it runs
is aborted or handed back, so a drain costs no request anything but the capacity it removes.
A worker keeps its id (which names the role it started in) across flips.

Every change goes through `_set`, which tells the listeners (metrics, logs) what changed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.picker import prefill_load
from workers.messages import LoadReport

STARTING, ACTIVE, DRAINING, DEAD, STOPPED = "starting", "active", "draining", "dead", "stopped"
STATES = (STARTING, ACTIVE, DRAINING, DEAD, STOPPED)
_MOVES = {                  # the transitions the state machine allows
    STARTING: {ACTIVE, DEAD, STOPPED},
    ACTIVE: {DRAINING, DEAD},
    DRAINING: {ACTIVE, STOPPED, DEAD},
    DEAD: {ACTIVE, STARTING, STOPPED},
    STOPPED: set(),
}


@dataclass(slots=True)
class Member:
    worker_id: str
    role: str
    handle: object
    state: str = STARTING
    leaving: bool = False                              # drained to flip or to be removed
    to_role: str | None = None                         # leaving: the role it flips to (None: removed)
    since: float = field(default_factory=time.monotonic)   # when it entered its state
    report: LoadReport | None = None                   # the latest, None before the first poll
    assigned: set = field(default_factory=set)         # requests open on this worker (for failover)
    unreported: dict = field(default_factory=dict)     # rid -> (prompt tokens, sent at): not yet in a report
    polled_at: float = 0.0                             # its latest report covers what was sent before this

    @property
    def alive(self) -> bool:
        """Answering: active or draining (a draining worker still runs what it has)."""
        return self.state in (ACTIVE, DRAINING)

    def sent(self, rid: str, num_tokens: int) -> None:
        self.assigned.add(rid)
        self.unreported[rid] = (num_tokens, time.monotonic())

    def reported(self, report: LoadReport, polled_at: float) -> None:
        """A report covers what was sent before the poll that carried it was issued."""
        self.report, self.polled_at = report, polled_at
        for rid in [r for r, (_, t) in self.unreported.items() if t < polled_at]:
            del self.unreported[rid]

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting here: those in the last report plus those sent since."""
        return prefill_load(self.report, sum(n for n, _ in self.unreported.values()))

    def queued_prefill_requests(self) -> int:
        return (self.report.waiting if self.report else 0) + len(self.unreported)

    def decode_sequences(self) -> int:
        """Sequences a decode worker runs, waits for room for or receives, plus those sent since
        its last report."""
        r = self.report
        return (r.running + r.waiting + r.pending + r.receiving if r else 0) + len(self.unreported)

    def idle(self) -> bool:
        """Holds nothing: no request open here (router's view) and, in a report taken after the
        last send, nothing running, waiting, held for a handoff or being received."""
        r = self.report
        return (not self.assigned and not self.unreported and r is not None and r.running == 0 and r.waiting == 0
                and r.held == 0 and r.pending == 0 and r.receiving == 0)


# A listener hears (member, old state, old role) after every change.
Listener = Callable[[Member, str, str], None]


class PoolRegistry:
    def __init__(self, budget: int | None = None):
        self.budget = budget                           # most workers at once (None: no limit)
        self._members: dict[str, Member] = {}
        self._listeners: list[Listener] = []

    @classmethod
    def of(cls, members: list[Member], budget: int | None = None) -> PoolRegistry:
        """A registry of these workers (the launcher's, ready: active)."""
        reg = cls(budget)
        for m in members:
            if m.worker_id in reg:
                raise ValueError(f"worker {m.worker_id} is listed twice")
            reg._members[m.worker_id] = m
        return reg

    def listen(self, fn: Listener) -> None:
        self._listeners.append(fn)

    # -- reading ----------------------------------------------------------------------------------
    def __iter__(self):
        return iter(list(self._members.values()))

    def __getitem__(self, worker_id: str) -> Member:
        return self._members[worker_id]

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._members

    def active(self, role: str) -> list[Member]:
        """The workers a request of this role may be sent to."""
        return [m for m in self._members.values() if m.role == role and m.state == ACTIVE]

    def coming(self, role: str) -> bool:
        """A worker will (again) serve this role: starting, restarting, or draining towards it."""
        return any((m.role == role and m.state in (STARTING, DEAD)) or
                   (m.state == DRAINING and m.to_role == role) for m in self._members.values())

    def live(self) -> list[Member]:
        """Members that hold a slot of the budget: everything not stopped."""
        return [m for m in self._members.values() if m.state != STOPPED]

    def count(self, role: str, states=(ACTIVE,)) -> int:
        return sum(m.role == role and m.state in states for m in self._members.values())

    def draining(self) -> list[Member]:
        return [m for m in self._members.values() if m.state == DRAINING]

    # -- changing ---------------------------------------------------------------------------------
    def add(self, worker_id: str, role: str, handle, state: str = STARTING, within_budget: bool = True) -> Member:
        """A worker joins. `within_budget=False`: one that another router added (the leader keeps
        the budget; a follower's view may still count a worker the leader has retired)."""
        if worker_id in self._members and self._members[worker_id].state != STOPPED:
            raise ValueError(f"worker {worker_id} is already in the pools")
        if within_budget and self.budget is not None and len(self.live()) >= self.budget:
            raise ValueError(f"the worker budget of {self.budget} is reached")
        m = Member(worker_id, role, handle, state)
        self._members[worker_id] = m
        self._tell(m, STOPPED, role)
        return m

    def activate(self, worker_id: str) -> None:
        self._set(self[worker_id], ACTIVE)

    def lost(self, worker_id: str) -> None:
        """Died or hung: out of the pools until restarted. A worker lost while draining comes back
        with nothing to hold, so its flip (or removal) completes the moment it returns."""
        m = self[worker_id]
        m.report = None
        m.unreported.clear()
        self._set(m, DEAD)

    def restarted(self, worker_id: str) -> None:
        """Ready again after a loss: back in its pool, or (it was draining) flipped or stopped."""
        m = self[worker_id]
        if m.leaving:
            self.finish_drain(worker_id, from_state=DEAD)
        else:
            self._set(m, ACTIVE)

    def drain(self, worker_id: str, to_role: str | None) -> Member:
        """Stop sending it work; once idle it flips to `to_role`, or is removed (None)."""
        m = self[worker_id]
        if m.state != ACTIVE:
            raise ValueError(f"worker {worker_id} is {m.state}, not active: it cannot drain")
        if to_role == m.role:
            raise ValueError(f"worker {worker_id} is already a {to_role} worker")
        m.to_role, m.leaving = to_role, True
        self._set(m, DRAINING)
        return m

    def finish_drain(self, worker_id: str, from_state: str = DRAINING) -> Member:
        """The worker is idle (and, for a flip, has taken its new role): rejoin or stop."""
        m = self[worker_id]
        if m.state != from_state:
            raise ValueError(f"worker {worker_id} is {m.state}, not {from_state}")
        to = m.to_role
        m.to_role, m.leaving = None, False
        if to is None:
            self._set(m, STOPPED)
        else:
            old = m.role
            m.role = to
            self._set(m, ACTIVE, old_role=old)
        return m

    def follow(self, worker_id: str, role: str, accepting: bool) -> None:
        """Another router leads these pools: take a worker's state from its own report (not
        accepting: draining; accepting, perhaps in another role: active). Only active and
        draining members move; a dead or starting one waits for its own way back."""
        m = self[worker_id]
        if m.state not in (ACTIVE, DRAINING):
            return
        state = ACTIVE if accepting else DRAINING
        if state == m.state and role == m.role:
            return
        old_role, m.role = m.role, role
        m.to_role, m.leaving = None, False
        self._set(m, state, old_role=old_role)

    def stop(self, worker_id: str) -> None:
        """Gone for good (never came back from a restart, or never started)."""
        m = self[worker_id]
        if m.state != STOPPED:
            self._set(m, STOPPED)

    def _set(self, m: Member, state: str, old_role: str | None = None) -> None:
        old = m.state
        if state != old and state not in _MOVES[old]:
            raise ValueError(f"worker {m.worker_id}: {old} -> {state} is not a pool transition")
        m.state, m.since = state, time.monotonic()
        self._tell(m, old, old_role or m.role)

    def _tell(self, m: Member, old_state: str, old_role: str) -> None:
        for fn in self._listeners:
            fn(m, old_state, old_role)
