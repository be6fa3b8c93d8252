"""The decode side of the handoff: a DecodeOp waits in the handoff book for room, its blocks are
reserved, and a thread of its own pulls the KV through its prefill peer's KVMover
(workers/kv_movers.py); the loop thread then commits the sequence to the batch, or frees the
blocks and tells the router (a retryable error: it resumes the request elsewhere).

A long prompt's KV may stream while it is prefilled (workers/kv_stream.py): the router's
KVMoreOp words feed the pull under way, or the op still waiting for room, or wait a while for
a DecodeOp they overtook (the actor's threads may reorder two calls).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from workers.engine_core import held_tokens_fit
from workers.handoff import HandoffBook, Outcome
from workers.kv_cache_manager import cdiv
from workers.kv_movers import LocalKV, Movers
from workers.kv_stream import KVFeed, StreamEnded, newer
from workers.messages import DecodeOp, ErrorEvent, HeldKV, KVMoreOp, TransferTotals
from workers.peers import peer, release_on
from workers.traces import WorkerTraces

log = logging.getLogger("pdcluster.worker")


class KVReceiver:
    def __init__(self, local: LocalKV, handoffs: HandoffBook, cluster_id: str, in_loop: Callable,
                 apply: Callable, publish: Callable, traces: WorkerTraces):
        """`in_loop(fn)` runs fn on the engine loop thread; `apply(rid, outcome, abort)` carries
        out the handoff book's decision there; `publish(events, samples)` puts events and metric
        samples in the outboxes; `traces`: the worker's record of traced requests (loop thread)."""
        self.local, self.handoffs, self.cluster_id = local, handoffs, cluster_id
        self.traces = traces
        self.in_loop, self.apply, self.publish = in_loop, apply, publish
        self.movers = Movers(local)
        self._feeds: dict[str, KVFeed] = {}          # each streamed pull's feed
        self._early: dict[str, tuple[float, KVMoreOp]] = {}   # words before their DecodeOp, with when
        self._lock = threading.Lock()                 # the totals (pull threads add, the loop reads)
        self._totals = TransferTotals()

    # -- the loop thread ---------------------------------------------------------------------------
    def wait_for_room(self, op: DecodeOp) -> None:
        if op.streaming and op.kv is None:
            raise ValueError("a streaming DecodeOp names the blocks computed so far (kv)")
        self.handoffs.wait_for_room(op.rid, op)
        if (early := self._early.pop(op.rid, None)) is not None:
            self.more(early[1])

    def more(self, op: KVMoreOp) -> None:
        """The router's next word on a streamed pull: to the op still waiting for room (the held
        KV's word makes it an ordinary DecodeOp), or to the pull under way, or kept a while for
        the DecodeOp it came before."""
        final = op.output_token_ids is not None
        waiting = self.handoffs.pending_op(op.rid)
        if waiting is not None:
            if newer(op.kv, final, waiting.kv, not waiting.streaming):
                if final and waiting.streaming and not held_tokens_fit(waiting.output_token_ids, op.output_token_ids):
                    # the same check a pull under way makes (engine_core.receive_token)
                    self._refuse_waiting(op.rid, waiting, f"{len(op.output_token_ids)} output tokens arrived "
                                         f"for a reservation that had {len(waiting.output_token_ids)} and "
                                         "awaited one more")
                    return
                waiting.kv = op.kv
                if final:
                    waiting.output_token_ids, waiting.streaming = list(op.output_token_ids), False
            return
        feed = self._feeds.get(op.rid)
        if feed is None:             # before its DecodeOp, or after its pull ended
            now = time.monotonic()
            timeout_s = self.local.timeout_s
            self._early = {r: w for r, w in self._early.items() if now - w[0] < timeout_s}
            known = self._early.get(op.rid)
            if known is None or newer(op.kv, final, known[1].kv, known[1].output_token_ids is not None):
                self._early[op.rid] = (now, op)
            return
        if final and not feed.final:
            try:
                self.local.engine.receive_token(op.rid, op.output_token_ids)
            except (KeyError, ValueError, AssertionError) as e:
                feed.end(f"the held KV's word does not fit its reservation: {e}")
                return
        feed.tell(op.kv, final)

    def _refuse_waiting(self, rid: str, op: DecodeOp, why: str) -> None:
        """A streamed handoff still waiting for room whose held word does not fit: it leaves the
        line, the prefill side frees its copy, and the router runs the request again."""
        self.handoffs.abort(rid)
        log.warning("worker %s: KV handoff of %s refused: %s", self.local.worker_id, rid, why)
        with self._lock:
            t = self._totals
            t.failures += 1
            t.failures_by_point = {**t.failures_by_point, "request": t.failures_by_point.get("request", 0) + 1}
        release_on(self.cluster_id, op.prefill_id, rid)
        self.traces.forget(rid)
        self.publish([ErrorEvent(rid, f"KV transfer failed: the held KV's word does not fit its reservation: {why}",
                                 retryable=True, cause="handoff_failed")])

    def abort(self, rid: str) -> None:
        """The router aborted the request: a streamed pull of it stops (the caller frees it)."""
        self._early.pop(rid, None)
        if (feed := self._feeds.get(rid)) is not None:
            feed.end(f"request {rid} was aborted", aborted=True)

    def admit(self) -> None:
        """Reserve blocks for waiting decode requests, oldest first, while there is room, and
        start each one's pull."""
        engine = self.local.engine

        def reserve(op: DecodeOp):
            return engine.reserve(op.rid, op.prompt_token_ids, op.output_token_ids, op.params, op.priority,
                                  num_receiving=self.handoffs.num_receiving, forks=op.forks, tpot_s=op.tpot_s,
                                  token_to_come=op.streaming)
        bs = engine.kv.block_size
        for op, dst in self.handoffs.admit(reserve):
            self.handoffs.start_transfer(op.rid)
            self.traces.mark(op.rid, "reserved")
            num_kv = len(op.prompt_token_ids) + len(op.output_token_ids) - 1 + op.streaming
            skip = cdiv(num_kv, bs) - len(dst)
            if op.streaming:
                self._feeds[op.rid] = KVFeed(op.kv)
            threading.Thread(target=self._pull, args=(op, dst, skip), daemon=True, name=f"pull-{op.rid}").start()

    def totals(self) -> TransferTotals:
        with self._lock:
            return dataclasses.replace(self._totals)

    # -- a pull's own thread -----------------------------------------------------------------------
    def _pull(self, op: DecodeOp, dst: list[int], skip: int) -> None:
        """Take the KV from the prefill worker into the reserved blocks (`dst`, after the `skip`
        leading blocks this worker's prefix cache holds): while the prompt is prefilled, for a
        streaming op whose mover can, else once it is held."""
        rid, prefill_id, faults = op.rid, op.prefill_id, self.local.faults
        feed = self._feeds.get(rid)
        point = ["request"]                 # where the pull is (workers/faults.py's FAILURE_POINTS)
        try:
            prefill = peer(self.cluster_id, prefill_id)
            t0, wall0 = time.monotonic(), time.time()
            busy = None                     # a streamed pull's seconds of copying (it also waits for words)
            mover = self.movers.mover_for(prefill_id, prefill) if dst else None
            if mover is not None and mover.streams and feed is not None:
                nbytes, busy = mover.pull_streamed(op, prefill, feed, dst, skip, point)
            else:
                if feed is not None:        # the KV travels once it is held: wait for that word
                    op = dataclasses.replace(op, kv=self._held_word(feed))
                    t0, wall0 = time.monotonic(), time.time()
                nbytes = mover.pull(op, prefill, dst, skip, point) if mover is not None else 0
            done = time.monotonic()
            pulled = {"pull_start": wall0, "pull_end": wall0 + (done - t0)}
            how = {"bytes": nbytes, "blocks_skipped": skip, "streamed": busy is not None,
                   "transport": mover.way if mover is not None else "none"}
            point[0] = "before_commit"
            faults.hit("recv", "before_commit")
            tail = done - max(t0, feed.final_at or t0) if feed is not None else done - t0
            self._record(nbytes, done - t0 if busy is None else busy, skip, tail)
        except Exception as e:
            aborted = isinstance(e, StreamEnded) and e.aborted
            if not aborted:             # an abort is the router's doing: nothing failed
                # The transport's errors say where it was; the blocks may hold part of the payload,
                # so the failure path below frees them and the sequence never joins the batch.
                said = getattr(e, "point", None)
                point = said if said == "refused" or point[0] == "request" and said else point[0]
                log.warning("worker %s: KV pull of %s failed at %s: %s", self.local.worker_id, rid, point, e)
                with self._lock:
                    t = self._totals
                    t.failures += 1     # a new dict: load reports already built keep theirs
                    t.failures_by_point = {**t.failures_by_point, point: t.failures_by_point.get(point, 0) + 1}
            release_on(self.cluster_id, prefill_id, rid)
            # (built here: `e` is unbound once this block ends)
            error = None if aborted else ErrorEvent(rid, f"KV transfer failed: {e}", retryable=True,
                                                    cause="handoff_failed")

            def failed():
                self.traces.forget(rid)
                self._feeds.pop(rid, None)
                if self.handoffs.finish_transfer(rid, ok=False) is Outcome.FREE:
                    self.local.engine.abort(rid)
                if error is not None:
                    self.publish([error])
            self.in_loop(failed)
            return
        prefill.release_kv.remote(rid)                  # acknowledged: the prefill side frees

        def committed():
            for name, t in pulled.items():
                self.traces.mark(rid, name, t)
            self.traces.mark(rid, "committed", **how)
            self._feeds.pop(rid, None)
            self.apply(rid, self.handoffs.finish_transfer(rid, ok=True), abort=True)
        self.in_loop(committed)

    def _held_word(self, feed: KVFeed) -> HeldKV:
        """A streamed pull's held KV, once the router has said it."""
        kv, final = feed.kv, feed.final
        while not final:
            kv, final = feed.wait(kv, self.local.timeout_s)
        return kv

    def _record(self, nbytes: int, seconds: float, reused: int, tail_s: float) -> None:
        with self._lock:
            t = self._totals
            t.bytes += nbytes
            t.count += 1
            t.seconds += seconds
            t.blocks_reused += reused
        self.publish((), {"kv_transfer_s": [seconds], "kv_tail_s": [tail_s]})
