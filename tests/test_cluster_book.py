"""A cluster's book (cluster/run/book.py), as plain Python on fake clocks: the lead passes from a
holder that stops renewing to the next claimant, and only then; its term outlives the book's
restarts (its lead store), so a router that led keeps its drains across one and a router
taking over gets a higher term; the requests the other routers relay through it reach the
leader's log so that the controller reads what one router taking every request would have read.
And once live on Ray: a book that Ray restarts goes on from its term."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

from cluster.run.book import ClusterBook
from cluster.run.controller import observe
from common import Clock, wait_for
from router.slo import RequestLog
from workers.leases import LeaderLease, LeadStore


def test_the_lead_passes_only_once_its_holder_lets_it_lapse():
    clock = Clock()
    lead = LeaderLease(clock)
    assert lead.claim("serve~1", 4.0) == "serve~1" and lead.term == 1
    clock.t += 3.0
    assert lead.claim("r1~7", 4.0) == "serve~1"              # held: the claimant follows
    assert lead.claim("serve~1", 4.0) == "serve~1"           # renewed at 103, to 107
    clock.t += 3.9
    assert lead.claim("r1~7", 4.0) == "serve~1" and lead.term == 1
    clock.t += 0.2                                           # 107.1: the holder went silent
    assert lead.claim("r2~3", 4.0) == "r2~3" and lead.term == 2
    assert lead.claim("serve~1", 4.0) == "r2~3"              # back from a stall: it follows now
    lead.release("serve~1")                                  # not the holder's: nothing changes
    assert lead.claim("r1~7", 4.0) == "r2~3"
    lead.release("r2~3")                                     # a clean stop: the next claim takes it
    assert lead.claim("r1~7", 4.0) == "r1~7" and lead.term == 3
    with pytest.raises(ValueError, match="lease"):
        lead.claim("r1~7", 0)



def test_a_restarted_book_goes_on_from_its_term_and_its_holder_keeps_it():
    """The book's process dies and a new one starts on the same lead store: the term goes on
    from the last one given; the holder holds the lead for one lease from the restart and its
    claim keeps the term; anyone else takes it only after, at a higher term."""
    clock, store = Clock(), LeadStore()
    book = ClusterBook({}, clock=clock, lead_store=store)
    assert book.claim("serve~1", 4.0) == ("serve~1", 1)
    book.release("serve~1")
    assert book.claim("r1~7", 4.0) == ("r1~7", 2)
    clock.t += 3.0
    book = ClusterBook({}, clock=clock, lead_store=store)         # restarted (r1's lease had 1 s left)
    assert (book.lead.holder, book.lead.term) == ("r1~7", 2)
    clock.t += 3.9                                               # one lease from the restart: still r1's
    assert book.claim("serve~1", 4.0) == ("r1~7", 2)
    assert book.claim("r1~7", 4.0) == ("r1~7", 2)                # its claim: the same term (drains go on)
    clock.t += 4.1                                               # r1 went silent
    assert book.claim("serve~1", 4.0) == ("serve~1", 3)          # another reign: a higher term
    book = ClusterBook({}, clock=clock, lead_store=store)         # restarted again, holder and all
    clock.t += 4.1
    assert book.claim("r2~3", 4.0) == ("r2~3", 4)
    # A holder that released it before the restart holds it no longer: the next claim takes it.
    book.release("r2~3")
    book = ClusterBook({}, clock=clock, lead_store=store)
    assert book.claim("r1~7", 4.0) == ("r1~7", 5)


def test_a_new_term_is_saved_before_it_is_given():
    """A claim that would change the holder while the store cannot save says so, and changes
    nothing: no term is ever given that a restarted book could give again."""
    class Flaky(LeadStore):
        down = False

        def save(self, *record):
            if self.down:
                raise ConnectionError("the GCS is away")
            super().save(*record)
    clock, store = Clock(), Flaky()
    book = ClusterBook({}, clock=clock, lead_store=store)
    assert book.claim("serve~1", 4.0) == ("serve~1", 1)
    clock.t += 5.0
    store.down = True
    assert book.claim("serve~1", 4.0) == ("serve~1", 1)          # a renewal saves nothing
    clock.t += 5.0
    with pytest.raises(ConnectionError):
        book.claim("r1~7", 4.0)
    assert (book.lead.holder, book.lead.term) == ("serve~1", 1)
    store.down = False
    assert book.claim("r1~7", 4.0) == ("r1~7", 2)
    assert ClusterBook({}, clock=clock, lead_store=store).lead.term == 2


class BookHandle:
    """What a router calls (`book.claim.remote(...)`, `book.release.remote(...)`), answered at
    once by a plain ClusterBook; `book = None` while its process is down (calls fail)."""

    def __init__(self, book: ClusterBook | None):
        self.book = book

    def __getattr__(self, name):
        async def call(*args):
            if self.book is None:
                raise ConnectionError("the book's actor died")
            return getattr(self.book, name)(*args)
        return SimpleNamespace(remote=call)


def test_the_router_that_led_keeps_its_drains_across_a_restart_of_the_book(monkeypatch):
    """`LeadKeeper.claim`'s decision across a restart of the book: r0 leads (term 2)
    and drains a worker; it loses the book for longer than its lease (it follows); Ray restarts
    the book; r0 takes the lead back at term 2, so its drain goes on. Later r0 stalls, r1 leads
    meanwhile (term 3) and leaves: r0's next claim gives term 4, and r0 calls off its old drain
    even though it never saw itself lose the lead."""
    import asyncio
    import time

    from cluster.run import lead, serve
    from cluster.run.lead import LeadKeeper
    from cluster.run.spec import ClusterSpec
    from router.dispatch import Dispatcher
    from router.metrics import Metrics
    from router.supervisor import Supervisor
    from router.pools import ACTIVE, DRAINING, Member, PoolRegistry
    from workers.names import DECODE, DISAGGREGATED, PREFILL
    monkeypatch.setattr(lead, "find_book", lambda cluster_id: object())      # away, not removed
    lease_s = 4.0
    clock, store = Clock(), LeadStore()
    handle = BookHandle(ClusterBook({}, clock=clock, lead_store=store))

    def router(router_id: str) -> serve.ServingCluster:
        pools = PoolRegistry.of([Member(w, w.rsplit("-", 1)[0], object(), ACTIVE)
                                 for w in ("prefill-0", "decode-0", "decode-1")])
        c = serve.ServingCluster(ClusterSpec(model="tiny", router_lease_s=lease_s), attach=([], []), book=handle,
                                 router_id=router_id)
        c.pools = pools
        metrics = Metrics(workers=False)
        c.supervisor = Supervisor(Dispatcher(pools, DISAGGREGATED, metrics), c.leadership)
        c.lead = LeadKeeper("default", lease_s, handle, c.leadership, router_id, pools, c.supervisor,
                            metrics.requests, lambda: None)
        return c

    r0, r1 = router("r0"), router("r1")
    claim = lambda r: asyncio.run(r.lead.claim())               # noqa: E731
    claim(r1)
    asyncio.run(r1.lead.step_down())                             # r1 led first (term 1), and left
    claim(r0)
    assert r0.leads and r0.leadership.term == 2
    r0.pools.drain("decode-1", PREFILL)                          # r0's own drain
    handle.book = None                                           # the book's node dies ...
    r0.leadership.renewed_at = time.monotonic() - lease_s - 1    # ... for longer than r0's lease
    claim(r0)
    assert not r0.leads                                          # it follows meanwhile
    handle.book = ClusterBook({}, clock=clock, lead_store=store)  # Ray restarts the book
    claim(r1)
    assert not r1.leads                                          # r0's for one lease from the restart
    claim(r0)
    assert r0.leads and r0.leadership.term == 2
    assert (r0.pools["decode-1"].state, r0.pools["decode-1"].to_role) == (DRAINING, PREFILL)
    # r0 stalls past its lease (no claim), the book restarts once more, r1 leads and leaves.
    handle.book = ClusterBook({}, clock=clock, lead_store=store)
    clock.t += lease_s + 0.1
    claim(r1)
    assert r1.leads and r1.leadership.term == 3
    asyncio.run(r1.lead.step_down())
    claim(r0)                                                    # it thought it still led
    assert r0.leads and r0.leadership.term == 4
    assert (r0.pools["decode-1"].state, r0.pools["decode-1"].role, r0.pools["decode-1"].to_role) == \
        (ACTIVE, DECODE, None)

def test_relayed_requests_read_as_one_router_taking_them_all():
    """Two routers, each on its own clock (other processes, other epochs), relay through the
    book to a leader on a third; the leader's log then gives the controller's `observe` the
    same reading as one log that took every request itself."""
    # Clock offsets: the leader's and the single log's read 1000 when the book's reads 50 and r1's 7.
    offsets = {"lead": 950.0, "r1": -43.0, "one": 950.0}
    book_clock = Clock(50.0)
    clocks = {k: Clock(50.0 + off) for k, off in offsets.items()}
    logs = {k: RequestLog(horizon_s=300.0, clock=c) for k, c in clocks.items()}
    book = ClusterBook({}, clock=book_clock)
    events = []                               # (book time, what), in time order
    for i in range(40):                       # a request every 0.5 s to each router; 2 s each
        for router, at, scale, met in (("lead", 50.0 + 0.5 * i, 1, i % 3 != 0), ("r1", 50.25 + 0.5 * i, 2, i % 3 == 0)):
            tokens = (scale * (100 + 10 * i), 40 + i)
            for log in (router, "one"):
                events.append((at, "arrive", log, tokens, met))
                events.append((at + 2.0, "finish", log, tokens, met, at))
    events += [(50.0 + 4.1 * k, "relay") for k in range(1, 7)]
    events.sort(key=lambda e: e[0])
    posted = -math.inf
    for t, what, *rest in events:
        book_clock.t = t
        for k, c in clocks.items():
            c.t = t + offsets[k]
        if what == "arrive":
            log, (prompt, max_tokens), _ = rest
            logs[log].arrived(prompt, max_tokens)
        elif what == "finish":
            log, (prompt, max_tokens), met, at = rest
            logs[log].finished(at + offsets[log], max_tokens // 2, max_tokens, met, True)
        else:                                 # a relay turn: r1 posts, the leader takes
            cut = clocks["r1"]()
            arrivals, finishes = logs["r1"].aged_since(posted)
            posted = cut
            book.post("r1~1", arrivals, finishes)
            logs["lead"].merge_aged(*book.take("serve~1"))
    assert book.take("serve~1") == ([], [])                  # nothing twice
    leader, one = logs["lead"], logs["one"]
    assert len(leader.arrivals) == len(one.arrivals) == 80 and len(leader.finishes) == len(one.finishes) == 80
    now = clocks["lead"]()
    for window in (10.0, 30.0):
        got = observe(leader, now, interval_s=5.0, window_s=window)
        want = observe(one, now, interval_s=5.0, window_s=window)
        for field in ("arrival_rate", "mean_prompt_tokens", "mean_output_tokens", "ttft_attainment",
                      "tpot_attainment"):
            assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    # The leader's own requests never come back to it, and a second leader gets the history.
    assert book.take("r1~1") == ([], [])
    assert len(book.take("r2~1")[0]) == 40


def test_the_book_keeps_relayed_requests_only_within_its_horizon():
    clock = Clock()
    book = ClusterBook({"cluster_id": "x"}, horizon_s=60.0, clock=clock)
    book.post("r1~1", [(0.0, 10, 20)], [])
    clock.t += 61.0
    book.post("r1~1", [(0.0, 11, 20)], [(1.0, 3.0, 5, 20, True, False)])
    arrivals, finishes = book.take("serve~1")
    assert arrivals == [(0.0, 11, 20)] and finishes == [(1.0, 3.0, 5, 20, True, False)]
    assert book.settings() == {"cluster_id": "x"}



def test_a_book_that_ray_restarts_goes_on_from_its_term(ray_session):
    """Live: the book's actor is killed and Ray restarts it; its lead record lives in Ray's
    internal KV, so the term is not reset: the holder's claim keeps its term, another's waits,
    and the next reign's term is higher than every one before the restart."""
    import ray

    from cluster.run.launcher import KVLeadStore, open_book
    from cluster.run.spec import ClusterSpec
    spec = ClusterSpec(model="tiny", cluster_id=f"booktest{os.getpid()}")
    book = open_book(spec)
    lease_s = 3600.0                                             # never lapses here: no clock bounds
    try:
        assert tuple(ray.get(book.claim.remote("serve~1", lease_s))) == ("serve~1", 1)
        ray.get(book.release.remote("serve~1"))
        assert tuple(ray.get(book.claim.remote("r1~7", lease_s))) == ("r1~7", 2)
        pid = ray.get(book.__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(book, no_restart=False)
        wait_for(lambda: _book_pid(book), lambda p: p not in (None, pid), 60)
        assert tuple(ray.get(book.claim.remote("serve~1", lease_s))) == ("r1~7", 2)   # still r1's
        assert tuple(ray.get(book.claim.remote("r1~7", lease_s))) == ("r1~7", 2)      # its term kept
        ray.get(book.release.remote("r1~7"))
        assert tuple(ray.get(book.claim.remote("serve~1", lease_s))) == ("serve~1", 3)
    finally:
        ray.kill(book, no_restart=True)
        KVLeadStore(spec.cluster_id).clear()


def _book_pid(book):
    import ray
    try:
        return ray.get(book.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    except Exception:                   # restarting
        return None
