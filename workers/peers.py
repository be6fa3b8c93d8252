"""Other workers of the cluster, as the handoff reaches them: named Ray actors in the cluster's
namespace. The one place the worker side looks peers up; everything else takes the handles."""
from __future__ import annotations


def actor_name(cluster_id: str, worker_id: str) -> str:
    return f"pdcluster-{cluster_id}-{worker_id}"


def peer(cluster_id: str, worker_id: str):
    import ray
    return ray.get_actor(actor_name(cluster_id, worker_id), namespace="pdcluster")


def release_on(cluster_id: str, worker_id: str, rid: str) -> None:
    """Tell a prefill worker to drop its copy; a peer that is gone has nothing left to free."""
    try:
        peer(cluster_id, worker_id).release_kv.remote(rid)
    except Exception:
        pass


def wait_ref(ref, timeout_s: float):
    import ray
    return ray.get(ref, timeout=timeout_s)
