"""Whether this router leads its cluster: the one record of it.

Several routers may serve one cluster; one leads: it holds the lead in the cluster's book
(cluster/run/book.py; cluster/run/lead.py claims and renews it). The leader restarts hung workers,
finishes drains and retires workers (router/supervisor.py), runs the pool controller, and
exports the workers' and pools' metrics; the others follow the pools as the workers report
them. Every part reads `leads` here, and the parts that act on a change hear it (`subscribe`),
in the order they subscribed. Plain Python: no Ray, no clock of its own.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable


class Leadership:
    def __init__(self, leads: bool = False):
        self.leads = leads
        self.term = 0                     # the book's term this router last held the lead in
        self.renewed_at = -math.inf       # when its claim last renewed the lead (monotonic)
        self._on_take: list[Callable[[bool], None]] = []
        self._on_give_up: list[Callable[[], Awaitable | None]] = []

    def subscribe(self, on_take: Callable[[bool], None] | None = None,
                  on_give_up: Callable[[], Awaitable | None] | None = None) -> None:
        """`on_take(resume)` runs when this router comes to lead (`resume`: it led last, and only
        lost touch with the book for a while, so its own drains go on); `on_give_up()` when it
        stops (it may return an awaitable: awaited in turn)."""
        if on_take is not None:
            self._on_take.append(on_take)
        if on_give_up is not None:
            self._on_give_up.append(on_give_up)

    def take(self, resume: bool = False) -> None:
        self.leads = True
        for fn in self._on_take:
            fn(resume)

    async def give_up(self) -> None:
        self.leads = False
        for fn in self._on_give_up:
            result = fn()
            if inspect.isawaitable(result):
                await result
