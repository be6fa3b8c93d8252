"""The thread that owns a worker's engine. Other threads never touch the engine: they hand this
thread closures (`call`, or `ask` to wait for the answer). Each turn runs the closures that came,
then the worker's `turn` (its chores and, while there is work, one engine step); a turn that
found nothing to do waits for the next closure (briefly: the wait also paces lease expiry and
the retries of reservations waiting for room)."""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger("pdcluster.worker")
IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, name: str, turn: Callable[[], bool], timeout_s: float):
        """`turn()` runs on the thread after each batch of closures and says whether it worked
        (an idle turn waits); `timeout_s` bounds `ask` unless told otherwise."""
        self.name, self.turn, self.timeout_s = name, turn, timeout_s
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], object]) -> None:
        """Run fn on the loop thread, soon; its exceptions are logged there."""
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify_all()

    def ask(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run fn on the loop thread, after every closure that came before, and return what it
        returns (or raise what it raised) here."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:     # handed back to the caller's thread
                fut.set_exception(e)
        self.call(run)
        return fut.result(timeout=timeout_s or self.timeout_s)

    def stop(self, join_s: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def _run(self) -> None:
        while not self._stop:
            with self._cv:
                commands, self._inbox = self._inbox, deque()
            for fn in commands:
                try:
                    fn()
                except Exception:
                    log.exception("%s: command failed", self.name)
            if not self.turn():
                with self._cv:
                    if not self._inbox and not self._stop:
                        self._cv.wait(IDLE_WAIT_S)
