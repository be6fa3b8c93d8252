#!/usr/bin/env python
"""What request tracing costs on the served path (issue 31): `pdcluster serve` in its defaults
(1 prefill + 1 decode worker, exported `tiny`) with tracing off, and with
`--otlp-traces-endpoint` pointing at an OTLP/HTTP receiver in this process, under vLLM's
benchmark client.

    .venv/bin/python benchmarks/bench_tracing.py [--rounds 2] [--concurrency 64] [--num-prompts 1280]
        [--baseline-tree DIR] [--json OUT]

Each round starts a fresh server per configuration, in the order off, on, on, off, ... (so a drift
of the box's speed over the run falls on both alike), warms it with 64 requests at 8 clients, then
runs a closed loop of --concurrency clients over --num-prompts random prompts (128 -> 64 tokens,
ignore_eos). With --baseline-tree (a checkout of the commit before tracing, e.g. `git worktree
add out/notrace b98cc39`), that tree's server runs too, untraced: "off costs nothing" is off
against it. Printed: per run, completed requests per second, TTFT and TPOT medians, the
router's CPU per request (/proc of the serve process); then each configuration's mean and its
ratio to off. The receiver reads each export and answers 200 without decoding it (a collector
elsewhere does that work); it counts the bytes.
"""
from __future__ import annotations

import argparse
import http.server
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_admission import vllm_load  # noqa: E402
from benchmarks.bench_defaults import start, stop  # noqa: E402
from benchmarks.bench_event_path import wait_healthy  # noqa: E402
from benchmarks.common import process_cpu_seconds, write_json  # noqa: E402
from cluster.run.serve import free_port  # noqa: E402
from workers.checkpoint import export_builtin  # noqa: E402


class Sink:
    """An OTLP/HTTP endpoint that takes every export and keeps only its size."""

    def __init__(self):
        self.bytes = self.posts = 0
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers["Content-Length"])
                self.rfile.read(n)
                sink.bytes += n
                sink.posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def one_run(a, name: str, flags: list[str], tree: Path, ckpt: Path, work: Path) -> dict:
    port = free_port()
    log = work / f"{name}-server.log"
    proc = start(a, "pd", ckpt, port, log, flags, cwd=tree)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 600, log)
        vllm_load(a, base, ckpt, work, f"{name}-warm", 64, "inf", 8)
        before = process_cpu_seconds(proc.pid)
        r = vllm_load(a, base, ckpt, work, name, a.num_prompts, "inf", a.concurrency)
        after = process_cpu_seconds(proc.pid)
    finally:
        stop(proc)
    done = max(1, r["completed"] or 0)
    row = {"config": name.split("-")[0], "req_s": r["request_throughput"], "failed": r["failed"],
           "ttft_ms": r["median_ttft_ms"], "tpot_ms": r["median_tpot_ms"],
           "router_cpu_ms": 1000 * (after[0] - before[0]) / done}
    print(f"  {name:14s} {row['req_s']:6.2f} req/s, failed {row['failed']}, TTFT p50 {row['ttft_ms']:6.1f} ms, "
          f"TPOT p50 {row['tpot_ms']:5.1f} ms, router CPU {row['router_cpu_ms']:.2f} ms/request", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=1280)
    p.add_argument("--baseline-tree", type=Path, default=None, help="a checkout without tracing, run untraced too")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.input_len, a.output_len, a.seed, a.slo_ttft_ms, a.slo_tpot_ms, a.duration_s = 128, 64, 0, 1000, 100, 60
    sink = Sink()
    work = Path(tempfile.mkdtemp(prefix="bench_tracing-"))
    ckpt = export_builtin("tiny", work / "tiny")
    configs = [("off", [], ROOT), ("on", ["--otlp-traces-endpoint", sink.url], ROOT)]
    if a.baseline_tree is not None:
        configs.append(("baseline", [], a.baseline_tree.resolve()))
    print(f"pdcluster serve (defaults, 1P+1D, tiny), vLLM's client: closed {a.concurrency} over {a.num_prompts} "
          f"prompts, 128 -> 64; logs in {work}", flush=True)
    rows = []
    for k in range(a.rounds):
        for name, flags, tree in (configs if k % 2 == 0 else configs[::-1]):
            rows.append(one_run(a, f"{name}-{k}", flags, tree, ckpt, work))
    print(f"the receiver took {sink.posts} exports, {sink.bytes / 2**20:.1f} MiB")
    means = {c: {m: statistics.fmean(r[m] for r in rows if r["config"] == c) for m in ("req_s", "router_cpu_ms")}
             for c, _, _ in configs}
    print("| config | req/s (mean) | vs off | router CPU ms/request | vs off |\n|---|---|---|---|---|")
    for c, m in means.items():
        print(f"| {c} | {m['req_s']:.2f} | {m['req_s'] / means['off']['req_s']:.3f}x | {m['router_cpu_ms']:.2f} | "
              f"{m['router_cpu_ms'] / means['off']['router_cpu_ms']:.3f}x |")
    if a.json:
        write_json(a.json, {"rows": rows, "means": means, "exports": sink.posts, "export_bytes": sink.bytes})


if __name__ == "__main__":
    main()
