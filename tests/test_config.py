"""One source of configuration: every config field has exactly one flag, a command line with no
flags builds the dataclasses' defaults, and flag values land in the right fields and units."""
from __future__ import annotations

import dataclasses

import pytest

from cluster import cli
from cluster import flags as flag_defs
from cluster.run.spec import ClusterSpec
from router.config import RouterConfig
from router.slo import SLOTargets
from workers.config import CacheConfig, EngineConfig, SchedulerConfig

NOT_FLAGS = {ClusterSpec: {"model", "engine"},                   # model: --model (engine)
             RouterConfig: {"slo"},                               # slo: SLO_FLAGS
             CacheConfig: {"shared_memory"}}                      # the worker's, from --kv-transport


def _paths(cls, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        if f.name in NOT_FLAGS.get(cls, ()):
            continue
        if f.name in ("cache", "scheduler") and cls is EngineConfig:
            out |= _paths(CacheConfig if f.name == "cache" else SchedulerConfig, f"{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


@pytest.mark.parametrize("flags, cls", [(flag_defs.ENGINE_FLAGS, EngineConfig), (flag_defs.CLUSTER_FLAGS, ClusterSpec),
                                        (flag_defs.ROUTER_FLAGS, RouterConfig), (flag_defs.SLO_FLAGS, SLOTargets)])
def test_every_field_has_one_flag(flags, cls):
    bound = [f.field for f in flags]
    assert len(bound) == len(set(bound)), "two flags for one field"
    assert set(bound) == _paths(cls), f"fields without a flag: {_paths(cls) - set(bound)}; " \
                                      f"flags without a field: {set(bound) - _paths(cls)}"


def test_no_flags_give_the_dataclass_defaults():
    a = cli.build_parser().parse_args(["serve"])
    engine = flag_defs.engine_config_from_args(a)
    assert engine == EngineConfig()
    spec = flag_defs.cluster_spec_from_args(a, engine)
    assert dataclasses.replace(spec, cluster_id="x") == ClusterSpec(cluster_id="x")
    assert flag_defs.router_config_from_args(a) == RouterConfig()


def test_flag_values_land_in_their_fields_and_units():
    a = cli.build_parser().parse_args([
        "serve", "--model", "small", "--block-size", "32", "--kv-cache-memory-mib", "64", "--no-prefix-caching",
        "--max-num-seqs", "7", "--preemption-mode", "swap", "--kv-lease-s", "12.5", "--kv-transfer-timeout-s", "3",
        "--prefill", "3", "--port", "9001", "--policy", "random", "--slo-ttft-ms", "250", "--max-retries", "0"])
    engine = flag_defs.engine_config_from_args(a)
    assert (engine.model, engine.cache.block_size, engine.cache.kv_cache_memory_bytes) == ("small", 32, 64 * 2**20)
    assert engine.cache.enable_prefix_caching is False
    assert (engine.scheduler.max_num_seqs, engine.scheduler.preemption_mode) == (7, "swap")
    spec = flag_defs.cluster_spec_from_args(a, engine)
    assert (spec.model, spec.num_prefill, spec.lease_s, spec.transfer_timeout_s) == ("small", 3, 12.5, 3.0)
    router = flag_defs.router_config_from_args(a)
    assert (router.port, router.policy, router.max_retries) == (9001, "random", 0)
    assert router.slo.ttft_s == pytest.approx(0.25) and router.slo.tpot_s == SLOTargets().tpot_s


def test_bench_launch_takes_the_engine_flags():
    a = cli.build_parser().parse_args(["bench", "--launch", "--block-size", "8", "--max-num-seqs", "3",
                                       "--model", "tiny", "--seed", "5"])
    from cluster.loadtest.bench import LAUNCH_SKIPS
    engine = flag_defs.engine_config_from_args(a, skip=LAUNCH_SKIPS)
    assert (engine.cache.block_size, engine.scheduler.max_num_seqs) == (8, 3)
    assert engine.seed == EngineConfig().seed            # --seed is bench's (the dataset's), not the engine's


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--workers", "3"], "--workers applies to --mode colocated"),
    (["serve", "--mode", "colocated", "--prefill", "2"], "--prefill applies to --mode disaggregated"),
    (["serve", "--mode", "colocated", "--decode", "2"], "--decode applies to --mode disaggregated"),
    (["serve", "--policy", "fastest"], "invalid choice"),
    (["serve", "--max-refusals-per-s", "0"], "--max-refusals-per-s must be > 0, got 0"),
])
def test_flags_that_do_not_apply_are_refused_before_anything_starts(argv, needle, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:                          # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_serve_with_device_cuda_without_cuda_fails_before_starting_ray(capsys, monkeypatch):
    # A local Ray's workers run on this machine: its torch is checked before Ray starts.
    import ray
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    was_connected = ray.is_initialized()
    rc = cli.main(["serve", "--device", "cuda", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda:" in err and "use --device auto or cpu" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert ray.is_initialized() == was_connected


def test_device_cuda_without_cuda_names_the_fix(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    rc = cli.main(["generate", "--device", "cuda", "--input", str(inp), "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda:" in err and "use --device auto or cpu" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_simulate_reads_the_controller_flags_as_serve_does():
    # `pdcluster simulate --controller` takes serve's flags: the same defaults, values and checks.
    import argparse
    import types

    from cluster.capacity.commands import add_controller_args, control_from_args
    from cluster.run.spec import ClusterSpec
    from router.slo import SLOTargets
    p = argparse.ArgumentParser()
    add_controller_args(p)
    pools = types.SimpleNamespace(mode="disaggregated", num_prefill=2, num_decode=3, num_colocated=2)
    assert control_from_args(p.parse_args([]), pools) is None
    spec, slo = ClusterSpec(num_prefill=2, num_decode=3), SLOTargets()
    c = control_from_args(p.parse_args(["--controller"]), pools)
    assert (c.interval_s, c.window_s, c.config.cooldown_s, c.config.max_workers, c.slo_ttft_s, c.slo_tpot_s) == (
        spec.controller_interval_s, spec.controller_window_s, spec.controller_cooldown_s, 5, slo.ttft_s, slo.tpot_s)
    c = control_from_args(p.parse_args(["--controller", "--controller-interval-s", "2", "--max-workers", "8",
                                        "--slo-tpot-ms", "40"]), pools)
    assert (c.interval_s, c.config.max_workers, c.slo_tpot_s) == (2.0, 8, 0.04)
    assert not c.config.mixed
    assert control_from_args(p.parse_args(["--controller", "--controller-mixed"]), pools).config.mixed
    with pytest.raises(ValueError, match="controller_interval_s"):
        control_from_args(p.parse_args(["--controller", "--controller-interval-s", "0"]), pools)
    with pytest.raises(ValueError, match="tpot_s"):
        control_from_args(p.parse_args(["--controller", "--slo-tpot-ms", "-1"]), pools)
