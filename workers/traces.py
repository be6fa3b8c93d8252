"""A worker's record of its traced requests (ops that came with a traceparent): when each
arrived, which engine steps ran it, when its first token came, how its KV was pulled. Each
finished part goes to the router on the request's TokenEvent (`messages.TraceRecord`), which
turns it into spans (router/tracing.py): the worker needs no tracing library and no collector's
address, and an untraced request costs one truth test per step. The engine loop thread's,
like the engine; plain Python.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from workers.messages import MAX_TRACED_STEPS, TraceRecord

MAX_OPEN = 4096          # records kept at once: the oldest goes first (a request whose end never came)


class WorkerTraces:
    def __init__(self, worker_id: str, clock: Callable[[], float] = time.time):
        self.worker_id, self.clock = worker_id, clock
        self._open: dict[str, TraceRecord] = {}
        self._decodes_here: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._open)

    def __contains__(self, rid: str) -> bool:
        return rid in self._open

    def begin(self, rid: str, parent: str, part: str, arrived: float, decodes_here: bool = False) -> None:
        """A traced op came (`parent` its traceparent, "" when untraced: nothing is kept);
        `decodes_here`: a colocated request, whose decode part follows its prefill here."""
        if not parent:
            return
        if len(self._open) >= MAX_OPEN:
            self.forget(next(iter(self._open)))
        self._open[rid] = TraceRecord(parent, self.worker_id, part, {"arrived": arrived})
        if decodes_here:
            self._decodes_here.add(rid)

    def mark(self, rid: str, name: str, t: float | None = None, **attrs) -> None:
        rec = self._open.get(rid)
        if rec is not None:
            rec.marks.setdefault(name, self.clock() if t is None else t)
            rec.attrs.update(attrs)

    def steps(self, scheduled, start: float, end: float) -> None:
        """An engine step ran from `start` to `end`: `scheduled` is its (sequence, tokens) list."""
        for seq, n in scheduled:
            rec = self._open.get(seq.seq_id)
            if rec is None:
                continue
            rec.marks.setdefault("first_step", start)
            if len(rec.steps) < MAX_TRACED_STEPS:
                rec.steps.append([start, end, n])
            else:
                rec.attrs["steps_left_out"] = rec.attrs.get("steps_left_out", 0) + 1

    def output(self, rid: str, finished: bool, t: float) -> TraceRecord | None:
        """The request's step output at `t`: the part it ends, if it ends one (a prefill part at
        its first output, a colocated request's decode part starting then; any part at the
        request's end), to go with its event."""
        rec = self._open.get(rid)
        if rec is None:
            return None
        if rec.part == "prefill":
            rec.marks.setdefault("first_token", t)
            del self._open[rid]
            if not finished and rid in self._decodes_here:
                self._open[rid] = TraceRecord(rec.parent, self.worker_id, "decode", {"first_token": t})
            self._decodes_here.discard(rid)
            return rec
        if finished:
            rec.marks.setdefault("finished", t)
            del self._open[rid]
            return rec
        return None

    def forget(self, rid: str) -> None:
        self._open.pop(rid, None)
        self._decodes_here.discard(rid)
