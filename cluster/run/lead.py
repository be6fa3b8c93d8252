"""A router's part in its cluster's lead (cluster/run/book.py holds it; router/leadership.py records
whether this router has it).

Every quarter lease the router claims the lead (the holder's claim renews it) and leads or
follows as the book answers; it relays requests through the book (a follower posts its new ones,
the leader takes the others' into its log, for the controller); while it follows, it takes in
the workers the leader added (its controller grows pools). Stopping, it hands the lead on at
once, not at its lapse.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import ray

from cluster.run.launcher import NAMESPACE, find_book, named_workers
from router.dispatch import awaitable
from router.leadership import Leadership
from router.pools import STARTING, STOPPED, PoolRegistry
from router.slo import RequestLog
from router.supervisor import Supervisor

log = logging.getLogger("pdcluster.serve")


class LeadKeeper:
    def __init__(self, cluster_id: str, lease_s: float, book, leadership: Leadership, owner: str,
                 pools: PoolRegistry, supervisor: Supervisor, requests: RequestLog,
                 request_exit: Callable[[], None]):
        """`owner`: this router's owner tag (its name in the book); `requests`: its request log
        (router/metrics.py), relayed; `request_exit()` stops the router (the cluster is gone)."""
        self.cluster_id, self.lease_s, self.book, self.leadership = cluster_id, lease_s, book, leadership
        self.owner, self.pools, self.supervisor, self.requests = owner, pools, supervisor, requests
        self.request_exit = request_exit

    async def claim(self) -> None:
        """Claim the cluster's lead, and lead or follow as the book answers. A router that cannot
        reach the book keeps leading only while its last renewal lasts (another takes the lead
        once it lapses); a book gone for good means that the cluster was removed (`pdcluster
        down`, or its launcher stopped it): this router stops. Its own drains go on only when
        it leads again at the term it last led in (the book's terms outlive the book's
        restarts, cluster/run/book.py): nobody led in between."""
        lead, lease_s = self.leadership, self.lease_s
        sent = time.monotonic()                          # the lease runs from the claim, not its answer
        try:
            # (an answer later than the lease is worth nothing: the lead may have moved meanwhile)
            holder, term = await asyncio.wait_for(awaitable(self.book.claim.remote(self.owner, lease_s)), lease_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            try:
                removed = await asyncio.to_thread(find_book, self.cluster_id) is None
            except Exception:                            # the GCS itself is away: try again next turn
                removed = False
            if removed:
                log.error("cluster %s was removed; this router stops", self.cluster_id)
                self.request_exit()
            elif lead.leads and time.monotonic() - lead.renewed_at > lease_s:
                log.error("could not renew the lead within its lease (%r): following", e)
                await lead.give_up()
            else:
                log.warning("could not reach the cluster's book: %r", e)
            return
        if holder == self.owner:
            lead.renewed_at = sent
            if lead.leads and term != lead.term:         # it stalled past its lease, and another led meanwhile
                log.error("cluster %s had another leader meanwhile (term %d, now %d): leading anew",
                          self.cluster_id, lead.term, term)
                await lead.give_up()
            if not lead.leads:
                (log.info if term == 1 else log.warning)("router %s leads cluster %s now (term %d)", self.owner,
                                                         self.cluster_id, term)
                lead.take(resume=term == lead.term)
            lead.term = term
        elif lead.leads:
            log.error("router %s took the lead (this one had stalled past its lease): following", holder)
            await lead.give_up()

    async def keep(self) -> None:
        """Every quarter lease: claim the lead; relay requests."""
        log_, posted = self.requests, -math.inf
        while True:
            await asyncio.sleep(self.lease_s / 4)
            await self.claim()
            try:
                if self.leadership.leads:
                    posted = log_.clock()                # (should it follow again: only what is new)
                    arrivals, finishes = await asyncio.wait_for(awaitable(self.book.take.remote(self.owner)),
                                                                self.lease_s / 2)
                    log_.merge_aged(arrivals, finishes)
                else:
                    cut = log_.clock()
                    arrivals, finishes = log_.aged_since(posted)
                    posted = cut
                    if arrivals or finishes:
                        await asyncio.wait_for(awaitable(self.book.post.remote(self.owner, arrivals, finishes)),
                                               self.lease_s / 2)
            except asyncio.CancelledError:
                raise
            except Exception as e:                       # the next turn claims, and finds out why
                log.warning("could not relay requests through the cluster's book: %r", e)

    async def follow(self, every_s: float = 5.0) -> None:
        """While another router leads: every few seconds, take in the workers it added since;
        each joins once it answers `ready()`."""
        while True:
            await asyncio.sleep(every_s)
            if self.leadership.leads:
                continue
            try:
                names = (await asyncio.to_thread(named_workers)).get(self.cluster_id, {})
            except Exception as e:                       # the GCS is briefly away: next time
                log.warning("could not list the cluster's workers: %s", e)
                continue
            for worker_id, name in names.items():
                if worker_id in self.pools and self.pools[worker_id].state != STOPPED:
                    continue
                try:
                    handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
                except Exception as e:                   # gone meanwhile
                    log.info("worker %s: not found (%s)", worker_id, e)
                    continue
                log.info("worker %s joined the cluster; following it", worker_id)
                # (the leader keeps the budget: a follower takes in whatever it added)
                self.supervisor.watch(self.pools.add(worker_id, worker_id.rsplit("-", 1)[0], handle, STARTING,
                                                     within_budget=False))

    async def step_down(self) -> None:
        """Stopping: give up the lead (its controller stops), and hand it on at once."""
        if self.leadership.leads:
            await self.leadership.give_up()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(awaitable(self.book.release.remote(self.owner)), 2)
