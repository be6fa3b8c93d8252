"""The capacity commands around the simulator: `pdcluster profile` and `pdcluster simulate`
(`pdcluster plan` is cluster/capacity/plan.py).

`simulate` takes `pdcluster bench`'s workload flags and `pdcluster serve`'s cluster-shape flags,
and writes bench's report and JSON, so a simulated run and a measured one compare line by line.
Costs come from a profile of this machine (`--profile FILE`) or from the roofline of a GPU and a
model shape (`--gpu NAME --model NAME`, tensor-parallel per pool).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import random
import time

from cluster.capacity.simulate import SimCluster, SimRequest, Simulator, utilization
from cluster.flags import (CLUSTER_FLAGS, ENGINE_FLAGS, MODE_ONLY, ROUTER_FLAGS, SLO_FLAGS, add_engine_args, add_flags,
                           engine_config_from_args, given, nested)
from cluster.loadtest import loadgen
from cluster.loadtest.bench_data import random_lens
from cluster.run.spec import ClusterSpec
from router.config import RouterConfig
from router.slo import SLOTargets
from workers.config import EngineConfig
from workers.cost_model import HARDWARE, LINKS, MODELS, CostModel, roofline
from workers.names import COLOCATED, DISAGGREGATED

# The engine flags a simulated worker takes (the rest, like dtype or device, have no meaning there).
SIM_ENGINE_FLAGS = ("--block-size", "--num-kv-blocks", "--no-prefix-caching", "--max-num-batched-tokens",
                    "--max-num-seqs", "--watermark", "--scheduling-policy", "--no-priority-inheritance",
                    "--prefill-us-per-token", "--max-model-len", "--no-chunked-prefill")
# The router's: how it picks, how much it queues, its decode gate, local prefill (serve's defaults).
SIM_ROUTER_FLAGS = ("--policy", "--max-pending", "--no-decode-gate", "--local-prefill-max-tokens")


# -- flags ----------------------------------------------------------------------------------------
def add_cost_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("costs (one of --profile, or --gpu with --model)")
    c.add_argument("--profile", default=None, metavar="FILE", help="a `pdcluster profile` JSON: this machine's "
                   "measured step and handoff costs")
    c.add_argument("--gpu", default=None, choices=sorted(HARDWARE), type=str.lower,
                   help="roofline costs of this GPU type")
    c.add_argument("--model", default=None, help=f"the model's shape: {', '.join(sorted(MODELS))}, or a "
                   "directory with a Hugging Face config.json")
    c.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="GPUs per worker (colocated; the default of both pools)")
    c.add_argument("--prefill-tp", type=int, default=None, help="GPUs per prefill worker (default --tp)")
    c.add_argument("--decode-tp", type=int, default=None, help="GPUs per decode worker (default --tp)")
    c.add_argument("--kv-link", default=None, choices=sorted(LINKS), help="the KV handoff's link (default: "
                   "the GPU's NVLink, a prefill and a decode worker in one node)")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for weights "
                   "and KV cache (default 0.9)")
    c.add_argument("--request-overhead-ms", type=float, default=None, help="router and HTTP time before a "
                   "request reaches a worker (default: the profile's measured one; 0 with --gpu)")


def add_shape_args(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("cluster"), tuple(f for f in CLUSTER_FLAGS if f.flag in
                                                      ("--mode", "--prefill", "--decode", "--workers")), ClusterSpec)
    add_flags(p.add_argument_group("router"), tuple(f for f in ROUTER_FLAGS if f.flag in SIM_ROUTER_FLAGS),
              RouterConfig)
    add_flags(p.add_argument_group("engine"), tuple(f for f in ENGINE_FLAGS if f.flag in SIM_ENGINE_FLAGS),
              EngineConfig)


CONTROLLER_FLAGS = ("--controller", "--controller-interval-s", "--controller-window-s", "--controller-cooldown-s",
                    "--controller-forecast-s", "--controller-shrink-hold-s", "--controller-mixed", "--max-workers",
                    "--min-workers")
CONTROLLER_SLO_FLAGS = ("--slo-ttft-ms", "--slo-tpot-ms")


def _controller_flags():
    return (tuple(f for f in CLUSTER_FLAGS if f.flag in CONTROLLER_FLAGS),
            tuple(f for f in SLO_FLAGS if f.flag in CONTROLLER_SLO_FLAGS))


def add_controller_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s controller and SLO flags (the same fields, defaults and checks)."""
    cluster_flags, slo_flags = _controller_flags()
    c = p.add_argument_group("pool-ratio controller (disaggregated)")
    add_flags(c, cluster_flags, ClusterSpec)
    add_flags(c, slo_flags, SLOTargets)
    c.add_argument("--worker-startup-s", type=float, default=None, help="seconds from the controller's ask for a "
                   "worker to its first work (weights, warm-up): it holds its GPUs meanwhile (default: the "
                   "profile's measured start-up, else 0)")


def control_from_args(a: argparse.Namespace, cluster: SimCluster, startup_s: float = 0.0):
    """The controller's settings, or None without --controller: read and checked as `serve`
    reads them (a ClusterSpec of the simulated pools' shape, SLOTargets); an added worker's
    start-up is --worker-startup-s, else `startup_s` (the profile's)."""
    from cluster.capacity.sim_control import SimControl
    cluster_flags, slo_flags = _controller_flags()
    fields = given(a, cluster_flags)
    if fields.get("controller", "off") == "off":
        return None
    if fields["controller"] == "advise":
        raise ValueError("--controller advise changes nothing: simulate without --controller for that, or with "
                         "--controller to see what it would do")
    spec = ClusterSpec(mode=cluster.mode, num_prefill=cluster.num_prefill, num_decode=cluster.num_decode,
                       num_colocated=cluster.num_colocated, **fields)
    slo = SLOTargets(**given(a, slo_flags))
    startup = a.worker_startup_s if getattr(a, "worker_startup_s", None) is not None else startup_s
    if not startup >= 0:
        raise ValueError(f"--worker-startup-s must be >= 0, got {startup}")
    return SimControl(spec.controller_config(), spec.controller_interval_s, spec.controller_window_s, slo.ttft_s, slo.tpot_s, startup,
                      forecast_interval_s=spec.controller_forecast_s if spec.min_workers is not None else 0.0)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from cluster.loadtest.bench import add_dataset_args, add_output_args, add_rate_args
    add_cost_args(p)
    add_shape_args(p)
    add_controller_args(p)
    add_dataset_args(p, phases=True)
    p.add_argument("--tokenizer", default=None, help="for sharegpt and custom datasets: a built-in model name "
                   "or a directory with tokenizer.json, to count their prompts' tokens")
    add_rate_args(p)
    add_output_args(p)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="where to write the profile JSON")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per batch shape (the median is kept)")
    p.add_argument("--no-served", action="store_true", help="skip the served-path calibration (it launches a "
                   "local 1 prefill + 1 decode cluster for about a minute)")
    add_engine_args(p)


# -- costs ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Costs:
    """A cost model per pool, and what the simulated engine needs to know of the model."""
    prefill: CostModel
    decode: CostModel
    max_model_len: int
    source: str
    request_overhead_s: float = 0.0     # measured by a profile's served calibration
    request_overhead_per_token_s: float = 0.0
    shared_cores: float | None = None   # a profile's machine: its workers and router share its cores
    background_cpu_per_request_s: float = 0.0   # beside the engines' steps, per request
    background_cpu_per_token_s: float = 0.0     # and per streamed token
    prefill_wait_share: float = 0.5             # of the cores the busy workers go without
    startup_s: float = 0.0              # a new worker's start-up (a profile's measured engine start)


def costs_from_args(a: argparse.Namespace, prefill_tp: int | None = None, decode_tp: int | None = None) -> Costs:
    tp = a.tp
    ptp, dtp = prefill_tp or a.prefill_tp or tp, decode_tp or a.decode_tp or tp
    if min(tp, ptp, dtp) < 1:
        raise ValueError("tensor-parallel sizes must be at least 1")
    if a.profile:
        from cluster.capacity.profile import load_profile
        if a.gpu:
            raise ValueError("give --profile or --gpu, not both")
        if max(tp, ptp, dtp) > 1:
            raise ValueError("a profile is measured on one worker of this machine: tensor parallelism needs "
                             "--gpu and --model (the roofline)")
        cost, facts = load_profile(a.profile)
        served = facts.get("served") or {}
        return Costs(cost, cost, facts.get("max_model_len", 1 << 30), cost.source,
                     served.get("request_overhead_s", 0.0), served.get("request_overhead_per_token_s", 0.0),
                     facts.get("cpus"), served.get("background_cpu_per_request_s", 0.0),
                     # (profiles before the machine's busy CPU was read: the router's and client's threads)
                     served.get("background_cpu_per_token_s", served.get("router_cpu_per_token_s", 0.0)),
                     served.get("prefill_wait_share", 0.5), facts.get("startup_s", 0.0))
    if not a.gpu or not a.model:
        raise ValueError("costs: give --profile FILE (see `pdcluster profile`), or --gpu NAME with --model NAME")
    from workers.cost_model import model_shape
    shape = model_shape(a.model)
    if not 0 < a.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    p = roofline(shape, a.gpu, ptp, a.kv_link, gpu_memory_utilization=a.gpu_memory_utilization)
    d = p if dtp == ptp else roofline(shape, a.gpu, dtp, a.kv_link, gpu_memory_utilization=a.gpu_memory_utilization)
    return Costs(p, d, shape.max_len, f"roofline {a.gpu} {shape.name}")


def engine_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_dict(nested(given(a, tuple(f for f in ENGINE_FLAGS if f.flag in SIM_ENGINE_FLAGS))))


def with_capacity(cost: CostModel, engine: EngineConfig) -> CostModel:
    """--num-kv-blocks overrides the cost model's KV capacity."""
    if engine.cache.num_blocks is None:
        return cost
    return dataclasses.replace(cost, kv_capacity_tokens=engine.cache.num_blocks * engine.cache.block_size)


# -- the workload ---------------------------------------------------------------------------------
def sim_workload(a: argparse.Namespace, tokenizer=None) -> tuple[list[SimRequest], bool, list | None]:
    """bench's workload as the simulator takes it: (requests, whether prompts can share blocks,
    each request's load phase or None when the workload has none).
    Send times are bench's own (`workload`'s rule); random, prefix-repetition and trace lengths
    are drawn as bench draws them, with synthetic ids (bench sizes text to those lengths, give or
    take the tokenizer's seams); sharegpt and custom prompts go through the tokenizer."""
    from cluster.loadtest.bench import TIMED, build_requests, check_workload, trace_rows
    check_workload(a)
    if a.dataset_name in TIMED:
        rows = trace_rows(a)
        phases = [r.phase for r in rows] if any(r.phase is not None for r in rows) else None
        return [SimRequest.synthetic(r.arrival_s, max(2, r.prompt_len), r.output_len, i)
                for i, r in enumerate(rows)], False, phases
    n = a.num_prompts
    times = loadgen.send_times(n, a.request_rate, a.burstiness, a.seed)
    rng = random.Random(a.seed)
    if a.dataset_name == "random":
        if a.random_input_len < 1 or a.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be at least 1")
        ins = random_lens(rng, n, a.random_input_len, a.random_range_ratio)
        outs = random_lens(rng, n, a.random_output_len, a.random_range_ratio)
        prefix = [30001, 30001] + [0] * (a.random_prefix_len - 2) if a.random_prefix_len > 1 else None
        p = len(prefix or ())
        return [SimRequest.synthetic(t, p + max(2, k), o, i, prefix)
                for i, (t, k, o) in enumerate(zip(times, ins, outs))], prefix is not None, None
    if a.dataset_name == "prefix-repetition":
        if a.prefix_repetition_num_prefixes < 1:
            raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
        plen = max(2, a.prefix_repetition_prefix_len)
        prefixes = [[30001 + i, 30001] + [0] * (plen - 2) for i in range(a.prefix_repetition_num_prefixes)]
        which = [i % len(prefixes) for i in range(n)]
        rng.shuffle(which)
        return [SimRequest.synthetic(t, plen + max(2, a.prefix_repetition_suffix_len), a.prefix_repetition_output_len,
                                     i, prefixes[k]) for i, (t, k) in enumerate(zip(times, which))], True, None
    if tokenizer is None:
        raise ValueError(f"--dataset-name {a.dataset_name} needs --tokenizer to count its prompts' tokens")
    reqs = build_requests(a, tokenizer)
    return [SimRequest(t, tokenizer.encode(r.prompt), r.output_len) for t, r in zip(times, reqs)], True, None


# -- one simulated run ----------------------------------------------------------------------------
def simulate(cluster: SimCluster, requests: list[SimRequest], slos: dict[str, float], metrics=("ttft", "tpot"),
             percentiles=(99.0,), max_model_len: int = 1 << 30, control=None, keep_results: bool = False) -> dict:
    """bench's summary of one simulated run, plus the simulator's own facts under `simulator`
    (and, with a controller, its decisions)."""
    if control is not None:
        from cluster.capacity.sim_control import ControlledSimulator
        sim = ControlledSimulator(cluster, control, max_model_len=max_model_len, record_itl="itl" in metrics)
    else:
        sim = Simulator(cluster, max_model_len=max_model_len, record_itl="itl" in metrics)
    t0 = time.perf_counter()
    results, duration = sim.run(requests)
    wall = time.perf_counter() - t0
    out = loadgen.summarize(results, duration, slos, metrics, percentiles)
    out["simulator"] = {"wall_s": wall, "events": sim.num_events, "events_per_s": sim.num_events / max(wall, 1e-9),
                        "simulated_s": duration, "utilization": utilization(sim),
                        "handoffs": sim.num_handoffs, "local_prefills": sim.num_local_prefills,
                        "preemptions": sum(w.engine.scheduler.stats.num_preemptions["recompute"]
                                           for w in sim.workers.values())}
    if keep_results:
        out["results"] = results        # in request order (the caller splits them by phase)
    if control is not None:
        out["simulator"]["controller"] = {"role_changes": sim.role_changes, "decisions": sim.decisions,
                                          "added": sim.added, "removed": sim.removed, "undone": sim.undone,
                                          "gpu_hours": sim.gpu_hours(),
                                          "final": {"prefill": len(sim.pools["prefill"]),
                                                    "decode": len(sim.pools["decode"])}}
    return out


def cluster_from_args(a: argparse.Namespace, costs: Costs, engine: EngineConfig) -> SimCluster:
    shape = given(a, tuple(f for f in CLUSTER_FLAGS if f.flag in ("--mode", "--prefill", "--decode", "--workers")))
    mode = shape.get("mode", DISAGGREGATED)
    for name, (needs, flag) in MODE_ONLY.items():
        if name in shape and mode != needs:
            raise ValueError(f"{flag} applies to --mode {needs}; this cluster is {mode}")
    router = given(a, tuple(f for f in ROUTER_FLAGS if f.flag in SIM_ROUTER_FLAGS))
    router.setdefault("local_prefill_max_tokens", RouterConfig().local_prefill_max_tokens)   # serve's default
    slo = SLOTargets(**given(a, _controller_flags()[1]))      # the requests' default targets, as serve's
    overhead, per_token = costs.request_overhead_s, costs.request_overhead_per_token_s
    if a.request_overhead_ms is not None:
        overhead, per_token = a.request_overhead_ms / 1000, 0.0
    if not overhead >= 0:
        raise ValueError("--request-overhead-ms must be >= 0")
    return SimCluster(mode=mode, num_prefill=shape.get("num_prefill", 1), num_decode=shape.get("num_decode", 1),
                      num_colocated=shape.get("num_colocated", 2), prefill_cost=with_capacity(costs.prefill, engine),
                      decode_cost=with_capacity(costs.decode, engine), engine=engine, seed=a.seed,
                      request_overhead_s=overhead, request_overhead_per_token_s=per_token, shared_cores=costs.shared_cores,
                      background_cpu_per_request_s=costs.background_cpu_per_request_s,
                      background_cpu_per_token_s=costs.background_cpu_per_token_s,
                      prefill_wait_share=costs.prefill_wait_share, slo=slo, **router)


def _tokenizer(a: argparse.Namespace):
    if a.dataset_name not in ("sharegpt", "custom"):
        return None
    from workers.checkpoint import load_tokenizer
    if not a.tokenizer:
        raise ValueError(f"--dataset-name {a.dataset_name} needs --tokenizer to count its prompts' tokens")
    tok = load_tokenizer(a.tokenizer)
    if tok is None:
        raise ValueError(f"--tokenizer {a.tokenizer}: no tokenizer.json there")
    return tok


def cmd_simulate(a: argparse.Namespace) -> int:
    from cluster.loadtest.bench import parse_options, save_plots, report, save
    opts = parse_options(a)
    if a.max_concurrency is not None:
        raise ValueError("--max-concurrency is not simulated yet: drop it")
    costs = costs_from_args(a)
    engine = engine_from_args(a)
    requests, shared, phases = sim_workload(a, _tokenizer(a))
    if not shared and engine.cache.enable_prefix_caching:
        # No two prompts share a block, so the cache cannot hit: skipping the hashes changes
        # nothing but the simulator's speed.
        engine = dataclasses.replace(engine, cache=dataclasses.replace(engine.cache, enable_prefix_caching=False))
    cluster = cluster_from_args(a, costs, engine)
    workers = ({COLOCATED: cluster.num_colocated} if cluster.mode == COLOCATED
               else {"prefill": cluster.num_prefill, "decode": cluster.num_decode})
    print(f"pdcluster simulate: {len(requests)} requests ({a.dataset_name}) on {cluster.mode} "
          + ", ".join(f"{n} {r}" for r, n in workers.items()) + f" ({cluster.num_gpus} GPUs); costs: {costs.source}",
          flush=True)
    control = control_from_args(a, cluster, costs.startup_s)
    run = simulate(cluster, requests, opts.slos, opts.percentile_metrics, opts.percentiles, costs.max_model_len,
                   control, keep_results=phases is not None)
    results = run.pop("results", None)
    rate = a.request_rate
    if a.dataset_name in ("trace", "phases"):
        from cluster.loadtest.bench import offered_rate
        rate = offered_rate([r.arrival_s for r in requests])
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": "pdcluster-simulate",
              "model_id": a.model or costs.source, "dataset_name": a.dataset_name,
              "num_workers": sum(workers.values()), "num_gpus": cluster.num_gpus, "workers_by_role": workers,
              "cost_model": costs.source, "interrupted": False, **run,
              "request_rate": rate if math.isfinite(rate) else "inf",
              "burstiness": None if a.dataset_name == "trace" else a.burstiness, "max_concurrency": None,
              "num_prompts": len(requests)}
    if phases is not None:
        result["phases"] = loadgen.summarize_phases(results, [r.arrival_s for r in requests], phases,
                                                    opts.slos, opts.percentiles)
    if a.dataset_name == "trace":
        result.update(trace=a.dataset_path, trace_time_scale=a.trace_time_scale)
    print(report(result, opts, "Simulated Serving Benchmark Result"))
    s = run["simulator"]
    print(f"simulated {s['simulated_s']:.1f} s in {s['wall_s']:.2f} s of wall time ({s['events']} events, "
          f"{s['events_per_s']:,.0f}/s); busy: " + ", ".join(f"{r} {u:.0%}" for r, u in s["utilization"].items()))
    if "controller" in s:
        ctl = s["controller"]
        for d in ctl["decisions"]:
            print(f"  t={d['t']:8.1f} s  {d['prefill']}P+{d['decode']}D  {d['action']:<12} {d['reason']}")
        print(f"controller: {ctl['role_changes']} role changes, {ctl['added']} added, {ctl['removed']} removed "
              f"({ctl['undone']} changes undone within 5 minutes); {ctl['gpu_hours']:.2f} GPU-hours held; pools at "
              f"the end: {ctl['final']['prefill']} prefill, {ctl['final']['decode']} decode")
    if a.save_result:
        path = save(result, a)
        plots = [] if a.no_plots or "itl" not in opts.percentile_metrics else save_plots(result, path)
        print(f"result: {path}" + "".join(f"\nplot:   {p}" for p in plots), flush=True)
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from cluster.capacity.profile import run_profile
    if a.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    doc = run_profile(engine_config_from_args(a), a.output, a.repeats, serve=not a.no_served)
    p = doc["profile"]
    step, link = doc["step"], doc["link"]
    print(f"fitted step costs (ms): prefill {step['p0'] * 1e3:.3f} + {step['p1'] * 1e3:.5f}/token + "
          f"{step['p2'] * 1e3:.3g}/token^2; decode {step['d0'] * 1e3:.3f} + {step['d1'] * 1e3:.3g}/context token + "
          f"{step['d2'] * 1e3:.4f}/sequence\n"
          f"fit error over {len(p['steps'])} timed steps: median {p['fit_median_rel_error']:.1%}, "
          f"max {p['fit_max_rel_error']:.1%}\n"
          f"handoff: {link['latency_s'] * 1e3:.2f} ms + bytes / {link['bandwidth'] / 1e9:.2f} GB/s; KV "
          f"{doc['kv_bytes_per_token']} B/token, {doc['kv_capacity_tokens']} tokens per worker\n"
          f"profile: {a.output} ({p['seconds']:.0f} s)")
    return 0
