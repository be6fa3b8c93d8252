"""`pdcluster bench`: load tests that report latency and SLO-attainment goodput.

One run sends `--num-prompts` requests at `--request-rate` (or, with `--dataset-name trace`, at
a timed trace's own timestamps; with `--dataset-name phases`, in alternating prefill-heavy and
decode-heavy phases, reported phase by phase) and reports TTFT, TPOT, ITL and E2E latency. `workload`
gives the same requests and send times without a server, for `pdcluster simulate`. With `--goodput`, requests meeting every SLO count as good; `--sweep` runs several
rates and reports the highest one at which at least `--slo-attainment` of requests are good
(DistServe's goodput), per worker and per GPU when the server says how many it has; when the
highest rate tried still passes, that is a lower bound and the report says so.
Ctrl-C stops a run or a sweep: what had finished is reported (and saved with `--save-result`,
marked `"interrupted": true`), and the exit status is 130.
`--launch` starts a local pdcluster on the built-in model first, and shuts it down after.
Run as a Ray job with `--save-result`, it also prints the result in the job's log, from which
`--from-ray-job ID` saves it on the submitter's machine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx

from cluster.loadtest import loadgen, promtext
from cluster.flags import add_engine_args
from router.slo import ATTAINMENT
from router.tracing import AFTER_FIRST_TOKEN, TTFT_PHASES
from cluster.loadtest.bench_data import (DECODE_HEAVY, PREFILL_HEAVY, TIMESTAMP_UNITS, TRACES, BenchRequest, Phase,
                                TraceRow, alternate, load_custom, load_trace, phase_rows, sample_prefix_repetition,
                                sample_random, sample_sharegpt, sample_trace, save_trace)
from workers.names import DISAGGREGATED, MODES

LAUNCH_SKIPS = ("--model", "--seed")      # engine flags whose names bench already uses
KEEP_PACE = 0.5        # a sweep point must complete at least this fraction of its offered rate
DATASETS = ("random", "sharegpt", "prefix-repetition", "custom", "trace")
TIMED = ("trace", "phases")      # datasets whose rows carry their own send times (`trace_rows`)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (flags as in `vllm bench serve`)")
    t.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: that, "
                   "or the launched cluster)")
    t.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    t.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models; "
                   "with --launch, the model to serve, default tiny)")
    t.add_argument("--tokenizer", default=None, help="built-in name or a directory with tokenizer.json, for "
                   "building prompts (default: --model when it is one)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: OPENAI_API_KEY)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before it counts as failed")

    add_dataset_args(p, phases=True)
    r = add_rate_args(p)
    r.add_argument("--sweep", action="store_true", help="run several rates and report the highest with "
                   "enough SLO attainment (needs --goodput)")
    r.add_argument("--sweep-rates", default=None, help="comma-separated rates; default: found by doubling, "
                   "then bisection")
    r.add_argument("--sweep-start", type=float, default=1.0, help="first rate of the automatic search")
    r.add_argument("--sweep-steps", type=int, default=3, help="bisection steps after the doubling")
    r.add_argument("--sweep-duration", type=float, default=30.0, help="seconds of arrivals per sweep rate at "
                   "least (more than --num-prompts requests where needed), so that overload shows as queueing")
    add_output_args(p)

    j = p.add_argument_group("as a Ray job (`ray job submit -- pdcluster bench ... --save-result`)")
    j.add_argument("--from-ray-job", default=None, metavar="SUBMISSION_ID",
                   help="run no load test: wait for that Ray job, take the result it logged, and save it "
                   "(and its plots) in --result-dir here")
    j.add_argument("--ray-address", default=None, help="Ray's job API (the dashboard), as `ray job submit "
                   "--address`, e.g. http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS, else RAY_ADDRESS)")

    c = p.add_argument_group("local cluster (--launch)")
    c.add_argument("--launch", action="store_true", help="start a local pdcluster first, stop it after")
    c.add_argument("--launch-mode", default=DISAGGREGATED, choices=MODES)
    c.add_argument("--launch-prefill", type=int, default=1)
    c.add_argument("--launch-decode", type=int, default=1)
    c.add_argument("--launch-workers", type=int, default=2, help="colocated workers")
    # The served engine's flags, as `pdcluster serve` takes them (--model and --seed are bench's own).
    add_engine_args(p, skip=LAUNCH_SKIPS)


def add_dataset_args(p: argparse.ArgumentParser, phases: bool = False) -> argparse._ArgumentGroup:
    """The workload: which requests (and, for a trace, when). Shared with `pdcluster simulate`;
    `phases` adds the phase generator (bench's own, so far)."""
    d = p.add_argument_group("workload")
    d.add_argument("--dataset-name", default="random", choices=DATASETS + (("phases",) if phases else ()))
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON, JSONL for custom, or for trace a CSV "
                   "(arrived_at,num_prefill_tokens,num_decode_tokens), a JSONL timed trace (one object a line: "
                   "arrival_s or timestamp, prompt or prompt_len/input_length, output_len/output_length/"
                   f"output_tokens, optional phase) or a built-in trace: {', '.join(TRACES)}")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send (trace: its first N, all if "
                   "it has fewer)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--custom-output-len", type=int, default=256)
    d.add_argument("--trace-time-scale", type=float, default=1.0, help="trace: divide its timestamps by this "
                   "(2 sends at twice the trace's rate). A trace's timestamps are the send times: "
                   "--request-rate, --burstiness and --sweep are refused with it")
    d.add_argument("--trace-length-scale", type=float, default=1.0, help="trace: multiply its prompt and "
                   "output lengths by this (rounded, at least 1)")
    d.add_argument("--trace-max-len", type=int, default=None, help="trace: cut prompts so that prompt + output "
                   "fits in this many tokens (e.g. the served model's context)")
    d.add_argument("--trace-timestamp-unit", default="s", choices=tuple(TIMESTAMP_UNITS), help="JSONL trace: the "
                   "unit of a 'timestamp' field (ms for Mooncake's traces); 'arrival_s' is always seconds")
    d.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM's extension)")
    d.add_argument("--seed", type=int, default=0)
    if phases:
        g = p.add_argument_group("load phases (--dataset-name phases): alternating prefill-heavy and decode-heavy "
                                 "phases, the first prefill-heavy; gamma gaps within each (--burstiness), lengths "
                                 "spread by --random-range-ratio; --num-prompts does not apply")
        g.add_argument("--phases", type=int, default=4, help="how many phases")
        g.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase")
        g.add_argument("--prefill-phase-input-len", type=int, default=1024)
        g.add_argument("--prefill-phase-output-len", type=int, default=16)
        g.add_argument("--prefill-phase-rate", type=float, default=2.0, help="requests/s")
        g.add_argument("--decode-phase-input-len", type=int, default=32)
        g.add_argument("--decode-phase-output-len", type=int, default=256)
        g.add_argument("--decode-phase-rate", type=float, default=2.0, help="requests/s")
        g.add_argument("--save-trace", default=None, metavar="FILE", help="phases or trace: write the workload as a "
                       "JSONL timed trace (replay: --dataset-name trace --dataset-path FILE, in bench or simulate) "
                       "and exit, sending nothing")
    return d


def add_rate_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """When requests are sent, and what counts as good. Shared with `pdcluster simulate`."""
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once; "
                   "not with --dataset-name trace, whose timestamps set the send times)")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    r.add_argument("--max-concurrency", type=int, default=None)
    r.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:5000; a request is good if it meets all")
    r.add_argument("--slo-attainment", type=float, default=ATTAINMENT, help="fraction of requests that must "
                   "be good (default 0.9)")
    return r


def add_output_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The report and the result file. Shared with `pdcluster simulate`."""
    o = p.add_argument_group("output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    o.add_argument("--save-result", action="store_true", help="write the JSON result (and PNG plots)")
    o.add_argument("--result-dir", default=".")
    o.add_argument("--result-filename", default=None)
    o.add_argument("--no-plots", action="store_true", help="with --save-result, skip the PNG plots")
    o.add_argument("--disable-tqdm", action="store_true")
    return o


@dataclass(slots=True)
class BenchOptions:
    percentile_metrics: tuple[str, ...]
    percentiles: tuple[float, ...]
    slos: dict[str, float]


def parse_options(a: argparse.Namespace) -> BenchOptions:
    metrics = tuple(m.strip() for m in a.percentile_metrics.split(",") if m.strip())
    for m in metrics:
        if m not in loadgen.METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {m!r}; use {', '.join(loadgen.METRICS)}")
    try:
        pcts = tuple(float(x) for x in a.metric_percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers, got {a.metric_percentiles!r}") from None
    if not pcts or any(not 0 < p <= 100 for p in pcts):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    check_workload(a)
    if not 0 < a.slo_attainment <= 1:
        raise ValueError("--slo-attainment must be in (0, 1]")
    slos = loadgen.parse_goodput(a.goodput)
    sweeping = getattr(a, "sweep", False)           # (bench's own flag; `simulate` has none)
    if sweeping and not slos:
        raise ValueError("--sweep needs --goodput (the SLOs that define a good request)")
    if sweeping and a.sweep_duration < 0:
        raise ValueError("--sweep-duration must be non-negative")
    if sweeping and a.dataset_name in TIMED:
        raise ValueError(f"--sweep does not apply to --dataset-name {a.dataset_name}: it sets its own rates "
                         "(run it at several " + ("--trace-time-scale values" if a.dataset_name == "trace"
                                                  else "--prefill-phase-rate and --decode-phase-rate values")
                         + " instead)")
    return BenchOptions(metrics, pcts, slos)


def check_workload(a: argparse.Namespace) -> None:
    """The dataset and rate flags (add_dataset_args, add_rate_args) make sense together."""
    if a.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if a.dataset_name in ("sharegpt", "custom") and not a.dataset_path:
        raise ValueError(f"--dataset-name {a.dataset_name} needs --dataset-path")
    loadgen.arrival_gaps(0, a.request_rate, a.burstiness)           # validates both
    if a.dataset_name == "trace":
        if not a.dataset_path:
            raise ValueError(f"--dataset-name trace needs --dataset-path: a CSV file or a built-in trace "
                             f"({', '.join(TRACES)})")
        if not math.isinf(a.request_rate) or a.burstiness != 1.0:
            raise ValueError("--dataset-name trace sends at the trace's own timestamps: drop --request-rate "
                             "and --burstiness (use --trace-time-scale to speed it up or slow it down)")
        if not a.trace_time_scale > 0 or not a.trace_length_scale > 0:
            raise ValueError("--trace-time-scale and --trace-length-scale must be positive")
        if a.trace_max_len is not None and a.trace_max_len < 2:
            raise ValueError("--trace-max-len must be at least 2 (a 1-token prompt and output)")
    if a.dataset_name == "phases":
        if not math.isinf(a.request_rate):
            raise ValueError("--dataset-name phases sets its rates per phase: drop --request-rate (use "
                             "--prefill-phase-rate and --decode-phase-rate)")
        if a.phases < 1:
            raise ValueError("--phases must be at least 1")
        if not (a.phase_s > 0 and math.isfinite(a.phase_s)):
            raise ValueError("--phase-s must be positive")
        for kind in ("prefill", "decode"):
            rate = getattr(a, f"{kind}_phase_rate")
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"--{kind}-phase-rate must be a positive number of requests/s")
            if getattr(a, f"{kind}_phase_input_len") < 1 or getattr(a, f"{kind}_phase_output_len") < 1:
                raise ValueError(f"--{kind}-phase-input-len and --{kind}-phase-output-len must be at least 1")
        if not 0 <= a.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {a.random_range_ratio}")
    if getattr(a, "save_trace", None) and a.dataset_name not in TIMED:
        raise ValueError("--save-trace writes a timed workload: it needs --dataset-name phases or trace")


def server_info(base_url: str, api_key: str | None) -> dict:
    """The first entry of /v1/models (pdcluster adds num_workers, workers_by_role, num_gpus)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {base_url}/v1/models: {e}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"{base_url}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]


SERVER_TOTALS = ("pdcluster:kv_transfer_seconds_count", "pdcluster:kv_transfer_seconds_sum",
                 "pdcluster:kv_transfer_bytes_total", "pdcluster:kv_transfer_failures_total",
                 "pdcluster:prefix_cache_queries_total", "pdcluster:prefix_cache_hits_total",
                 "pdcluster:num_preemptions_total", "pdcluster:engine_step_batch_size_sum",
                 "pdcluster:engine_step_batch_size_count", "pdcluster:local_prefills_total")


def server_totals(base_url: str) -> dict[str, float] | None:
    """pdcluster's own counters from the server's /metrics, summed over workers (batch sizes per
    role); None when it has none (vLLM, SGLang, or no /metrics)."""
    try:
        metrics = promtext.scrape(base_url + "/metrics")
    except (httpx.HTTPError, ValueError):
        return None
    totals: dict[str, float] = {}
    ours = False
    for series, value in metrics.items():
        name, labels = promtext.split(series)
        ours = ours or name.startswith("pdcluster:")
        if name in SERVER_TOTALS:
            key = name + (f"/{labels.get('role')}" if "batch_size" in name else "")
            totals[key] = totals.get(key, 0.0) + value
    return totals if ours else None


def server_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the cluster did during the run: KV handoffs, requests prefilled on their decode
    worker instead (conditional disaggregation), prefix-cache hits, preemptions, and the mean
    batch per role (differences of its counters)."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    n = d.get("pdcluster:kv_transfer_seconds_count", 0.0)
    queries = d.get("pdcluster:prefix_cache_queries_total", 0.0)
    roles = sorted(k.split("/")[1] for k in d if k.startswith("pdcluster:engine_step_batch_size_count/"))
    return {
        "kv_transfers": int(n),
        "kv_transfer_bytes": int(d.get("pdcluster:kv_transfer_bytes_total", 0)),
        "kv_transfer_mean_ms": 1000 * d.get("pdcluster:kv_transfer_seconds_sum", 0.0) / n if n else None,
        "kv_transfer_failures": int(d.get("pdcluster:kv_transfer_failures_total", 0)),
        "local_prefills": int(d.get("pdcluster:local_prefills_total", 0)),
        "prefix_cache_hit_rate": d.get("pdcluster:prefix_cache_hits_total", 0.0) / queries if queries else None,
        "preemptions": int(d.get("pdcluster:num_preemptions_total", 0)),
        "mean_batch_size": {r: d[f"pdcluster:engine_step_batch_size_sum/{r}"] / c for r in roles
                            if (c := d[f"pdcluster:engine_step_batch_size_count/{r}"])},
    }


def server_report(s: dict) -> str:
    w = 50
    lines = [f"{' Cluster, from its /metrics ':-^{w}}"]
    xfer = (f"{s['kv_transfers']} ({s['kv_transfer_bytes'] / 2**20:.1f} MiB, mean {s['kv_transfer_mean_ms']:.1f} ms)"
            if s["kv_transfers"] else "0")
    lines.append(f"{'KV handoffs:':<22}{xfer:>28}")
    lines.append(f"{'KV handoff failures:':<40}{s['kv_transfer_failures']:>10}")
    lines.append(f"{'Prefilled on the decode worker:':<40}{s['local_prefills']:>10}")
    if s["prefix_cache_hit_rate"] is not None:
        lines.append(f"{'Prefix cache hit rate:':<40}{s['prefix_cache_hit_rate']:>10.1%}")
    lines.append(f"{'Preemptions:':<40}{s['preemptions']:>10}")
    for role, b in s["mean_batch_size"].items():
        lines.append(f"{f'Mean batch ({role}):':<40}{b:>10.1f}")
    return "\n".join(lines + ["=" * w])


def server_phases(base_url: str, api_key: str | None) -> dict | None:
    """The server's traced requests' phases by trace id (pdcluster serve --otlp-traces-endpoint:
    /debug/phases); None when it does not trace (or is not pdcluster)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/debug/phases", headers=headers, timeout=60, trust_env=False)
        body = resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    return body.get("requests") if isinstance(body, dict) and body.get("tracing") else None


TTFT_WINDOW = 0.05           # the requests averaged for a TTFT percentile: this share around its rank


def ttft_breakdown(result: dict, phases: dict, percentiles: list[float], slowest: int = 5) -> dict | None:
    """Where the time to first token went, at each TTFT percentile: the requests ranked by the
    server's TTFT, the phases (ms) averaged over those within TTFT_WINDOW of the percentile's
    rank (so each bar sums to about that percentile's TTFT), and the slowest requests' trace
    ids (by the client's TTFT). None when no request of the run is among the server's traces."""
    ids, ttfts, errors = result.get("trace_ids") or [], result["ttfts"], result["errors"]
    ok = [(ttft, t) for t, ttft, e in zip(ids, ttfts, errors) if not e and t in phases]
    if not ok:
        return None
    ranked = sorted((phases[t] for _, t in ok), key=lambda p: p["ttft"])
    n, half = len(ranked), round(TTFT_WINDOW * len(ranked) / 2)
    out = {}
    for q in sorted({50.0, *percentiles}):
        at = min(n - 1, round(q / 100 * (n - 1)))
        group = ranked[max(0, at - half):at + half + 1]
        row = {k: 1000 * sum(p[k] for p in group) / len(group) for k in ("ttft", *TTFT_PHASES)}
        after = [p for p in group if "handoff" in p]
        if after:
            row.update({k: 1000 * sum(p[k] for p in after) / len(after) for k in AFTER_FIRST_TOKEN})
        out[f"p{q:g}"] = row
    return {"requests": n, "of": len(ids), "by_percentile": out,
            "slowest": [{"trace_id": t, "ttft_ms": 1000 * ttft} for ttft, t in sorted(ok, reverse=True)[:slowest]]}


def breakdown_report(b: dict | None) -> str:
    """The TTFT-by-phase table: a column per TTFT percentile, its phases' mean over the requests
    at that rank, summing to the router's TTFT there; then the parts after the first token."""
    w = 79
    if b is None:
        return (f"{' TTFT by phase ':-^{w}}\n"
                "the server does not trace (pdcluster serve --otlp-traces-endpoint URL): no breakdown")
    rows = b["by_percentile"]
    cols = list(rows)
    title = f" TTFT by phase (ms; {b['requests']} of {b['of']} requests traced) "
    lines = [f"{title:-^{w}}", f"{'':<24}" + "".join(f"{c:>10}" for c in cols)]

    def line(name: str, key: str) -> None:
        lines.append(f"{name:<24}" + "".join(f"{rows[c].get(key, math.nan):>10.2f}" for c in cols))
    for k in TTFT_PHASES:
        line(f"  {k}", k)
    line("= TTFT at the router", "ttft")
    if any("handoff" in rows[c] for c in cols):
        lines.append("after the first token:")
        for k in AFTER_FIRST_TOKEN:
            line(f"  {k}", k)
    lines.append("slowest (client TTFT): " + ", ".join(f"{x['trace_id']} {x['ttft_ms']:.0f} ms" for x in b["slowest"]))
    return "\n".join(lines)


def phases_from_args(a: argparse.Namespace) -> list[Phase]:
    prefill = Phase(PREFILL_HEAVY, a.prefill_phase_input_len, a.prefill_phase_output_len, a.prefill_phase_rate)
    decode = Phase(DECODE_HEAVY, a.decode_phase_input_len, a.decode_phase_output_len, a.decode_phase_rate)
    return alternate(a.phases, prefill, decode)


def trace_rows(a: argparse.Namespace, num: int | None = None, tokenizer=None) -> list[TraceRow]:
    """The timed rows of --dataset-name phases (all of them), or the first `num` (default
    --num-prompts) of the --dataset-path trace, scaled by the --trace-* flags. A JSONL trace's
    text prompts are measured with `tokenizer`, else with --tokenizer's (loaded if needed)."""
    if a.dataset_name == "phases":
        return phase_rows(phases_from_args(a), a.phase_s, a.burstiness, a.random_range_ratio, a.seed)

    def named_tokenizer():
        if not getattr(a, "tokenizer", None):
            return None
        from workers.checkpoint import load_tokenizer
        try:
            return load_tokenizer(a.tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer {a.tokenizer}: {e}") from None

    return load_trace(a.dataset_path, num or a.num_prompts, a.trace_time_scale, a.trace_length_scale,
                      a.trace_max_len, tokenizer if tokenizer is not None else named_tokenizer,
                      getattr(a, "trace_timestamp_unit", "s"))


def _need_tokenizer(name: str, tokenizer) -> None:
    if tokenizer is None and name != "custom":
        raise ValueError(f"--dataset-name {name} needs a tokenizer to size prompts: pass --tokenizer "
                         "(a built-in model name or a directory with tokenizer.json)")


def build_requests(a: argparse.Namespace, tokenizer, num: int | None = None,
                   seed: int | None = None) -> list[BenchRequest]:
    """`num` requests (default --num-prompts) drawn with `seed` (default --seed): random
    workloads draw that many; a file-based dataset with fewer rows than asked is cycled; a
    trace gives its first `num` rows (all of them, if fewer: see `workload` for their times)."""
    name, want = a.dataset_name, num or a.num_prompts
    seed = a.seed if seed is None else seed
    _need_tokenizer(name, tokenizer)
    if name in TIMED:
        return sample_trace(tokenizer, trace_rows(a, want, tokenizer), seed)
    if name == "random":
        return sample_random(tokenizer, want, a.random_input_len, a.random_output_len,
                             a.random_range_ratio, a.random_prefix_len, seed)
    if name == "prefix-repetition":
        return sample_prefix_repetition(tokenizer, want, a.prefix_repetition_prefix_len,
                                        a.prefix_repetition_suffix_len, a.prefix_repetition_num_prefixes,
                                        a.prefix_repetition_output_len, seed)
    if name == "sharegpt":
        base = sample_sharegpt(a.dataset_path, tokenizer, a.num_prompts, a.sharegpt_output_len, seed)
    else:
        base = load_custom(a.dataset_path, tokenizer, a.num_prompts, a.custom_output_len)
    return [base[i % len(base)] for i in range(want)] if want > len(base) else base


def workload(a: argparse.Namespace, tokenizer) -> tuple[list[BenchRequest], list[float]]:
    """What one run sends, and when: the requests and their send times in seconds from the start
    (non-decreasing). A trace's own (scaled) timestamps or the phases', else `loadgen.send_times` at
    --request-rate and --burstiness, drawn with --seed: exactly what `run_load` would draw.
    No server needed: `pdcluster simulate` replays the same workload as `pdcluster bench`."""
    check_workload(a)
    if a.dataset_name in TIMED:
        _need_tokenizer(a.dataset_name, tokenizer)
        rows = trace_rows(a, tokenizer=tokenizer)
        return sample_trace(tokenizer, rows, a.seed), [r.arrival_s for r in rows]
    requests = build_requests(a, tokenizer)
    return requests, loadgen.send_times(len(requests), a.request_rate, a.burstiness, a.seed)


def _tokenizer(a: argparse.Namespace, model: str):
    from workers.checkpoint import load_tokenizer
    source = a.tokenizer or model
    try:
        tok = load_tokenizer(source)
    except (OSError, ValueError) as e:
        if a.tokenizer:
            raise ValueError(f"--tokenizer {a.tokenizer}: {e}") from None
        return None
    if tok is None and a.tokenizer:
        raise ValueError(f"--tokenizer {a.tokenizer}: no tokenizer.json there")
    return tok


class Progress:
    """tqdm on stderr, one tick per finished request (failures shown in the postfix)."""

    def __init__(self, total: int, desc: str, disable: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disable,
                        dynamic_ncols=True, leave=False)
        self.failed = 0

    def __call__(self, r: loadgen.RequestResult) -> None:
        if not r.success:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during one run: `result` summarizes the requests that had finished by then."""

    def __init__(self, result: dict):
        super().__init__(f"interrupted after {result['completed'] + result['failed']} of "
                         f"{result['num_prompts']} requests")
        self.result = result


def offered_rate(arrivals: list[float]) -> float:
    """The mean rate of these send times: requests after the first over the time they span."""
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def run_once(target: loadgen.Target, requests: list[BenchRequest], rate: float, a, opts: BenchOptions,
             desc: str, arrivals: list[float] | None = None) -> dict:
    """One run's summary, at `rate` or at the given send times (`workload`'s); on Ctrl-C,
    BenchInterrupted with the summary of the requests that finished (those in flight or not
    yet sent are `not_finished`: neither completed nor failed)."""
    progress = Progress(len(requests), desc, a.disable_tqdm)
    cut = None
    try:
        results, duration = asyncio.run(loadgen.run_load(target, requests, rate, a.burstiness,
                                                         a.max_concurrency, a.seed, progress, arrivals))
        in_order = results
    except loadgen.LoadInterrupted as e:
        cut, in_order = e, e.results
        results, duration = [r for r in e.results if r is not None], e.duration
    finally:
        progress.close()
    out = loadgen.summarize(results, duration, opts.slos, opts.percentile_metrics, opts.percentiles)
    out.update(request_rate=rate if math.isfinite(rate) else "inf", burstiness=a.burstiness,
               max_concurrency=a.max_concurrency, num_prompts=len(requests))
    if a.dataset_name == "trace" and arrivals is not None:
        # The trace's rate (its mean over the requests sent), not a gamma process's.
        trace_rate = offered_rate(arrivals)
        out.update(request_rate=trace_rate if math.isfinite(trace_rate) else "inf", burstiness=None,
                   trace=a.dataset_path, trace_time_scale=a.trace_time_scale,
                   trace_length_scale=a.trace_length_scale, trace_max_len=a.trace_max_len)
    if a.dataset_name == "phases" and arrivals is not None:
        mean_rate = offered_rate(arrivals)
        out.update(request_rate=mean_rate if math.isfinite(mean_rate) else "inf",
                   phase_config={"phases": a.phases, "phase_s": a.phase_s, "range_ratio": a.random_range_ratio,
                                 **{p.name: {"input_len": p.input_len, "output_len": p.output_len, "rate": p.rate}
                                    for p in phases_from_args(a)[:2]}})
    if arrivals is not None and any(q.phase is not None for q in requests):
        out["phases"] = loadgen.summarize_phases(in_order, arrivals, [q.phase for q in requests], opts.slos,
                                                 opts.percentiles)
    if cut is not None:
        out.update(interrupted=True, not_finished=len(requests) - len(results),
                   in_flight_at_interrupt=cut.started - len(results), not_sent=len(requests) - cut.started)
        raise BenchInterrupted(out)
    return out


def _ms(x) -> str:
    return f"{x:.2f}"


def report(result: dict, opts: BenchOptions, title: str = "Serving Benchmark Result") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(k, v):
        lines.append(f"{k:<40}{v:>10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("interrupted"):
        row("Not finished (Ctrl-C):", result["not_finished"])
        row("  in flight at the interrupt:", result["in_flight_at_interrupt"])
        row("  not sent:", result["not_sent"])
    row("Request rate (req/s):", result["request_rate"] if isinstance(result["request_rate"], str)
        else f"{result['request_rate']:.2f}")
    if result.get("trace"):
        row("Arrivals:", f"trace x{result['trace_time_scale']:g}")
    elif result.get("phase_config"):
        c = result["phase_config"]
        row("Arrivals:", f"{c['phases']} phases x {c['phase_s']:g} s")
        row("Burstiness (1 = Poisson):", f"{result['burstiness']:g}")
    else:
        row("Burstiness (1 = Poisson):", f"{result['burstiness']:g}")
    row("Max concurrency:", result["max_concurrency"] or "none")
    row("Benchmark duration (s):", f"{result['duration']:.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", f"{result['request_throughput']:.2f}")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", f"{result['request_goodput']:.2f}")
        row("SLO attainment:", f"{result['slo_attainment']:.1%}")
    row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for m in opts.percentile_metrics:
        lines.append(f"{' ' + names[m] + ' ':-^{w}}")
        row(f"Mean {m.upper()} (ms):", _ms(result[f"mean_{m}_ms"]))
        row(f"Median {m.upper()} (ms):", _ms(result[f"median_{m}_ms"]))
        for p in opts.percentiles:
            row(f"P{p:g} {m.upper()} (ms):", _ms(result[f"p{p:g}_{m}_ms"]))
    if result.get("phases"):
        lines.append(phase_report(result["phases"], opts))
    errors = [e for e in result["errors"] if e]
    if errors:
        lines.append(f"{' Errors ':-^{w}}")
        counts: dict[str, int] = {}
        for e in errors:
            counts[e] = counts.get(e, 0) + 1
        for e, n in sorted(counts.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {n} x {e[:200]}")
    lines.append("=" * w)
    return "\n".join(lines)


def phase_report(phases: list[dict], opts: BenchOptions) -> str:
    """The per-phase table: requests by the phase they were due to be sent in."""
    p = f"p{opts.percentiles[-1]:g}"
    lines = [f"{' Per phase (by send time) ':-^79}",
             f"{'#':>2} {'phase':<14} {'from s':>7} {'sent':>5} {'done':>5} {'fail':>4} {'attain':>7} "
             f"{'goodput':>8} {p + ' TTFT':>9} {p + ' TPOT':>9}"]
    for k, ph in enumerate(phases, 1):
        attain = "-" if ph["slo_attainment"] is None else f"{ph['slo_attainment']:.1%}"
        good = "-" if ph["request_goodput"] is None else f"{ph['request_goodput']:.2f}"
        lines.append(f"{k:>2} {str(ph['phase'])[:14]:<14} {ph['start_s']:>7.1f} {ph['num_prompts']:>5} "
                     f"{ph['completed']:>5} {ph['failed']:>4} {attain:>7} {good:>8} "
                     f"{ph[f'{p}_ttft_ms']:>9.1f} {ph[f'{p}_tpot_ms']:>9.1f}")
    return "\n".join(lines)


def search_rate(meets_slo, start: float, steps: int, max_probes: int = 12) -> float | None:
    """The highest rate where `meets_slo(rate)` holds, assuming it holds below some threshold:
    double from `start` until a rate misses (halve while it misses), then bisect the bracket
    `steps` times. Returns None if no probed rate meets it."""
    lo = hi = None
    rate = start
    for _ in range(max_probes):
        if meets_slo(rate):
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    if lo is None or hi is None:
        return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        if meets_slo(mid):
            lo = mid
        else:
            hi = mid
    return lo


def sweep(target, requests_for, a, opts: BenchOptions) -> tuple[list[dict], float | None, dict | None]:
    """Runs at several rates; returns the points (sorted by rate), the highest rate that
    passes (None if none does), and None, or after Ctrl-C the interrupted point's partial
    summary ({} when the interrupt came between points): the sweep stops there, keeping the
    points it finished. Each point sends at least `--sweep-duration` seconds of arrivals, so
    an overloaded server shows it as queueing that breaks the SLOs; and a point passes only if
    the server also kept pace (completed at least KEEP_PACE of the offered rate): a burst that
    merely queues and drains inside the SLOs is not a sustained rate."""
    points: dict[float, dict] = {}

    def at(rate: float) -> bool:
        if rate not in points:
            n = max(a.num_prompts, math.ceil(rate * a.sweep_duration))
            p = points[rate] = run_once(target, requests_for(n, len(points)), rate, a, opts, f"rate {rate:g}/s")
            p["kept_pace"] = p["request_throughput"] >= KEEP_PACE * rate
            p["passed"] = p["kept_pace"] and p["slo_attainment"] >= a.slo_attainment
            print(f"  rate {rate:8.3g} req/s, {n} requests: attainment {p['slo_attainment']:6.1%}, goodput "
                  f"{p['request_goodput']:.2f} req/s, {p['request_throughput']:.2f} req/s done"
                  + ("" if p["kept_pace"] else " (did not keep pace)")
                  + f", p99 TTFT {p.get('p99_ttft_ms', p['mean_ttft_ms']):.0f} ms, failed {p['failed']}", flush=True)
        return points[rate]["passed"]

    if a.sweep_rates:
        try:
            rates = sorted(float(x) for x in a.sweep_rates.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--sweep-rates must be comma-separated numbers, got {a.sweep_rates!r}") from None
        if not rates or rates[0] <= 0:
            raise ValueError("--sweep-rates must be positive")
    cut = None
    try:
        if a.sweep_rates:
            for r in rates:
                at(r)
        else:
            search_rate(at, a.sweep_start, a.sweep_steps)
    except BenchInterrupted as e:
        cut = e.result
    except KeyboardInterrupt:
        cut = {}
    ordered = [points[r] for r in sorted(points)]
    good = [r for r in sorted(points) if points[r]["passed"]]
    return ordered, (max(good) if good else None), cut


def save(result: dict, a) -> Path:
    """Writes the result in --result-dir as --result-filename, else as
    pdcluster-bench-MODEL-TIME.json, made unique (-2, -3, ...) so that a run never overwrites
    another's result or plots."""
    out_dir = Path(a.result_dir)
    text = json.dumps(result, indent=2)
    if a.result_filename:
        path = out_dir / a.result_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"pdcluster-bench-{result['model_id']}-{datetime.datetime.now():%Y%m%d-%H%M%S}".replace("/", "_")
    for k in range(1, 10_000):
        path = out_dir / (f"{stem}.json" if k == 1 else f"{stem}-{k}.json")
        try:
            with path.open("x") as f:
                f.write(text)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"{out_dir}: too many results named {stem}-N.json")


def cmd_bench(a: argparse.Namespace) -> int:
    if a.from_ray_job:
        return fetch_ray_job_result(a)
    opts = parse_options(a)
    if a.save_trace:
        rows = trace_rows(a, tokenizer=lambda: _tokenizer(a, a.model) if a.tokenizer or a.model else None)
        path = save_trace(rows, a.save_trace)
        print(f"pdcluster bench: wrote {len(rows)} requests ({rows[-1].arrival_s:.1f} s of arrivals) to {path}; "
              f"replay: --dataset-name trace --dataset-path {path}", flush=True)
        return 0
    with _maybe_launch(a) as base_url:
        api_key = a.api_key or os.environ.get("OPENAI_API_KEY")
        info = server_info(base_url, api_key)
        model = a.model if a.model and not a.launch else info["id"]     # launched: the served name
        tokenizer = _tokenizer(a, model)
        requests, arrivals = workload(a, tokenizer)

        def requests_for(n: int, k: int) -> list[BenchRequest]:
            # Sweep point k draws its own prompts: replaying the same ones at every rate would
            # let the server's prefix cache flatter the later points.
            return build_requests(a, tokenizer, n, a.seed + k)

        target = loadgen.Target(base_url, a.endpoint, model, api_key, a.ignore_eos, a.request_timeout)
        header = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": "openai",
                  "base_url": base_url, "endpoint": a.endpoint, "model_id": model,
                  "tokenizer_id": a.tokenizer or model, "dataset_name": a.dataset_name,
                  "num_workers": info.get("num_workers"), "num_gpus": info.get("num_gpus"),
                  "workers_by_role": info.get("workers_by_role")}
        what = (f"trace {a.dataset_path}, {arrivals[-1]:.1f} s of arrivals" if a.dataset_name == "trace"
                else f"{a.phases} phases of {a.phase_s:g} s, prefill-heavy first" if a.dataset_name == "phases"
                else a.dataset_name)
        print(f"pdcluster bench: {len(requests)} requests ({what}) to {base_url}{a.endpoint}, "
              f"model {model!r}" + (f", {info['num_workers']} workers" if info.get("num_workers") else ""),
              flush=True)
        interrupted = False
        if a.sweep:
            points, best, cut = sweep(target, requests_for, a, opts)
            interrupted = cut is not None
            result = {**header, "interrupted": interrupted, **_sweep_summary(points, best, info, a)}
            if interrupted:
                result["interrupted_point"] = cut or None
            print(sweep_report(result, a))
        else:
            before = server_totals(base_url)
            try:
                run = run_once(target, requests, a.request_rate, a, opts, "requests", arrivals)
            except BenchInterrupted as e:
                run, interrupted = e.result, True
            result = {**header, "interrupted": interrupted, **run}
            print(report(result, opts, "Serving Benchmark Result (interrupted)" if interrupted
                         else "Serving Benchmark Result"))
            traced = None if interrupted else server_phases(base_url, api_key)
            result["ttft_phases"] = None if traced is None else ttft_breakdown(result, traced, opts.percentiles)
            print(breakdown_report(result["ttft_phases"]))
            after = server_totals(base_url) if before is not None and not interrupted else None
            if after is not None:
                result["server"] = server_summary(before, after)
                print(server_report(result["server"]))
    if interrupted:
        print("pdcluster bench: interrupted (Ctrl-C); the report covers what finished before it"
              + ("" if a.save_result else " (not saved: no --save-result)"), flush=True)
    if a.save_result:
        path = save(result, a)
        plots = [] if a.no_plots else save_plots(result, path)
        print(f"result: {path}" + (" (partial: interrupted)" if interrupted else "")
              + "".join(f"\nplot:   {p}" for p in plots), flush=True)
        if job_id := ray_job_id():
            emit_result(result, path.name, job_id)
    return 130 if interrupted else 0


def _sweep_summary(points: list[dict], best: float | None, info: dict, a) -> dict:
    """The sweep's verdict. The goodput is a lower bound when the highest rate tried still
    passed: the server's limit lies above it, how far is unknown."""
    workers, gpus = info.get("num_workers"), info.get("num_gpus")
    lower = best is not None and best == max(float(p["request_rate"]) for p in points)
    return {"slo_attainment_target": a.slo_attainment, "goodput_slos_ms": _slos_ms(a),
            "max_goodput_rate": best, "goodput_is_lower_bound": lower,
            "max_goodput_rate_per_worker": best / workers if best is not None and workers else None,
            "max_goodput_rate_per_gpu": best / gpus if best is not None and gpus else None,
            "sweep": points}


def _slos_ms(a) -> dict[str, float]:
    return {k: v * 1000 for k, v in loadgen.parse_goodput(a.goodput).items()}


def sweep_report(result: dict, a) -> str:
    lines = [f"{' Goodput sweep ':=^72}",
             f"{'rate req/s':>10} {'attain':>8} {'goodput':>9} {'req/s':>8} {'out tok/s':>10} "
             f"{'p99 TTFT ms':>12} {'failed':>7}  pass"]
    for p in result["sweep"]:
        lines.append(f"{float(p['request_rate']):>10.3g} {p['slo_attainment']:>8.1%} {p['request_goodput']:>9.2f} "
                     f"{p['request_throughput']:>8.2f} {p['output_throughput']:>10.1f} "
                     f"{p.get('p99_ttft_ms', p['mean_ttft_ms']):>12.1f} {p['failed']:>7}  "
                     + ("yes" if p["passed"] else "no" if p["kept_pace"] else "no (pace)"))
    best = result["max_goodput_rate"]
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result["goodput_slos_ms"].items())
    interrupted = result.get("interrupted")
    if interrupted:
        cut = result.get("interrupted_point")
        lines.append("interrupted (Ctrl-C) " + (
            f"at rate {float(cut['request_rate']):g} req/s, after {cut['completed'] + cut['failed']} of its "
            f"{cut['num_prompts']} requests finished; that rate is left out" if cut else "between rates"))
    if best is None:
        lines.append(f"no rate tried reached {a.slo_attainment:.0%} attainment of {slos} while keeping pace"
                     + ("" if not result["sweep"] else "; try lower rates ("
                        + ("--sweep-rates" if a.sweep_rates else "--sweep-start") + ") or looser --goodput SLOs"))
    else:
        ge = ">= " if result["goodput_is_lower_bound"] else ""
        lines.append(f"goodput: {ge}{best:.3g} req/s at >= {a.slo_attainment:.0%} attainment of {slos}")
        if result["goodput_is_lower_bound"]:
            lines.append("  (a lower bound: the highest rate tried still met the SLOs; "
                         + ("the sweep was interrupted before a rate missed)" if interrupted else
                            "add higher rates to --sweep-rates to find the limit)" if a.sweep_rates else
                            "raise --sweep-start to find the limit)"))
        if result["max_goodput_rate_per_worker"] is not None:
            lines.append(f"  {ge}{result['max_goodput_rate_per_worker']:.3g} req/s per worker "
                         f"({result['num_workers']} workers)")
        if result["max_goodput_rate_per_gpu"] is not None:
            lines.append(f"  {ge}{result['max_goodput_rate_per_gpu']:.3g} req/s per GPU ({result['num_gpus']} GPUs)")
    lines.append("=" * 72)
    return "\n".join(lines)


def save_plots(result: dict, path: Path) -> list[Path]:
    """PNG plots beside the result file and named after it: NAME.json -> NAME-latency.png (one
    run; and NAME-ttft-phases.png when the server traced it) or NAME-sweep.png (a sweep; none
    when no rate finished)."""
    from cluster.loadtest.bench_plots import plot_distributions, plot_sweep, plot_ttft_phases
    if "sweep" in result:
        return [plot_sweep(result, path.with_name(f"{path.stem}-sweep.png"))] if result["sweep"] else []
    plots = [plot_distributions(result, path.with_name(f"{path.stem}-latency.png"))]
    if result.get("ttft_phases"):
        plots.append(plot_ttft_phases(result, path.with_name(f"{path.stem}-ttft-phases.png")))
    return plots


# -- as a Ray job: the result file travels back in the job's log (no shared filesystem) ---------
RESULT_BEGIN, RESULT_END = "pdcluster-bench-result-begin", "pdcluster-bench-result-end"


def ray_job_id() -> str | None:
    """The submission id when this process is the entrypoint of a Ray job (`ray job submit`)."""
    try:
        return json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", ""))["metadata"]["job_submission_id"]
    except (ValueError, KeyError, TypeError):
        return None


def emit_result(result: dict, name: str, job_id: str) -> None:
    """The saved result, on one line between markers in the job's log, for `--from-ray-job`."""
    print(f"{RESULT_BEGIN} {name}\n{json.dumps(result, separators=(',', ':'))}\n{RESULT_END} (to save it "
          f"elsewhere: pdcluster bench --from-ray-job {job_id} --ray-address http://HEAD:8265)", flush=True)


def extract_result(log: str) -> tuple[tuple[str, dict] | None, str]:
    """((file name, result) of the last complete result block in a job's log, or None; the log
    without its result blocks)."""
    lines = [line.rstrip("\r") for line in log.split("\n")]
    found, rest, i = None, [], 0
    while i < len(lines):
        if (lines[i].startswith(RESULT_BEGIN + " ") and i + 2 < len(lines)
                and lines[i + 2].startswith(RESULT_END)):
            try:
                found = lines[i].removeprefix(RESULT_BEGIN + " "), json.loads(lines[i + 1])
                i += 3
                continue
            except ValueError:                # cut short: not a result
                pass
        rest.append(lines[i])
        i += 1
    return found, "\n".join(rest)


def fetch_ray_job_result(a: argparse.Namespace) -> int:
    """Wait for the Ray job to end, read the result it logged, save it (and plots) here."""
    import time

    from ray.job_submission import JobSubmissionClient
    job = a.from_ray_job
    try:
        client = JobSubmissionClient(a.ray_address)
        status = client.get_job_status(job)
        if not status.is_terminal():
            print(f"pdcluster bench: waiting for Ray job {job} ({status.value}) to finish", flush=True)
            while not (status := client.get_job_status(job)).is_terminal():
                time.sleep(1.0)
        log = client.get_job_logs(job)
    except (ConnectionError, OSError) as e:
        raise RuntimeError(f"cannot reach Ray's job API at {a.ray_address or 'RAY_ADDRESS'}: {e}") from None
    except RuntimeError as e:                 # e.g. HTTP 404: no such job
        raise RuntimeError(f"Ray job {job}: {e}") from None
    found, rest = extract_result(log)
    if found is None:
        tail = "\n".join(log.strip().splitlines()[-5:])
        raise RuntimeError(f"Ray job {job} ({status.value}) logged no result; was it `pdcluster bench ... "
                           f"--save-result`? Its log ends:\n{tail}")
    print(rest.rstrip("\n"))                  # the job's own report
    name, result = found
    a.result_filename = a.result_filename or name
    path = save(result, a)
    plots = [] if a.no_plots else save_plots(result, path)
    done = (f": {result['completed']} completed, {result['failed']} failed" if "completed" in result else "")
    done += " (interrupted: partial)" if result.get("interrupted") else ""
    print(f"Ray job {job} ({status.value}){done}\nresult: {path}" + "".join(f"\nplot:   {p}" for p in plots))
    return 0


@contextlib.contextmanager
def _maybe_launch(a: argparse.Namespace):
    """The server's root URL: --base-url's, or, with --launch, a local `pdcluster serve` started
    for the run in a process (and process group) of its own, as a user runs one, and stopped
    after it as a user stops it (SIGINT: it drains, stops its own Ray, exits). Not served from
    this process: the router would share the client's interpreter, its parsing of every
    streamed chunk, and read slower than it serves (TPOT 4.41 ms against 2.12 ms at 14 req/s
    of 256 -> 48 tokens, BENCHMARKS.md, simulator fidelity)."""
    if not a.launch:
        yield (a.base_url or "http://127.0.0.1:8000").rstrip("/").removesuffix("/v1")
        return
    if a.base_url:
        raise ValueError("--launch starts its own server; drop --base-url")
    from cluster.flags import ENGINE_FLAGS
    from router.config import API_KEY_ENV
    from router.slo import SLOTargets
    # The launched server's SLO targets are the ones this run judges goodput by (its admission
    # refuses what would miss them), where --goodput names them; serve's defaults otherwise.
    given = loadgen.parse_goodput(a.goodput) if a.goodput else {}
    slo = SLOTargets(**{f"{k}_s": given[k] for k in ("ttft", "tpot") if k in given})
    sizes = (["--prefill", str(a.launch_prefill), "--decode", str(a.launch_decode)] if a.launch_mode == DISAGGREGATED
             else ["--workers", str(a.launch_workers)])
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", a.model or "tiny", "--mode", a.launch_mode,
            *sizes, "--port", "0", "--slo-ttft-ms", f"{slo.ttft_s * 1000:g}", "--slo-tpot-ms", f"{slo.tpot_s * 1000:g}"]
    for f in ENGINE_FLAGS:                       # the engine flags this run was given, passed on
        dest = f.flag.removeprefix("--").replace("-", "_")
        if f.flag not in LAUNCH_SKIPS and hasattr(a, dest):
            argv += [f.flag] if f.type is bool else [f.flag, str(getattr(a, dest))]
    env = dict(os.environ, **({API_KEY_ENV: a.api_key} if a.api_key else {}))
    what = (f"{a.launch_prefill} prefill + {a.launch_decode} decode" if a.launch_mode == DISAGGREGATED
            else f"{a.launch_workers} workers")
    print(f"pdcluster bench: launching a local cluster ({a.launch_mode}: {what}) on {a.model or 'tiny'!r}, SLO targets "
          f"TTFT {slo.ttft_s * 1000:g} ms, TPOT {slo.tpot_s * 1000:g} ms, in a process of its own", flush=True)
    from cluster.run.serve import die_with_parent
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=die_with_parent)
    lines: list[str] = []
    try:
        for line in proc.stdout:                 # (the port its own bind picked, from its banner)
            lines.append(line)
            if "OpenAI API at " in line:
                url = line.split("OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")
                break
        else:
            tail = "".join(lines[-20:]).strip()
            raise RuntimeError(f"the launched server ended before it served (exit {proc.wait()}):\n{tail}")

        def relay():
            """What it says after its banner (a worker lost, the controller's moves) comes out on
            our stderr, as it did when it served in this process; read on, so its pipe never fills."""
            banner = True
            for said in proc.stdout:
                banner = banner and said.startswith("  ")          # the banner's indented lines
                if not banner:
                    print(f"[serve] {said}", end="", file=sys.stderr, flush=True)
        threading.Thread(target=relay, daemon=True).start()
        yield url
    finally:
        stop_group(proc, signal.SIGINT, 120)


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 60.0) -> None:
    """Stop a process started in a session (process group) of its own, and all it started: `sig`
    to the group, then SIGKILL if it has not ended within `wait_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
