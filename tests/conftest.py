"""Shared fixtures: the built-in `tiny` model exported as a Hugging Face checkpoint, the same
checkpoint loaded by transformers, and transformers' greedy outputs as the reference oracle.

The reference is computed by transformers (an independent Llama implementation), never by
our own engine, and only once per prompt for the whole session.

The tiers: a test that uses `ray_session` (itself or through a fixture such as `cluster`) is
marked `ray`; one that starts processes of ours or Ray's (a server, a CLI, a Ray node, a
transport's peer) asks for the `spawns` fixture and is marked `spawns`. `make test-fast` runs the
rest. Nobody has to remember: a test without either marker that starts such a process fails,
naming the fixture it lacks.

`make test` runs two pytest processes (xdist). A test that measures this machine (a load the
cluster must meet, a profile of its speed) asks for `alone`: the other process waits while it
runs, as it would on a machine of its own (a lock around each test: `_turn`).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repo root: tests reuse benchmarks' bodies

import common
from common import MAX_NEW_TOKENS, VOCAB

# Two cores, shared with other work: one intra-op thread keeps runs predictable.
torch.set_num_threads(1)

LIVE = {"ray_session": "ray", "spawns": "spawns"}     # fixture -> the marker it gives its tests


ALONE = "alone"                 # fixture and marker: the other test process waits while it runs
LOCKS = "PDCLUSTER_TEST_LOCKS"  # the folder of the lock files both test processes share


# Seconds a file's tests take here, one process, for the files that take more than ten (the
# rest count a tenth of a second a test). `make test` hands files out longest first, so that
# the last file to end is a short one: handed out by test count (xdist's default), the one-test
# files of a minute came last while the other process had nothing left to run. A stale figure
# costs time, never a result.
FILE_COST_S = {
    "test_multinode.py": 120, "test_controller.py": 115, "test_tensor_parallel.py": 105, "test_faults.py": 80,
    "test_serve_cli.py": 100, "test_admission_live.py": 60, "test_cluster.py": 55, "test_routers.py": 50,
    "test_api_fuzz.py": 50, "test_inner_plane.py": 45, "test_capacity.py": 45, "test_bench.py": 40,
    "test_cancel_storm.py": 40, "test_transfer_faults.py": 30, "test_controller_live.py": 30, "test_samples.py": 25,
    "test_admission.py": 25, "test_live_pools.py": 20, "test_hf_parity.py": 20, "test_drain.py": 20,
    "test_observability.py": 20, "test_lm_eval.py": 20, "test_sampling.py": 15, "test_policies_cluster.py": 15,
    "test_prefix_cluster.py": 15, "test_penalties.py": 15, "test_decode_gate.py": 12, "test_kv_transfer.py": 12, "test_kv_shm.py": 11,
    "test_handoff.py": 10, "test_kv_streaming.py": 10,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in {**LIVE, ALONE: ALONE}.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
    if config.getoption("dist", "no") == "loadfile":          # (with --no-loadscope-reorder)
        files: dict[str, list] = {}
        for item in items:
            files.setdefault(item.path.name, []).append(item)
        order = sorted(files, key=lambda f: -FILE_COST_S.get(f, 0.1 * len(files[f])))
        items[:] = [item for f in order for item in files[f]]


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="pdcluster-tests-")    # the workers inherit it


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(LOCKS):
        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


@contextlib.contextmanager
def _turn(alone: bool):
    """A test's turn on the machine: shared with the other test process, or the whole of it.
    Every test holds `box` (shared, or exclusive when alone) from its setup to its teardown
    (module fixtures included); `gate` is held only while taking `box`, so that a test waiting
    for the whole box keeps new shared turns from starting meanwhile."""
    folder = os.environ.get(LOCKS)
    if folder is None or not Path(folder).is_dir():           # one process: nobody to wait for
        yield
        return
    with open(Path(folder) / "gate", "a") as gate, open(Path(folder) / "box", "a") as box:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(box, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(box, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item.get_closest_marker(ALONE) is not None):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (a module's cluster included)."""
    common.live_allowed = any(item.get_closest_marker(m) for m in LIVE.values())


def _live_process(args) -> bool:
    """Whether a command starts one of ours (the console script, `-m cluster.cli`) or Ray's
    (the `ray` CLI, and what `ray.init` starts: its GCS, raylet and Python workers)."""
    argv = [args] if isinstance(args, (str, bytes, Path)) else list(args)
    for a in argv:
        a = str(a)
        if "cluster.cli" in a or "/ray/" in a or Path(a.split()[0] if a.split() else a).name in ("pdcluster", "ray"):
            return True
    return False


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kw):
    if not common.live_allowed and _live_process(args):
        raise RuntimeError(f"this test starts {str(args)[:120]}: ask for the `spawns` fixture (a process of ours) "
                           "or `ray_session` (Ray), so that it is marked and `make test-fast` leaves it out")
    _popen_init(self, args, *rest, **kw)


subprocess.Popen.__init__ = _guarded_popen_init


@pytest.fixture(scope="session")
def spawns():
    """The test starts processes of ours or Ray's: marked `spawns` (pytest -m 'not spawns')."""


@pytest.fixture(scope="session")
def alone():
    """The test measures this machine: the other test process waits while it runs (marked `alone`)."""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from workers.checkpoint import export_builtin
    return str(export_builtin("tiny", tmp_path_factory.mktemp("tiny-hf")))


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    # The engine runs with ignore_eos: make transformers ignore EOS too, so lengths match.
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(prompts) -> transformers' greedy continuations (MAX_NEW_TOKENS each),
    one prompt per generate call (no padding), memoized for the session."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for p in prompts:
            key = tuple(p)
            if key not in cache:
                ids = torch.tensor([p])
                # An explicit mask: without it transformers infers one from the pad token id
                # and would mask prompt tokens that happen to equal it.
                with torch.inference_mode():
                    gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None,
                                            pad_token_id=VOCAB - 1)
                cont = gen[0, len(p):].tolist()
                assert len(cont) == MAX_NEW_TOKENS, "transformers stopped early: EOS not ignored"
                cache[key] = cont
            out.append(cache[key])
        return out

    return run


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (starting one costs seconds); actors ask for
    fractions of these 4 CPUs."""
    import ray

    from cluster.run.launcher import NAMESPACE
    if ray.is_initialized():      # one a Worker made in this process started implicitly (test_contract's)
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_session):
    """The API tests' cluster (common.api_cluster: 1 prefill + 1 decode, `tiny`), one per test
    module; a module that needs another defines its own `cluster`."""
    from common import api_cluster
    with api_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    """An HTTP client on the test module's `cluster` (a ServingCluster)."""
    import httpx
    with httpx.Client(base_url=cluster.base_url, timeout=120) as c:
        yield c
