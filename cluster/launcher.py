"""Bringing the pools up on Ray: a local embedded cluster by default, or `--address`.

Each worker is a named Ray actor (so peers find each other for the KV handoff) with real
resources: one GPU per worker on GPU clusters; on CPU a fraction of a core and one torch
thread each, so several fit on a laptop.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray

from cluster.spec import ClusterSpec
from router.dispatch import WorkerState
from workers.worker import Worker, actor_name

__all__ = ["ClusterSpec", "NAMESPACE", "connect", "launch", "shutdown"]

log = logging.getLogger("pdcluster.launcher")
NAMESPACE = "pdcluster"


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
    engine = spec.engine
    if gpus and engine.device == "auto":
        engine = dataclasses.replace(engine, device="cuda")
    handles = []
    for worker_id, role in spec.roles():
        opts = dict(name=actor_name(spec.cluster_id, worker_id), namespace=NAMESPACE, num_cpus=spec.num_cpus_per_worker,
                    num_gpus=gpus, max_concurrency=32, max_restarts=0)
        if spec.placement == "spread":        # Ray's SPREAD: each next worker on the next node with room
            opts["scheduling_strategy"] = "SPREAD"
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


def shutdown(workers: list[WorkerState], grace_s: float = 5.0) -> None:
    """Stop each worker's loop and transport, then end the actors (a hung one is killed anyway)."""
    refs = []
    for w in workers:
        try:
            refs.append(w.handle.shutdown.remote())
        except Exception:                 # already gone
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    for w in workers:
        try:
            ray.kill(w.handle)
        except Exception:
            pass
