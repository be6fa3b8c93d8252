"""Live pools on a local Ray: a worker flips roles under load with its weights kept, the cluster
grows and shrinks within its budget, and no request is lost or changed on the way (the oracle is
the offline single engine on the same prompts)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray

from cluster.run.launcher import ClusterSpec
from cluster.run.serve import ServingCluster
from common import free_port, wait_for, wait_pools_clean
from router.pools import ACTIVE, DRAINING, STOPPED
from test_cluster import API_KEY, MAX_TOKENS, engine_cfg, mixed_prompts, send_all
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.names import DECODE, PREFILL
from workers.sequence import SamplingParams


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(48, seed=3)


@pytest.fixture(scope="module")
def reference(prompts):
    engine = LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def cluster(ray_session):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=2, engine=engine_cfg(), num_cpus_per_worker=0.5,
                       max_workers=4)
    # Every request admitted (no SLO shedding while workers drain and flip): each output is checked.
    with ServingCluster(spec, port=free_port(), api_key=API_KEY, admission="queue") as c:
        yield c


def on_loop(c: ServingCluster, fn):
    """Run fn on the router's event loop (the registry is the loop's) and return its result."""
    async def call():
        out = fn()
        return await out if asyncio.iscoroutine(out) else out
    return asyncio.run_coroutine_threadsafe(call(), c.loop).result(timeout=120)


def metric(c: ServingCluster, name: str, labels: dict) -> float:
    return c.server.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_decode_worker_flips_to_prefill_under_load_and_back(cluster, prompts, reference):
    c = cluster
    before = {k: metric(c, "pdcluster:pool_role_changes_total", {"from_role": a, "to_role": b})
              for k, (a, b) in {"dp": (DECODE, PREFILL), "pd": (PREFILL, DECODE)}.items()}
    # Requests in flight while decode-1 drains: it takes no new work, finishes what it runs, flips.
    fut = asyncio.run_coroutine_threadsafe(send_all(c.base_url, prompts), c.loop)
    wait_for(lambda: c.pools["decode-1"].assigned, bool, 60)
    on_loop(c, lambda: c.pools.drain("decode-1", PREFILL))
    assert c.pools["decode-1"].state == DRAINING
    assert fut.result(timeout=180) == reference
    wait_for(lambda: (c.pools["decode-1"].state, c.pools["decode-1"].role), lambda s: s == (ACTIVE, PREFILL), 60)
    assert ray.get(c.pools["decode-1"].handle.ready.remote()).role == PREFILL
    # (the loop thread counts the change after the member's state moved: wait for it, not race it)
    wait_for(lambda: metric(c, "pdcluster:pool_role_changes_total", {"from_role": DECODE, "to_role": PREFILL}),
             lambda n: n == before["dp"] + 1, 10)
    assert metric(c, "pdcluster:pool_workers", {"role": PREFILL}) == 2
    # Now a prefill worker: it takes prompts (and holds their KV for the decode pool).
    steps = ray.get(c.pools["decode-1"].handle.stats.remote()).steps
    assert asyncio.run_coroutine_threadsafe(send_all(c.base_url, prompts), c.loop).result(timeout=180) == reference
    after = ray.get(c.pools["decode-1"].handle.stats.remote())
    assert after.role == PREFILL and after.steps > steps
    # And back, while idle: the flip completes at the next poll.
    on_loop(c, lambda: c.pools.drain("decode-1", DECODE))
    wait_for(lambda: (c.pools["decode-1"].state, c.pools["decode-1"].role), lambda s: s == (ACTIVE, DECODE), 30)
    wait_for(lambda: metric(c, "pdcluster:pool_role_changes_total", {"from_role": PREFILL, "to_role": DECODE}),
             lambda n: n == before["pd"] + 1, 10)
    wait_pools_clean(c)


def test_the_cluster_grows_within_its_budget_and_shrinks_after_a_drain(cluster, prompts, reference):
    c = cluster
    add = c._add_worker                           # (what the controller calls)
    m = on_loop(c, lambda: add(PREFILL))
    assert m is not None and m.worker_id == "prefill-1" and len(c.workers) == 4
    assert on_loop(c, lambda: add(DECODE)) is None                 # the budget is 4: nothing starts
    assert len(c.workers) == 4
    wait_for(lambda: m.state, lambda s: s == ACTIVE, 120)
    assert asyncio.run_coroutine_threadsafe(send_all(c.base_url, prompts), c.loop).result(timeout=180) == reference
    assert ray.get(m.handle.stats.remote()).steps > 0                # it took prompts
    on_loop(c, lambda: c.pools.drain("prefill-1", None))
    wait_for(lambda: m.state, lambda s: s == STOPPED, 60)
    assert len(c.workers) == 3
    with pytest.raises(ray.exceptions.RayActorError):
        wait_for(lambda: ray.get(m.handle.ready.remote(), timeout=10), lambda _: False, 30)
    assert asyncio.run_coroutine_threadsafe(send_all(c.base_url, prompts), c.loop).result(timeout=180) == reference
    wait_pools_clean(c)


def test_a_worker_killed_while_draining_resumes_its_requests_and_completes_its_flip(cluster, prompts, reference):
    """A fault in the middle of a move: decode-0 drains (towards prefill) and dies with requests
    open on it. They resume on the others, nothing is lost or changed; Ray restarts the process,
    which comes back empty and so completes the flip at once."""
    c = cluster
    m = c.pools["decode-0"]
    pid = ray.get(m.handle.ready.remote(), timeout=60).pid
    restarts = metric(c, "pdcluster:workers_replaced_total", {"role": DECODE})
    fut = asyncio.run_coroutine_threadsafe(send_all(c.base_url, prompts), c.loop)
    # Frozen first, so the requests it holds are still open when it dies (a busy box once let
    # them finish between the drain and the kill, and the death had nothing to resume); frozen
    # again if the last of them ended in the moment before the freeze.
    try:
        for _ in range(20):
            wait_for(lambda: m.assigned, bool, 60)
            os.kill(pid, signal.SIGSTOP)
            if on_loop(c, lambda: len(m.assigned)):
                break
            os.kill(pid, signal.SIGCONT)
        on_loop(c, lambda: c.pools.drain("decode-0", PREFILL))
        assert on_loop(c, lambda: len(m.assigned)) >= 1
    finally:
        os.kill(pid, signal.SIGKILL)             # (never leave a stopped process behind)
    assert fut.result(timeout=300) == reference
    wait_for(lambda: (m.state, m.role), lambda s: s == (ACTIVE, PREFILL), 120)
    assert ray.get(m.handle.ready.remote()).role == PREFILL
    assert metric(c, "pdcluster:requests_resumed_total", {"cause": "worker_died"}) >= 1
    assert metric(c, "pdcluster:workers_replaced_total", {"role": DECODE}) + \
        metric(c, "pdcluster:workers_replaced_total", {"role": PREFILL}) > restarts
    # Back to where it was, for the next test in this module.
    on_loop(c, lambda: c.pools.drain("decode-0", DECODE))
    wait_for(lambda: (m.state, m.role), lambda s: s == (ACTIVE, DECODE), 60)
    wait_pools_clean(c)
