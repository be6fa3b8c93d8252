"""The live pool registry (router/pools.py) on plain state: the state machine, what the dispatcher
may pick, the budget, drains that flip or remove, losses while draining, and what listeners hear."""
from __future__ import annotations

import pytest

from router.pools import ACTIVE, DEAD, DRAINING, STARTING, STOPPED, Member, PoolRegistry
from workers.messages import LoadReport, TransferTotals
from workers.names import DECODE, PREFILL


def report(**kw) -> LoadReport:
    base = dict(worker_id="w", role=PREFILL, running=0, waiting=0, swapped=0, queued_prefill_tokens=0, kv_blocks_used=0,
                kv_blocks_total=64, steps=1, kv_transfer=TransferTotals())
    return LoadReport(**{**base, **kw})


def registry(budget=None) -> tuple[PoolRegistry, list]:
    reg = PoolRegistry.of([Member("prefill-0", PREFILL, "h0", ACTIVE), Member("decode-0", DECODE, "h1", ACTIVE),
                           Member("decode-1", DECODE, "h2", ACTIVE)], budget)
    heard = []
    reg.listen(lambda m, state, role: heard.append((m.worker_id, state, role, m.state, m.role)))
    return reg, heard


def test_a_drained_worker_flips_and_rejoins_the_other_pool():
    reg, heard = registry()
    reg.drain("decode-1", PREFILL)
    # Draining: neither pool picks it, it still counts as alive (it runs what it has).
    assert [m.worker_id for m in reg.active(DECODE)] == ["decode-0"]
    assert [m.worker_id for m in reg.active(PREFILL)] == ["prefill-0"]
    assert reg["decode-1"].alive and reg.coming(PREFILL)
    reg.finish_drain("decode-1")
    assert [m.worker_id for m in reg.active(PREFILL)] == ["prefill-0", "decode-1"]
    assert reg["decode-1"].role == PREFILL and not reg["decode-1"].leaving
    assert heard == [("decode-1", ACTIVE, DECODE, DRAINING, DECODE), ("decode-1", DRAINING, DECODE, ACTIVE, PREFILL)]


def test_a_follower_takes_each_workers_state_from_its_reports():
    """A router over pools another leads: a worker that stops accepting is draining here too,
    one that accepts again (in its new role) is active; dead or starting ones are left alone."""
    reg, heard = registry()
    reg.follow("decode-1", DECODE, accepting=True)                  # nothing new: nothing heard
    reg.follow("decode-1", DECODE, accepting=False)
    assert [m.worker_id for m in reg.active(DECODE)] == ["decode-0"] and reg["decode-1"].alive
    reg.follow("decode-1", PREFILL, accepting=False)                # flipped, not taken back yet
    reg.follow("decode-1", PREFILL, accepting=True)
    assert [m.worker_id for m in reg.active(PREFILL)] == ["prefill-0", "decode-1"]
    assert heard == [("decode-1", ACTIVE, DECODE, DRAINING, DECODE), ("decode-1", DRAINING, DECODE, DRAINING, PREFILL),
                     ("decode-1", DRAINING, PREFILL, ACTIVE, PREFILL)]
    reg.lost("decode-0")
    reg.follow("decode-0", DECODE, accepting=True)                  # its own pump brings it back
    assert reg["decode-0"].state == DEAD


def test_a_worker_drained_to_leave_stops_and_frees_its_slot():
    reg, _ = registry(budget=3)
    with pytest.raises(ValueError, match="budget of 3"):
        reg.add("decode-2", DECODE, "h3")
    reg.drain("decode-1", None)
    reg.finish_drain("decode-1")
    assert reg["decode-1"].state == STOPPED and len(reg.live()) == 2
    m = reg.add("prefill-1", PREFILL, "h3")                      # the slot is free again
    assert m.state == STARTING and not reg.active(PREFILL)[1:] and reg.coming(PREFILL)
    reg.activate("prefill-1")
    assert reg.count(PREFILL) == 2


def test_illegal_transitions_are_refused():
    reg, _ = registry()
    with pytest.raises(ValueError, match="already a decode worker"):
        reg.drain("decode-0", DECODE)
    reg.drain("decode-0", PREFILL)
    with pytest.raises(ValueError, match="not active"):
        reg.drain("decode-0", PREFILL)                           # twice
    with pytest.raises(ValueError, match="not draining"):
        reg.finish_drain("prefill-0")
    with pytest.raises(ValueError, match="not a pool transition"):
        reg.stop("decode-1")                                     # an active worker drains first
    reg.lost("decode-1")
    reg.stop("decode-1")                                         # never came back
    with pytest.raises(ValueError, match="not a pool transition"):
        reg.activate("decode-1")                                 # stopped is final
    with pytest.raises(ValueError, match="already in the pools"):
        reg.add("prefill-0", PREFILL, "again")


def test_lost_and_restarted_worker_returns_to_its_pool():
    reg, _ = registry()
    m = reg["decode-0"]
    m.report = report(role=DECODE)
    m.sent("r1", 5)
    reg.lost("decode-0")
    assert m.state == DEAD and m.report is None and not m.unreported and not m.alive
    assert reg.coming(DECODE) and [w.worker_id for w in reg.active(DECODE)] == ["decode-1"]
    reg.restarted("decode-0")
    assert m.state == ACTIVE and m.role == DECODE


def test_a_worker_lost_while_draining_completes_its_move_on_return():
    reg, heard = registry()
    reg.drain("decode-1", PREFILL)
    reg.lost("decode-1")
    reg.restarted("decode-1")                                    # a fresh process holds nothing
    assert reg["decode-1"].state == ACTIVE and reg["decode-1"].role == PREFILL
    reg.drain("prefill-0", None)
    reg.lost("prefill-0")
    reg.restarted("prefill-0")
    assert reg["prefill-0"].state == STOPPED
    assert heard[-1][3] == STOPPED


def test_idle_needs_a_report_after_the_last_send_and_nothing_held():
    m = Member("prefill-0", PREFILL, "h", ACTIVE)
    assert not m.idle()                                          # no report yet
    m.reported(report(), polled_at=0.0)
    assert m.idle()
    m.sent("r1", 100)                                            # sent: open here, not yet reported
    assert not m.idle()
    m.assigned.discard("r1")
    m.reported(report(held=1), polled_at=m.unreported["r1"][1] + 1)
    assert not m.unreported and not m.idle()                     # its KV waits for a pull
    for busy in (dict(running=1), dict(waiting=1), dict(pending=1), dict(receiving=1)):
        m.reported(report(**busy), polled_at=0.0)
        assert not m.idle(), busy
    m.reported(report(), polled_at=0.0)
    assert m.idle()
