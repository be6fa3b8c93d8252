"""The front door under hostile request bodies (issue 14): property-based fuzzing of both POST
endpoints of a real serving cluster (1 prefill + 1 decode, `tiny`), and each limit on its own.

The fuzz contract: every body, whatever it holds (hostile values of known fields, unknown
fields, deep nesting, raw garbage), is answered 2xx, or 4xx with OpenAI's error JSON; never a
5xx, and never a dropped connection: all bodies go through one keep-alive connection, and the
test fails on any transport error or on a second connection. Afterwards the server still
serves the offline engine's greedy tokens. Hypothesis runs derandomized with no example
database, so CI sends the same bodies every time; the valid bodies it builds ask for at most 4
tokens.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from benchmarks.bench_front_door import benign_body, health_while, slow_shapes, timed_post
from common import VOCAB, metric_sum, nothing_left_running, sse_events, wait_for
from router.app import Server
from router.dispatch import RequestFailed
from router.protocol import MAX_JSON_DEPTH, APIError
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import MAX_STOP, MAX_STOP_LEN, SamplingParams

MODEL = "tiny"
MiB = 2**20
EXAMPLES = 1000                  # bodies per endpoint (2,000 took a minute of the CI budget)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck))


def check_answer(r: httpx.Response) -> None:
    """2xx with a whole answer, or 4xx with OpenAI's error JSON."""
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
        assert err["param"] is None or isinstance(err["param"], str), err
        return
    assert r.status_code == 200, r.text[:500]
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), chunks
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:500]


class OneConnection:
    """Posts through one keep-alive connection and fails if the server ever closed it (httpx
    would silently open another: the local port tells)."""

    def __init__(self, client: httpx.Client):
        self.client, self.port, self.sent, self.status = client, None, 0, {}

    def post(self, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
        r = self.client.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})
        port = r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
        self.port = self.port or port
        assert port == self.port, f"after {self.sent} bodies the server closed the connection"
        self.sent += 1
        self.status[r.status_code] = self.status.get(r.status_code, 0) + 1
        return r


# -- hostile values -------------------------------------------------------------------------
EXTREME_INTS = [10**30, -10**30, 2**63, 2**63 - 1, -2**63, -2**63 - 1, 2**64, 2**31, -2**31 - 1, 10**4000]
ODD_STRINGS = ["", "\ud800", "\x00", "\ufffd" * 3, "🙂" * 40, "text", "none", "auto", "required", MODEL, "a" * 3000]


def nest(depth: int):
    out = []
    for _ in range(depth):
        out = [out]
    return out


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(EXTREME_INTS),
                    st.floats(), st.text(max_size=20), st.sampled_from(ODD_STRINGS))
hostile = st.one_of(
    st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                    max_size=4), max_leaves=12),
    st.integers(0, 5000).map(lambda n: [1] * n),                 # long lists
    st.integers(MAX_JSON_DEPTH - 3, 200).map(nest),              # deep nesting about the limit
    st.lists(st.integers(-1, VOCAB + 1), max_size=40),           # token ids about the vocabulary
    st.lists(st.text(max_size=8), max_size=40),                  # stop strings
    st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=5),   # logit_bias-like
)

SHARED = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "best_of", "echo", "suffix",
          "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p",
          "include_stop_str_in_output", "stream",
          "stream_options", "priority", "user", "metadata", "response_format", "tools", "tool_choice",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
FIELDS = {"completions": ["prompt"] + SHARED, "chat/completions": ["messages"] + SHARED}

texts = st.text(min_size=1, max_size=24)
prompts = st.one_of(texts, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(lambda p: [p]))
contents = st.one_of(texts, st.lists(texts.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": contents}), min_size=1, max_size=3)


def valid_bodies(endpoint: str):
    """Cheap valid bodies: at most 4 tokens, sampled or greedy, streamed or not."""
    first = {"prompt": prompts} if endpoint == "completions" else {"messages": messages}
    return st.fixed_dictionaries({"model": st.just(MODEL), **first, "max_tokens": st.integers(1, 4)}, optional={
        "temperature": st.sampled_from([0, 0.5, 1.0]), "top_p": st.sampled_from([0.5, 1]),
        "top_k": st.sampled_from([-1, 0, 5]), "seed": st.integers(-2**63, 2**63 - 1), "stream": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "logprobs": st.booleans()
        if endpoint == "chat/completions" else st.integers(0, 5), "ignore_eos": st.booleans()})


# Built once: a strategy built inside a draw is validated again on every example.
VALID = {ep: valid_bodies(ep) for ep in FIELDS}
MUTATED = {ep: st.dictionaries(st.sampled_from(FIELDS[ep]), hostile, min_size=1, max_size=3) for ep in FIELDS}
UNKNOWN = {ep: st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k, ep=ep: k not in FIELDS[ep]),
                               hostile, min_size=1, max_size=2) for ep in FIELDS}
REQUIRED = {ep: st.sampled_from(["model", FIELDS[ep][0]]) for ep in FIELDS}
GARBAGE = st.binary(max_size=300)
choices = st.integers(0, 19)
depths = st.integers(MAX_JSON_DEPTH, 5000)


@st.composite
def payloads(draw, endpoint: str) -> bytes:
    """Mostly a valid body with 1 to 3 known fields given hostile values, maybe an unknown field
    or a required one missing; sometimes a valid body, raw garbage or broken JSON."""
    kind = draw(choices)
    if kind == 0:
        return draw(GARBAGE)
    body = draw(VALID[endpoint])
    if kind == 1:                                   # broken JSON: cut short, or nested past the limit
        raw = json.dumps(body).encode()
        depth = draw(depths)
        broken = [raw[:draw(st.integers(0, len(raw) - 1))], raw[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}",
                  b"[" * depth, b'{"model": ' + b"{" * depth]
        return broken[draw(st.integers(0, len(broken) - 1))]
    if kind > 3:                                    # a tenth stay valid (they generate: the slow ones)
        body.update(draw(MUTATED[endpoint]))
    if draw(choices) < 4:
        body.update(draw(UNKNOWN[endpoint]))
    if draw(choices) < 2:
        body.pop(draw(REQUIRED[endpoint]), None)
    return json.dumps(body).encode()                # NaN and Infinity as Python writes them


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_fuzzed_bodies_get_2xx_or_openai_4xx_on_one_connection(client, endpoint):
    conn = OneConnection(client)

    @FUZZ
    @given(payloads(endpoint))
    def one(raw: bytes):
        check_answer(conn.post(endpoint, raw))

    one()
    assert conn.sent >= EXAMPLES, conn.sent
    ok = sum(n for s, n in conn.status.items() if s < 300)
    # Hypothesis draws small choices often (kind 0: garbage; a required field dropped), so about
    # one body in twenty is served: at least one in forty must be.
    assert ok >= EXAMPLES // 40 and conn.status.get(400, 0) >= EXAMPLES // 4, conn.status


# -- each limit on its own ------------------------------------------------------------------
def body_for(endpoint: str, **fields) -> dict:
    first = {"prompt": "Hello"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    return {"model": MODEL, **first, "max_tokens": 1, **fields}


REFUSED = [   # (fields, the param the error names)
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"seed": 10**30}, "seed"), ({"seed": 1.5}, "seed"),
    ({"priority": 10**30}, "priority"), ({"priority": 2**31}, "priority"), ({"priority": True}, "priority"),
    ({"max_tokens": 10**30}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": 10**30}, "top_k"), ({"logprobs": 21}, "logprobs"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 10**400}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"top_p": float("inf")}, "top_p"),
    ({"stop": ["x"] * (MAX_STOP + 1)}, "stop"), ({"stop": "x" * (MAX_STOP_LEN + 1)}, "stop"), ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"), ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stream": 1}, "stream"), ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"), ({"model": 5}, "model"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 10**6}, "min_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"), ({"logit_bias": {"1": "5"}}, "logit_bias"),
    # asks for behaviour this server does not implement
    ({"echo": 1}, "echo"), ({"bad_words": "x"}, "bad_words"), ({"bad_words": [""]}, "bad_words"), ({"n": 65}, "n"), ({"n": True}, "n"), ({"best_of": 0}, "best_of"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"), ({"guided_choice": [1]}, "guided_choice"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"logit_bias": [1] * 1000}, "logit_bias"),
]
ACCEPTED = [{"seed": 2**63 - 1}, {"seed": -2**63}, {"priority": -5}, {"echo": False}, {"logit_bias": {}},
            {"logit_bias": None}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"best_of": 1}, {"n": 1}, {"n": 2}, {"n": 2, "best_of": 3},
            {"suffix": ""}, {"user": "someone"}, {"metadata": {"k": "v"}}, {"response_format": {"type": "text"}},
            {"tools": []}, {"tool_choice": "none"}, {"some_new_field": {"a": [1, 2, 3]}}, {"stop": ["x"] * MAX_STOP},
            {"stop_token_ids": [VOCAB - 1]}, {"temperature": 10**30, "seed": 1},
            {"logit_bias": {"1": 5, str(VOCAB - 1): -100}}, {"presence_penalty": 0.5}, {"frequency_penalty": -1},
            {"repetition_penalty": 1.2}, {"min_p": 0.1, "temperature": 1.0}, {"min_tokens": 2, "max_tokens": 4},
            {"include_stop_str_in_output": True, "stop": ["e"]}, {"response_format": {"type": "json_object"}},
            {"guided_regex": "[a-z]+"}, {"guided_choice": ["x", "y"]}, {"bad_words": ["e", "the end"]}, {"structured_outputs": {"json": {"type": "object"}}}]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("fields, param", REFUSED, ids=lambda x: json.dumps(x)[:40] if isinstance(x, dict) else x)
def test_a_value_past_a_limit_gets_400_naming_its_field(client, endpoint, fields, param):
    r = client.post(endpoint, content=json.dumps(body_for(endpoint, **fields)),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    check_answer(r)
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and len(err["message"]) < 400, err


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("fields", ACCEPTED, ids=lambda x: json.dumps(x)[:40])
def test_neutral_and_informational_values_are_accepted(client, endpoint, fields):
    r = client.post(endpoint, json=body_for(endpoint, **fields))
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"prompt": [VOCAB]}, "prompt"), ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
])
def test_prompts_and_messages_are_checked(client, endpoint, fields, param):
    r = client.post(endpoint, content=json.dumps(body_for(endpoint, **fields)),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]


@pytest.mark.parametrize("raw, says", [
    (b'{"model": "tiny", "prompt": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
     f"deeper than {MAX_JSON_DEPTH} levels"),
    (b"[" * 100_000, "deeper than"),
    (b'{"model": "tiny", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b'["model"]', "must be a JSON object"),
])
def test_bad_json_gets_400(client, raw, says):
    r = client.post("completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text[:300]


def test_nesting_at_the_limit_is_parsed(client):
    inner = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)       # the body's object is level 1
    r = client.post("completions", content=b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "x": ' + inner + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]


# -- the body's size ------------------------------------------------------------------------
def test_an_oversized_body_gets_413_and_the_connection_serves_on(client, cluster):
    limit = cluster.cfg.max_body_bytes
    assert limit == 8 * MiB                                       # the default
    conn = OneConnection(client)
    big = b'{"model": "tiny", "prompt": "' + b"a" * (60 * MiB) + b'"}'
    for content in (big, iter([big[i:i + MiB] for i in range(0, len(big), MiB)])):   # Content-Length, chunked
        r = conn.post("completions", content)
        assert r.status_code == 413, r.text[:300]
        check_answer(r)
        assert str(limit) in r.json()["error"]["message"] and "--max-body-mib" in r.json()["error"]["message"]
        check_answer(conn.post("completions", json.dumps(body_for("completions")).encode()))


class FakeRequest(Request):
    """A request whose body arrives in chunks; counts how many the server pulled."""

    def __init__(self, chunks: list[bytes], content_length: int | None):
        headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
        self.pulled = 0

        async def receive():
            self.pulled += 1
            i = self.pulled - 1
            return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

        super().__init__({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


@pytest.mark.parametrize("declared", [None, 100 * MiB])
def test_the_body_is_never_buffered_past_the_limit(declared):
    """A declared length over the limit is refused before any read; a chunked body as soon as it
    passes the limit (the server holds at most the limit and one chunk)."""
    server = SimpleNamespace(max_body_bytes=MiB, body_timeout_s=60.0)
    req = FakeRequest([b"x" * (64 * 1024)] * 1600, declared)          # 100 MiB
    with pytest.raises(APIError) as e:
        asyncio.run(Server._read(server, req))
    assert e.value.status == 413 and e.value.code == "request_too_large"
    assert req.pulled == (0 if declared else 17), req.pulled
    small = FakeRequest([b"{}", b""], 2)
    assert asyncio.run(Server._read(server, small)) == b"{}"


# -- afterwards ----------------------------------------------------------------------------
def test_after_the_fuzzing_the_server_serves_greedy_tokens(client):
    prompts = [[5, 6, 7], list(range(40, 90)), [200] * 17]
    engine = LLMEngine(EngineConfig(model=MODEL))
    want = [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    got = []
    for p in prompts:
        r = client.post("completions", json={"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True})
        assert r.status_code == 200, r.text[:300]
        got.append(r.json()["choices"][0]["token_ids"])
    assert got == want


# -- /openapi.json describes the bodies the server checks -----------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_openapi_documents_the_request_bodies_and_each_bound_is_the_one_enforced(cluster, client, endpoint):
    # Every bound the schema states is the server's: one past it is a 400 naming the field.
    doc = httpx.get(cluster.base_url.removesuffix("/v1") + "/openapi.json", timeout=30).json()
    body = doc["paths"][f"/v1/{endpoint}"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    required = {"completions": {"model", "prompt"}, "chat/completions": {"model", "messages"}}[endpoint]
    assert set(body["required"]) == required and required <= set(body["properties"])
    checked = 0
    for name, prop in body["properties"].items():
        past = []
        if prop.get("type") == "integer":
            past = [prop["maximum"] + 1, prop["minimum"] - 1]
        elif prop.get("type") == "array" and "maxItems" in prop:
            past = [[1] * (prop["maxItems"] + 1)]
        for value in past:
            sent = body_for(endpoint, **{name: value, **({"logprobs": True} if name == "top_logprobs" else {})})
            if name == "max_completion_tokens":
                del sent["max_tokens"]                  # which would win
            r = client.post(endpoint, json=sent)
            # max_completion_tokens is max_tokens' other name: its errors name max_tokens.
            want = "max_tokens" if name == "max_completion_tokens" else name
            assert r.status_code == 400 and r.json()["error"]["param"] == want, (name, value, r.text[:200])
            checked += 1
    assert checked >= 15
    for name in required:                       # and a required field left out
        r = client.post(endpoint, json={k: v for k, v in body_for(endpoint).items() if k != name})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text[:200])


# -- shapes built to be slow (issue 26) ----------------------------------------------------------
def test_bodies_built_to_be_slow_are_refused_as_fast_as_a_benign_body_and_health_answers_meanwhile(cluster):
    """Every slow shape (benchmarks/bench_front_door.py's), near the body limit, is answered
    about as fast as a benign body of the same size is served, and /health answers meanwhile.
    The bounds are 1 s and 250 ms, or three times the benign body's, whichever is larger: the
    issue's 100 ms for /health holds on a quiet machine (BENCHMARKS.md), but here the client's
    threads share the router's process and GIL, and a busy CI box stretches every C call. A
    shape past a bound is tried once more and judged on that try: a slow shape is slow every
    time, while a pause of the whole process (a collection of the test process's heap: a CI run
    saw one /health take 0.6 s once) comes once."""
    url = f"{cluster.base_url}/completions"
    root = cluster.base_url.removesuffix("/v1")
    size = cluster.cfg.max_body_bytes - 1024
    (status, benign_s), benign_health = health_while(root, lambda: timed_post(url, benign_body(size)))
    assert status == 200
    slowest_answer, slowest_health = max(1.0, 3 * benign_s), max(0.25, 3 * max(benign_health))
    for name, (raw, want) in slow_shapes(size).items():
        assert len(raw) <= cluster.cfg.max_body_bytes, name
        for _ in range(2):
            (status, took), health = health_while(root, lambda: timed_post(url, raw))
            assert status == want, name
            if took <= slowest_answer and max(health) <= slowest_health:
                break
        assert took <= slowest_answer, (name, took, benign_s)
        assert max(health) <= slowest_health, (name, max(health), benign_health)


def test_only_json_bodies_are_read(client):
    """A web page may POST text/plain or a form to a server on localhost without asking first:
    those get 415, as does a body with no Content-Type."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = client.post("completions", content=body, headers={"content-type": kind} if kind else {})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
    r = client.post("completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def read_response(s: socket.socket) -> bytes:
    """A whole HTTP response off a raw socket: its head, then Content-Length bytes of body (it
    may come in several segments), or what came before the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_body_that_does_not_arrive_in_time_gets_408_and_counts_no_longer(cluster):
    """A client that sends its head and then trickles (or stops) is answered 408 at the body
    deadline, and no longer counts among the bodies being validated."""
    server = cluster.server
    old = server.body_timeout_s
    server.body_timeout_s = 2.0                # long enough to be seen waiting on a busy box
    host, port = cluster.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\":")
            wait_for(lambda: server.validation.held, lambda n: n == 1, deadline_s=30)
            reply = read_response(s)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"request_timeout" in reply
        wait_for(lambda: server.validation.held, lambda n: n == 0, deadline_s=30)
    finally:
        server.body_timeout_s = old


def test_bodies_past_the_reading_bound_wait_in_line(cluster):
    """Past `max_validating` bodies being read at once, a new request waits in line, unread (a
    burst of clients is never refused for arriving together), and is served when a place frees;
    past `max_pending` waiting, 429 at once; a body the head already refuses does not wait."""
    server = cluster.server
    old = server.max_validating, server.max_pending
    server.max_validating = 2
    host, port = cluster.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    socks, body = [], {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    try:
        for _ in range(2):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            socks.append(s)
        wait_for(lambda: server.validation.held, lambda n: n == 2, deadline_s=30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, f"{cluster.base_url}/completions", json=body, timeout=60)
            wait_for(lambda: len(server.validation.waiters), lambda n: n == 1, deadline_s=30)
            # What the head alone refuses never takes a place in the line.
            r = httpx.post(f"{cluster.base_url}/completions", content=b"{}", timeout=60,
                           headers={"content-type": "text/plain"})
            assert r.status_code == 415 and len(server.validation.waiters) == 1, r.text
            server.max_pending = 1                          # the line is full: the next one is refused
            r = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=60)
            assert r.status_code == 429 and r.headers["retry-after"], r.text
            server.max_pending = old[1]
            socks.pop().close()                             # a place frees: the one in line is read
            assert waiting.result(60).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.max_validating, server.max_pending = old
    wait_for(lambda: server.validation.held, lambda n: n == 0, deadline_s=30)
    r = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_past_its_deadline_ends_with_an_error_and_frees_everything(cluster, stream):
    """--request-timeout-s: a request still running at its deadline ends with an OpenAI error (504,
    or an error event then [DONE] in a stream), is aborted on the workers (every block back), and
    the server serves on."""
    server = cluster.server
    old = server.request_timeout_s
    server.request_timeout_s = 1.0
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 200_000 // 100, "ignore_eos": True, "stream": stream}
    try:
        body["max_tokens"] = cluster.server.max_model_len - 8
        r = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=120)
    finally:
        server.request_timeout_s = old
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout", events[-3:]
    else:
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    assert metric_sum(cluster, "pdcluster:request_errors_total", reason="request_timeout") >= 1
    nothing_left_running(cluster)
    r = httpx.post(f"{cluster.base_url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_a_5xx_names_no_worker_and_no_cause(cluster):
    """A request that cannot be served (here: its attempts run out) gets a 503 whose body names
    the request, not the workers or the transport's error; the log has those."""
    dispatcher = cluster.server.dispatcher

    async def failing(req, first=None):
        raise RequestFailed("3 attempts in a row failed (last: KV transfer decode-0 <- prefill-0 at 10.0.0.7)")
        yield                                       # an async generator, as generate is
    real = dispatcher.generate
    dispatcher.generate = failing
    try:
        r = httpx.post(f"{cluster.base_url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=60)
    finally:
        dispatcher.generate = real
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "prefill" not in message and "decode" not in message and "10.0.0.7" not in message, message
    assert "cmpl-" in message


def test_a_request_whose_events_are_lost_resumes_and_answers_as_without_the_loss(cluster, client):
    """A request whose events stop reaching the router (here: every event of its first attempt
    after the first token is dropped at the router, as a stranger reading the worker's stream
    would take them) is not left hanging: once it has been silent for the silence timeout, the
    router asks its worker, which no longer has it, and it resumes from the tokens delivered.
    Its answer equals the same request's without the loss (greedy)."""
    body = {"model": MODEL, "prompt": "the lost events", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    want = client.post("completions", json=body).json()["choices"][0]["token_ids"]
    dispatcher = cluster.server.dispatcher
    deliver, seen = dispatcher._deliver, {}

    def lossy(ev):
        if ev.rid.endswith(".0"):                        # a first attempt: its first event passes
            seen[ev.rid] = seen.get(ev.rid, 0) + 1
            if seen[ev.rid] > 1:
                return
        deliver(ev)
    lost_before = metric_sum(cluster, "pdcluster:requests_resumed_total", cause="request_lost")
    dispatcher._deliver, dispatcher.request_silence_s = lossy, 1.0
    try:
        r = client.post("completions", json=body)
    finally:
        dispatcher._deliver, dispatcher.request_silence_s = deliver, dispatcher.hang_timeout_s
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert metric_sum(cluster, "pdcluster:requests_resumed_total", cause="request_lost") == lost_before + 1
    nothing_left_running(cluster)
