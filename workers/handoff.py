"""The KV handoff's bookkeeping on one worker: which request is in which phase, and leases.

Plain Python over plain state with an injectable clock (no torch, no Ray): the worker's loop
thread owns it, the engine does the memory verbs it decides on, the transport moves bytes.

    prefill side (sender)                        decode side (receiver)
    hold ─▶ HELD ──start_send/lend──▶ SENDING    wait ─▶ PENDING ──admit (room)──▶ RESERVED
             │  ▲                   │                                                │ start_transfer
             │  └──end_send─────────┘                                                ▼
             ├─ release (ack/abort) ─▶ freed                         TRANSFERRING ──finish_transfer──▶
             └─ lease expires ───────▶ freed                           committed (ok) or freed (failed)

A block that a transfer is reading or writing is never freed under it: a release or an abort
that arrives mid-transfer is remembered and carried out when the transfer ends.

The held block ids are recorded at `hold`, so a send starts without the engine: the prefill
side's verbs are safe from any thread (one lock), and a pull never waits behind a step. A *lent*
send is read by the receiver itself (shared memory on one node): it ends with the receiver's
release, or at its deadline, after which the receiver must not trust what it copied.
"""
from __future__ import annotations

import enum
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class Phase(enum.Enum):
    HELD = "held"                    # prefill done, blocks kept for a pull, lease running
    SENDING = "sending"              # a pull is reading the held blocks (lease paused)
    PENDING = "pending"              # decode side: waiting for room to reserve blocks
    RESERVED = "reserved"            # blocks reserved, the pull not started
    TRANSFERRING = "transferring"    # the pull is writing into the reserved blocks


class Outcome(enum.Enum):
    """What the caller must do to the engine after a bookkeeping verb."""
    NOTHING = "nothing"              # nothing held for it (unknown, or only pending)
    FREE = "free"                    # free its blocks now (engine.release / engine.abort)
    COMMIT = "commit"                # the KV arrived: the sequence joins the batch
    DEFERRED = "deferred"            # a transfer is using its blocks: freed when it ends


class HandoffError(RuntimeError):
    """A verb out of order (a bug, or a peer asking for KV this worker does not hold)."""


@dataclass(slots=True)
class _Entry:
    phase: Phase
    expires_at: float = 0.0          # HELD: lease deadline
    release_requested: bool = False  # SENDING/TRANSFERRING: free when the transfer ends
    op: object = None                # PENDING: the decode operation waiting for room
    block_ids: tuple[int, ...] = ()  # HELD/SENDING: the prompt's KV blocks, in token order
    lent: bool = False               # SENDING: the receiver reads the blocks itself, until expires_at


def _locked(verb):
    @functools.wraps(verb)
    def locked(self, *args, **kwargs):
        with self._lock:
            return verb(self, *args, **kwargs)
    return locked


class HandoffBook:
    def __init__(self, lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"the KV lease must be > 0 s, got {lease_s}")
        self.lease_s, self.clock = lease_s, clock
        self._entries: dict[str, _Entry] = {}
        self._pending: deque[str] = deque()          # PENDING rids, oldest first
        self._lock = threading.RLock()               # the loop thread and the senders' threads

    @_locked
    def phase(self, rid: str) -> Phase | None:
        e = self._entries.get(rid)
        return None if e is None else e.phase

    @_locked
    def count(self, *phases: Phase) -> int:
        return sum(e.phase in phases for e in self._entries.values())

    @_locked
    def rids(self) -> list[str]:
        """Every request in the handoff, whatever its phase."""
        return list(self._entries)

    @property
    def num_held(self) -> int:
        return self.count(Phase.HELD, Phase.SENDING)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_receiving(self) -> int:
        return self.count(Phase.RESERVED, Phase.TRANSFERRING)

    def _expect(self, rid: str, *phases: Phase) -> _Entry:
        e = self._entries.get(rid)
        if e is None or e.phase not in phases:
            have = "nothing" if e is None else e.phase.value
            raise HandoffError(f"request {rid}: expected {'/'.join(p.value for p in phases)}, found {have}")
        return e

    # -- the prefill side ------------------------------------------------------------------------
    @_locked
    def hold(self, rid: str, block_ids: list[int] = ()) -> None:
        if rid in self._entries:
            raise HandoffError(f"request {rid} is already in the handoff ({self._entries[rid].phase.value})")
        self._entries[rid] = _Entry(Phase.HELD, self.clock() + self.lease_s, block_ids=tuple(block_ids))

    @_locked
    def start_send(self, rid: str) -> tuple[int, ...] | None:
        """A pull begins reading the held blocks (returned; None when nothing is held for `rid`:
        released, aborted or expired); the lease stops while it runs."""
        e = self._entries.get(rid)
        if e is None or e.phase is not Phase.HELD:
            return None
        e.phase = Phase.SENDING
        return e.block_ids

    @_locked
    def lend(self, rid: str, timeout_s: float) -> tuple[tuple[int, ...], float] | None:
        """The receiver reads the held blocks itself: (block ids, the deadline on this book's
        clock), or None when nothing is held. Its release ends the loan; past the deadline the
        blocks are freed (a receiver that died mid-read leaks nothing), so a receiver that
        finishes after it must drop what it read."""
        ids = self.start_send(rid)
        if ids is None:
            return None
        e = self._entries[rid]
        e.lent, e.expires_at = True, self.clock() + timeout_s
        return ids, e.expires_at

    @_locked
    def end_send(self, rid: str) -> Outcome:
        """The send ended (either way). FREE if a release came meanwhile; else held again,
        with a fresh lease (the receiver acknowledges or gives up next)."""
        e = self._expect(rid, Phase.SENDING)
        if e.release_requested:
            del self._entries[rid]
            return Outcome.FREE
        e.phase, e.expires_at = Phase.HELD, self.clock() + self.lease_s
        return Outcome.NOTHING

    @_locked
    def release(self, rid: str) -> Outcome:
        """The receiver has the KV or gave up (a lent send ends here), or the request was aborted."""
        e = self._entries.get(rid)
        if e is None or e.phase not in (Phase.HELD, Phase.SENDING):
            return Outcome.NOTHING
        if e.phase is Phase.SENDING and not e.lent:
            e.release_requested = True
            return Outcome.DEFERRED
        del self._entries[rid]
        return Outcome.FREE

    @_locked
    def expired(self) -> list[str]:
        """Held requests whose lease ran out, and loans past their deadline (removed from the
        book: the caller frees them)."""
        now = self.clock()
        gone = [rid for rid, e in self._entries.items()
                if (e.phase is Phase.HELD or e.lent) and e.expires_at < now]
        for rid in gone:
            del self._entries[rid]
        return gone

    # -- the decode side ---------------------------------------------------------------------------
    @_locked
    def wait_for_room(self, rid: str, op: object) -> None:
        if rid in self._entries:
            raise HandoffError(f"request {rid} is already in the handoff ({self._entries[rid].phase.value})")
        self._entries[rid] = _Entry(Phase.PENDING, op=op)
        self._pending.append(rid)

    @_locked
    def pending_op(self, rid: str) -> object | None:
        """The decode operation of a request still waiting for room (None once it has blocks)."""
        e = self._entries.get(rid)
        return e.op if e is not None and e.phase is Phase.PENDING else None

    @_locked
    def admit(self, reserve: Callable[[object], list[int] | None]) -> list[tuple[object, list[int]]]:
        """Reserve blocks for pending requests, oldest first, while `reserve(op)` finds room
        (it returns the block ids, or None: backpressure, try again later)."""
        admitted = []
        while self._pending:
            rid = self._pending[0]
            e = self._entries[rid]
            blocks = reserve(e.op)
            if blocks is None:
                break
            self._pending.popleft()
            admitted.append((e.op, blocks))
            e.phase, e.op = Phase.RESERVED, None
        return admitted

    @_locked
    def start_transfer(self, rid: str) -> None:
        self._expect(rid, Phase.RESERVED).phase = Phase.TRANSFERRING

    @_locked
    def finish_transfer(self, rid: str, ok: bool) -> Outcome:
        """COMMIT when the KV arrived and nobody aborted meanwhile; else FREE."""
        e = self._expect(rid, Phase.TRANSFERRING)
        del self._entries[rid]
        return Outcome.COMMIT if ok and not e.release_requested else Outcome.FREE

    # -- either side ---------------------------------------------------------------------------------
    @_locked
    def abort(self, rid: str) -> Outcome:
        """The request is cancelled wherever it is in the handoff."""
        e = self._entries.get(rid)
        if e is None:
            return Outcome.NOTHING
        if e.phase in (Phase.SENDING, Phase.TRANSFERRING):
            e.release_requested = True
            return Outcome.DEFERRED
        del self._entries[rid]
        if e.phase is Phase.PENDING:
            self._pending.remove(rid)
            return Outcome.NOTHING
        return Outcome.FREE
