"""`pdcluster` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import NamedTuple

from cluster.spec import PLACEMENTS, ClusterSpec
from router.admission import ADMISSION_POLICIES
from router.config import API_KEY_ENV, RouterConfig
from router.slo import SLOTargets
from workers.config import EngineConfig
from workers.names import (ATTENTION_BACKENDS, AUTO, COLOCATED, DISAGGREGATED, MODES, PICKING_POLICIES, PREEMPTION_MODES,
                           SCHEDULING_POLICIES, TRANSPORTS, check_name)

PROG = "pdcluster"
MiB = 2**20


def local_prefill_tokens(text: str) -> int | str:
    """--local-prefill-max-tokens: a count of tokens >= 0, or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {text!r}")
    return n


class Flag(NamedTuple):
    """One command-line flag bound to a config field; its default is the field's default."""
    flag: str
    field: str                        # "name" on the flag's dataclass, or "section.name"
    help: str
    type: type = int
    choices: tuple | None = None
    unit: int = 1                     # the field holds flag value x unit (MiB -> bytes)
    negate: bool = False              # a store_true flag that turns a boolean field off


ENGINE_FLAGS = (
    Flag("--model", "model", "built-in model (tiny, small) or a HF checkpoint directory", str),
    Flag("--dtype", "dtype", "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16", str),
    Flag("--device", "device", "auto, cpu, cuda, cuda:N", str),
    Flag("--max-model-len", "max_model_len", "longest prompt + output (default: the model's, capped by the KV cache)"),
    Flag("--seed", "seed", "the engine's random seed (unseeded sampling draws from it)"),
    Flag("--attention-backend", "attention_backend", "attention kernels", str, ATTENTION_BACKENDS),
    Flag("--tensor-parallel-size", "tensor_parallel_size", "processes (GPUs) each worker's model is split over: "
         "Ray actors on one node, all-reduce over NCCL on GPUs and Gloo on CPU"),
    Flag("--block-size", "cache.block_size", "tokens per KV block"),
    Flag("--kv-cache-memory-mib", "cache.kv_cache_memory_bytes", "memory budget of the KV cache", unit=MiB),
    Flag("--num-kv-blocks", "cache.num_blocks", "KV blocks (overrides the memory budget)"),
    Flag("--swap-space-mib", "cache.swap_space_bytes", "host memory for swapped-out blocks", unit=MiB),
    Flag("--no-prefix-caching", "cache.enable_prefix_caching", "turn prefix caching off", bool, negate=True),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "token budget per step"),
    Flag("--max-num-seqs", "scheduler.max_num_seqs", "cap on running sequences"),
    Flag("--watermark", "scheduler.watermark", "fraction of KV blocks kept free when admitting", float),
    Flag("--preemption-mode", "scheduler.preemption_mode", "how a preempted sequence gives up its blocks", str,
         PREEMPTION_MODES),
    Flag("--scheduling-policy", "scheduler.policy", "queue order: fcfs (arrival); priority (the request's "
         "`priority`, lower first; see --no-priority-inheritance); deadline (prefill work by least slack to each "
         "request's TTFT deadline, `ttft_slo_ms` or --slo-ttft-ms, those that can still meet it first)", str,
         SCHEDULING_POLICIES),
    Flag("--no-priority-inheritance", "scheduler.priority_inheritance", "priority: keep running prompts' chunks "
         "ahead of waiting prompts whatever their priority, and let a waiting prompt recompute a prefix a "
         "lower-priority one is computing (without: it waits for those blocks and lends that one its priority)",
         bool, negate=True),
    Flag("--prefill-us-per-token", "scheduler.prefill_s_per_token", "deadline: the first estimate of a prompt "
         "token's cost, then measured from full steps", float, unit=1e-6),
    Flag("--no-chunked-prefill", "scheduler.chunked_prefill", "admit prompts whole, in steps of their own "
         "(decoding pauses for them; vLLM's v0 default)", bool, negate=True),
)

CLUSTER_FLAGS = (       # ClusterSpec fields (the engine's come from ENGINE_FLAGS)
    Flag("--mode", "mode", "disaggregated: prefill and decode pools; colocated: each worker does both", str, MODES),
    Flag("--prefill", "num_prefill", "prefill workers (disaggregated)"),
    Flag("--decode", "num_decode", "decode workers (disaggregated)"),
    Flag("--workers", "num_colocated", "workers (colocated)"),
    Flag("--prefill-tensor-parallel-size", "prefill_tensor_parallel_size", "ranks per prefill worker (default: "
         "--tensor-parallel-size); the handoff re-shards the KV heads between pools of different sizes"),
    Flag("--decode-tensor-parallel-size", "decode_tensor_parallel_size", "ranks per decode worker (default: "
         "--tensor-parallel-size)"),
    Flag("--kv-transport", "kv_transport", "KV handoff transport; auto: nccl on GPUs, gloo on CPU", str, TRANSPORTS),
    Flag("--address", "address", "Ray cluster to join (default: RAY_ADDRESS, else a local one)", str),
    Flag("--cpus-per-worker", "num_cpus_per_worker", "CPUs each worker asks Ray for", float),
    Flag("--gpus-per-worker", "num_gpus_per_worker", "GPUs each worker asks Ray for (default: 1 on GPU "
         "clusters, else 0)", float),
    Flag("--placement", "placement", "how Ray places the workers: default (Ray's, which fills the node "
         "it is called from first) or spread (round-robin over the nodes, so the pools span them)", str, PLACEMENTS),
    Flag("--ready-timeout-s", "ready_timeout_s", "seconds for the workers to load their model", float),
    Flag("--kv-lease-s", "lease_s", "seconds a prefill worker holds a prompt's KV for a decode worker to pull",
         float),
    Flag("--kv-transfer-timeout-s", "transfer_timeout_s", "seconds one KV pull may take before it fails "
         "(the request then re-runs from prefill)", float),
    Flag("--router-lease-s", "router_lease_s", "a router that sends a worker no heartbeat for this long (it "
         "died, or stalled) loses its requests there: the worker ends them and frees their blocks", float),
    Flag("--cluster-id", "cluster_id", "names this cluster's Ray actors; `pdcluster router --cluster-id` attaches "
         "to it (default: a random one, printed)", str),
    Flag("--controller", "controller", "run the pool-ratio controller: it moves workers between the pools (and "
         "adds or removes them within --max-workers) as the load shifts, against the --slo-* targets", bool),
    Flag("--controller-interval-s", "controller_interval_s", "seconds between the controller's decisions", float),
    Flag("--controller-window-s", "controller_window_s", "seconds of arrivals and finishes a decision sees", float),
    Flag("--controller-cooldown-s", "controller_cooldown_s", "no change within this long of the last", float),
    Flag("--max-workers", "max_workers", "the worker budget the controller keeps to (default: the launched pools)"),
)

ROUTER_FLAGS = (        # RouterConfig fields
    Flag("--host", "host", "address the HTTP server binds", str),
    Flag("--router-id", "router_id", "this router's name on the workers (letters, digits, '_', '.', '-'); a "
         "restarted router may reuse it", str),
    Flag("--port", "port", "port of the HTTP server"),
    Flag("--api-key", "api_key", "require 'Authorization: Bearer KEY' on /v1 (a command line is visible to "
         "every user of the machine: prefer PDCLUSTER_API_KEY or --api-key-file)", str),
    Flag("--served-model-name", "served_model_name", "the model name clients send (default: --model)", str),
    Flag("--policy", "policy", "how the router picks workers (prefix: prefill workers by the prompt blocks "
         "their prefix caches hold, against their queues)", str, PICKING_POLICIES),
    Flag("--local-prefill-max-tokens", "local_prefill_max_tokens", "disaggregated: a request with at most this "
         "many prompt tokens to compute (beyond its decode worker's prefix cache) is prefilled on that decode "
         "worker, with no KV handoff; 0: always hand off; auto (the default): while the prefill pool has a queue, "
         "when the cost model says the handoff and that queue would cost the request more than the prefill "
         "delays the decode worker's batch",
         local_prefill_tokens),
    Flag("--max-pending", "max_pending", "requests in flight before 429"),
    Flag("--no-decode-gate", "decode_gate", "disaggregated: do not hold new requests before their prefill while "
         "the decode pool is full (they then wait for a decode seat after their first token)", bool, negate=True),
    Flag("--admission", "admission", "slo: also refuse (429 at once) a request predicted to miss its TTFT or TPOT "
         "target; queue: only the --max-pending bound", str, ADMISSION_POLICIES),
    Flag("--max-body-mib", "max_body_bytes", "largest request body: a larger one gets 413 before it is read "
         "(a string prompt is bounded by this too)", unit=MiB),
    Flag("--max-retries", "max_retries", "resumes of a request in a row that make no progress (a failed "
         "handoff, a lost worker) before it fails with an error"),
    Flag("--worker-hang-timeout-s", "worker_hang_timeout_s", "a worker that answers no poll for this long is "
         "taken as hung: restarted, its requests resumed", float),
    Flag("--client-stall-timeout-s", "client_stall_timeout_s", "a stream whose client takes no data for this "
         "long (it stopped reading) is ended and its request aborted", float),
    Flag("--drain-timeout-s", "drain_timeout_s", "on SIGINT/SIGTERM: seconds in-flight requests may run to "
         "completion (new ones get 503) before the rest end with an error event", float),
    Flag("--request-timeout-s", "request_timeout_s", "a request still running this long after it arrived ends "
         "with an error (504, or an error event in a stream) and is aborted on the workers", float),
    Flag("--body-timeout-s", "body_timeout_s", "a request body that has not fully arrived within this long is "
         "refused (408)", float),
    Flag("--max-validating", "max_validating", "request bodies being read or validated at once (before "
         "admission); the others wait in line unread, 429 past --max-pending waiting or --body-timeout-s"),
)

SLO_FLAGS = (           # SLOTargets fields, given in ms on the command line
    Flag("--slo-ttft-ms", "ttft_s", "TTFT target: requests are judged against it in the SLO metrics, and it is "
         "the deadline of a request without its own ttft_slo_ms", float, unit=1e-3),
    Flag("--slo-tpot-ms", "tpot_s", "TPOT (time per output token) target (a request's tpot_slo_ms overrides it)",
         float, unit=1e-3),
    Flag("--slo-window-s", "window_s", "window of the router's pdcluster:slo_attainment gauge", float),
)


def _field_default(cls, path: str):
    """The default of a (possibly nested: "cache.block_size") dataclass field."""
    head, _, rest = path.partition(".")
    f = next(f for f in dataclasses.fields(cls) if f.name == head)
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return getattr(value, rest) if rest else value


def add_flags(g, flags: tuple[Flag, ...], cls, **overrides) -> None:
    """Declare `flags` on a parser group, each defaulting to its field's default in `cls`."""
    for f in flags:
        default = overrides.get(f.field, _field_default(cls, f.field))
        # SUPPRESS: a flag not given leaves no attribute, so `given` knows what the user said.
        if f.type is bool:                # a switch: on when given (or, negated, off)
            g.add_argument(f.flag, action="store_true", default=argparse.SUPPRESS, help=f.help)
            continue
        shown = default / f.unit if isinstance(default, (int, float)) and f.unit != 1 else default
        if isinstance(shown, float) and shown.is_integer() and f.type is int:
            shown = int(shown)
        note = "" if "default" in f.help else f" (default: {shown})"
        g.add_argument(f.flag, type=f.type, default=argparse.SUPPRESS, choices=f.choices, help=f.help + note)


def given(a: argparse.Namespace, flags: tuple[Flag, ...]) -> dict:
    """{field path: value} of the flags given on the command line, in the fields' units (the
    dataclasses supply every other field's default)."""
    out = {}
    for f in flags:
        dest = f.flag.removeprefix("--").replace("-", "_")
        if not hasattr(a, dest):
            continue
        v = getattr(a, dest)
        if f.negate:
            v = not v
        elif v is not None and f.unit != 1:
            v = v * f.unit
            v = int(v) if f.unit > 1 else v
        out[f.field] = v
    return out


def _nested(values: dict) -> dict:
    """{"cache.block_size": 16, "model": "tiny"} -> {"cache": {"block_size": 16}, "model": "tiny"}"""
    out: dict = {}
    for path, v in values.items():
        head, _, rest = path.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = v
        else:
            out[head] = v
    return out


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    add_flags(p.add_argument_group("engine"), tuple(f for f in ENGINE_FLAGS if f.flag not in skip), EngineConfig)


def engine_config_from_args(a: argparse.Namespace, skip: tuple[str, ...] = ()) -> EngineConfig:
    flags = tuple(f for f in ENGINE_FLAGS if f.flag not in skip)
    return EngineConfig.from_dict(_nested(given(a, flags)))


_MODE_ONLY = {"num_colocated": (COLOCATED, "--workers"), "num_prefill": (DISAGGREGATED, "--prefill"),
              "num_decode": (DISAGGREGATED, "--decode")}


def cluster_spec_from_args(a: argparse.Namespace, engine: EngineConfig) -> ClusterSpec:
    values = given(a, CLUSTER_FLAGS)
    mode = values.get("mode", _field_default(ClusterSpec, "mode"))
    for name, (needs, flag) in _MODE_ONLY.items():
        if name in values and mode != needs:
            other = "--workers" if mode == COLOCATED else "--prefill and --decode"
            raise ValueError(f"{flag} applies to --mode {needs}; this cluster is {mode}: size it with {other}")
    return ClusterSpec(model=engine.model, engine=engine, **values)


def add_router_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router")
    add_flags(g, ROUTER_FLAGS, RouterConfig)
    g.add_argument("--api-key-file", help=f"read the API key from this file's first line (else --api-key, else "
                   f"${API_KEY_ENV}; none of them: no key, every client is let in)")


def router_config_from_args(a: argparse.Namespace) -> RouterConfig:
    values = given(a, ROUTER_FLAGS)
    values["api_key"] = api_key_from(values.get("api_key"), getattr(a, "api_key_file", None))
    return RouterConfig(slo=SLOTargets(**given(a, SLO_FLAGS)), **values)


def api_key_from(flag: str | None, path: str | None) -> str | None:
    """The router's API key: --api-key, else the first line of --api-key-file, else
    $PDCLUSTER_API_KEY; None: no key (every client is let in)."""
    if flag is not None and path is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file: {path} holds no key on its first line")
        return key
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def cmd_generate(a) -> int:
    from cluster.offline import read_jsonl, run
    from workers.engine import LLMEngine
    requests = read_jsonl(a.input)
    engine = LLMEngine(engine_config_from_args(a))
    try:
        results = run(engine, requests)
    finally:
        engine.close()
    with open(a.output, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(results)} results to {a.output}", file=sys.stderr)
    return 0


def cmd_export_model(a) -> int:
    from workers.checkpoint import export_builtin
    out = export_builtin(a.name, a.dir)
    print(f"wrote the built-in model {a.name!r} as a Hugging Face checkpoint in {out}")
    return 0


def cmd_demo(a) -> int:
    from cluster.demo import run_offline_demo
    return run_offline_demo(engine_config_from_args(a), a.num_prompts)


def cmd_serve(a) -> int:
    from cluster.ports import check_port_free
    spec = cluster_spec_from_args(a, engine_config_from_args(a))
    router = router_config_from_args(a)
    if a.routers < 1:
        raise ValueError(f"--routers must be >= 1, got {a.routers}")
    # What can fail in a second fails before the seconds of imports, Ray and model loading.
    for port in range(router.port, router.port + a.routers):
        check_port_free(router.host, port)
    if spec.engine.device.startswith("cuda") and not (spec.address or os.environ.get("RAY_ADDRESS")):
        from workers.engine import resolve_device      # a local Ray's workers run on this machine
        resolve_device(spec.engine.device)
    from cluster.launcher import check_fits, connect
    if connect(spec):
        check_fits(spec)
    from cluster.serve import ServingCluster, serve_forever
    return serve_forever(ServingCluster(spec, router), a.routers - 1, router_args(a))


def router_args(a: argparse.Namespace) -> list[str]:
    """The router and SLO flags given on this command line, as given (but the port and the
    router id, which each router has its own of)."""
    out = []
    for f in ROUTER_FLAGS + SLO_FLAGS:
        dest = f.flag.removeprefix("--").replace("-", "_")
        if hasattr(a, dest) and f.flag not in ("--port", "--router-id", "--api-key"):   # the key: by env
            out += [f.flag] if f.type is bool else [f.flag, str(getattr(a, dest))]
    return out


def _join(a, what: str) -> str:
    """Join the Ray cluster that `--address` (or RAY_ADDRESS) names, for a command on running
    pools; the address."""
    address = a.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(f"{what}: give their Ray cluster's address (--address, or RAY_ADDRESS; `pdcluster serve` "
                         "prints it)")
    if a.cluster_id is not None:
        check_name(a.cluster_id, "--cluster-id")
    from cluster.launcher import connect
    connect(ClusterSpec(address=address))
    return address


def cmd_router(a) -> int:
    from cluster.ports import check_port_free
    router = router_config_from_args(a)
    check_port_free(router.host, router.port)
    address = _join(a, "a router attaches to running pools")
    from cluster.launcher import find_cluster
    spec, members, infos, book = find_cluster(a.cluster_id, a.ready_timeout_s)
    # The launcher's settings, on this process's Ray address: workers it adds, should it lead, are
    # detached as the launcher's are.
    spec = dataclasses.replace(spec, address=address)
    from cluster.serve import ServingCluster, serve_forever
    return serve_forever(ServingCluster(spec, router, attach=(members, infos), book=book))


def cmd_down(a) -> int:
    if a.grace_s < 0:
        raise ValueError(f"--grace-s must be >= 0, got {a.grace_s:g}")
    _join(a, "down removes running pools")
    from cluster.launcher import remove_cluster
    cluster_id, n = remove_cluster(a.cluster_id, a.grace_s)
    print(f"{PROG}: removed cluster {cluster_id} ({n} worker{'s' if n != 1 else ''})")
    return 0


def cmd_bench(a) -> int:
    from cluster.bench import cmd_bench as run
    return run(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Disaggregated prefill/decode LLM serving on Ray")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation: JSONL requests in, JSONL results out")
    g.add_argument("--input", required=True, help="JSONL: one request per line")
    g.add_argument("--output", required=True, help="JSONL: one result per line, in input order")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export-model", help="write a built-in model as a Hugging Face checkpoint")
    e.add_argument("name", help="tiny or small")
    e.add_argument("dir")
    e.set_defaults(func=cmd_export_model)

    s = sub.add_parser("serve", help="start the prefill and decode pools on Ray and the OpenAI-compatible router")
    add_flags(s.add_argument_group("cluster"), CLUSTER_FLAGS, ClusterSpec)
    add_router_flags(s)
    s.add_argument("--routers", type=int, default=1, help="routers over these pools: this process's, and N-1 "
                   "`pdcluster router` processes on the next ports (--port + 1, ...), each with the router flags "
                   "given here; they end with this one (default: 1)")
    add_flags(s.add_argument_group("SLOs"), SLO_FLAGS, SLOTargets)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="another router over running pools (those a `serve` launched)",
                       description="Serve the OpenAI API over pools another `pdcluster serve` launched, beside its "
                       "router: more front-end capacity, and one that a router's death does not take down. One "
                       "router leads (restarts of hung workers, drains, the controller, the workers' metrics): the "
                       "serve that launched the pools, and, should it die, one of the routers attached.")
    r.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS)")
    r.add_argument("--cluster-id", help="which pools (default: the only ones on that Ray cluster)")
    r.add_argument("--ready-timeout-s", type=float, default=60.0, help="seconds for the workers to answer")
    add_router_flags(r)
    add_flags(r.add_argument_group("SLOs"), SLO_FLAGS, SLOTargets)
    r.set_defaults(func=cmd_router)

    dn = sub.add_parser("down", help="remove a cluster's pools from a Ray cluster (a serve that died left them)",
                        description="Stop a cluster's workers and remove its book; its routers then stop. On a Ray "
                        "cluster the pools outlive the `serve` that launched them, should it die (its routers take "
                        "over); stopping that serve cleanly removes them, as this does.")
    dn.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS)")
    dn.add_argument("--cluster-id", help="which pools (default: the only ones on that Ray cluster)")
    dn.add_argument("--grace-s", type=float, default=5.0, help="seconds each worker gets to stop before it is killed")
    dn.set_defaults(func=cmd_down)

    from cluster.bench import add_bench_args
    from cluster.capacity import add_profile_args, add_simulate_args, cmd_profile, cmd_simulate
    from cluster.plan import add_plan_args, cmd_plan
    for name, add_args, func, help, description in (
            ("bench", add_bench_args, cmd_bench, "load-test an OpenAI-compatible server: latency, throughput, goodput",
             "Load-test an OpenAI-compatible server (pdcluster, vLLM, SGLang) with streaming requests; flags "
             "follow `vllm bench serve`. --launch starts a local pdcluster first."),
            ("profile", add_profile_args, cmd_profile, "measure this machine's engine steps and KV handoff; fit the "
             "cost model", "Time the engine over a grid of batch shapes, the KV handoff between two processes "
             "and the served path; write the fitted cost model (JSON) for `simulate --profile`."),
            ("simulate", add_simulate_args, cmd_simulate, "simulate a cluster on a virtual clock: bench's report "
             "without GPUs", "Discrete-event simulation of the cluster, running the real scheduler, KV cache "
             "manager and picker with a cost model in place of the model. Takes bench's workload flags and "
             "serve's cluster flags; writes bench's report and JSON."),
            ("plan", add_plan_args, cmd_plan, "find the placement with the highest goodput per GPU, by simulation",
             "Search placements (workers per pool, tensor-parallel degree per pool; colocated as the baseline) "
             "for the highest goodput per GPU at the SLOs, by simulated rate searches on bench's workload flags.")):
        c = sub.add_parser(name, help=help, description=description)
        add_args(c)
        c.set_defaults(func=func)

    d = sub.add_parser("demo", help="run the engine on the built-in model with a mixed workload and report")
    d.add_argument("--num-prompts", type=int, default=64)
    add_engine_args(d)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # User-caused problems: one line naming what is wrong, no traceback.
        print(f"{PROG} {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
