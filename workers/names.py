"""The names the CLI, the router and the workers share: roles, modes, transports, policies.

Each choice is spelled here once; flags, validation and metrics labels import it.
"""
from __future__ import annotations

PREFILL, DECODE, COLOCATED = ROLES = ("prefill", "decode", "colocated")
DISAGGREGATED = "disaggregated"
MODES = (DISAGGREGATED, COLOCATED)                    # a cluster's shape
# KV handoff. auto: nccl on GPUs; on CPU shared memory between workers of one node, else gloo.
AUTO, SHM, GLOO, NCCL = TRANSPORTS = ("auto", "shm", "gloo", "nccl")
P2C, RANDOM, ROUND_ROBIN, PREFIX = PICKING_POLICIES = ("p2c", "random", "round-robin", "prefix")   # how the router picks
PREEMPTION_KINDS = ("recompute", "swap")                # what a preemption did
PREEMPTION_MODES = ("auto",) + PREEMPTION_KINDS         # what the scheduler may choose
SCHEDULING_POLICIES = ("fcfs", "priority", "deadline")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash")


def first_role(mode: str) -> str:
    """The role a request starts on in a cluster of this mode."""
    return COLOCATED if mode == COLOCATED else PREFILL


# A request id starts with its router's owner tag: "{router id}~{incarnation}/...". Workers route
# a request's events to its owner, and end its requests when the owner's lease lapses. An id
# without a tag belongs to no router (tools and tests that poll a worker themselves).
OWNER_SEP = "/"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def check_name(name: str, what: str = "--router-id") -> str:
    """A router's or a cluster's id: it goes into request ids and actor names."""
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= NAME_CHARS:
        raise ValueError(f"{what} takes 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    return name


def owner_tag(router_id: str) -> str:
    """A router process's owner tag: its id and an incarnation of its own, so that a router
    restarted under the same id owns none of its predecessor's requests."""
    import secrets
    return f"{check_name(router_id)}~{secrets.token_hex(4)}"


def owner_of(rid: str) -> str:
    """The owner tag of a request id ("" for an id without one)."""
    owner, sep, _ = rid.partition(OWNER_SEP)
    return owner if sep else ""
