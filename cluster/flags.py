"""The command line's flags, bound to the configs' fields, and the configs built from them: what
`pdcluster`'s subcommands (cli.py, bench.py, capacity.py, plan.py) declare and read. It imports
none of them, so each can import it."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import NamedTuple

from cluster.run.spec import CONTROLLER_MODES, PLACEMENTS, ClusterSpec
from router.admission import ADMISSION_POLICIES
from router.config import API_KEY_ENV, TOOL_PARSERS, RouterConfig
from router.slo import SLOTargets
from workers.config import EngineConfig
from workers.names import (ATTENTION_BACKENDS, AUTO, COLOCATED, DISAGGREGATED, MODES, PICKING_POLICIES, PREEMPTION_MODES,
                           SCHEDULING_POLICIES, TRANSPORTS)


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
    const: str | None = None          # the value of the flag given without one (a choice that may be left out)


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
         "adds or removes them within --min-workers and --max-workers) as the load shifts, against the --slo-* "
         "targets; `--controller advise` reports what it would do (log, metrics) and changes nothing (default: "
         "off)", str, CONTROLLER_MODES, const="on"),
    Flag("--controller-interval-s", "controller_interval_s", "seconds between the controller's decisions", float),
    Flag("--controller-window-s", "controller_window_s", "seconds of arrivals and finishes a decision sees", float),
    Flag("--controller-cooldown-s", "controller_cooldown_s", "no change within this long of the last", float),
    Flag("--controller-forecast-s", "controller_forecast_s", "the controller's long interval: a forecast of the "
         "next ones' arrivals keeps a floor under each pool ahead of demand (0: no forecast)", float),
    Flag("--controller-shrink-hold-s", "controller_shrink_hold_s", "elastic: no pool shrinks within this long of "
         "its growth (a worker added costs its start-up; a shrink undone costs another)", float),
    Flag("--controller-mixed", "controller_mixed", "the controller may empty the prefill pool when splitting does "
         "not pay (short prompts whose chunks barely stall a decode step, a load the workers carry whole): the "
         "decode workers then serve requests whole, and it splits again when long prompts or missed targets "
         "call for it", bool),
    Flag("--max-workers", "max_workers", "the worker budget the controller keeps to (default: the launched pools)"),
    Flag("--min-workers", "min_workers", "elastic: the controller also shrinks the total when demand falls, to no "
         "fewer than this (default: it never shrinks)"),
)

ROUTER_FLAGS = (        # RouterConfig fields
    Flag("--host", "host", "address the HTTP server binds", str),
    Flag("--router-id", "router_id", "this router's name on the workers (letters, digits, '_', '.', '-'); a "
         "restarted router may reuse it", str),
    Flag("--port", "port", "port of the HTTP server"),
    Flag("--api-key", "api_key", "require 'Authorization: Bearer KEY' on /v1 (a command line is visible to "
         "every user of the machine: prefer PDCLUSTER_API_KEY or --api-key-file)", str),
    Flag("--served-model-name", "served_model_name", "the model name clients send (default: --model)", str),
    Flag("--policy", "policy", "how the router picks workers (p2c: of two sampled, fewer prompt tokens queued; "
         "colocated, first where a sequence slot frees sooner; prefix: prefill workers by the prompt blocks "
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
    Flag("--tool-call-parser", "tool_call_parser", "how the model's answers call tools (chat requests with "
         "tools and tool_choice auto): hermes (<tool_call>{...}</tool_call>: Hermes, Qwen, the built-in "
         "template) or llama3_json (Llama 3.1's JSON calls); auto: by the chat template", str, TOOL_PARSERS),
    Flag("--max-validating", "max_validating", "request bodies being read or validated at once (before "
         "admission); the others wait in line unread, 429 past --max-pending waiting or --body-timeout-s"),
    Flag("--otlp-traces-endpoint", "otlp_traces_endpoint", "send each request's trace (OpenTelemetry: the "
         "router's, the prefill and decode workers' and the handoff's spans; a client's traceparent is "
         "continued) to this OTLP/HTTP collector, e.g. http://localhost:4318 (Jaeger, Tempo, the OpenTelemetry "
         "Collector); default: no tracing", str),
    Flag("--max-refusals-per-s", "max_refusals_per_s", "429s of a full server (admission, --max-pending) "
         "answered per second at most (with SLO admission, also at most three times the requests served per second, "
         "20 at least); the rest wait their turn, up to 1 s (the TTFT target if less), and past it that long: "
         "a client that sends again the moment it is refused comes back at this pace, not as fast as the "
         "router can refuse", float),
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
        more = {} if f.const is None else {"nargs": "?", "const": f.const}
        g.add_argument(f.flag, type=f.type, default=argparse.SUPPRESS, choices=f.choices, help=f.help + note, **more)


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


def nested(values: dict) -> dict:
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
    return EngineConfig.from_dict(nested(given(a, flags)))


MODE_ONLY = {"num_colocated": (COLOCATED, "--workers"), "num_prefill": (DISAGGREGATED, "--prefill"),
              "num_decode": (DISAGGREGATED, "--decode")}


def cluster_spec_from_args(a: argparse.Namespace, engine: EngineConfig) -> ClusterSpec:
    values = given(a, CLUSTER_FLAGS)
    mode = values.get("mode", _field_default(ClusterSpec, "mode"))
    for name, (needs, flag) in MODE_ONLY.items():
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
