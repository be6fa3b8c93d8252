"""Each router's lease on a worker: the router renews it (a heartbeat every quarter lease); when
it lapses, the worker ends that router's requests and frees their blocks, since nobody is left
to read their tokens or to hand their KV on.

    touch / renew ──▶ LIVE (expires_at) ──lease passes──▶ LAPSED (its requests aborted)
                          ▲                                  │  renew: LIVE again, and the
                          └──────────────────────────────────┘  router hears that it lost them
                                          LAPSED for `forget_after_s` ──▶ forgotten (outbox closed)

Plain Python with an injectable clock (the worker's loop thread asks `lapsed` each turn; Ray
threads renew), so that tests drive it without waiting.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RouterLeases:
    def __init__(self, lease_s: float = 10.0, forget_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"the router lease must be > 0 s, got {lease_s}")
        self.lease_s, self.clock = lease_s, clock
        self.forget_after_s = 6 * lease_s if forget_after_s is None else forget_after_s
        self._live: dict[str, float] = {}       # owner -> when its lease ends
        self._lapsed: dict[str, float] = {}     # owner -> when it lapsed
        self._lock = threading.Lock()

    def renew(self, owner: str) -> bool:
        """The owner is alive: its lease runs `lease_s` from now. False when it had lapsed (its
        requests here were ended; it resumes them elsewhere)."""
        with self._lock:
            self._live[owner] = self.clock() + self.lease_s
            return self._lapsed.pop(owner, None) is None

    def lapsed(self) -> list[str]:
        """The owners whose lease ran out since the last call (the caller ends their requests)."""
        now = self.clock()
        with self._lock:
            gone = [o for o, end in self._live.items() if end < now]
            for o in gone:
                del self._live[o]
                self._lapsed[o] = now
            return gone

    def forgotten(self) -> list[str]:
        """The owners lapsed for `forget_after_s` without a renewal (gone for good: the caller
        drops what it kept for them)."""
        now = self.clock()
        with self._lock:
            gone = [o for o, at in self._lapsed.items() if now - at >= self.forget_after_s]
            for o in gone:
                del self._lapsed[o]
            return gone

    def drop(self, owner: str) -> None:
        """The owner left cleanly: no lease to lapse."""
        with self._lock:
            self._live.pop(owner, None)
            self._lapsed.pop(owner, None)

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)


class LeadStore:
    """Where a `LeaderLease` keeps its record outside its own memory, so that a book restarted in a
    new process goes on from it: `load()` gives the last record saved (None: nothing yet), `save`
    replaces it and raises when it cannot (the lease then changes nothing). The record is
    (holder, term, lease_s): the holder and term of the last change of holder, and the lease that
    holder claimed with (0 once it released it). Renewals are not saved (nothing in the record
    changes with them).

    This one keeps it in memory (tests; a book whose process never restarts). On a Ray cluster
    the book keeps it in Ray's internal KV (cluster/run/launcher.py `KVLeadStore`), which outlives
    the book's process."""

    def __init__(self):
        self.record: tuple[str | None, int, float] | None = None

    def load(self) -> tuple[str | None, int, float] | None:
        return self.record

    def save(self, holder: str | None, term: int, lease_s: float) -> None:
        self.record = (holder, term, lease_s)


class LeaderLease:
    """Which router leads a cluster (restarts hung workers, retires drained ones, runs the
    controller, exports the workers' metrics): the one holding this lease. Each router claims
    it every quarter lease; the holder's claim renews it, anyone else's takes it only once the
    holder has let it lapse (it died, or stalled past the lease). `term` counts the changes of
    holder, so that logs and tests can tell one reign from the next, and so that a router taking
    the lead back can tell whether anyone led in between: it did not iff the term is the one it
    last held.

    The term outlives the process that keeps the lease (`store`, a `LeadStore`): each change of
    holder, and a release, is saved before it takes effect (before the claim answers), and a
    lease made anew (a book that Ray restarted) starts from the saved record:

    - its term goes on from the saved one, so every term handed out after a restart is greater
      than any handed out before it (never a new reign under an old number);
    - the saved holder holds it again, for one lease from the restart (its last renewal was
      before the restart, so it believes it leads no longer than that: nobody else takes it
      meanwhile), and its claim renews it with its term unchanged (nobody led in between: a
      router that led keeps its drains); anyone else takes it once that lapses, at term + 1;
    - a holder that had released it (lease 0) holds it no longer: the next claim takes it.

    Plain Python with an injectable clock; a cluster's registry actor (cluster/run/book.py) keeps one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, store: LeadStore | None = None):
        self.clock = clock
        self.store = LeadStore() if store is None else store
        self.holder: str | None = None
        self.expires_at = -float("inf")
        self.term = 0
        if (record := self.store.load()) is not None:
            self.holder, self.term, lease_s = record
            if lease_s > 0:
                self.expires_at = clock() + lease_s

    def claim(self, owner: str, lease_s: float) -> str:
        """Renew the lease for `owner`, or take it when nobody holds it now. Returns the holder.
        A change of holder is saved first (should the store fail, it raises and nothing changes)."""
        if lease_s <= 0:
            raise ValueError(f"the leader lease must be > 0 s, got {lease_s}")
        now = self.clock()
        if self.holder != owner and self.expires_at >= now:
            return self.holder
        if self.holder != owner:
            self.store.save(owner, self.term + 1, lease_s)
            self.holder, self.term = owner, self.term + 1
        self.expires_at = now + lease_s
        return owner

    def release(self, owner: str) -> None:
        """The holder steps down cleanly: the next claim, anyone's, takes it at once."""
        if self.holder == owner:
            self.store.save(owner, self.term, 0.0)
            self.expires_at = -float("inf")
