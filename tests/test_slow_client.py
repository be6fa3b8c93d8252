"""A client that stops reading its stream holds nothing for long and stalls nobody: a stream the
kernel's buffers hold runs to its end like any other; past them, the stream is ended after
`--client-stall-timeout-s` (its request aborted, its slot freed, a log line and
`request_errors_total{reason="slow_client"}`); a client reading normally meanwhile gets the
offline engine's output. Many idle connections do not keep the server from serving."""
from __future__ import annotations

import asyncio
import json
import socket
import types

import httpx
import pytest

from cluster.run.launcher import ClusterSpec
from cluster.run.serve import ServingCluster
from common import free_port, wait_for, wait_pools_clean
from router.app import ClientStream
from router.config import RouterConfig
from router.metrics import Metrics
from router.slo import SLOTargets
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

STALL_S = 1.0


@pytest.fixture(scope="module")
def cluster(ray_session):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    with ServingCluster(spec, RouterConfig(port=free_port(), client_stall_timeout_s=STALL_S)) as c:
        yield c


def non_reader(c: ServingCluster, max_tokens: int) -> socket.socket:
    """A streaming request on a socket with a small receive buffer that is never read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((c.host, c.port))
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "logprobs": 5}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def test_a_client_that_stops_reading_holds_no_slot_and_stalls_nobody(cluster):
    """On one machine the kernel takes up to a few MB of a connection's unread stream: a stream
    that fits runs to its end, its slot and KV freed as for any request."""
    c = cluster
    stuck = non_reader(c, max_tokens=600)
    try:
        wait_for(lambda: c.server.pending, lambda n: n == 1, 30, describe=lambda: "the request admitted")
        # Meanwhile a reading client is served, and correctly.
        prompt = [5, 6, 7, 8, 9]
        r = httpx.post(f"{c.base_url}/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        expected = LLMEngine(EngineConfig(model="tiny")).generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert r.json()["choices"][0]["token_ids"] == expected.token_ids
        wait_for(lambda: c.server.pending, lambda n: n == 0, 60, describe=lambda: "its slot freed")
        wait_pools_clean(c)
    finally:
        stuck.close()


class Blocked:
    """The ASGI side of a client that stopped reading: the response's head goes out, then no
    body chunk is ever taken."""

    def __init__(self):
        self.sent = []

    async def __call__(self, message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()
        self.sent.append(message)


def test_a_stream_whose_client_takes_nothing_is_ended_counted_and_closed():
    """Past the kernel's buffers the server's writes wait for the client: after the stall
    timeout the stream ends, its generator is closed (which aborts the request and frees its
    slot), and the metric counts it."""
    metrics = Metrics(SLOTargets())
    server = types.SimpleNamespace(client_stall_timeout_s=0.2, metrics=metrics)
    closed = asyncio.Event()

    async def chunks():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def run():
        send = Blocked()
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(ClientStream(chunks(), server)(scope, None, send), 10)
        return send.sent
    sent = asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert closed.is_set()
    assert metrics.registry.get_sample_value("pdcluster:request_errors_total", {"reason": "slow_client"}) == 1


def test_many_idle_connections_do_not_keep_the_server_from_serving(cluster):
    c = cluster
    idle = [socket.create_connection((c.host, c.port)) for _ in range(200)]
    try:
        r = httpx.post(f"{c.base_url}/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
    finally:
        for s in idle:
            s.close()
