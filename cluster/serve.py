"""`pdcluster serve`: the pools on Ray, the router's HTTP server in this process."""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import ray
import uvicorn

from cluster.launcher import ClusterSpec, connect, launch, shutdown
from router.app import Server, build_app
from router.dispatch import Dispatcher
from router.metrics import Metrics
from router.slo import SLOTargets
from workers.checkpoint import load_tokenizer

log = logging.getLogger("pdcluster.serve")


@contextlib.asynccontextmanager
async def _lifespan(app):
    app.state.dispatcher.start()
    yield
    await app.state.dispatcher.stop()


class ServingCluster:
    """Workers + router + HTTP server. `with ServingCluster(spec) as c: c.base_url ...`"""

    def __init__(self, spec: ClusterSpec, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, policy: str = "p2c", max_pending: int = 512,
                 model_name: str | None = None, ray_num_cpus: int | None = None,
                 slo: SLOTargets | None = None):
        self.spec, self.host, self.port = spec, host, port
        self.slo = slo or SLOTargets()
        self.api_key, self.policy, self.max_pending = api_key, policy, max_pending
        self.model_name = model_name or spec.model
        self.ray_num_cpus = ray_num_cpus
        self.workers = []
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def build(self) -> uvicorn.Server:
        tokenizer = load_tokenizer(self.spec.model)
        if tokenizer is None:
            raise ValueError(f"model {self.spec.model!r} has no tokenizer.json; the HTTP API needs one")
        connect(self.spec.address, self.ray_num_cpus)
        self.workers, infos = launch(self.spec)
        metrics = Metrics(self.slo)
        dispatcher = Dispatcher(self.workers, self.spec.mode, metrics, self.policy)
        roles = {r: sum(i["role"] == r for i in infos) for r in ("prefill", "decode", "colocated")}
        server = Server(dispatcher, tokenizer, self.model_name, min(i["max_model_len"] for i in infos),
                        self.api_key, self.max_pending,
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_forever(cluster: ServingCluster) -> int:
    server = cluster.build()
    print(f"pdcluster: serving {cluster.model_name!r} ({cluster.spec.mode}: "
          + ", ".join(f"{w.role} {w.worker_id}" for w in cluster.workers) + ")")
    print(f"  OpenAI API at {cluster.base_url}   (metrics: http://{cluster.host}:{cluster.port}/metrics)")
    print(f"  try: curl {cluster.base_url}/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{cluster.model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
    try:
        server.run()                      # returns on Ctrl-C / SIGTERM after a graceful drain
    finally:
        shutdown(cluster.workers)
        if ray.is_initialized():
            ray.shutdown()
    return 0
