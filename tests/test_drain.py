"""Graceful shutdown: a drain stops admitting (503, /health "draining"), lets the requests in
flight finish within its timeout, then ends the rest with an error event (never a cut stream)
and frees their blocks. (`pdcluster serve` drained by SIGTERM or Ctrl-C: test_serve_cli.)

Oracles: the offline engine's greedy output (a finished stream equals it, an ended one is a
prefix of it), the workers' own load reports (no block in use, nothing running), /proc.
"""
from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray

from cluster.run.launcher import ClusterSpec
from cluster.offline import generate
from cluster.run.serve import ServingCluster
from common import free_port, wait_for, wait_pools_clean

PROMPT = list(range(40, 90))
LONG = 2000                                  # far more than a drain's timeout lets the tiny model make


def body(max_tokens: int, stream: bool = True) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def offline(max_tokens: int) -> list[int]:
    return generate([{"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": True}], model="tiny")[0]["token_ids"]


def read_stream(url: str, max_tokens: int, first: threading.Event, headers: dict | None = None) -> list[str]:
    """Every SSE data line of one streamed completion; `first` is set at its first chunk. A
    connection cut before the response's end raises (httpx: incomplete chunked read)."""
    lines = []
    with (httpx.Client(timeout=120, headers=headers) as client,
          client.stream("POST", url, json=body(max_tokens)) as r):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line.removeprefix("data: "))
                first.set()
    return lines


def parse(lines: list[str]) -> tuple[list[int], str | None, dict | None]:
    """(token ids, the last finish_reason, the error event or None) of a stream that must end
    with [DONE]."""
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(x) for x in lines[:-1]]
    error = chunks.pop()["error"] if chunks and "error" in chunks[-1] else None
    assert all("error" not in c for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    return ids, (reasons[-1] if reasons else None), error


def one_pair(drain_timeout_s: float = 5) -> ServingCluster:
    engine = {"cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": 512}}
    spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=1, num_decode=1, engine=engine,
                       num_cpus_per_worker=0.5, lease_s=30)
    return ServingCluster(spec, port=free_port(), drain_timeout_s=drain_timeout_s)


def test_drain_lets_a_request_in_flight_finish_and_refuses_new_ones(ray_session):
    n = 64
    with one_pair() as c, ThreadPoolExecutor(1) as pool:
        url = f"{c.base_url}/completions"
        first = threading.Event()
        stream = pool.submit(read_stream, url, n, first)
        assert first.wait(60), "no first token"

        async def start():                   # on the server's loop: what is in flight, then drain
            in_flight = c.server.pending
            c.server.start_drain()
            return in_flight

        assert asyncio.run_coroutine_threadsafe(start(), c.loop).result(10) == 1, "the stream ended too soon"
        drained = asyncio.run_coroutine_threadsafe(c.server.drain(60), c.loop)

        refused = httpx.post(url, json=body(4, stream=False), timeout=30)
        assert refused.status_code == 503
        err = refused.json()["error"]
        assert err["code"] == "draining" and err["type"] == "server_error" and "shutting down" in err["message"]
        refused = httpx.post(f"{c.base_url}/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        health = httpx.get(f"{c.base_url.removesuffix('/v1')}/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "draining"

        ids, reason, error = parse(stream.result(120))
        assert error is None and reason == "length"
        assert ids == offline(n)
        assert drained.result(30) is True            # it ended as soon as the stream did, nothing ended
        assert c.server.pending == 0 and c.server.ended == 0
        wait_pools_clean(c)


def test_drain_timeout_ends_what_is_left_with_an_error_and_frees_its_blocks(ray_session):
    """ServingCluster.stop_serving (close()'s first half): the drain, then the HTTP server stops,
    and the process's collector gets back the heap the router kept out of its walks while it
    served (workers/heap.py: each full collection walked it, 150-220 ms with the loop stopped);
    the workers' processes, launched, froze theirs at start."""
    alive_before = [object()]
    with one_pair(drain_timeout_s=1) as c, ThreadPoolExecutor(2) as pool:
        assert not any(o is alive_before for o in gc.get_objects())      # frozen: in no generation collected
        for w in c.workers:                              # and each worker's process froze its own at start
            assert ray.get(w.handle.__ray_call__.remote(lambda worker: gc.get_freeze_count()), timeout=30) > 10_000
        url = f"{c.base_url}/completions"
        first = threading.Event()
        stream = pool.submit(read_stream, url, LONG, first)
        whole = pool.submit(httpx.post, url, json=body(LONG, stream=False), timeout=120)
        assert first.wait(60), "no first token"
        wait_for(lambda: c.server.pending, lambda n: n == 2)        # both in flight
        decode = c.workers[1].handle
        wait_for(lambda: ray.get(decode.stats.remote()).running, lambda n: n >= 1)   # decoding

        t0 = time.monotonic()
        c.stop_serving()
        took = time.monotonic() - t0
        assert 1.0 <= took < 8, took                 # the 1 s drain, then uvicorn's own shutdown
        assert c.server.ended == 2 and c.server.pending == 0
        assert any(o is alive_before for o in gc.get_objects()) and gc.get_freeze_count() == 0

        ids, reason, error = parse(stream.result(30))      # an error event, then [DONE]: never cut
        assert reason is None and error["code"] == "server_shutdown" and error["type"] == "server_error"
        assert "shut down before this request finished" in error["message"]
        assert 0 < len(ids) < LONG
        r = whole.result(30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text

        # The workers dropped both requests (aborted, not run to the end: that takes far longer
        # than this deadline) and every block came back.
        steps_at_end = ray.get(decode.stats.remote()).steps
        wait_pools_clean(c, deadline_s=10)
        assert ray.get(decode.stats.remote()).steps - steps_at_end < 50
        assert ids == offline(len(ids))
