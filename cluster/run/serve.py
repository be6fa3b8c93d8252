"""`pdcluster serve`: the pools on Ray, the router's HTTP server in this process."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import ray
import uvicorn

from cluster.run.launcher import (ClusterSpec, ask_autoscaler, check_fits, check_new, connect, launch, open_book, restart, retire, room_for_one, start_worker, stop_cluster)
from cluster.run.ports import check_port_free, free_port
from workers import heap
from router.admission import SLO, SLOAdmission
from router.app import Server, build_app
from router.tracing import Tracing
from cluster.run.lead import LeadKeeper
from router.dispatch import Dispatcher, DispatchSettings
from router.leadership import Leadership
from router.supervisor import SupervisionSettings, Supervisor
from router.pools import STARTING, Member, PoolRegistry
from router.metrics import Metrics
from router.config import API_KEY_ENV, RouterConfig
from workers.names import AUTO, COLOCATED, ROLES, first_role
from workers.checkpoint import load_tokenizer
from workers.messages import WorkerInfo


__all__ = ["ServingCluster", "banner", "free_port", "serve_forever"]   # free_port: for tests and tools
log = logging.getLogger("pdcluster.serve")


@contextlib.asynccontextmanager
async def _lifespan(app):
    supervisor, lead = app.state.supervisor, app.state.lead
    supervisor.start()
    tasks = []
    if lead is not None:
        await lead.claim()                        # before the first request: who leads is settled
        tasks = [asyncio.ensure_future(lead.keep()), asyncio.ensure_future(lead.follow())]
    yield
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if lead is not None:
        await lead.step_down()
    await supervisor.stop()
    if app.state.tracing is not None:             # the spans not sent yet go now
        await asyncio.to_thread(app.state.tracing.close)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains the router before it closes connections. On SIGINT/SIGTERM, or
    `request_exit()` from any thread: new requests get 503, those in flight run up to
    `drain_timeout_s`, the rest end with an error event (`Server.drain`); only then does uvicorn
    shut down (it would otherwise wait `timeout_graceful_shutdown`, then cut the streams). A second
    signal ends the drain at once (the requests left still get their error event); a third exits
    without waiting for anything, as uvicorn's second Ctrl-C does."""

    def __init__(self, config: uvicorn.Config, router: Server, drain_timeout_s: float, announce=None):
        super().__init__(config)
        self.router, self.drain_timeout_s = router, drain_timeout_s
        self.announce = announce or (lambda line: None)     # where the signal path says what it does
        self.loop: asyncio.AbstractEventLoop | None = None     # the server's, once it starts
        self._drain: asyncio.Task | None = None
        self._cut: asyncio.Task | None = None
        self._signals = 0
        self.on_started = None                                 # called once it listens (on its loop)

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        # What the process holds by now lives as long as it serves: out of the collector's
        # walks (workers/heap.py), which otherwise stop this loop for 150-220 ms each.
        heap.hold()
        try:
            await super().startup(sockets=sockets)
        except BaseException:
            heap.release()
            raise
        if not self.started:                   # (uvicorn returns without starting when it cannot bind)
            heap.release()
        elif self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        heap.release()
        await super().shutdown(sockets=sockets)
        if self.force_exit:
            # uvicorn skips the app's shutdown then; run it anyway (it only stops the pumps), or
            # its task would be cancelled mid-wait at the loop's teardown and logged as an error.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), 2)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread): only records and hands over to the loop. Only the
        first signal is re-raised once the server stops (it sets the exit status: 130 or 143);
        raising a second SIGINT would interrupt the event loop's teardown."""
        self._signals += 1
        if not self._captured_signals:
            self._captured_signals.append(sig)
        self.request_exit(force=self._signals > 1, announce=True)

    def request_exit(self, force: bool = False, announce: bool = False) -> None:
        """Safe from any thread and from a signal handler."""
        loop = self.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._exit_requested, force, announce)
                return
            except RuntimeError:                      # the loop has closed: nothing left to drain
                pass
        self.force_exit = self.force_exit or (force and self.should_exit)
        self.should_exit = True

    def _exit_requested(self, force: bool, announce: bool) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit(announce))
        elif force and self._cut is None and not self._drain.done():
            if announce:
                self.announce(f"ending {self.router.pending} request(s) now")
            self._cut = asyncio.ensure_future(self.router.end_inflight(timeout=2.0))
        elif force:                                  # again, or uvicorn is already closing connections
            self.should_exit = self.force_exit = True

    async def _drain_then_exit(self, announce: bool) -> None:
        try:
            if announce and self.router.pending:
                self.announce(f"draining {self.router.pending} request(s) in flight (up to "
                              f"{self.drain_timeout_s:g}s; press Ctrl-C again to end them now)")
            if not await self.router.drain(self.drain_timeout_s):
                line = f"{self.router.ended} request(s) did not finish and ended with an error"
                self.announce(line) if announce else log.warning("shutdown: %s", line)
        finally:
            self.should_exit = True


class ServingCluster:
    """Workers + router + HTTP server. `with ServingCluster(spec, port=...) as c: c.base_url ...`
    (keyword arguments are RouterConfig's fields, or pass `router=RouterConfig(...)`).

    Without `attach`, it launches the pools and their book (cluster/run/book.py), and owns them:
    closing it stops them. With `attach` (launcher.find_cluster's members and ready() answers)
    and that cluster's `book`, a router over pools another process launched (`pdcluster
    router`): closing it stops only itself.

    Either way, the router that holds the cluster's lead keeps the workers' lives (restarts of
    hung ones, drains, the controller, their metrics). The launcher takes it first; should it
    die, a router attached to the pools takes it over once its lease lapses."""

    def __init__(self, spec: ClusterSpec, router: RouterConfig | None = None, ray_num_cpus: int | None = None,
                 attach: tuple[list[Member], list[WorkerInfo]] | None = None, book=None, **router_fields):
        self.spec = spec
        self.attach = attach
        self.book = book                              # the cluster's book actor (the launcher opens it)
        self.dispatcher: Dispatcher | None = None
        self.supervisor: Supervisor | None = None
        self.leadership = Leadership()                # whether this router leads (it claims at start)
        self.lead: LeadKeeper | None = None           # its claims on the book, once it serves
        self.cfg = router or RouterConfig(**router_fields)
        self.host, self.port = self.cfg.host, self.cfg.port
        self.model_name = self.cfg.served_model_name or spec.model
        self.ray_num_cpus = ray_num_cpus
        self.pools: PoolRegistry | None = None
        self.controller = None                        # cluster/run/pool_control.py's, with spec.controller
        self._asked_autoscaler = False                # the controller asked Ray's autoscaler for room
        self.infos: list[WorkerInfo] = []             # each launched worker's ready() answer
        self._uvicorn: DrainingServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def owns(self) -> bool:
        """It launched the pools (not attached to another's): it stops them when it stops."""
        return self.attach is None

    @property
    def leads(self) -> bool:
        """It holds the cluster's lead now (before it serves: it will claim it first, if it owns)."""
        return self.leadership.leads if self.lead is not None else self.owns

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The HTTP server's event loop (the router's coroutines run there:
        `asyncio.run_coroutine_threadsafe(c.server.drain(10), c.loop)`)."""
        return self._uvicorn.loop if self._uvicorn is not None else None

    def router_cpu_s(self) -> float:
        """CPU-seconds the HTTP server's thread (the router's event loop) has used so far."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident)) if self._thread else 0.0

    @property
    def workers(self) -> list[Member]:
        """Every worker of the cluster now (launched, added, restarting), in the order they came."""
        return self.pools.live() if self.pools is not None else []

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def answering(self, timeout_s: float = 10.0) -> dict[str, WorkerInfo]:
        """worker id -> its `ready()` answer (role, pid, node, ...), for each worker that answers
        now (one being restarted does not): fault drills and their tests find processes here."""
        out = {}
        for w in self.workers:
            try:
                info = ray.get(w.handle.ready.remote(), timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
            out[info.worker_id] = info
        return out

    def build(self, announce=None) -> DrainingServer:
        tokenizer = load_tokenizer(self.spec.model)
        if tokenizer is None:
            raise ValueError(f"model {self.spec.model!r} has no tokenizer.json; the HTTP API needs one")
        check_port_free(self.host, self.port)          # before seconds of Ray and model loading
        if self.attach is not None:
            members, infos = self.attach
        else:
            if connect(self.spec, self.ray_num_cpus):
                check_fits(self.spec)
            check_new(self.spec.cluster_id)
            members, infos = launch(self.spec)
            self.book = open_book(self.spec)
        try:
            return self._build_router(members, infos, tokenizer, announce)
        except BaseException:
            if self.owns:      # a launch that cannot serve leaves nothing (on a cluster its actors are detached)
                stop_cluster(members, self.book)
            raise

    def _build_router(self, members: list[Member], infos: list[WorkerInfo], tokenizer, announce) -> DrainingServer:
        # Any router may come to lead (cluster/run/book.py): each keeps what leading needs ready.
        self.pools = PoolRegistry.of(members, budget=self.spec.budget)
        self.infos = infos
        cfg = self.cfg
        metrics = Metrics(cfg.slo, cfg.router_id, workers=False)
        metrics.follow(self.leadership)
        self.dispatcher = dispatcher = Dispatcher(self.pools, self.spec.mode, metrics, DispatchSettings(
            cfg.policy, cfg.max_retries, hang_timeout_s=cfg.worker_hang_timeout_s,
            restart_timeout_s=self.spec.ready_timeout_s, block_size=infos[0].block_size,
            local_prefill_max_tokens=cfg.local_prefill_max_tokens, decode_gate=cfg.decode_gate,
            decode_seats=self.spec.engine.scheduler.max_num_seqs, router_id=cfg.router_id))
        self.supervisor = Supervisor(dispatcher, self.leadership, SupervisionSettings(
            cfg.worker_hang_timeout_s, self.spec.ready_timeout_s, self.spec.router_lease_s), restart, retire)
        sched = self.spec.engine.scheduler
        local_auto = cfg.local_prefill_max_tokens == AUTO and self.spec.mode != COLOCATED
        fit = self._step_fit(infos) if self.spec.controls or cfg.admission == SLO or local_auto else None
        if local_auto:
            dispatcher.price_local_prefill(fit, sched.max_num_batched_tokens, cfg.slo.tpot_s)
        self.controller = self._controller(dispatcher, infos, fit) if self.spec.controls else None
        if self.controller is not None:
            self.leadership.subscribe(lambda resume: self.controller.start(), self.controller.stop)
        admission = (SLOAdmission(self.pools, self.spec.mode, fit, cfg.slo, sched.max_num_batched_tokens,
                                  local_prefill=cfg.local_prefill_max_tokens != 0)
                     if cfg.admission == SLO else None)
        if admission is not None and dispatcher.gate is not None:
            admission.seats_to_free = dispatcher.seats_to_free
        if admission is not None:
            admission.worker_pace = dispatcher.worker_pace
        roles = {r: sum(i.role == r for i in infos) for r in ROLES}
        server = Server(dispatcher, tokenizer, self.model_name, min(i.max_model_len for i in infos),
                        cfg.api_key, cfg.max_pending, max_body_bytes=cfg.max_body_bytes, admission=admission,
                        client_stall_timeout_s=cfg.client_stall_timeout_s, slo=cfg.slo,
                        request_timeout_s=cfg.request_timeout_s, body_timeout_s=cfg.body_timeout_s,
                        max_validating=cfg.max_validating, refusals_per_s=cfg.max_refusals_per_s,
                        leadership=self.leadership, tracing=Tracing(cfg.otlp_traces_endpoint)
                        if cfg.otlp_traces_endpoint else None,
                        tool_parser=None if cfg.tool_call_parser == AUTO else cfg.tool_call_parser,
                        cluster_info={"num_workers": len(infos), "workers_by_role": roles,
                                      "num_gpus": sum(i.device.startswith("cuda") for i in infos)})
        self.server = server
        app = build_app(server)
        self.lead = LeadKeeper(self.spec.cluster_id, self.spec.router_lease_s, self.book, self.leadership,
                               dispatcher.owner, self.pools, self.supervisor, metrics.requests,
                               lambda: self._uvicorn.request_exit())
        app.state.supervisor, app.state.lead, app.state.tracing = self.supervisor, self.lead, server.tracing
        app.router.lifespan_context = _lifespan
        # Keep-alive longer than clients' usual idle timeouts, so a client never sends on a
        # connection the server is closing (uvicorn's 5 s default is shorter than aiohttp's 15 s).
        # Connections and tasks past `limit_concurrency` get 503 from uvicorn before any of ours
        # runs: room for every admitted request, every body being validated and as many idle
        # keep-alive connections again. A request head (line and headers) is at most 16 KiB.
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, timeout_keep_alive=75, http="h11",
                                limit_concurrency=2 * (cfg.max_pending + cfg.max_validating) + 64,
                                h11_max_incomplete_event_size=16 * 1024)
        self._uvicorn = DrainingServer(config, server, cfg.drain_timeout_s, announce)
        return self._uvicorn

    def _step_fit(self, infos: list[WorkerInfo]):
        """The step cost model the controller and SLO admission price the pools with: fitted on
        the steps the workers serve and first on a grid one worker times before serving (seconds
        on a GPU): with the controller on, the whole grid, so that the controller has a model
        from the start; with SLO admission, its prefill shapes (about a second for `tiny` on a
        CPU), so that a burst is priced at batched prompts' cost from the first request, and a
        pool whose steps are seldom prefill alone (colocated: 3 of 1,669 steps of a closed loop)
        is not priced on those few."""
        from workers.cost_model import StepFit
        info, profiled = infos[0], []
        decode = self.spec.controls
        if (decode or self.cfg.admission == SLO) and self.owns:   # (a router that comes to lead fits on served steps)
            t0 = time.monotonic()
            worker = self.pools.active(first_role(self.spec.mode))[0]
            try:
                profiled = ray.get(worker.handle.profile.remote(decode=decode))
            except Exception as e:      # a worker lost meanwhile: the supervisor restarts it; fit on served steps
                log.warning("step profile of worker %s failed (%s): the cost model fits on served steps only",
                            worker.worker_id, e)
            else:
                log.info("%d steps profiled in %.1fs (%s)", len(profiled), time.monotonic() - t0,
                         "the controller's grid" if decode else "prefill shapes, for SLO admission")
        fit = StepFit(info.bytes_per_block // info.block_size,
                      min(i.num_blocks for i in infos) * info.block_size, profiled)
        self.supervisor.sample_listeners.append(lambda worker, role, samples: fit.add(samples.get("step_shape", ()),
                                                                                      worker))
        return fit

    def _controller(self, dispatcher: Dispatcher, infos: list[WorkerInfo], fit):
        from cluster.run.pool_control import LiveControl, PoolController
        spec, slo, sched = self.spec, self.cfg.slo, self.spec.engine.scheduler
        cores = os.cpu_count() or 1
        if infos[0].device == "cpu" and cores < spec.budget:
            # The cost model prices each worker as a device of its own (as a GPU is); CPU workers
            # with fewer cores than workers share them, so a move between pools moves no compute.
            log.warning("controller: %d CPU workers (the budget) share %d cores here: the controller prices each "
                        "worker as a device of its own, so its moves exercise the mechanism, not the split",
                        spec.budget, cores)
        control = LiveControl(spec.controller_config(), spec.controller_interval_s, spec.controller_window_s, spec.controller_forecast_s,
                              advise=spec.controller == "advise")
        return PoolController(dispatcher, control, fit, slo.ttft_s, slo.tpot_s, sched.max_num_batched_tokens,
                              sched.max_num_seqs, add_worker=self._add_worker, shrunk=self._shrunk)

    async def _shrunk(self, workers: int) -> None:
        """The controller removed workers: a standing request to the autoscaler comes down with
        them, so that it can let the idle nodes go."""
        if self._asked_autoscaler:
            await asyncio.to_thread(ask_autoscaler, self.spec, workers)

    async def _add_worker(self, role: str) -> Member | None:
        """The controller grows a pool: a new actor that joins once it has loaded (never above the
        budget; without room on the Ray cluster, nothing starts and the log says why)."""
        live = len(self.pools.live())
        if live >= self.spec.budget:
            return None
        short = await asyncio.to_thread(room_for_one, self.spec)
        if short:
            # the autoscaler (if any) adds a node for it; the controller asks again next time
            await asyncio.to_thread(ask_autoscaler, self.spec, live + 1)
            self._asked_autoscaler = True
            log.warning("controller: cannot add a %s worker yet: %s (asked Ray's autoscaler for room)", role, short)
            return None
        taken = {m.worker_id for m in self.pools}
        worker_id = next(f"{role}-{i}" for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        handle = await asyncio.to_thread(start_worker, self.spec, worker_id, role)
        m = self.pools.add(worker_id, role, handle, STARTING)
        self.supervisor.watch(m)
        return m

    def __enter__(self) -> ServingCluster:
        server = self.build()
        self._thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        if self.port == 0:          # the kernel chose it as the server bound: no race with another taker
            self.port = server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stop_serving(self) -> None:
        """Drain (new requests get 503; those in flight get `drain_timeout_s` to finish, then end
        with an error and are aborted on the workers), then stop the HTTP server. The workers
        keep running."""
        if self._uvicorn is not None:
            self._uvicorn.request_exit()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.drain_timeout_s + 15)

    def close(self) -> None:
        """stop_serving(), then stop the workers (those it launched)."""
        self.stop_serving()
        if self.owns:
            stop_cluster(self.workers, self.book)
        self.pools = None


def banner(cluster: ServingCluster) -> list[str]:
    """What `serve` prints once it answers: the workers, the URLs, and a request that works as
    printed (with the API key's header when one is required)."""
    nodes = {i.worker_id: i.node for i in cluster.infos}
    auth = ' -H "Authorization: Bearer $PDCLUSTER_API_KEY"' if cluster.cfg.api_key else ""    # never the key
    body = json.dumps({"model": cluster.model_name, "prompt": "Hello", "max_tokens": 16})
    how = "" if cluster.owns else f"router {cluster.cfg.router_id}, attached to "
    lines = [f"pdcluster: serving {cluster.model_name!r} ({how}cluster {cluster.spec.cluster_id}, {cluster.spec.mode}: "
             + ", ".join(f"{w.role} {w.worker_id} on {nodes.get(w.worker_id, '?')}" for w in cluster.workers) + ")",
             f"  OpenAI API at {cluster.base_url}   (metrics: http://{cluster.host}:{cluster.port}/metrics)",
             f"  try: curl {cluster.base_url}/completions -H 'Content-Type: application/json'{auth} "
             f"-d {shlex.quote(body)}"]
    if cluster.owns and ray.is_initialized():
        lines.append(f"  another router: pdcluster router --address {ray.get_runtime_context().gcs_address} "
                     f"--cluster-id {cluster.spec.cluster_id} --router-id NAME --port PORT")
    return lines


def serve_forever(cluster: ServingCluster, more_routers: int = 0, router_args: list[str] = ()) -> int:
    """Serve until a signal. `more_routers`: also run that many `pdcluster router` processes
    over these pools, on the next ports (each with `router_args`, the router flags given)."""
    name = "serve" if cluster.owns else "router"
    server = cluster.build(announce=lambda line: print(f"pdcluster {name}: {line}", file=sys.stderr, flush=True))
    children = []

    def started() -> None:
        """Once it listens: the banner, with the port its bind took where --port 0 let the kernel
        choose (`bench --launch` reads it there), and the other routers on the ports after it."""
        if cluster.port == 0:
            cluster.port = server.servers[0].sockets[0].getsockname()[1]
        print("\n".join(banner(cluster)), flush=True)
        for i in range(1, more_routers + 1):
            children.append(_spawn_router(cluster, f"{cluster.cfg.router_id}-{i}", cluster.port + i, router_args))
            print(f"  router {cluster.cfg.router_id}-{i}: http://{cluster.host}:{cluster.port + i}/v1", flush=True)
    server.on_started = started
    # On SIGINT/SIGTERM the server drains (DrainingServer), then uvicorn re-raises the signal
    # with the previous handler: SIGINT becomes KeyboardInterrupt (exit 130), SIGTERM this
    # SystemExit (143); both unwind through the `finally`, so the workers and a local Ray stop
    # with the router.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        server.run()
    finally:
        _stop_routers(children, cluster.cfg.drain_timeout_s + 15)
        if cluster.owns:
            stop_cluster(cluster.workers, cluster.book)
        if ray.is_initialized():
            ray.shutdown()
    return 0


def die_with_parent() -> None:
    """A child's preexec_fn: the kernel SIGKILLs it when the thread that started it ends
    (PR_SET_PDEATHSIG), so a parent killed outright leaves no child serving behind."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # 1: PR_SET_PDEATHSIG


def _spawn_router(cluster: ServingCluster, router_id: str, port: int, router_args: list[str]) -> subprocess.Popen:
    """A `pdcluster router` over this cluster's pools, killed by the kernel when this process
    dies (PR_SET_PDEATHSIG): a SIGKILLed serve leaves no router behind either."""
    cmd = [sys.executable, "-m", "cluster.cli", "router", "--address", ray.get_runtime_context().gcs_address,
           "--cluster-id", cluster.spec.cluster_id, "--router-id", router_id, "--host", cluster.host, "--port",
           str(port), *router_args]
    env = dict(os.environ)                 # the key by environment: a command line is public on the machine
    env.pop(API_KEY_ENV, None)
    if cluster.cfg.api_key:
        env[API_KEY_ENV] = cluster.cfg.api_key
    return subprocess.Popen(cmd, preexec_fn=die_with_parent, env=env)


def _stop_routers(children: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM: each drains as serve does; whatever is left after `timeout_s` is killed."""
    for p in children:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in children:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
