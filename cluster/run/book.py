"""A cluster's book: one small registry actor per cluster (`pdcluster-<cluster id>-book`), beside
its workers, that every router of the cluster reads and writes.

- **Its settings**: the ClusterSpec it was launched with (as a dict), so that a router attaching
  later runs the pools as their launcher did: the worker budget, the controller's settings, the
  resources of a worker it adds.
- **The lead** (workers/leases.py `LeaderLease`): which router restarts hung workers, retires
  drained ones, runs the controller and exports the workers' metrics. The launching `serve`
  takes it first; when its holder dies, another router takes it once its lease lapses.
- **The other routers' requests, on their way to the leader**: each router that does not lead
  posts its new arrivals and finishes (router/slo.py `RequestLog.aged_since`); the leader takes
  them into its own log, so the controller judges every router's requests, not only its own.
  Times travel as ages (seconds before the call), since each process has its own clock.

Plain Python (a Ray actor in a running cluster: cluster/run/launcher.py `open_book`), so that tests
drive it on a fake clock. On a Ray cluster it is detached with the workers, and Ray restarts it
with the same settings should its node die. The lead's record (its holder and term:
workers/leases.py `LeaderLease`) lives outside the actor, in `lead_store` (Ray's internal KV:
launcher.py `KVLeadStore`), so a restarted book goes on from it: its terms keep rising (a router
that takes the lead back at an unchanged term knows that nobody led in between, and keeps its
drains), and the holder before the restart holds it for one more lease, for its claim to renew.
The requests in transit are lost with the process (they are posted again within a lease).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from workers.leases import LeaderLease, LeadStore

__all__ = ["ClusterBook", "book_name"]

ARRIVAL, FINISH = 0, 1


class Record(NamedTuple):
    """One posted request event: its sequence number, its poster, ARRIVAL or FINISH, when it
    happened and (a finish) when it was sent, on the book's clock; the rest of what was posted."""
    seq: int
    poster: str
    kind: int
    at: float
    sent: float | None
    rest: tuple


def book_name(cluster_id: str) -> str:
    """Its Ray actor name (a worker's is `pdcluster-<cluster id>-<role>-<n>`)."""
    return f"pdcluster-{cluster_id}-book"


class ClusterBook:
    def __init__(self, spec: dict, horizon_s: float = 300.0, max_records: int = 200_000,
                 clock: Callable[[], float] = time.monotonic, lead_store: LeadStore | None = None):
        self.spec, self.horizon_s, self.clock = spec, horizon_s, clock
        self.lead = LeaderLease(clock, lead_store)       # (goes on from lead_store's record)
        self._records: deque[Record] = deque(maxlen=max_records)
        self._seq = 0
        self._taken: dict[str, int] = {}         # taker -> the last sequence number it took

    def settings(self) -> dict:
        return self.spec

    def claim(self, owner: str, lease_s: float) -> tuple[str, int]:
        """(the holder of the lead after this claim, its term). A new term is saved in the lead
        store before it is answered: should the store fail, the claim raises (the router tries
        again next turn) and nothing changes."""
        return self.lead.claim(owner, lease_s), self.lead.term

    def release(self, owner: str) -> None:
        self.lead.release(owner)

    def post(self, owner: str, arrivals: list, finishes: list) -> None:
        """A router's requests since its last post, each time an age as of the call."""
        now = self.clock()
        for a in arrivals:
            self._seq += 1
            self._records.append(Record(self._seq, owner, ARRIVAL, now - a[0], None, tuple(a[1:])))
        for f in finishes:
            self._seq += 1
            self._records.append(Record(self._seq, owner, FINISH, now - f[0], now - f[1], tuple(f[2:])))
        horizon = now - self.horizon_s
        while self._records and self._records[0].at < horizon:
            self._records.popleft()

    def take(self, owner: str) -> tuple[list, list]:
        """The other routers' requests that `owner` has not taken yet, aged as of now (the
        first take gets every one still within the horizon)."""
        now, since = self.clock(), self._taken.get(owner, 0)
        arrivals, finishes = [], []
        for r in reversed(self._records):                   # newest first
            if r.seq <= since:
                break
            if r.poster == owner:
                continue
            if r.kind == ARRIVAL:
                arrivals.append((now - r.at, *r.rest))
            else:
                finishes.append((now - r.at, now - r.sent, *r.rest))
        self._taken[owner] = self._seq
        return arrivals, finishes
