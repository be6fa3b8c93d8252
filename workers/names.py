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


def roles_of(mode: str) -> tuple[str, ...]:
    """The pools a cluster of this mode has."""
    return (COLOCATED,) if mode == COLOCATED else (PREFILL, DECODE)
