"""The workers as the router sees them: the pool registry's one writer on the router's side.

One pump per worker reads its event stream (router/events.py): each frame brings the worker's
load report, metric samples and prefix-cache changes, which the supervisor records, and its
requests' events, which go to the dispatcher (router/dispatch.py `take_frame`). A heartbeat
renews this router's lease on every worker every quarter lease (workers/leases.py).

A worker that died, or hung (no frame within `hang_timeout_s`), leaves the pools, and every
request of this router open on it resumes elsewhere (the dispatcher's `resume_all`); the
leading router has Ray restart a hung one (`restart` kills its process), and each rejoins once
it answers `ready()` again, while every other worker forgets its transport pairs with the old
process. The leader also completes the drains the controller starts: a drained worker flips
its role, or leaves through `retire`. A follower (router/leadership.py) follows the roles and
drains the workers report instead.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.dispatch import Dispatcher, awaitable, fire, tell
from router.events import EventStream
from router.leadership import Leadership
from router.pools import ACTIVE, DEAD, DRAINING, STOPPED, Member
from workers import messages as msg

log = logging.getLogger("pdcluster.router")


@dataclass(frozen=True)
class SupervisionSettings:
    hang_timeout_s: float = 10.0       # a worker silent this long (no frame, no heartbeat answer) is hung
    restart_timeout_s: float = 300.0   # a worker not back (or not started) within this long leaves the pools
    router_lease_s: float = 10.0       # this router's lease on each worker (heartbeats every quarter of it)


class Supervisor:
    def __init__(self, dispatcher: Dispatcher, leadership: Leadership,
                 settings: SupervisionSettings = SupervisionSettings(),
                 restart: Callable[[object], None] | None = None, retire: Callable[[object], None] | None = None):
        """`restart(handle)` kills a hung worker's process so that Ray restarts it (blocking
        briefly); `retire(handle)` ends a drained worker that leaves the cluster (blocking)."""
        self.dispatcher, self.leadership, self.settings = dispatcher, leadership, settings
        self.pools, self.metrics, self.owner = dispatcher.pools, dispatcher.metrics, dispatcher.owner
        self._restart, self._retire = restart, retire
        self._lapsed: set[str] = set()       # workers that said our lease had lapsed there
        self._hung: set[str] = set()         # workers this router lost as hung while it followed, not back
        self._pumps: dict[str, asyncio.Task] = {}
        self._beat: asyncio.Task | None = None
        self._stopping = False
        self.sample_listeners: list[Callable[[str, str, dict], None]] = []   # (worker, role, samples)
        self.pools.listen(self._pool_changed)
        self.metrics.count_pools(self.pools)
        leadership.subscribe(self._took_lead)

    def _pool_changed(self, m: Member, old_state: str, old_role: str) -> None:
        self.metrics.count_pools(self.pools)
        if old_role != m.role:
            self.metrics.role_changes.labels(old_role, m.role).inc()
        if self.leadership.leads and DRAINING in (m.state, old_state) and m.alive:
            # The worker itself refuses new requests while drained, those of routers that
            # follow these pools too (they resume them elsewhere)
            tell(m.handle, "set_accepting", m.state != DRAINING)

    def _took_lead(self, resume: bool) -> None:
        """This router leads now. A drain that another leader left half done is called off (the
        worker takes new requests again; the controller, if any, decides anew): no router
        would ever finish it. `resume`: this router led last, and only lost touch with the
        book for a while: its own drains go on. (`_restart` blocks briefly: a Ray kill.)"""
        for m in list(self.pools.draining()):
            if not (resume and (m.to_role is not None or m.leaving)):
                self.pools.follow(m.worker_id, m.role, True)
        # A worker seen hung while another led is restarted now, should that leader have died
        # before it did (if it did, the worker loads its model once more: one restart too many,
        # rather than a worker that never comes back).
        for worker_id in self._hung:
            log.warning("worker %s: hung and not back; restarting it", worker_id)
            if self._restart is not None:
                self._restart(self.pools[worker_id].handle)
        self._hung.clear()

    def start(self) -> None:
        for m in self.pools.live():
            self.watch(m)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeats())

    def watch(self, m: Member) -> None:
        """Start reading a worker (one launched later starts in `starting` and joins its pool once
        it answers `ready()`)."""
        self._pumps[m.worker_id] = asyncio.get_running_loop().create_task(self._pump(m))

    async def stop(self) -> None:
        """Stop reading the workers' streams. Each pump ends after the frame it waits for (one
        comes every half second at least), or is cancelled past the hang timeout."""
        self._stopping = True
        if self._beat is not None:
            self._beat.cancel()
        pumps = list(self._pumps.values())
        if pumps:
            await asyncio.wait(pumps, timeout=self.settings.hang_timeout_s)
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for w in self.pools.live():                      # our leases end now, not at a lapse
            if w.alive:
                tell(w.handle, "leave", self.owner)

    # -- the pumps -----------------------------------------------------------------------------
    async def _pump(self, w: Member) -> None:
        hang_s, restart_s = self.settings.hang_timeout_s, self.settings.restart_timeout_s
        if w.state != ACTIVE and not await self._await_ready(w, restart_s):
            return
        stream = None
        try:
            while w.state != STOPPED and not self._stopping:
                try:
                    if stream is None:
                        stream = await EventStream.open(w.handle, self.owner, hang_s)
                    raw, polled_at = await stream.next(hang_s)
                    reply = msg.decode(raw, msg.PollReply)
                except asyncio.CancelledError:
                    raise
                except TimeoutError:
                    stream = _closed(stream)
                    if w.worker_id in self._lapsed:       # our outbox there is gone, not the worker
                        self._lapsed.discard(w.worker_id)
                        self.dispatcher.resume_all(w, "lease_expired", "this router's lease lapsed")
                        continue
                    self._lost(w, "hung", f"no events nor heartbeat within {hang_s:g}s")
                    if self.leadership.leads and self._restart is not None:
                        self._restart(w.handle)
                    else:                                # the leader restarts it; or this router, should it lead
                        self._hung.add(w.worker_id)
                    back = await self._await_ready(w, restart_s)
                    self._hung.discard(w.worker_id)
                    if not back:
                        return
                    continue
                except Exception as e:                   # the actor died (Ray restarts it)
                    stream = _closed(stream)
                    if w.state == STOPPED:               # retired while we waited
                        return
                    self._lost(w, "died", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                    if not await self._await_ready(w, restart_s):
                        return
                    continue
                self._take(w, reply, polled_at)
                if self.leadership.leads and w.state == DRAINING and w.idle():   # (a follower's drains are the leader's)
                    await self._finish_drain(w)
        finally:
            _closed(stream)

    def _take(self, w: Member, reply: msg.PollReply, polled_at: float) -> None:
        """A worker's frame: its report and samples here, then the rest to the dispatcher."""
        self._lapsed.discard(w.worker_id)               # (our outbox there is alive)
        if not self.leadership.leads:                    # the leader's drains and flips, as the worker tells
            self.pools.follow(w.worker_id, reply.load.role, reply.load.accepting)
        w.reported(reply.load, polled_at)
        self.metrics.observe_load(reply.load)
        self.metrics.observe_samples(w.worker_id, reply.load.role, reply.samples)
        for fn in self.sample_listeners:
            fn(w.worker_id, reply.load.role, reply.samples)
        self.dispatcher.take_frame(w, reply)

    async def _finish_drain(self, w: Member) -> None:
        """A drained worker flips its role (the worker checks, on its own loop, that it holds
        nothing) and rejoins; or, drained to leave, it stops."""
        if w.to_role is not None:
            try:
                flipped = await asyncio.wait_for(awaitable(w.handle.set_role.remote(w.to_role)),
                                                 self.settings.hang_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:                       # the next frame finds out what happened
                log.warning("worker %s: role change failed: %s", w.worker_id, e)
                return
            if not flipped:                              # something arrived after all: drain on
                return
            old = w.role
            self.pools.finish_drain(w.worker_id)
            self.metrics.forget_worker(w.worker_id, old)
            log.info("worker %s: %s -> %s after a drain of %.1fs", w.worker_id, old, w.role,
                     time.monotonic() - w.since)
            return
        self.pools.finish_drain(w.worker_id)
        self.metrics.forget_worker(w.worker_id, w.role)
        log.info("worker %s: drained, leaving the cluster", w.worker_id)
        if self.leadership.leads and self._retire is not None:
            await asyncio.to_thread(self._retire, w.handle)

    def _lost(self, w: Member, cause: str, detail: str) -> None:
        """Take a dead or hung worker out of the pools and resume everything open on it."""
        log.error("worker %s %s: %s; resuming its %d requests elsewhere", w.worker_id, cause, detail,
                  len(w.assigned))
        self.pools.lost(w.worker_id)
        self.metrics.workers_lost.labels(w.role, cause).inc()
        self.dispatcher.resume_all(w, f"worker_{cause}", f"worker {w.worker_id} {cause}")
        for other in self.pools:                          # their transport pairs with it are stale
            if other is not w and other.alive:
                fire(other.handle.forget_peer.remote(w.worker_id))

    async def _heartbeats(self) -> None:
        """Renew this router's lease on every worker it streams from, every quarter lease. A
        worker that answers False had let it lapse (this router stalled past the lease): it
        ended our requests there, and its outbox's errors resume them; should that outbox be
        gone too, the stream's silence reopens it (`_pump`), not a restart of the worker."""
        period = self.settings.router_lease_s / 4
        while not self._stopping:
            live = [w for w in self.pools.live() if w.alive]
            answers = await asyncio.gather(*(self._beat_one(w, period * 2) for w in live), return_exceptions=True)
            for w, kept in zip(live, answers):
                if kept is False:
                    log.warning("worker %s: this router's lease had lapsed there; its requests there resume",
                                w.worker_id)
                    self._lapsed.add(w.worker_id)
            await asyncio.sleep(period)

    async def _beat_one(self, w: Member, timeout_s: float) -> bool:
        """One heartbeat (a worker that fails to answer is the pump's business)."""
        return await asyncio.wait_for(awaitable(w.handle.heartbeat.remote(self.owner)), timeout_s)

    async def _await_ready(self, w: Member, timeout_s: float) -> bool:
        """Wait for a starting (or restarted) worker to load its model; then it joins its pool.
        Ray restarts a process with the role it was created in: a restarted worker first takes
        its current one (or, lost while draining, the one it was moving to: it holds nothing now,
        so its flip, or its exit, completes at once)."""
        t0 = time.monotonic()
        restarting = w.state == DEAD
        while time.monotonic() - t0 < timeout_s and w.state != STOPPED and not self._stopping:
            try:
                await asyncio.wait_for(awaitable(w.handle.ready.remote()), timeout_s)
                if restarting:
                    await asyncio.wait_for(awaitable(w.handle.set_role.remote(w.to_role or w.role)), timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:                            # still starting or restarting
                await asyncio.sleep(0.5)
                continue
            if not restarting:
                self.pools.activate(w.worker_id)
                log.info("worker %s (%s) joined after %.1fs", w.worker_id, w.role, time.monotonic() - t0)
                return True
            self.pools.restarted(w.worker_id)
            self.metrics.workers_replaced.labels(w.role).inc()
            log.warning("worker %s is back after %.1fs", w.worker_id, time.monotonic() - t0)
            if w.state != STOPPED:
                return True
            break
        else:
            if w.state == STOPPED or self._stopping:     # (stopping: the supervisor, not the worker)
                return False
            log.error("worker %s did not %s within %.0fs; the %s pool stays smaller", w.worker_id,
                      "come back" if restarting else "start", timeout_s, w.role)
        self.pools.stop(w.worker_id)
        if self.leadership.leads and self._retire is not None:
            await asyncio.to_thread(self._retire, w.handle)
        return False


def _closed(stream: EventStream | None) -> None:
    if stream is not None:
        stream.close()
