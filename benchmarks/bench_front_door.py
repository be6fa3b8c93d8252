#!/usr/bin/env python
"""Bodies built to be slow against a default `pdcluster serve` (issue 26): how long each takes
to be answered and how long /health waits meanwhile, beside a benign body of the same size.

    .venv/bin/python benchmarks/bench_front_door.py [--size-mib 8] [--repeats 3] [--json OUT]

Starts `pdcluster serve` with its defaults (1 prefill + 1 decode, `tiny`) in a session of its
own, on a free port. For each shape (`slow_shapes`), near the body limit: the time from sending
the body to its answer (best of --repeats), its status, and the slowest /health answered while
it was being handled (asked over and over from another connection). The reference is a benign
body of the same size (a long unknown field, one token generated), in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.bench_routers import pdcluster, wait_healthy  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from cluster.loadtest.bench import stop_group  # noqa: E402
from cluster.run.ports import free_port  # noqa: E402


def slow_shapes(size: int) -> dict[str, tuple[bytes, int]]:
    """Bodies of about `size` bytes, each a shape that costs a naive front door time out of
    proportion to its size (a backtracking string regex, recursion, dict growth, big-number
    parsing, a tokenizer's work), and the status it must get."""
    head = b'{"model": "tiny", "prompt": "'
    n = size - 64
    return {
        "unclosed string of escaped quotes": (head + b'\\"' * (n // 2), 400),
        "unclosed string of escaped backslashes and quotes": (head + b'\\\\\\"' * (n // 4), 400),
        "100k-deep arrays": (b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        "deep objects to the limit": (b'{"a":' * (n // 5), 400),
        "200k keys": (b'{"model": "tiny", "prompt": "x", ' + b",".join(b'"k%d":1' % i for i in range(200_000))
                      + b"}", 400),
        "empty strings to the limit": (b'{"model": "tiny", "x": [' + b'"",' * (n // 3) + b'""]}', 400),
        "a huge integer": (b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * n + b"}", 400),
        "a huge float (valid: 1.0)": (b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "temperature": 0.'
                                      + b"9" * n + b"}", 200),
        "a huge exponent": (b'{"model": "tiny", "prompt": "x", "temperature": 1e' + b"9" * n + b"}", 400),
        "long unicode escapes": (head + b"\\u00e9" * (n // 6) + b'"}', 400),
        "a batch of long unicode prompts": (b'{"model": "tiny", "prompt": [' + b",".join(
            [b'"' + b"\\u00e9" * (n // 1536) + b'"'] * 256) + b"]}", 400),
        "chat with many long messages": (b'{"model": "tiny", "messages": [' + b",".join(
            [b'{"role": "user", "content": "' + b"a" * (n // 4096) + b'"}'] * 4000) + b"]}", 400),
    }


def benign_body(size: int) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1, "x": "a" * (size - 80)}).encode()


def timed_post(url: str, raw: bytes) -> tuple[int, float]:
    t0 = time.monotonic()
    r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=300)
    return r.status_code, time.monotonic() - t0


def health_while(root_url: str, work) -> tuple[object, list[float]]:
    """Runs `work()` in a thread and asks /health over and over meanwhile: (its result, each
    /health's latency in seconds)."""
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=root_url, timeout=300) as c:
        c.get("/health")                       # the connection up before timing
        running = pool.submit(work)
        latencies = []
        while not running.done() or not latencies:
            t0 = time.monotonic()
            c.get("/health")
            latencies.append(time.monotonic() - t0)
        return running.result(), latencies


def measure(root_url: str, raw: bytes, repeats: int) -> dict:
    runs = [health_while(root_url, lambda: timed_post(f"{root_url}/v1/completions", raw)) for _ in range(repeats)]
    return {"status": sorted({s for (s, _), _ in runs}), "answer_s": min(t for (_, t), _ in runs),
            "health_max_s": max(max(h) for _, h in runs), "health_n": sum(len(h) for _, h in runs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=float, default=8.0, help="body size (serve's default limit: 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    port = free_port()
    root_url = f"http://127.0.0.1:{port}"
    size = int(a.size_mib * 2**20) - 1024
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
        with open(log, "w") as out:
            proc = subprocess.Popen(pdcluster("serve", "--port", str(port)), stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, cwd=ROOT)
        try:
            wait_healthy(root_url, proc, log)
            results = {"benign body (one token generated)": {**measure(root_url, benign_body(size), a.repeats),
                                                              "want": 200}}
            for name, (raw, want) in slow_shapes(size).items():
                results[name] = {**measure(root_url, raw, a.repeats), "want": want}
        finally:
            stop_group(proc, signal.SIGTERM, 120)
    ref = results["benign body (one token generated)"]
    print(f"bodies of {size / 2**20:.2f} MiB against a default serve (best of {a.repeats}; /health: slowest)")
    print(f"{'shape':52s} {'status':>7s} {'answer':>8s} {'x benign':>8s} {'/health':>8s}")
    ok = True
    for name, r in results.items():
        good = r["status"] == [r["want"]]
        ok &= good
        print(f"{name:52s} {','.join(map(str, r['status'])):>7s} {r['answer_s'] * 1e3:6.0f}ms "
              f"{r['answer_s'] / ref['answer_s']:8.2f} {r['health_max_s'] * 1e3:6.0f}ms{'' if good else '  WRONG'}")
    if a.json:
        write_json(a.json, {"size_bytes": size, "repeats": a.repeats, "results": results})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
