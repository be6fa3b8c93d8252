"""Several routers over the same pools. `pdcluster serve` (here: a ServingCluster in this process,
router "r0") launches 1 prefill + 2 decode workers; `pdcluster router` (a subprocess, as a user
runs it) attaches to them as router "r1". Both serve the transformers greedy outputs; SIGKILL of
r1 mid-stream leaves r0's streams whole, and the workers end r1's requests once its lease lapses,
so every block comes back; a new r1 attaches and serves; and each router's /metrics carries its
own label, the workers' series only r0's (it leads). r1's requests reach r0's request log (the
controller's) through the cluster's book."""
from __future__ import annotations

import asyncio
import os
import subprocess

import httpx
import openai
import pytest
import ray

from cluster.loadtest import promtext
from cluster.run.launcher import ClusterSpec
from cluster.run.serve import ServingCluster
from common import free_port
from common import (MAX_NEW_TOKENS, PROMPTS, ROOT, descendants, kill_all, pdcluster_cmd, still_running,
                    wait_for, wait_pools_clean)

LEASE_S = 2.0


@pytest.fixture(scope="module")
def r0(ray_session):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=2, num_cpus_per_worker=0.5, router_lease_s=LEASE_S,
                       max_workers=4,
                       engine={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 512}})
    with ServingCluster(spec, port=free_port(), admission="queue", router_id="r0") as c:
        yield c


class Router:
    """`pdcluster router` in its own session, attached to r0's pools."""

    def __init__(self, cluster: ServingCluster, log, router_id: str = "r1"):
        self.port, self.log = free_port(), log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        cmd = pdcluster_cmd("router", "--address", ray.get_runtime_context().gcs_address, "--cluster-id",
                            cluster.spec.cluster_id, "--router-id", router_id, "--port", str(self.port),
                            "--admission", "queue")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.tree: dict = {}
        try:
            wait_for(self._health, lambda s: s in ("ok", "exited"), 120, lambda: self.output[-3000:], poll_s=0.2)
            assert self.proc.poll() is None, self.output[-3000:]
            self.tree = descendants(self.proc.pid)
        except BaseException:
            self.kill()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _health(self):
        if self.proc.poll() is not None:
            return "exited"
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json().get("status")
        except (httpx.HTTPError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing of it runs cleanup."""
        self.tree |= descendants(self.proc.pid)
        self.proc.kill()
        self.proc.wait(timeout=30)
        wait_for(lambda: still_running(self.tree), lambda left: not left, 20)
        kill_all(self.tree)


async def stream(url: str, prompt: list[int], tokens: list[int], max_tokens: int = MAX_NEW_TOKENS) -> None:
    """One streaming completion through the official client (token ids in, and out: each
    chunk's `token_ids`), appending each token to `tokens` as it arrives."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        chunks = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices:
                tokens.extend(chunk.choices[0].token_ids or [])
    finally:
        await client.close()


def greedy_through(urls: list[str], prompts: list[list[int]]) -> list[list[int]]:
    """The prompts through the routers, spread round-robin, all at once."""
    async def run():
        outs = [[] for _ in prompts]
        await asyncio.gather(*(stream(urls[i % len(urls)], p, outs[i]) for i, p in enumerate(prompts)))
        return outs
    return asyncio.run(run())


def metrics(url: str) -> dict[str, float]:
    return promtext.scrape(f"{url}/metrics")


def routers_of(m: dict[str, float]) -> set[str]:
    return {promtext.split(series)[1].get("router") for series in m}


def test_two_routers_serve_the_greedy_outputs_and_a_dead_one_loses_only_its_own(r0, tmp_path, hf_greedy):
    prompts = PROMPTS[:8]
    want = hf_greedy(prompts)
    r1 = Router(r0, tmp_path / "r1.log")
    try:
        # Both routers, half the prompts each, at once: every output is transformers'.
        url0 = r0.base_url.removesuffix("/v1")
        assert greedy_through([url0, r1.url], prompts) == want
        # Each router's /metrics: its own label; the workers' series only from r0 (it launched them).
        m0, m1 = metrics(url0), metrics(r1.url)
        assert routers_of(m0) == {"r0"} and routers_of(m1) == {"r1"}
        assert len({promtext.split(k)[1].get("worker") for k in m0 if k.startswith("pdcluster:num_requests_running")}) == 3
        assert not any(k.startswith("pdcluster:num_requests_running") for k in m1)
        done = [promtext.total(m, "pdcluster:request_success_total") for m in (m0, m1)]
        assert done == [len(prompts) / 2] * 2            # they add up: each router counts its own
        # r1 relays its requests through the cluster's book to the leader (r0): the controller's
        # log holds every router's requests, each once.
        log = r0.dispatcher.metrics.requests
        wait_for(lambda: (len(log.arrivals), len(log.finishes)), lambda n: min(n) >= len(prompts), LEASE_S + 10)
        assert (len(log.arrivals), len(log.finishes)) == (len(prompts), len(prompts))
        assert sorted(a[1] for a in log.arrivals) == sorted(map(len, prompts))

        # r1 dies (SIGKILL) with its streams mid-way (long ones: they would run on for many seconds);
        # r0's streams, running beside them, finish whole.
        long_prompts = [p for p in prompts if len(p) < 64][:4]

        async def kill_mid_way():
            mine = [[] for _ in prompts]
            theirs = [[] for _ in long_prompts]
            r0_runs = [asyncio.ensure_future(stream(url0, p, mine[i])) for i, p in enumerate(prompts)]
            r1_runs = [asyncio.ensure_future(stream(r1.url, p, theirs[i], 1500)) for i, p in enumerate(long_prompts)]
            deadline = asyncio.get_running_loop().time() + 60
            while min(map(len, theirs)) < 4:                        # r1's streams under way
                assert asyncio.get_running_loop().time() < deadline, theirs
                await asyncio.wait(r1_runs, timeout=0.05)
            await asyncio.to_thread(r1.kill)
            results = await asyncio.gather(*r1_runs, return_exceptions=True)
            assert all(isinstance(e, Exception) for e in results)           # cut off, as its clients see it
            await asyncio.gather(*r0_runs)
            return mine
        assert asyncio.run(kill_mid_way()) == want
        # The workers end r1's requests once its lease lapses (long before they would finish):
        # every block comes back.
        wait_for(lambda: promtext.total(metrics(url0), "pdcluster:router_lease_aborts_total"),
                 lambda n: n >= len(long_prompts), LEASE_S + 20)
        wait_pools_clean(r0, 20)
        # A new router under the same name attaches to the running pools and serves.
        r1 = Router(r0, tmp_path / "r1-again.log")
        assert greedy_through([r1.url], prompts[:3]) == want[:3]
        wait_pools_clean(r0, 20)
    finally:
        r1.kill()


def test_an_attached_router_follows_the_leaders_pool_changes(r0, tmp_path, hf_greedy):
    """The leading router moves a decode worker to the prefill pool (a drain, then the flip)
    while the attached router streams through the pools, and adds a worker (as its controller
    does); the attached router follows both (the drain and the role in the worker's reports, the
    new actor's name) and serves the greedy outputs throughout."""
    prompts = PROMPTS[:4]
    want = hf_greedy(prompts)
    r1 = Router(r0, tmp_path / "r1.log")

    def pools_of(url: str) -> dict:
        return httpx.get(f"{url}/health", timeout=10).json()["workers"]
    try:
        assert pools_of(r1.url) == {"prefill": 1, "decode": 2, "colocated": 0}

        async def drain_under_load():
            # r1 streams while the leader drains decode-1: r1's requests that reach it after the
            # drain began are refused there and resume on decode-0; those running finish.
            outs = [[] for _ in prompts]
            runs = [asyncio.ensure_future(stream(r1.url, p, outs[i])) for i, p in enumerate(prompts)]
            while sum(map(len, outs)) < len(prompts):
                await asyncio.wait(runs, timeout=0.05)
            r0.loop.call_soon_threadsafe(r0.pools.drain, "decode-1", "prefill")
            await asyncio.gather(*runs)
            return outs
        assert asyncio.run(drain_under_load()) == want
        wait_for(lambda: pools_of(r1.url), lambda p: p == {"prefill": 2, "decode": 1, "colocated": 0}, 60)
        added = asyncio.run_coroutine_threadsafe(r0._add_worker("decode"), r0.loop).result(60)
        assert added is not None and added.worker_id == "decode-2"
        wait_for(lambda: pools_of(r1.url), lambda p: p == {"prefill": 2, "decode": 2, "colocated": 0}, 120)
        assert greedy_through([r1.url], prompts) == want
        wait_pools_clean(r0, 20)
    finally:
        r1.kill()


def test_a_worker_dies_under_two_routers_and_each_resumes_its_own(r0, tmp_path, hf_greedy):
    """SIGKILL of a decode worker while both routers stream through it: each router sees the
    death on its own stream and resumes its own requests (no gap, no token twice: transformers'
    outputs); Ray restarts the worker and every block comes back."""
    prompts = PROMPTS[:8]
    want = hf_greedy(prompts)
    r1 = Router(r0, tmp_path / "r1.log")
    url0 = r0.base_url.removesuffix("/v1")
    try:
        async def kill_a_decode_worker_mid_way():
            outs = [[] for _ in prompts]
            runs = [asyncio.ensure_future(stream([url0, r1.url][i % 2], p, outs[i])) for i, p in enumerate(prompts)]
            deadline = asyncio.get_running_loop().time() + 60
            # The victim runs streams now, as the worker itself says: the file's earlier tests
            # flipped decode-1 and added decode-2, and both routers may send every stream to one
            # of the two decode workers (a kill of the idle one resumed nothing).
            while True:
                assert asyncio.get_running_loop().time() < deadline, outs
                await asyncio.wait(runs, timeout=0.05)
                if sum(map(len, outs)) >= len(prompts) * MAX_NEW_TOKENS // 4:
                    if victim := decode_worker_running_streams(r0):
                        break
            os.kill(victim.pid, 9)
            await asyncio.gather(*runs)
            return outs
        assert asyncio.run(kill_a_decode_worker_mid_way()) == want
        resumed = [promtext.total(metrics(u), "pdcluster:requests_resumed_total", cause="worker_died")
                   for u in (url0, r1.url)]
        assert sum(resumed) >= 1, resumed           # streams on it resumed (each router resumes its own)
        wait_for(lambda: httpx.get(f"{r1.url}/health", timeout=10).json()["workers"]["decode"], lambda n: n == 2, 120)
        wait_for(lambda: set(r0.answering()), lambda ids: ids == {w.worker_id for w in r0.workers}, 120)
        wait_pools_clean(r0, 30)
    finally:
        r1.kill()


def decode_worker_running_streams(cluster: ServingCluster):
    """The `ready()` answer of a decode worker that runs a sequence now (asked of the worker,
    not read from a report that may be old), or None while none does."""
    for worker_id, info in cluster.answering().items():
        handle = next(w.handle for w in cluster.workers if w.worker_id == worker_id)
        if info.role == "decode" and ray.get(handle.stats.remote(), timeout=10).running > 0:
            return info
    return None


def test_a_second_launch_of_running_pools_and_down_of_absent_ones_fail_naming_the_way(r0):
    """`serve --cluster-id` of pools that run already fails before it launches anything, naming
    `pdcluster router` and `pdcluster down`; `down` of pools that are not there names those that are."""
    from cluster.run.launcher import remove_cluster
    again = ServingCluster(ClusterSpec(model="tiny", num_prefill=1, num_decode=1, cluster_id=r0.spec.cluster_id),
                           port=free_port())
    with pytest.raises(RuntimeError, match="runs on this Ray cluster already.*pdcluster router.*pdcluster down"):
        again.build()
    with pytest.raises(RuntimeError, match=f"no workers of cluster 'absent'.*{r0.spec.cluster_id}"):
        remove_cluster("absent")
    assert set(r0.answering()) == {w.worker_id for w in r0.workers}      # r0's pools untouched


def test_a_restarted_book_is_claimed_again_and_the_router_serves_on(r0, hf_greedy):
    """The book's process dies (its node lost): Ray restarts it with the launch settings, the
    lead is claimed anew within a lease, and serving never stopped."""
    from cluster.run.launcher import find_book
    book = find_book(r0.spec.cluster_id)
    pid = ray.get(book.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(book, no_restart=False)
    wait_for(lambda: _try_pid(book), lambda p: p not in (None, pid), 30)
    url0 = r0.base_url.removesuffix("/v1")
    assert greedy_through([url0], PROMPTS[:2]) == hf_greedy(PROMPTS[:2])
    # The book's holder and the router's own view: a router that could not renew while the book
    # restarted follows until its next claim, which the book (its term kept) answers with the lead.
    wait_for(lambda: (ray.get(book.__ray_call__.remote(lambda self: self.lead.holder)), r0.leads),
             lambda v: v == (r0.dispatcher.owner, True), LEASE_S + 10)
    assert httpx.get(f"{url0}/health").json()["leads"] is True
    assert ray.get(book.settings.remote())["cluster_id"] == r0.spec.cluster_id


def _try_pid(book):
    try:
        return ray.get(book.__ray_call__.remote(lambda self: os.getpid()), timeout=5)
    except Exception:                   # restarting
        return None


def test_a_launch_that_fails_after_its_workers_started_leaves_nothing(ray_session, monkeypatch):
    """Whatever fails between the workers' start and serving (here: building the router) stops
    the workers and removes the book: on a Ray cluster they are detached and would outlive us."""
    from cluster.run.launcher import find_book, named_workers

    def broken(self, *args):
        raise RuntimeError("the router could not be built")
    monkeypatch.setattr(ServingCluster, "_build_router", broken)
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    with pytest.raises(RuntimeError, match="could not be built"):
        ServingCluster(spec, port=free_port()).build()
    assert spec.cluster_id not in named_workers() and find_book(spec.cluster_id) is None
