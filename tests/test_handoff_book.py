"""The handoff's bookkeeping without a model or Ray: phases, leases on a fake clock, releases
and aborts that arrive mid-transfer, backpressure order, and (hypothesis) that under any order
of verbs no block is freed while a transfer uses it and every block is freed or committed once
the traffic drains."""
from __future__ import annotations

import pytest
from common import Clock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from workers.handoff import HandoffBook, HandoffError, Outcome, Phase


def test_lease_expires_only_while_held_and_restarts_after_a_send():
    clock = Clock()
    book = HandoffBook(lease_s=10, clock=clock)
    book.hold("a")
    book.hold("b")
    clock.t += 9
    assert book.expired() == []
    book.start_send("b")                      # a pull is reading b's blocks: its lease pauses
    clock.t += 2
    assert book.expired() == ["a"] and book.phase("a") is None
    assert book.phase("b") is Phase.SENDING
    assert book.end_send("b") is Outcome.NOTHING and book.phase("b") is Phase.HELD
    clock.t += 9.5                            # a fresh lease from the end of the send
    assert book.expired() == []
    clock.t += 1
    assert book.expired() == ["b"]
    assert book.num_held == 0


def test_a_release_during_a_send_waits_for_the_send():
    book = HandoffBook()
    book.hold("a")
    book.start_send("a")
    assert book.release("a") is Outcome.DEFERRED
    assert book.num_held == 1
    assert book.end_send("a") is Outcome.FREE
    assert book.phase("a") is None
    assert book.release("a") is Outcome.NOTHING            # acknowledged twice: harmless


def test_an_abort_during_a_pull_frees_instead_of_committing():
    book = HandoffBook()
    book.wait_for_room("a", "op-a")
    assert book.admit(lambda op: [1, 2]) == [("op-a", [1, 2])]
    book.start_transfer("a")
    assert book.abort("a") is Outcome.DEFERRED
    assert book.num_receiving == 1
    assert book.finish_transfer("a", ok=True) is Outcome.FREE
    assert book.num_receiving == 0


def test_pending_requests_reserve_oldest_first_and_stop_at_the_first_without_room():
    book = HandoffBook()
    for rid in "abcd":
        book.wait_for_room(rid, rid)
    room = {"a": [0], "b": None, "c": [1]}
    assert book.admit(lambda op: room.get(op)) == [("a", [0])]        # b blocks c (FIFO)
    assert (book.num_pending, book.num_receiving) == (3, 1)
    assert book.abort("b") is Outcome.NOTHING                         # pending: nothing allocated
    assert book.admit(lambda op: room.get(op)) == [("c", [1])]
    assert book.phase("d") is Phase.PENDING
    assert book.abort("c") is Outcome.FREE                            # reserved, not yet pulling


def test_a_send_or_loan_gets_the_blocks_held_or_nothing():
    clock = Clock()
    book = HandoffBook(lease_s=10, clock=clock)
    assert book.start_send("a") is None and book.lend("a", 1.0) is None     # never held
    book.hold("a", [7, 3, 9])
    assert book.lend("a", 2.0) == ((7, 3, 9), clock.t + 2.0)
    assert book.start_send("a") is None and book.lend("a", 2.0) is None     # already out
    book.hold("b", [4])
    assert book.abort("b") is Outcome.FREE
    assert book.start_send("b") is None                                   # aborted: nothing to send


def test_a_loan_ends_with_the_readers_release_or_at_its_deadline():
    """The reader's release frees at once (it has stopped reading); an abort meanwhile waits for
    it; a reader that never comes back loses the blocks at the deadline, not at the lease."""
    clock = Clock()
    book = HandoffBook(lease_s=100, clock=clock)
    for rid in "abc":
        book.hold(rid, [1])
        book.lend(rid, 5.0)
    assert book.release("a") is Outcome.FREE
    assert book.abort("b") is Outcome.DEFERRED                          # the reader is still reading
    assert book.release("b") is Outcome.FREE
    clock.t += 4.9
    assert book.expired() == []
    clock.t += 0.2
    assert book.expired() == ["c"] and book.phase("c") is None
    assert book.release("c") is Outcome.NOTHING                         # late: already freed


@pytest.mark.parametrize("verb", ["end_send", "start_transfer", "finish_transfer"])
def test_verbs_out_of_order_are_errors(verb):
    book = HandoffBook()
    book.wait_for_room("p", "op")
    args = ("p", True) if verb == "finish_transfer" else ("p",)
    with pytest.raises(HandoffError):
        getattr(book, verb)(*args)
    with pytest.raises(HandoffError):
        book.hold("p")                                                # already in the handoff


class HandoffMachine(RuleBasedStateMachine):
    """Random interleavings of both sides' verbs against a model of who owns blocks."""
    RIDS = ("a", "b", "c")

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.book = HandoffBook(lease_s=5, clock=self.clock)
        self.allocated: set[str] = set()     # rids whose blocks are allocated on this worker
        self.busy: set[str] = set()          # rids whose blocks a transfer is using
        self.lent: set[str] = set()          # rids a receiver reads itself (it releases them)
        self.room = True

    def _carry_out(self, rid: str, outcome: Outcome) -> None:
        if outcome is Outcome.FREE:
            assert rid not in self.busy, f"{rid}'s blocks freed while a transfer uses them"
            assert rid in self.allocated
            self.allocated.discard(rid)
        elif outcome is Outcome.COMMIT:
            self.allocated.discard(rid)       # joined the batch: the engine owns it now

    @rule(rid=st.sampled_from(RIDS))
    def hold(self, rid):
        if self.book.phase(rid) is None:
            self.book.hold(rid)
            self.allocated.add(rid)

    @rule(rid=st.sampled_from(RIDS))
    def send(self, rid):
        if self.book.phase(rid) is Phase.HELD:
            self.book.start_send(rid)
            self.busy.add(rid)

    @rule(rid=st.sampled_from(RIDS))
    def send_ends(self, rid):
        if self.book.phase(rid) is Phase.SENDING and rid not in self.lent:
            self.busy.discard(rid)
            self._carry_out(rid, self.book.end_send(rid))

    @rule(rid=st.sampled_from(RIDS))
    def lend(self, rid):
        if self.book.phase(rid) is Phase.HELD:
            assert self.book.lend(rid, 3.0) is not None
            self.busy.add(rid)
            self.lent.add(rid)

    @rule(rid=st.sampled_from(RIDS))
    def reader_done(self, rid):
        """The receiver stops reading a loan and releases it (what it read kept or not)."""
        if rid in self.lent:
            self.busy.discard(rid)
            self.lent.discard(rid)
            self._carry_out(rid, self.book.release(rid))

    @rule(rid=st.sampled_from(RIDS))
    def release(self, rid):
        if rid not in self.lent:            # a loan is released by its reader only
            self._carry_out(rid, self.book.release(rid))

    @rule(rid=st.sampled_from(RIDS))
    def wait(self, rid):
        if self.book.phase(rid) is None:
            self.book.wait_for_room(rid, rid)

    @rule(room=st.booleans())
    def admit(self, room):
        for op, _ in self.book.admit(lambda op: [0] if room else None):
            self.allocated.add(op)

    @rule(rid=st.sampled_from(RIDS))
    def pull(self, rid):
        if self.book.phase(rid) is Phase.RESERVED:
            self.book.start_transfer(rid)
            self.busy.add(rid)

    @rule(rid=st.sampled_from(RIDS), ok=st.booleans())
    def pull_ends(self, rid, ok):
        if self.book.phase(rid) is Phase.TRANSFERRING:
            self.busy.discard(rid)
            self._carry_out(rid, self.book.finish_transfer(rid, ok))

    @rule(rid=st.sampled_from(RIDS))
    def abort(self, rid):
        self._carry_out(rid, self.book.abort(rid))

    @rule(dt=st.floats(0, 10))
    def tick(self, dt):
        self.clock.t += dt
        for rid in self.book.expired():
            if rid in self.lent:            # past its deadline the reader drops what it read
                self.busy.discard(rid)
                self.lent.discard(rid)
            self._carry_out(rid, Outcome.FREE)

    @invariant()
    def counts_match_phases(self):
        phases = [self.book.phase(r) for r in self.RIDS]
        assert self.book.num_held == sum(p in (Phase.HELD, Phase.SENDING) for p in phases)
        assert self.book.num_receiving == sum(p in (Phase.RESERVED, Phase.TRANSFERRING) for p in phases)
        assert self.book.num_pending == phases.count(Phase.PENDING)

    def teardown(self):
        """Drain: transfers end, everything left is aborted; no block may stay allocated."""
        for rid in self.RIDS:
            phase = self.book.phase(rid)
            if phase is Phase.SENDING:
                self.busy.discard(rid)
                self._carry_out(rid, self.book.release(rid) if rid in self.lent else self.book.end_send(rid))
                self.lent.discard(rid)
            elif phase is Phase.TRANSFERRING:
                self.busy.discard(rid)
                self._carry_out(rid, self.book.finish_transfer(rid, ok=False))
            self._carry_out(rid, self.book.abort(rid))
        assert not self.allocated, f"blocks never came back: {self.allocated}"
        assert all(self.book.phase(r) is None for r in self.RIDS)


TestHandoffMachine = HandoffMachine.TestCase
TestHandoffMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
