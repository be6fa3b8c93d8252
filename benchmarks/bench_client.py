"""Is `pdcluster bench` itself the bottleneck? Drives an instant OpenAI-style streaming server
(a separate process, so that the two share the machine's cores the way a real run would)
as fast as the client can, and reports the request rate reached and the client's own CPU
time per request and per chunk (what it spends parsing and timestamping the stream).

    .venv/bin/python benchmarks/bench_client.py --num-requests 2000 --tokens 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402

from cluster.loadtest import loadgen  # noqa: E402
from cluster.loadtest.bench_data import BenchRequest  # noqa: E402
from cluster.run.serve import free_port  # noqa: E402


def serve(port: int) -> None:
    """The instant server: every token chunk is written as soon as the previous one is."""
    from aiohttp import web

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "instant", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for _ in range(n):
            await resp.write(b'data: {"choices":[{"index":0,"text":"tok ","finish_reason":null}]}\n\n')
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_ready(url: str, proc: subprocess.Popen, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the instant server exited")
        try:
            if httpx.get(url + "/v1/models", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the instant server did not come up")


def measure(url: str, num: int, tokens: int, concurrency: int | None) -> dict:
    target = loadgen.Target(url, "/v1/completions", "instant")
    requests = [BenchRequest("hello", 1, tokens) for _ in range(num)]
    cpu0 = time.process_time()
    results, duration = asyncio.run(loadgen.run_load(target, requests, max_concurrency=concurrency))
    cpu = time.process_time() - cpu0
    ok = sum(r.success for r in results)
    chunks = sum(r.output_len for r in results if r.success)
    return {"concurrency": concurrency, "requests": num, "ok": ok, "duration_s": duration,
            "request_rate": ok / duration, "chunks_per_s": chunks / duration,
            "client_cpu_s": cpu, "client_cpu_us_per_request": cpu / num * 1e6,
            "client_cpu_us_per_chunk": cpu / max(1, chunks) * 1e6,
            "client_bound_request_rate": num / cpu if cpu else float("inf")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=16, help="chunks (tokens) per response")
    p.add_argument("--concurrency", default="none,64", help="max-concurrency values to try; none = unbounded")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve is not None:
        serve(a.serve)
        return 0
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        measure(url, 200, a.tokens, None)                         # warm-up: connections, imports
        print(f"client against an instant server ({a.tokens} chunks per response, {os.cpu_count()} CPUs, "
              f"server in its own process)")
        print(f"{'concurrency':>12} {'req/s':>9} {'chunks/s':>10} {'client CPU/req':>15} "
              f"{'CPU/chunk':>10} {'client-bound req/s':>19} {'failed':>7}")
        for c in a.concurrency.split(","):
            conc = None if c.strip() == "none" else int(c)
            m = measure(url, a.num_requests, a.tokens, conc)
            print(f"{str(conc or 'unbounded'):>12} {m['request_rate']:>9.0f} {m['chunks_per_s']:>10.0f} "
                  f"{m['client_cpu_us_per_request']:>12.0f} us {m['client_cpu_us_per_chunk']:>7.1f} us "
                  f"{m['client_bound_request_rate']:>19.0f} {m['requests'] - m['ok']:>7}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
