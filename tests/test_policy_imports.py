"""Policy code stays plain Python: the scheduler, the KV cache manager, the block pool, the
picker, the handoff book, the wire contract, the SLO judge and the configs import without torch
or Ray, so the simulator and unit tests run the same code the cluster runs."""
from __future__ import annotations

import subprocess
import sys

POLICY_MODULES = ("workers.scheduler", "workers.kv_cache_manager", "workers.block_pool", "workers.handoff",
                  "workers.faults", "workers.engine_core", "cluster.capacity.simulate", "workers.cost_model",
                  "cluster.run.controller", "workers.messages", "workers.config", "workers.names", "router.picker",
                  "router.placement", "router.leadership", "router.slo", "router.config", "cluster.run.spec",
                  "router.pools", "cluster.run.pool_control", "router.admission", "cluster.capacity.sim_control",
                  "workers.leases", "cluster.run.book", "cluster.run.forecast", "cluster.capacity.dynamo_baseline")


def test_policy_modules_load_neither_torch_nor_ray():
    code = ("import importlib, sys\n"
            f"for m in {POLICY_MODULES!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"policy modules pulled in {out.stdout.strip()}"
