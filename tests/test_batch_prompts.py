"""A list of prompts in one completions request (issue 14, item 4), against a real serving
cluster (1 prefill + 1 decode, `tiny`).

Each prompt of a batch runs as a request of its own; the answer has a choice per prompt,
`index` in prompt order, and the usage summed. The oracle for a batch is the same prompts sent
one by one to the same server, and the offline engine on the same token ids. Failure and
admission, which a live cluster cannot be made to show on demand, run against a `Server`
whose dispatcher is a stand-in.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httpx
import openai
import pytest

from common import VOCAB, nothing_left_running, sse_events, wait_for
from router.app import Server, build_app
from router.dispatch import RequestFailed, TokenDelta
from router.metrics import Metrics
from router.protocol import MAX_PROMPTS
from workers.checkpoint import load_tokenizer
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

MODEL = "tiny"
MAX_TOKENS = 8
TEXTS = ["Hello", "The quick brown fox", "a", "Once upon a time, in a land far away,"]
TOKEN_IDS = [[5, 6, 7], list(range(40, 90)), [200] * 17, [1]]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0, timeout=120) as c:
        yield c


def offline_greedy(prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=MODEL))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]


# -- a batch equals its prompts one by one ------------------------------------------------------
@pytest.mark.parametrize("prompts", [TEXTS, TOKEN_IDS], ids=["strings", "token_ids"])
def test_a_batch_equals_its_prompts_one_by_one(cluster, oai, prompts):
    extra = {"ignore_eos": True}
    batch = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body=extra)
    singles = [oai.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra) for p in prompts]
    assert [c.index for c in batch.choices] == list(range(len(prompts)))
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert [c.token_ids for c in batch.choices] == [s.choices[0].token_ids for s in singles]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == len(prompts) * MAX_TOKENS
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens

    ids = [cluster.server.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    assert [c.token_ids for c in batch.choices] == offline_greedy(ids)
    nothing_left_running(cluster)


def test_a_mixed_batch_and_a_batch_of_one(client):
    """Strings and token-id lists in one batch; a batch of one answers as its prompt alone."""
    mixed = client.post("completions", json={"model": MODEL, "prompt": [TEXTS[0], TOKEN_IDS[0]], **GREEDY})
    one = [client.post("completions", json={"model": MODEL, "prompt": [p], **GREEDY}) for p in (TEXTS[0], TOKEN_IDS[0])]
    alone = client.post("completions", json={"model": MODEL, "prompt": TEXTS[0], **GREEDY})
    assert mixed.status_code == 200 and all(r.status_code == 200 for r in one), (mixed.text, [r.text for r in one])
    assert [c["token_ids"] for c in mixed.json()["choices"]] == [r.json()["choices"][0]["token_ids"] for r in one]
    assert one[0].json()["choices"] == alone.json()["choices"]


def test_a_streamed_batch_equals_the_whole_one(cluster, client):
    body = {"model": MODEL, "prompt": TEXTS + TOKEN_IDS, **GREEDY}
    whole = client.post("completions", json=body).json()
    r = client.post("completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
    *token_chunks, usage_chunk = chunks
    n = len(body["prompt"])
    texts, ids, finishes = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for c in token_chunks:
        assert c["id"] == token_chunks[0]["id"] and len(c["choices"]) == 1, c
        choice = c["choices"][0]
        i = choice["index"]
        texts[i] += choice["text"]
        ids[i] += choice["token_ids"]
        if choice["finish_reason"] is not None:
            finishes[i].append(choice["finish_reason"])
    assert texts == [c["text"] for c in whole["choices"]]
    assert ids == [c["token_ids"] for c in whole["choices"]]
    assert finishes == [["length"]] * n                   # each index ends exactly once
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == n * MAX_TOKENS
    nothing_left_running(cluster)


def test_every_prompt_of_a_seeded_batch_uses_the_seed(client):
    """vLLM's meaning: the request's seed is each prompt's seed, so a prompt given twice in one
    batch samples the same tokens twice, and the same as it does alone with that seed."""
    sampled = {"max_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    p, q = TOKEN_IDS[1], TOKEN_IDS[2]
    batch = client.post("completions", json={"model": MODEL, "prompt": [p, q, p], **sampled}).json()
    alone = [client.post("completions", json={"model": MODEL, "prompt": x, **sampled}).json() for x in (p, q)]
    got = [c["token_ids"] for c in batch["choices"]]
    assert got == [alone[0]["choices"][0]["token_ids"], alone[1]["choices"][0]["token_ids"], got[0]]


# -- refusals -------------------------------------------------------------------------------------
def test_a_batch_over_the_limit_gets_400(cluster, client):
    r = client.post("completions", json={"model": MODEL, "prompt": ["a"] * (MAX_PROMPTS + 1), **GREEDY})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(MAX_PROMPTS) in err["message"], err
    assert cluster.server.pending == 0


@pytest.mark.parametrize("prompt, index, param", [
    (["fine", ""], 1, "prompt"),                                    # empty
    ([[1, 2], []], 1, "prompt"),
    ([[1, 2], [3, VOCAB]], 1, "prompt"),                            # outside the vocabulary
    ([[-1], [1, 2]], 0, "prompt"),
    (["fine", 5], 1, "prompt"),                                     # not a prompt
    (["fine", "also fine", [1, "x"]], 2, "prompt"),
    (["fine", None], 1, "prompt"),
], ids=lambda x: json.dumps(x)[:30] if isinstance(x, list) else str(x))
def test_a_batch_with_one_bad_prompt_gets_400_naming_its_index(cluster, client, prompt, index, param):
    r = client.post("completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 200})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and f"prompt[{index}]" in err["message"], err
    assert cluster.server.pending == 0


def test_each_prompt_of_a_batch_is_held_to_the_context_length(cluster, client):
    context = cluster.server.max_model_len
    for prompt, param in ((["fine", "x" * context], "prompt"),                 # the prompt alone is too long
                          ([[1], [2] * (context - 100)], "max_tokens")):       # with its max_tokens
        r = client.post("completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 200})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and "prompt[1]" in err["message"], err


# -- a client that goes away ----------------------------------------------------------------------
def answer(s: socket.socket) -> str:
    """Whatever the server has written back so far (a refusal, say), without waiting for more."""
    s.setblocking(False)
    try:
        return s.recv(65536).decode(errors="replace")
    except BlockingIOError:
        return "no answer yet"
    finally:
        s.setblocking(True)


# Long enough to be running when the client leaves, short enough that all four fit the decode
# worker's cache at once (api_cluster: 256 blocks of 16; 4 x 1000 tokens filled it, and a prompt
# that waited for room started only after the others ended: CI's run saw none running).
# Long enough that no prompt can end while the client looks: at 600 tokens a CI run's stream had
# ended on the server (its chunks all in the socket's buffers) before the client, its thread
# starved on a busy box, had read the first chunk of each prompt.
LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_leaves_nothing_of_its_batch_running(cluster, client, stream):
    prompts = TOKEN_IDS
    body = {"model": MODEL, "prompt": prompts, "stream": stream, **LONG}
    registry = cluster.server.metrics.registry

    def disconnects() -> float:
        return registry.get_sample_value("pdcluster:request_errors_total", {"reason": "client_disconnect"}) or 0.0
    before = disconnects()
    if stream:
        with client.stream("POST", "completions", json=body) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():                 # until every prompt has sent tokens
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    assert choice["finish_reason"] is None, choice
                    seen.add(choice["index"])
                    if len(seen) == len(prompts):
                        break
            assert cluster.server.pending == len(prompts)
        # Leaving the block unread closes the connection.
    else:
        host, port = httpx.URL(cluster.base_url).host, httpx.URL(cluster.base_url).port
        raw = json.dumps(body).encode()
        with socket.create_connection((host, port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
            wait_for(lambda: cluster.server.pending, lambda n: n == len(prompts), describe=lambda: answer(s))
            # until all of them decode on the workers
            wait_for(lambda: registry.get_sample_value("pdcluster:router_requests_running"),
                     lambda n: n == len(prompts))
    nothing_left_running(cluster)
    # Each prompt was cancelled, none ran on to its end (which nothing_left_running alone allows).
    assert disconnects() - before == len(prompts)


# -- a failed prompt, and admission, with a stand-in dispatcher ------------------------------------
class StandInDispatcher:
    """Generates `tokens` tokens per request, one per event; a request whose prompt is FAIL
    fails (as one does after its resumes run out) after its first token. Counts the
    generations still running."""
    FAIL = [99]

    def __init__(self, tokens: int = 50):
        self.metrics, self.tokens, self.live = Metrics(), tokens, 0
        self.release = asyncio.Event()

    async def generate(self, req):
        self.live += 1
        try:
            for k in range(self.tokens):
                if k == 1 and req.prompt_token_ids == self.FAIL:
                    raise RequestFailed("no worker could finish it")
                if k == 2:
                    await self.release.wait()          # the others stay in flight until released
                await asyncio.sleep(0)
                last = k == self.tokens - 1
                yield TokenDelta([65 + k % 26], last, "length" if last else None)
        finally:
            self.live -= 1


def stand_in_server(**kw) -> tuple[Server, StandInDispatcher]:
    dispatcher = StandInDispatcher()
    return Server(dispatcher, load_tokenizer(MODEL), MODEL, 4096, **kw), dispatcher


async def settled(condition, deadline_s: float = 10.0) -> bool:
    """Whether condition() holds within the deadline, polled between the loop's other work."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not condition() and loop.time() < end:
        await asyncio.sleep(0.01)
    return condition()


async def post(server: Server, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://router/v1") as c:
        return await c.post("completions", json=body)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_one_failed_prompt_fails_the_whole_batch(stream):
    async def go():
        server, dispatcher = stand_in_server()
        r = await post(server, {"model": MODEL, "prompt": [[1], StandInDispatcher.FAIL, [2]], "max_tokens": 50,
                                "stream": stream})
        # The other prompts' generations end by being cancelled, not by the loop closing.
        return r, server, dispatcher, await settled(lambda: dispatcher.live == 0)
    r, server, dispatcher, none_left = asyncio.run(go())
    if stream:
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
        assert events[-2]["error"]["code"] == "service_unavailable", events[-2]
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2]), events
    else:
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
    assert none_left and server.pending == 0                             # the other prompts were aborted
    assert server.metrics.registry.get_sample_value("pdcluster:request_errors_total",
                                                    {"reason": "worker_failure"}) == 1


def test_a_batch_is_admitted_whole_and_counts_as_its_prompts():
    async def go():
        server, dispatcher = stand_in_server(max_pending=4)
        dispatcher.release.set()
        server.pending = 2                                                # two requests in flight
        refused = await post(server, {"model": MODEL, "prompt": [[1], [2], [3]], "max_tokens": 3})
        too_big = await post(server, {"model": MODEL, "prompt": [[1]] * 5, "max_tokens": 3})
        fits = await post(server, {"model": MODEL, "prompt": [[1], [2]], "max_tokens": 3})
        return refused, too_big, fits, server
    refused, too_big, fits, server = asyncio.run(go())
    assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "prompt", too_big.text
    assert fits.status_code == 200 and [c["index"] for c in fits.json()["choices"]] == [0, 1], fits.text
    assert server.pending == 2


def post_scope(body: bytes, spec: str) -> dict:
    """An ASGI scope of a POST of `body` to /v1/completions."""
    return {"type": "http", "asgi": {"spec_version": spec, "version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("router", 80),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_stream_whose_client_is_gone_before_its_head_gives_its_slots_back(spec):
    # The client is gone before the response's head goes out (its send fails at once): the
    # stream's generator never starts, and its admitted prompts still leave `pending` (ASGI
    # 2.3 servers also say so through receive(); 2.4 ones only through a failing send).
    body = json.dumps({"model": MODEL, "prompt": [[1], [2]], "max_tokens": 5, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    scope = post_scope(body, spec)

    async def go():
        server, dispatcher = stand_in_server()
        with contextlib.suppress(Exception):            # the failed send, as the server sees it
            await build_app(server)(scope, receive, send)
        return server, dispatcher
    server, dispatcher = asyncio.run(go())
    assert server.pending == 0 and dispatcher.live == 0


def test_a_stream_sends_a_chunk_per_event_and_its_last_with_the_usage_and_done():
    """Each send is a write to the client's socket, a syscall that wakes the client (the
    router's largest cost per token): a stream sends its head, one chunk per event, then its
    last chunk, the usage and [DONE] in one, then the end of the body."""
    body = json.dumps({"model": MODEL, "prompt": [[1], [2]], "max_tokens": 50, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():                              # the client stays to the end
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    async def go():
        server, dispatcher = stand_in_server()
        dispatcher.release.set()
        await build_app(server)(post_scope(body, "2.3"), receive, send)
        return server, dispatcher
    server, dispatcher = asyncio.run(go())
    assert server.pending == 0 and dispatcher.live == 0
    head, *bodies, end = sent
    assert head["type"] == "http.response.start" and head["status"] == 200
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}
    per_send = [sse_events(m["body"].decode()) for m in bodies]
    tokens = 2 * dispatcher.tokens                    # both prompts' events
    assert [len(e) for e in per_send] == [1] * (tokens - 1) + [3]
    last, usage, done = per_send[-1]
    assert last["choices"][0]["finish_reason"] == "length" and usage["choices"] == [] and done == "[DONE]"
    assert usage["usage"]["completion_tokens"] == tokens
