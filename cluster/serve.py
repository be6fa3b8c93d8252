"""`pdcluster serve`: the pools on Ray, the router's HTTP server in this process."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import shlex
import signal
import socket
import sys
import threading
import time

import ray
import uvicorn

from cluster.launcher import ClusterSpec, check_fits, connect, launch, shutdown
from router.app import Server, build_app
from router.dispatch import Dispatcher
from router.metrics import Metrics
from router.config import RouterConfig
from workers.names import ROLES
from workers.checkpoint import load_tokenizer

log = logging.getLogger("pdcluster.serve")


@contextlib.asynccontextmanager
async def _lifespan(app):
    app.state.dispatcher.start()
    yield
    await app.state.dispatcher.stop()


class ServingCluster:
    """Workers + router + HTTP server. `with ServingCluster(spec, port=...) as c: c.base_url ...`
    (keyword arguments are RouterConfig's fields, or pass `router=RouterConfig(...)`)."""

    def __init__(self, spec: ClusterSpec, router: RouterConfig | None = None, ray_num_cpus: int | None = None,
                 **router_fields):
        self.spec = spec
        self.cfg = router or RouterConfig(**router_fields)
        self.host, self.port = self.cfg.host, self.cfg.port
        self.model_name = self.cfg.served_model_name or spec.model
        self.ray_num_cpus = ray_num_cpus
        self.workers = []
        self.infos: list[dict] = []                   # each worker's ready() answer
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def build(self) -> uvicorn.Server:
        tokenizer = load_tokenizer(self.spec.model)
        if tokenizer is None:
            raise ValueError(f"model {self.spec.model!r} has no tokenizer.json; the HTTP API needs one")
        check_port_free(self.host, self.port)          # before seconds of Ray and model loading
        if connect(self.spec, self.ray_num_cpus):
            check_fits(self.spec)
        self.workers, infos = launch(self.spec)
        self.infos = infos
        cfg = self.cfg
        metrics = Metrics(cfg.slo)
        dispatcher = Dispatcher(self.workers, self.spec.mode, metrics, cfg.policy, cfg.max_retries)
        roles = {r: sum(i["role"] == r for i in infos) for r in ROLES}
        server = Server(dispatcher, tokenizer, self.model_name, min(i["max_model_len"] for i in infos),
                        cfg.api_key, cfg.max_pending,
                        cluster_info={"num_workers": len(infos), "workers_by_role": roles,
                                      "num_gpus": sum(i["device"].startswith("cuda") for i in infos)})
        self.server = server
        app = build_app(server)
        app.state.dispatcher = dispatcher
        app.router.lifespan_context = _lifespan
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        return self._uvicorn

    def __enter__(self) -> "ServingCluster":
        server = self.build()
        self._thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        shutdown(self.workers)
        self.workers = []


def check_port_free(host: str, port: int) -> None:
    """A ValueError naming the fix when the HTTP server could not bind host:port (uvicorn binds
    with SO_REUSEADDR too, so a port in TIME_WAIT counts as free)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"{host}:{port} {why}: choose another --port (or --host)") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def banner(cluster: ServingCluster) -> list[str]:
    """What `serve` prints once it answers: the workers, the URLs, and a request that works as
    printed (with the API key's header when one is required)."""
    nodes = {i["worker_id"]: i.get("node", "?") for i in cluster.infos}
    auth = f" -H {shlex.quote('Authorization: Bearer ' + cluster.cfg.api_key)}" if cluster.cfg.api_key else ""
    body = json.dumps({"model": cluster.model_name, "prompt": "Hello", "max_tokens": 16})
    return [f"pdcluster: serving {cluster.model_name!r} ({cluster.spec.mode}: "
            + ", ".join(f"{w.role} {w.worker_id} on {nodes.get(w.worker_id, '?')}" for w in cluster.workers) + ")",
            f"  OpenAI API at {cluster.base_url}   (metrics: http://{cluster.host}:{cluster.port}/metrics)",
            f"  try: curl {cluster.base_url}/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}"]


def serve_forever(cluster: ServingCluster) -> int:
    server = cluster.build()
    print("\n".join(banner(cluster)), flush=True)
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal with the previous handler:
    # SIGINT becomes KeyboardInterrupt (exit 130), SIGTERM this SystemExit (143); both unwind
    # through the `finally`, so the workers and a local Ray stop with the router.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        server.run()
    finally:
        shutdown(cluster.workers)
        if ray.is_initialized():
            ray.shutdown()
    return 0
