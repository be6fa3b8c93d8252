"""pdcluster on an existing multi-node Ray cluster, as the README's "On an existing Ray cluster"
and "As a Ray job" sections run it.

Two real Ray nodes on this machine (`ray start --head` and `ray start --address`, each its own
raylet, object store and custom resource `node_a` / `node_b`), then `pdcluster serve --address
HEAD --placement spread` through the console script joins them: the prefill and the decode worker
must land on different nodes, so every request's KV handoff crosses nodes, and the output must
equal the offline engine's. Then `pdcluster bench` runs as a Ray job (`ray job submit`) against
that server, and `pdcluster bench --from-ray-job` brings its result file back to the submitter.

Isolation: the nodes use a temp dir of their own and free ports (GCS, dashboard, agents, client
server), every Ray process is started here and stopped here by pid: never `ray stop`, which
would end every Ray on the machine. No Ray runs in this process (the session's `ray_session`
stays untouched): the test reads the cluster's state through the dashboard's HTTP API.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from cluster.loadtest import promtext
from common import descendants, free_port, free_ports, kill_all, still_running, wait_for
from workers.cpu_kernels import cache_dir

BIN = Path(sys.executable).parent            # the venv's: ray, pdcluster
PROMPT = "Prefill on one node, decode on the other:"
MAX_TOKENS = 24
BENCH_PROMPTS = 6
ROUTER_LEASE_S = 5.0


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _die_with_us(new_session: bool):
    """preexec_fn: SIGTERM the child when this process dies (a killed pytest leaves no Ray
    behind: `ray start --block` stops its node on SIGTERM); optionally in a session of its own."""
    def preexec():
        if new_session:
            os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    return preexec


def _stop(procs: list[subprocess.Popen], extra: dict) -> None:
    """SIGTERM these processes (a `ray start --block` then stops its node's processes), wait,
    then SIGKILL whatever of them and `extra` (their descendants, collected before) is left."""
    for p in procs:
        if _alive(p):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    try:
        wait_for(lambda: still_running(extra), lambda left: not left, 10)
    except AssertionError:
        print(f"killing what is left of the Ray nodes: {still_running(extra)}")
        kill_all(extra)


class TwoNodeCluster:
    def __init__(self, root: Path):
        self.root = root
        # Every port this cluster's processes listen on, distinct (see free_ports).
        self.ports = iter(free_ports(8))
        self.gcs_port, self.dashboard_port, self.router_port = next(self.ports), next(self.ports), next(self.ports)
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.router = f"http://127.0.0.1:{self.router_port}"
        # RAY_AUTH_MODE: Ray 2.60 turns on token auth for new clusters otherwise.
        self.env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
        for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            self.env.pop(k, None)
        self.nodes: list[subprocess.Popen] = []
        self.serve: subprocess.Popen | None = None
        self.t0 = time.monotonic()

    def mark(self, what: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {what}", flush=True)

    def _start_node(self, name: str, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        with open(log, "w") as f:
            # Its own session: Ray's reaper signals its process group, which must not be ours.
            proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", "--disable-usage-stats",
                                     "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
                                     "--dashboard-agent-listen-port", str(next(self.ports)), *args],
                                    stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                                    preexec_fn=_die_with_us(new_session=True))
        self.nodes.append(proc)
        wait_for(lambda: (_alive(proc), "Ray runtime started" in _log(log)), lambda v: v[1] or not v[0], 60,
                 lambda: _log(log)[-3000:], poll_s=0.2)
        if "Cannot include dashboard with missing packages" in _log(log):
            pytest.fail("Ray's dashboard (the job API) needs `ray[default]` installed")
        assert _alive(proc), f"`ray start` for {name} exited:\n{_log(log)[-3000:]}"
        self.mark(f"ray node {name} started")

    def start(self) -> None:
        self._start_node("head", ["--head", "--port", str(self.gcs_port), "--resources", '{"node_a": 1}',
                                  "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                                  "--dashboard-port", str(self.dashboard_port),
                                  "--ray-client-server-port", str(next(self.ports)),
                                  "--temp-dir", str(self.root / "ray")])
        self._start_node("node-b", ["--address", self.address, "--resources", '{"node_b": 1}'])
        from ray.util.state import list_nodes
        nodes = wait_for(lambda: _try(lambda: list_nodes(address=self.dashboard, filters=[("state", "=", "ALIVE")])),
                         lambda ns: ns is not None and len(ns) == 2, 60, poll_s=0.2)
        self.node_of = {}                    # Ray node id -> "node_a" | "node_b"
        for n in nodes:
            tags = [r for r in ("node_a", "node_b") if r in n.resources_total]
            assert len(tags) == 1, n
            self.node_of[n.node_id] = tags[0]
        assert sorted(self.node_of.values()) == ["node_a", "node_b"]
        self.mark("both nodes alive in the dashboard")

    def start_serve(self) -> None:
        log = self.root / "serve.log"
        with open(log, "w") as f:
            self.serve = subprocess.Popen(
                [str(BIN / "pdcluster"), "serve", "--address", self.address, "--placement", "spread",
                 "--prefill", "1", "--decode", "1", "--model", "tiny", "--port", str(self.router_port),
                 "--kv-cache-memory-mib", "16", "--swap-space-mib", "0",
                 "--router-lease-s", str(ROUTER_LEASE_S),         # (the lead moves after one)
                 "--local-prefill-max-tokens", "0"],   # every prompt's KV crosses the nodes (what this tests)
                stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                preexec_fn=_die_with_us(new_session=False))
        wait_for(lambda: (_alive(self.serve), _try(lambda: httpx.get(self.router + "/v1/models", timeout=5))),
                 lambda v: not v[0] or (v[1] is not None and v[1].status_code == 200), 120,
                 lambda: _log(log)[-3000:], poll_s=0.2)
        assert _alive(self.serve), f"`pdcluster serve` exited:\n{_log(log)[-3000:]}"
        self.mark("pdcluster serve answers")

    def stop(self) -> None:
        extra = descendants(*[p.pid for p in self.nodes + ([self.serve] if self.serve else [])])
        if self.serve is not None and _alive(self.serve):
            self.serve.send_signal(signal.SIGINT)            # Ctrl-C: drain, stop the workers
            try:
                self.serve.wait(30)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        self.mark("serve stopped")
        _stop(self.nodes[1:], {})                           # the worker node, then the head
        _stop(self.nodes[:1], extra)
        self.mark(f"both nodes stopped ({len(extra)} processes)")


def _try(fn):
    try:
        return fn()
    except Exception:                     # not up yet
        return None


@pytest.fixture(scope="module")
def cluster(spawns):
    # Short: Ray's unix sockets live under it (their paths are limited to ~107 bytes).
    root = Path(tempfile.mkdtemp(prefix="pdc-mn-", dir="/tmp"))
    c = TwoNodeCluster(root)
    try:
        c.start()
        c.start_serve()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _kv_transfers(router: str) -> tuple[float, float]:
    """(KV pulls, KV bytes) the decode workers reported, from the router's /metrics."""
    m = promtext.scrape(router + "/metrics")
    return (promtext.total(m, "pdcluster:kv_transfer_seconds_count"),
            promtext.total(m, "pdcluster:kv_transfer_bytes_total"))


def test_workers_span_nodes_and_kv_crosses_them(cluster):
    from ray.util.state import list_actors

    from cluster.offline import generate

    actors = [a for a in list_actors(address=cluster.dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
              if a.name and a.name.startswith("pdcluster-") and a.class_name == "Worker"]   # (and its book)
    where = {a.name.rsplit("-", 2)[-2]: cluster.node_of[a.node_id] for a in actors}
    assert len(actors) == 2 and sorted(where) == ["decode", "prefill"], actors
    assert where["prefill"] != where["decode"], f"both workers on {where['prefill']}: --placement spread failed"

    pulls0, bytes0 = _kv_transfers(cluster.router)
    r = httpx.post(cluster.router + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    offline = generate([{"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}],
                       model="tiny")[0]
    assert choice["token_ids"] == offline["token_ids"]
    assert choice["text"] == offline["text"]
    # The request's KV went from the prefill worker's node to the decode worker's: one pull.
    pulls, nbytes = wait_for(lambda: _kv_transfers(cluster.router), lambda v: v[0] >= pulls0 + 1, 10)
    assert pulls == pulls0 + 1 and nbytes > bytes0, (pulls0, pulls, bytes0, nbytes)
    cluster.mark("cross-node request checked")


def test_bench_as_ray_job_brings_its_result_back(cluster, tmp_path):
    job = f"pdcluster-bench-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--submission-id", job, "--no-wait",
         "--", str(BIN / "pdcluster"), "bench", "--base-url", cluster.router, "--dataset-name", "random",
         "--num-prompts", str(BENCH_PROMPTS), "--random-input-len", "40", "--random-output-len", "8",
         "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", "job-results", "--no-plots"],
        capture_output=True, text=True, env=cluster.env, cwd=tmp_path, timeout=120)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    cluster.mark("bench job submitted")

    # The submitter's side: another directory, no filesystem shared with the job but the log.
    fetched = tmp_path / "fetched"
    got = subprocess.run(
        [str(BIN / "pdcluster"), "bench", "--from-ray-job", job, "--ray-address", cluster.dashboard,
         "--result-dir", str(fetched)],
        capture_output=True, text=True, env=cluster.env, cwd=tmp_path, timeout=180)
    assert got.returncode == 0, got.stdout + got.stderr
    cluster.mark("bench result fetched")
    files = sorted(p.name for p in fetched.iterdir())
    results = [f for f in files if f.endswith(".json")]
    assert len(results) == 1 and any(f.endswith("-latency.png") for f in files), files
    result = json.loads((fetched / results[0]).read_text())
    assert result["completed"] == BENCH_PROMPTS and result["failed"] == 0, result.get("errors")
    assert result["num_workers"] == 2
    assert result["server"]["kv_transfers"] == BENCH_PROMPTS      # each handed over across the nodes
    assert f"{BENCH_PROMPTS} completed, 0 failed" in got.stdout, got.stdout
    assert "Serving Benchmark Result" in got.stdout                # the job's report, echoed
    assert "pdcluster-bench-result-begin" not in got.stdout         # ... without the raw result
    # The job saved its own copy on the head (under the node's directory), not where we fetched to.
    assert not (tmp_path / "job-results").exists()
    on_head = list(cluster.root.rglob(f"job-results/{results[0]}"))
    assert len(on_head) == 1 and json.loads(on_head[0].read_text()) == result, on_head


def _completion(router: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    r = httpx.post(router + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _workers(cluster) -> dict[str, int]:
    """Worker actor name -> pid, of the pdcluster workers alive now."""
    from ray.util.state import list_actors
    return {a.name: a.pid for a in list_actors(address=cluster.dashboard, filters=[("state", "=", "ALIVE")],
                                               limit=1000)
            if a.name and a.name.startswith("pdcluster-") and a.class_name == "Worker"}


class _Router:
    """`pdcluster router` attached to the module's pools, with a short hang timeout."""

    def __init__(self, cluster, router_id: str, log: Path):
        self.url, self.log = f"http://127.0.0.1:{free_port()}", log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [str(BIN / "pdcluster"), "router", "--address", cluster.address, "--router-id", router_id,
                 "--port", self.url.rsplit(":", 1)[1], "--worker-hang-timeout-s", "3"],
                stdout=f, stderr=subprocess.STDOUT, env=cluster.env, cwd=cluster.root,
                preexec_fn=_die_with_us(new_session=False))
        wait_for(lambda: (_alive(self.proc), self.health()), lambda v: not v[0] or (v[1] or {}).get("status") == "ok",
                 120, lambda: _log(log)[-3000:], poll_s=0.2)
        assert _alive(self.proc), _log(log)[-3000:]

    def health(self) -> dict | None:
        return _try(lambda: httpx.get(self.url + "/health", timeout=5).json())

    def metrics(self) -> dict[str, float]:
        return promtext.scrape(self.url + "/metrics")

    def wait_lead(self, deadline_s: float) -> dict[str, float]:
        """Its /metrics once it leads (the workers' series appear there)."""
        return wait_for(self.metrics, lambda m: any(k.startswith("pdcluster:kv_cache_usage_perc") for k in m),
                        deadline_s, lambda: _log(self.log)[-3000:], poll_s=0.5)

    def stop(self) -> None:
        if _alive(self.proc):
            self.proc.kill()
            self.proc.wait()


def _while_streaming(router: _Router, max_tokens: int, act) -> list[int]:
    """A long completion through `router`; `act()` once its tokens flow; then its token ids."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_completion, router.url, max_tokens)
        wait_for(lambda: promtext.total(router.metrics(), "pdcluster:router_requests_running"),
                 lambda n: n >= 1 or running.done(), 60, poll_s=0.1)
        act()
        assert not running.done(), "the request finished before the fault: make it longer"
        return running.result(timeout=180)


def test_the_lead_moves_when_serve_and_then_a_router_die_and_down_removes_the_pools(cluster, tmp_path):
    """On a Ray cluster the pools outlive the serve that launched them. SIGKILL it while router
    r1 streams: that stream finishes whole and untouched, and r1 takes the lead once serve's
    lapses (the workers' series move to its /metrics). Then SIGKILL r1 and hang the decode
    worker (SIGSTOP) at once, while r2 streams: r2 takes the lead and restarts the worker that
    nobody else will, and its stream resumes to the offline engine's tokens. `pdcluster down`
    then removes the pools, and r2 stops on its own. (Runs last in this module: it kills the
    module's serve.)"""
    from cluster.offline import generate
    long_tokens = 1400                 # seconds of decoding: the faults land while it streams, on a fast box too
    want_long = generate([{"prompt": PROMPT, "max_tokens": long_tokens, "temperature": 0, "ignore_eos": True}],
                         model="tiny")[0]["token_ids"]
    workers, routers = _workers(cluster), []
    assert len(workers) == 2, workers
    decode = next(n for n in workers if "-decode-" in n)
    try:
        r1 = _Router(cluster, "r1", tmp_path / "r1.log")
        routers.append(r1)
        assert _completion(r1.url) == want_long[:MAX_TOKENS]
        assert r1.health()["leads"] is False
        assert not any(k.startswith("pdcluster:kv_cache_usage_perc") for k in r1.metrics())   # serve exports them

        def kill_serve():
            cluster.serve.kill()                        # SIGKILL: no cleanup of any kind
            cluster.serve.wait(30)
            cluster.mark("serve killed")
        assert _while_streaming(r1, long_tokens, kill_serve) == want_long
        assert promtext.total(r1.metrics(), "pdcluster:requests_resumed_total") == 0    # untouched
            # The workers live on, the same processes; r1 leads once serve's lease lapses.
        led = r1.wait_lead(ROUTER_LEASE_S + 30)
        assert {promtext.split(k)[1]["worker"] for k in led if k.startswith("pdcluster:kv_cache_usage_perc")} \
            == {n.split("-", 2)[2] for n in workers}
        assert promtext.total(led, "pdcluster:router_leader") == 1 and r1.health()["leads"] is True
        assert _workers(cluster) == workers
        cluster.mark("r1 leads")

        r2 = _Router(cluster, "r2", tmp_path / "r2.log")
        routers.append(r2)
        assert r2.health()["leads"] is False

        def kill_r1_and_hang_decode():
            r1.stop()
            os.kill(workers[decode], signal.SIGSTOP)
            cluster.mark("r1 killed, decode worker stopped")
        assert _while_streaming(r2, long_tokens, kill_r1_and_hang_decode) == want_long
        m = r2.wait_lead(ROUTER_LEASE_S + 30)
        assert promtext.total(m, "pdcluster:workers_replaced_total") == 1
        after = _workers(cluster)
        assert set(after) == set(workers) and after[decode] != workers[decode], (workers, after)
        assert "hung and not back; restarting it" in _log(r2.log), _log(r2.log)[-3000:]
        cluster.mark("r2 leads; it restarted the hung worker")

        down = subprocess.run([str(BIN / "pdcluster"), "down", "--address", cluster.address], capture_output=True,
                              text=True, env=cluster.env, cwd=cluster.root, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "(2 workers)" in down.stdout, down.stdout
        assert _workers(cluster) == {}
        r2.proc.wait(60)                                    # its cluster is gone: it stops by itself
        assert "was removed" in _log(r2.log), _log(r2.log)[-3000:]
        cluster.mark("pools removed; r2 stopped")
    finally:
        for r in routers:
            r.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[decode], signal.SIGKILL)        # a stopped process, should the test fail first


def test_result_block_in_a_job_log():
    """The job's log carries the result between markers: the last complete block wins, a block
    cut short is not a result, and the rest of the log is kept for the submitter to read."""
    import io

    from cluster.loadtest.bench import RESULT_BEGIN, emit_result, extract_result
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("progress\r")
        emit_result({"completed": 1}, "first.json", "job-1")
        print("report")
        emit_result({"completed": 2, "failed": 0}, "second.json", "job-1")
    found, rest = extract_result(out.getvalue() + f"{RESULT_BEGIN} cut.json\n{{\"completed\"")
    assert found == ("second.json", {"completed": 2, "failed": 0})
    assert rest.split("\n")[:2] == ["progress", "report"] and '"completed": 2' not in rest
    assert extract_result("no result here\n") == (None, "no result here\n")


# -- a Ray cluster started the way its docs say (`ray start --head`, Ray's default authentication) --
class DefaultHead:
    """`ray start --head` with Ray's defaults, in a HOME of its own that holds a token (as any
    machine that ever ran a local `ray.init` does): Ray then turns token authentication on."""

    def __init__(self, root: Path):
        self.root = root
        self.port, self.client_port, self.agent_port = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("RAY_") or k == "RAY_USAGE_STATS_ENABLED"}
        # (the kernels this machine built already: a HOME of its own would build them anew, a minute and more)
        self.env.update(HOME=str(root / "home"), OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
                        PDCLUSTER_CACHE_DIR=str(cache_dir()))
        self.node: subprocess.Popen | None = None

    def start(self) -> None:
        (self.root / "home").mkdir()
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=self.env, check=True,
                       capture_output=True, timeout=60)
        log = self.root / "head.log"
        with open(log, "w") as f:
            self.node = subprocess.Popen(
                [str(BIN / "ray"), "start", "--block", "--head", "--port", str(self.port), "--num-cpus", "2",
                 "--node-ip-address", "127.0.0.1", "--include-dashboard", "false",
                 "--ray-client-server-port", str(self.client_port), "--dashboard-agent-listen-port", str(self.agent_port),
                 "--temp-dir", str(self.root / "ray")],
                stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                preexec_fn=_die_with_us(new_session=True))
        wait_for(lambda: (_alive(self.node), "Ray runtime started" in _log(log)), lambda v: v[1] or not v[0], 60,
                 lambda: _log(log)[-3000:], poll_s=0.2)
        assert _alive(self.node), _log(log)[-3000:]
        assert "Token authentication is enabled" in _log(log), "the head did not turn token auth on"

    def stop(self) -> None:
        if self.node is not None:
            _stop([self.node], descendants(self.node.pid))

    def serve(self, *args: str, log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.root / log_name
        with open(log, "w") as f:
            proc = subprocess.Popen([str(BIN / "pdcluster"), "serve", "--model", "tiny", *args],
                                    stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                                    preexec_fn=_die_with_us(new_session=False))
        return proc, log


@pytest.fixture(scope="module")
def default_head(spawns):
    root = Path(tempfile.mkdtemp(prefix="pdc-head-", dir="/tmp"))
    head = DefaultHead(root)
    try:
        head.start()
        yield head
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)


def _serve_and_ask(head: DefaultHead, args: list[str], log_name: str) -> dict:
    """Run `pdcluster serve`, ask it one greedy completion, stop it with Ctrl-C; returns what the
    test needs: the answer, whether it started a Ray of its own, and its log."""
    port = free_port()
    proc, log = head.serve("--port", str(port), "--kv-cache-memory-mib", "16", "--swap-space-mib", "0", *args,
                           log_name=log_name)
    try:
        wait_for(lambda: (_alive(proc), _try(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5))),
                 lambda v: not v[0] or (v[1] is not None and v[1].status_code == 200), 180,
                 lambda: _log(log)[-3000:], poll_s=0.2)
        assert _alive(proc), f"`pdcluster serve {' '.join(args)}` exited:\n{_log(log)[-3000:]}"
        own_ray = any("gcs_server" in cmd for cmd in descendants(proc.pid).values())
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return {"token_ids": r.json()["choices"][0]["token_ids"], "own_ray": own_ray, "log": _log(log)}
    finally:
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        wait_for(lambda: still_running(tree), lambda left: not left, 30)


def test_serve_joins_a_cluster_started_with_rays_defaults(default_head):
    """Token authentication on (Ray's default once a token exists): `--address` still joins,
    sending the token it finds in ~/.ray, and serves."""
    from cluster.offline import generate
    got = _serve_and_ask(default_head, ["--address", default_head.address], "serve-join.log")
    assert not got["own_ray"], "it started a Ray of its own instead of joining"
    assert "InvalidAuthToken" not in got["log"]
    want = generate([{"prompt": PROMPT, "max_tokens": 8, "temperature": 0}], model="tiny")[0]
    assert got["token_ids"] == want["token_ids"]


def test_serve_without_address_starts_its_own_ray_sized_for_the_workers(default_head):
    """A Ray already runs on this machine (the head above): plain `serve` must not join it (the
    README: without --address it starts a local one), and its local Ray holds 3 workers at 1 CPU
    each on this 2-core box (oversubscribed, as a development box may be)."""
    got = _serve_and_ask(default_head, ["--prefill", "2", "--decode", "1", "--cpus-per-worker", "1"], "serve-local.log")
    assert got["own_ray"], "it joined the Ray already running here"


def _fails_fast(head: DefaultHead, args: list[str], *needles: str) -> None:
    t0 = time.monotonic()
    proc, log = head.serve(*args, log_name=f"fail-{uuid.uuid4().hex[:6]}.log")
    try:
        rc = proc.wait(30)
    finally:
        if _alive(proc):
            proc.kill()
    elapsed = time.monotonic() - t0
    out = _log(log)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), out[-3000:]
    assert elapsed < 5, f"took {elapsed:.1f}s to fail:\n{out[-2000:]}"


def test_a_port_in_use_fails_at_once_naming_the_fix(default_head):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _fails_fast(default_head, ["--port", str(port)], f"127.0.0.1:{port} is in use", "--port")


def test_an_address_nothing_answers_on_fails_at_once_naming_the_fix(default_head):
    closed = free_port()                                # bound and released: nothing listens there
    _fails_fast(default_head, ["--address", f"127.0.0.1:{closed}", "--port", str(free_port())],
                f"cannot reach the Ray cluster at 127.0.0.1:{closed}", "ray start --head")


def test_workers_that_do_not_fit_fail_at_once_naming_the_fix(default_head):
    _fails_fast(default_head, ["--address", default_head.address, "--port", str(free_port()), "--prefill", "4"],
                "need 2.5 CPU", "has 2 of 2 free", "--cpus-per-worker")
