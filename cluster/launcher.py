"""Bringing the pools up on Ray: a local embedded cluster by default, or `--address`.

Each worker is a named Ray actor (so peers find each other for the KV handoff) with real
resources: one GPU per worker on GPU clusters; on CPU a fraction of a core and one torch
thread each, so several fit on a laptop.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import ray

from router.dispatch import WorkerState
from workers.worker import Worker, actor_name

log = logging.getLogger("pdcluster.launcher")
NAMESPACE = "pdcluster"


@dataclass(slots=True)
class ClusterSpec:
    model: str = "tiny"
    mode: str = "disaggregated"               # or "colocated"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 2
    engine: dict = field(default_factory=dict)  # EngineConfig fields (cache/scheduler as dicts)
    kv_transport: str = "auto"
    address: str | None = None                # Ray address; None: RAY_ADDRESS or a local cluster
    num_gpus_per_worker: float | None = None   # None: 1 if the cluster has GPUs, else 0
    num_cpus_per_worker: float = 0.5
    ready_timeout_s: float = 300.0
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])   # names this cluster's actors

    def __post_init__(self):
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"--mode must be disaggregated or colocated, got {self.mode!r}")
        if self.mode == "disaggregated" and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("disaggregated mode needs at least one prefill and one decode worker")
        if self.mode == "colocated" and self.num_colocated < 1:
            raise ValueError("colocated mode needs at least one worker")

    def roles(self) -> list[tuple[str, str]]:
        if self.mode == "colocated":
            return [(f"colocated-{i}", "colocated") for i in range(self.num_colocated)]
        return ([(f"prefill-{i}", "prefill") for i in range(self.num_prefill)] +
                [(f"decode-{i}", "decode") for i in range(self.num_decode)])


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join `address` (or RAY_ADDRESS), else start an embedded local Ray."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=True)


def launch(spec: ClusterSpec) -> tuple[list[WorkerState], list[dict]]:
    """Create the workers and wait until each has loaded its model (or fail clearly)."""
    gpus = spec.num_gpus_per_worker
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    engine = {"model": spec.model, **spec.engine}
    if gpus:
        engine.setdefault("device", "cuda")
    handles = []
    for worker_id, role in spec.roles():
        opts = dict(name=actor_name(spec.cluster_id, worker_id), namespace=NAMESPACE, num_cpus=spec.num_cpus_per_worker,
                    num_gpus=gpus, max_concurrency=32, max_restarts=0)
        h = ray.remote(Worker).options(**opts).remote(
            worker_id, role, engine, spec.kv_transport, 1, spec.lease_s, spec.transfer_timeout_s, spec.cluster_id)
        handles.append((worker_id, role, h))
    refs = [h.ready.remote() for _, _, h in handles]
    t0 = time.monotonic()
    try:
        infos = ray.get(refs, timeout=spec.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        shutdown([WorkerState(w, r, h) for w, r, h in handles])
        raise RuntimeError(f"workers were not ready within {spec.ready_timeout_s:.0f}s: the cluster may lack "
                           f"resources ({spec.num_cpus_per_worker} CPU, {gpus} GPU per worker)") from None
    except ray.exceptions.RayActorError as e:
        shutdown([WorkerState(w, r, h) for w, r, h in handles])
        raise RuntimeError(f"a worker failed to start: {e}") from None
    log.info("%d workers ready in %.1fs", len(handles), time.monotonic() - t0)
    return [WorkerState(w, r, h) for w, r, h in handles], infos


def shutdown(workers: list[WorkerState]) -> None:
    for w in workers:
        try:
            ray.kill(w.handle)
        except Exception:                 # already gone
            pass
