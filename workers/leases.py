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


class LeaderLease:
    """Which router leads a cluster (restarts hung workers, retires drained ones, runs the
    controller, exports the workers' metrics): the one holding this lease. Each router claims
    it every quarter lease; the holder's claim renews it, anyone else's takes it only once the
    holder has let it lapse (it died, or stalled past the lease). `term` counts the changes of
    holder, so that logs and tests can tell one reign from the next.

    Plain Python with an injectable clock; a cluster's registry actor (cluster/book.py) keeps one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.holder: str | None = None
        self.expires_at = -float("inf")
        self.term = 0

    def claim(self, owner: str, lease_s: float) -> str:
        """Renew the lease for `owner`, or take it when nobody holds it now. Returns the holder."""
        if lease_s <= 0:
            raise ValueError(f"the leader lease must be > 0 s, got {lease_s}")
        now = self.clock()
        if self.holder != owner and self.expires_at >= now:
            return self.holder
        if self.holder != owner:
            self.holder, self.term = owner, self.term + 1
        self.expires_at = now + lease_s
        return owner

    def release(self, owner: str) -> None:
        """The holder steps down cleanly: the next claim, anyone's, takes it at once."""
        if self.holder == owner:
            self.expires_at = -float("inf")
