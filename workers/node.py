"""This node as Ray sees it: its id and address, the one address a worker's listeners bind, and a
local Ray of our own on loopback."""
from __future__ import annotations

import contextlib


def node_id() -> str:
    """Ray's id of this node: same-node peers share memory."""
    import ray
    return ray.get_runtime_context().get_node_id()


def node_ip() -> str:
    """The address other nodes reach this one at (Ray's view of it): 127.0.0.1 in a local Ray
    (`start_local_ray`)."""
    import ray
    return ray.util.get_node_ip_address()


def bind_host() -> str:
    """The one address every listener of a worker binds: its event streams, the KV rendezvous
    store and Gloo's pairs, the tensor-parallel store. Ray's address of this node: loopback in a
    local Ray, so nothing is reachable from off the machine; on a Ray cluster the node's own
    address (never every interface), which its peers on other nodes reach."""
    return node_ip()


def start_local_ray(**options) -> None:
    """`ray.init` of a local Ray of our own whose every listener is on loopback: GCS, raylet,
    object manager, the workers' gRPC servers, the dashboard agent and the runtime-env agent
    bind 127.0.0.1 when that is the node's address (Ray's C++ servers and agents check for it),
    and our own listeners follow the node's address (`bind_host`). Ray turns a
    loopback `_node_ip_address` into the machine's address unless its ENABLE_RAY_CLUSTER switch
    is off (the way it runs on macOS and Windows), so it is off for the call. No dashboard: our
    CLI never talks to it (`ray job submit` would need one, on 127.0.0.1, `dashboard_host`'s default)."""
    import ray
    with loopback_node():
        ray.init(address="local", _node_ip_address="127.0.0.1", **options)


@contextlib.contextmanager
def loopback_node():
    """Ray's ENABLE_RAY_CLUSTER off: Ray then keeps a loopback node address (and a loopback GCS
    address a driver joins) instead of turning it into the machine's address."""
    import ray._private.ray_constants as constants
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved
