"""A cluster's book (cluster/book.py), as plain Python on fake clocks: the lead passes from a
holder that stops renewing to the next claimant, and only then; the requests the other routers
relay through it reach the leader's log so that the controller reads what one router taking
every request would have read."""
from __future__ import annotations

import math

import pytest

from cluster.book import ClusterBook
from cluster.controller import observe
from common import Clock
from router.slo import RequestLog
from workers.leases import LeaderLease


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
