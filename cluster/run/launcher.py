"""Bringing the pools up on Ray: a local embedded cluster by default, or `--address`.

Each worker is a named Ray actor (so peers find each other for the KV handoff) with real
resources: one GPU per worker on GPU clusters; on CPU a fraction of a core and one torch
thread each, so several fit on a laptop.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import os
import re
import socket
import time

import ray

from cluster.run.spec import ClusterSpec
from router.pools import ACTIVE, STARTING, Member
from workers.faults import ENV_VAR as FAULTS_ENV
from workers.names import ROLES
from workers.node import loopback_node, start_local_ray
from workers.messages import WorkerInfo

__all__ = ["ClusterSpec", "KVLeadStore", "NAMESPACE", "check_fits", "check_new", "connect", "find_book", "find_cluster",
           "launch", "open_book", "outlives_launcher", "remove_cluster", "restart", "retire", "shutdown", "start_worker",
           "stop_cluster"]

log = logging.getLogger("pdcluster.launcher")
NAMESPACE = "pdcluster"


def connect(spec: ClusterSpec, num_cpus: int | None = None) -> bool:
    """Join `spec.address` (or RAY_ADDRESS), else start a local Ray of our own (never one that
    happens to run on this machine). A local one gets enough CPUs for the worker budget
    (a development box may oversubscribe its cores). Returns False when this process was
    already connected (then the caller's Ray is used as it is)."""
    if ray.is_initialized():
        return False
    address = spec.address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
        _use_auth_token_if_any()
        try:
            if _loopback_only(address):        # a local serve's Ray (it binds loopback only): join it there
                with loopback_node():
                    ray.init(address=address, _node_ip_address="127.0.0.1", namespace=NAMESPACE, log_to_driver=True)
            else:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise RuntimeError(f"cannot join the Ray cluster at {address}: {_first_line(e)}. Check the address "
                               "(`ray status` on the head prints it); a cluster with token authentication also "
                               "needs its token here (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)"
                               ) from None
        return True
    if num_cpus is None:
        num_cpus = max(os.cpu_count() or 1,
                       math.ceil(spec.budget * spec.num_cpus_per_worker * spec.max_tensor_parallel_size))
    start_local_ray(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=True)
    return True


def _loopback_only(address: str) -> bool:
    """Whether `address` is a GCS that listens on loopback only (a local serve's Ray): Ray joins a
    loopback address at the machine's address instead, which works for a head `ray start`ed on
    every interface but not for that one."""
    if not _is_loopback(address):
        return False
    try:
        with socket.create_connection((ray.util.get_node_ip_address(), int(address.rpartition(":")[2])), 2):
            return False
    except OSError:
        return True


def _is_loopback(address: str) -> bool:
    """A GCS address (host:port) on loopback; "auto", "local" and ray:// client addresses are not."""
    if "://" in address:
        return False
    host = address.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """A host:port address whose head does not answer fails here, in seconds, naming the fix
    (Ray itself retries an unreachable GCS for a minute or more, printing its own warnings).
    "auto", "local" and ray:// client addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = "nothing listens there" if isinstance(e, ConnectionRefusedError) else (e.strerror or type(e).__name__)
        raise RuntimeError(f"cannot reach the Ray cluster at {address} ({why}): start its head with "
                           "`.venv/bin/ray start --head`, and give the address it prints (--address or RAY_ADDRESS)"
                           ) from None


def _use_auth_token_if_any() -> None:
    """Ray's clients only send a token in token mode, and `ray start` turns that mode on by itself
    when it finds a token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN). Do the same
    when joining, so a cluster started with Ray's defaults accepts us (a cluster without
    authentication ignores the token). An explicit RAY_AUTH_MODE is left as it is."""
    try:     # the pinned Ray's own check (it also refreshes Ray's cached config)
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")


def gpus_per_worker(spec: ClusterSpec) -> float:
    """`--gpus-per-worker`, else 1 on a cluster with GPUs and 0 without."""
    if spec.num_gpus_per_worker is not None:
        return spec.num_gpus_per_worker
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


def check_fits(spec: ClusterSpec) -> None:
    """Fail at once, in one line naming the fix, when the Ray cluster cannot hold the workers
    (instead of waiting out the ready timeout)."""
    if spec.engine.device.startswith("cuda") and ray.cluster_resources().get("GPU", 0) == 0:
        raise RuntimeError("--device cuda, but the Ray cluster has no GPUs: use --device auto (or cpu)")
    if short := _shortfall(spec, len(spec.roles())):
        what, flag = short
        raise RuntimeError(f"{what}: use fewer workers (--prefill/--decode, or --workers), a smaller {flag}, "
                           "or a larger cluster")


def _shortfall(spec: ClusterSpec, n: int) -> tuple[str, str] | None:
    """What the Ray cluster lacks now for `n` more workers of this spec, and the flag that asks
    for it (None: they fit)."""
    total, free = ray.cluster_resources(), ray.available_resources()
    tp = spec.max_tensor_parallel_size      # each rank of a worker asks for as much as one worker
    for res, per, flag in (("CPU", spec.num_cpus_per_worker * tp, "--cpus-per-worker"),
                           ("GPU", gpus_per_worker(spec) * tp, "--gpus-per-worker")):
        if n * per > free.get(res, 0) + 1e-9:
            ranks = f" ({tp} tensor-parallel ranks each)" if tp > 1 else ""
            return (f"{n} worker{'s' if n > 1 else ''}{ranks} x {per:g} {res} need {n * per:g} {res}, but the Ray "
                    f"cluster has {free.get(res, 0):g} of {total.get(res, 0):g} free"), flag
    return None


def _engine(spec: ClusterSpec, gpus: float):
    engine = spec.engine
    if gpus and engine.device == "auto":
        engine = dataclasses.replace(engine, device="cuda")
    return engine


# A tensor-parallel worker's placement group, by its actor handle: removed when it leaves.
_GROUPS: dict = {}


def start_worker(spec: ClusterSpec, worker_id: str, role: str):
    """Create one worker actor (it loads its model in the background: `handle.ready` answers
    once it has). Ray restarts it whenever its process dies. A tensor-parallel worker is its
    ranks in one STRICT_PACK placement group (one node), this actor in the first bundle; it
    starts the other ranks itself (workers/tensor_parallel.py), and they end with it."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from workers.peers import actor_name
    from workers.worker import Worker, WorkerSettings      # torch: only once workers are made
    gpus = gpus_per_worker(spec)
    tp = spec.tensor_parallel_size(role)
    name = actor_name(spec.cluster_id, worker_id)
    opts = dict(name=name, namespace=NAMESPACE, num_cpus=spec.num_cpus_per_worker, num_gpus=gpus,
                max_concurrency=32, max_restarts=-1, max_task_retries=0, **_lifetime(spec))
    group = None
    if tp > 1:
        bundle = {"CPU": spec.num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        group = placement_group([bundle] * tp, strategy="STRICT_PACK", name=f"{name}-ranks", **_lifetime(spec))
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    elif spec.placement == "spread":      # Ray's SPREAD: each next worker on the next node with room
        opts["scheduling_strategy"] = "SPREAD"
    if os.environ.get(FAULTS_ENV):        # a fault drill: every worker gets the plan, on any node
        opts["runtime_env"] = {"env_vars": {FAULTS_ENV: os.environ[FAULTS_ENV]}}
    engine = dataclasses.replace(_engine(spec, gpus), tensor_parallel_size=tp)
    settings = WorkerSettings(kv_transport=spec.kv_transport, lease_s=spec.lease_s,
                              transfer_timeout_s=spec.transfer_timeout_s, cluster_id=spec.cluster_id,
                              router_lease_s=spec.router_lease_s, freeze_heap=True)
    handle = ray.remote(Worker).options(**opts).remote(worker_id, role, engine, settings, group)
    if group is not None:
        _GROUPS[handle] = group
    return handle


def outlives_launcher(spec: ClusterSpec) -> bool:
    """On a Ray cluster that this process joined (not a local one of its own), the workers and
    the book are detached: they outlive the process that launched them, so that another router
    can take over their lead (`pdcluster down` removes them). A local Ray ends with its
    process, and everything on it."""
    return bool(spec.address or os.environ.get("RAY_ADDRESS"))


def _lifetime(spec: ClusterSpec) -> dict:
    return {"lifetime": "detached"} if outlives_launcher(spec) else {}


class KVLeadStore:
    """A cluster's lead record (workers/leases.py `LeadStore`: the holder and term of the last change
    of holder, and its lease) in Ray's internal KV, in the GCS: it outlives the book's process,
    so a book that Ray restarts goes on from its term (cluster/run/book.py). Made by the launcher,
    used in the book's actor (the same object each time Ray restarts it). Only a Ray cluster
    whose GCS itself fails loses it, and then the whole cluster with it."""

    def __init__(self, cluster_id: str):
        from cluster.run.book import book_name
        self.key = f"{book_name(cluster_id)}/lead"

    def load(self) -> tuple[str | None, int, float] | None:
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(self.key, namespace=NAMESPACE)
        return None if raw is None else tuple(json.loads(raw))

    def save(self, holder: str | None, term: int, lease_s: float) -> None:
        from ray.experimental.internal_kv import _internal_kv_put
        _internal_kv_put(self.key, json.dumps([holder, term, lease_s]), overwrite=True, namespace=NAMESPACE)

    def clear(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del
        _internal_kv_del(self.key, namespace=NAMESPACE)


def open_book(spec: ClusterSpec):
    """Create the cluster's book (cluster/run/book.py) with the launch settings; the handle. Its lead
    record starts afresh (that of a removed cluster of the same id is dropped)."""
    from cluster.run.book import ClusterBook, book_name
    settings = dataclasses.asdict(spec)
    store = KVLeadStore(spec.cluster_id)
    store.clear()
    return ray.remote(ClusterBook).options(name=book_name(spec.cluster_id), namespace=NAMESPACE, num_cpus=0,
                                           max_restarts=-1, max_task_retries=0, **_lifetime(spec)).remote(
        settings, lead_store=store)


def find_book(cluster_id: str):
    """A running cluster's book, or None (its cluster was removed, or never had one)."""
    from cluster.run.book import book_name
    try:
        return ray.get_actor(book_name(cluster_id), namespace=NAMESPACE)
    except ValueError:
        return None


def check_new(cluster_id: str) -> None:
    """Fail, naming the two ways on, when a cluster of this id runs on the Ray cluster already."""
    if cluster_id in named_workers() or find_book(cluster_id) is not None:
        raise RuntimeError(f"cluster {cluster_id!r} runs on this Ray cluster already: attach a router to it "
                           f"(`pdcluster router --cluster-id {cluster_id}`), remove it (`pdcluster down "
                           f"--cluster-id {cluster_id}`), or give another --cluster-id")


def worker_bundles(spec: ClusterSpec, workers: int) -> list[dict[str, float]]:
    """The resource bundles `workers` workers of this spec ask Ray for (one per rank)."""
    bundle = {"CPU": spec.num_cpus_per_worker}
    if gpus := gpus_per_worker(spec):
        bundle["GPU"] = gpus
    return [dict(bundle) for _ in range(workers * spec.max_tensor_parallel_size)]


def ask_autoscaler(spec: ClusterSpec, workers: int) -> None:
    """A standing request to Ray's autoscaler (KubeRay's, or `ray up`'s) for room for `workers`
    workers of this spec: it adds nodes up to it, and lets idle ones go once it is lowered. A
    cluster without an autoscaler keeps the request and nothing happens."""
    from ray.autoscaler.sdk import request_resources
    request_resources(bundles=worker_bundles(spec, workers))


def room_for_one(spec: ClusterSpec) -> str | None:
    """None when the Ray cluster has the resources of one more worker free now, else what is short."""
    short = _shortfall(spec, 1)
    return short[0] if short else None


def launch(spec: ClusterSpec) -> tuple[list[Member], list[WorkerInfo]]:
    """Create the workers and wait until each has loaded its model (or fail clearly)."""
    handles = [(worker_id, role, start_worker(spec, worker_id, role)) for worker_id, role in spec.roles()]
    members = [Member(w, r, h, ACTIVE) for w, r, h in handles]
    refs = [h.ready.remote() for _, _, h in handles]
    t0 = time.monotonic()
    try:
        infos = ray.get(refs, timeout=spec.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        free = ray.available_resources()
        shutdown(members)
        raise RuntimeError(f"{len(refs) - len(ready)} of {len(refs)} workers were not ready within "
                           f"{spec.ready_timeout_s:g}s (each asks for {spec.num_cpus_per_worker:g} CPU and "
                           f"{gpus_per_worker(spec):g} GPU; the cluster had {free.get('CPU', 0):g} CPU and "
                           f"{free.get('GPU', 0):g} GPU free): a large model may need a longer --ready-timeout-s; "
                           "`ray status` shows what is pending") from None
    except ray.exceptions.RayActorError as e:
        shutdown(members)
        raise RuntimeError(f"a worker failed to start: {e}") from None
    log.info("%d workers ready in %.1fs", len(handles), time.monotonic() - t0)
    return members, infos


_ACTOR = re.compile(r"^pdcluster-(?P<cluster>[A-Za-z0-9_.-]+?)-(?P<worker>(?:" + "|".join(ROLES) + r")-\d+)$")


_BOOK = re.compile(r"^pdcluster-(?P<cluster>[A-Za-z0-9_.-]+)-book$")


def named_workers(with_books: bool = False) -> dict[str, dict[str, str]]:
    """cluster id -> {worker id: actor name} of every pdcluster worker on this Ray cluster
    (`with_books`: also each cluster that has only its book left, with no worker)."""
    found: dict[str, dict[str, str]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE and (m := _ACTOR.match(a["name"])):
            found.setdefault(m["cluster"], {})[m["worker"]] = a["name"]
        elif with_books and a["namespace"] == NAMESPACE and (m := _BOOK.match(a["name"])):
            found.setdefault(m["cluster"], {})
    return found


def _cluster_names(cluster_id: str | None, with_books: bool = False) -> tuple[str, dict[str, str]]:
    """(the cluster id, {worker id: actor name}) of a running cluster; without `cluster_id`, of
    the one cluster there is."""
    found = named_workers(with_books)
    if cluster_id is None:
        if len(found) != 1:
            raise RuntimeError("no pdcluster workers on this Ray cluster" if not found else
                               f"{len(found)} clusters run here ({', '.join(sorted(found))}): pick one with --cluster-id")
        cluster_id = next(iter(found))
    if cluster_id not in found:
        raise RuntimeError(f"no workers of cluster {cluster_id!r} on this Ray cluster"
                           + (f" (it has {', '.join(sorted(found))})" if found else ""))
    return cluster_id, found[cluster_id]


def find_cluster(cluster_id: str | None, timeout_s: float = 60.0) -> tuple[ClusterSpec, list[Member], list[WorkerInfo], object]:
    """A running cluster, found by its actors' names on the Ray cluster this process joined:
    (its launch settings, from its book; its members; each one's `ready()` answer; its book).
    Without `cluster_id`, the one cluster there is. A worker that does not answer within
    `timeout_s` (being restarted) joins later, once it does (a starting member)."""
    cluster_id, names = _cluster_names(cluster_id)
    book = find_book(cluster_id)
    if book is None:
        raise RuntimeError(f"cluster {cluster_id!r} has workers but no book (its launcher is stopping it, or an "
                           "older pdcluster launched it): remove it with `pdcluster down` and launch it again")
    spec = ClusterSpec(**ray.get(book.settings.remote(), timeout=timeout_s))
    handles = {w: ray.get_actor(name, namespace=NAMESPACE) for w, name in sorted(names.items())}
    refs = {w: h.ready.remote() for w, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    members, infos = [], []
    for w, ref in refs.items():
        try:
            info = ray.get(ref) if ref in ready else None
        except ray.exceptions.RayActorError:          # died just now: Ray restarts it
            info = None
        if info is None:
            log.warning("worker %s did not answer within %.0fs; it joins when it does", w, timeout_s)
        else:
            infos.append(info)
        # Its role now (a controller may have moved it); one that did not answer, as it was named
        members.append(Member(w, info.role if info else w.rsplit("-", 1)[0], handles[w], ACTIVE if info else STARTING))
    if not infos:
        raise RuntimeError(f"no worker of cluster {cluster_id!r} answered within {timeout_s:g}s")
    if full := [i.worker_id for i in infos if i.routers >= i.max_routers]:
        raise RuntimeError(f"worker {full[0]} streams to {infos[0].max_routers} routers already, the most a "
                           "worker takes: stop one first (a dead router's place frees once its lease lapses)")
    return spec, members, infos, book


def remove_cluster(cluster_id: str | None, grace_s: float = 5.0) -> tuple[str, int]:
    """`pdcluster down`: stop a running cluster's workers and remove its book (its routers then
    exit). (The cluster id, how many workers it had.)"""
    from ray.util.placement_group import get_placement_group, remove_placement_group
    cluster_id, names = _cluster_names(cluster_id, with_books=True)     # (a book with no worker left goes too)
    members = []
    for w, name in names.items():
        try:
            members.append(Member(w, "", ray.get_actor(name, namespace=NAMESPACE)))
        except ValueError:                            # gone meanwhile
            pass
    stop_cluster(members, find_book(cluster_id), grace_s)
    KVLeadStore(cluster_id).clear()                   # its book's lead record
    for name in names.values():                       # a tensor-parallel worker's ranks
        try:
            remove_placement_group(get_placement_group(f"{name}-ranks"))
        except ValueError:
            pass
    return cluster_id, len(members)


def stop_cluster(workers: list[Member], book, grace_s: float = 5.0) -> None:
    """Stop the workers, then remove the book: the routers still attached see it gone, and stop."""
    shutdown(workers, grace_s)
    if book is not None:
        try:
            ray.kill(book, no_restart=True)
        except Exception:                 # already gone
            pass


def restart(handle) -> None:
    """End a worker's process so that Ray starts a new one (a hung worker: SIGSTOPped, deadlocked)."""
    try:
        ray.kill(handle, no_restart=False)
    except Exception as e:                # already gone: Ray restarts it anyway
        log.warning("could not kill a hung worker: %s", e)


def retire(handle, grace_s: float = 5.0) -> None:
    """End a drained worker that leaves the cluster, for good (no restart)."""
    shutdown([Member("", "", handle)], grace_s)


def shutdown(workers: list[Member], grace_s: float = 5.0) -> None:
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
        if (group := _GROUPS.pop(w.handle, None)) is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(group)
