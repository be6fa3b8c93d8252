"""`n` > 1 and `best_of` (issue 14, item 3), against real serving clusters (1 prefill + 1 decode,
and one colocated worker; `tiny`).

The samples of a prompt start from one carrier: one prefill, one handoff, then each sample
decodes from the shared KV with its own seed. The oracles: the same server with n=1 (greedy
samples equal it; seeded sample j equals n=1 with `sample_seed(seed, j)`), the offline engine,
the metrics the workers report (prompt tokens prefilled, KV pulls), and the fault-free run for
a sample whose shared start failed and resumed alone.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from common import api_cluster, metric_sum, nothing_left_running, sse_events, wait_for
from router.app import sandboxed_template
from router.protocol import bad_words_tokens, chat_messages
from router.tools import tool_use
from test_tools import SCHEMAS, TOOLS
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.faults import ENV_VAR as FAULTS_ENV
from workers.faults import FaultPlan
from workers.sequence import SamplingParams, sample_seed
from workers.tokenizer import PLAIN_CHAT_TEMPLATE, byte_level_tokenizer

MODEL = "tiny"
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(37)]     # 2 full blocks and a partial one
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 8, "temperature": 1.0, "seed": 77, "ignore_eos": True}


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, ray_session):
    with api_cluster(request.param) as c:
        yield c


def completion(client, **body) -> dict:
    r = client.post("completions", json={"model": MODEL, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(answer: dict) -> list[list[int]]:
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["token_ids"] for c in answer["choices"]]


def offline(params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    engine = LLMEngine(EngineConfig(model=MODEL))
    return engine.generate([{"prompt_token_ids": prompt}], params)[0].token_ids


def test_greedy_samples_equal_n_1_from_one_prefill_and_one_handoff(cluster, client):
    first_role = "prefill" if cluster.spec.mode == "disaggregated" else "colocated"
    nothing_left_running(cluster)
    queried = metric_sum(cluster, "pdcluster:prefix_cache_queries_total", role=first_role)
    pulls = metric_sum(cluster, "pdcluster:kv_transfer_seconds_count")
    answer = completion(client, n=4, **GREEDY)
    one = token_ids(completion(client, **GREEDY))[0]
    assert token_ids(answer) == [one] * 4
    assert one == offline(SamplingParams(**GREEDY))
    assert answer["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 32,
                               "total_tokens": len(PROMPT) + 32}
    nothing_left_running(cluster)
    # The n=4 request and the n=1 one: two prompts prefilled (each looked up once in the prefix
    # cache), two KV pulls when disaggregated: one each.
    wait_for(lambda: metric_sum(cluster, "pdcluster:prefix_cache_queries_total", role=first_role) - queried,
             lambda n: n >= 2 * len(PROMPT))
    assert metric_sum(cluster, "pdcluster:prefix_cache_queries_total", role=first_role) - queried == 2 * len(PROMPT)
    if cluster.spec.mode == "disaggregated":
        wait_for(lambda: metric_sum(cluster, "pdcluster:kv_transfer_seconds_count") - pulls, lambda n: n >= 2)
        assert metric_sum(cluster, "pdcluster:kv_transfer_seconds_count") - pulls == 2


def test_seeded_samples_differ_repeat_and_each_equals_its_own_seed_alone(cluster, client):
    answer = token_ids(completion(client, n=4, **SEEDED))
    assert len({tuple(x) for x in answer}) == 4
    assert token_ids(completion(client, n=4, **SEEDED)) == answer
    for j, ids in enumerate(answer):
        alone = token_ids(completion(client, **{**SEEDED, "seed": sample_seed(SEEDED["seed"], j)}))[0]
        assert ids == alone
    assert answer[0] == offline(SamplingParams(**SEEDED))
    nothing_left_running(cluster)


def test_structured_samples_follow_the_schema_across_the_handoff_and_equal_the_offline_engine(cluster, client):
    """A JSON schema (vLLM's guided_json) with n=3 seeded samples: the prefill worker's first
    token obeys the grammar, each sample's matcher is rebuilt on the decode worker from the
    tokens before it, and every sample equals sample j run offline with its own seed."""
    schema = {"type": "object", "required": ["n", "k"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "k": {"enum": ["x", "yz"]}}}
    body = {**SEEDED, "max_tokens": 40, "ignore_eos": False}
    answer = completion(client, n=3, guided_json=schema, **body)
    params = SamplingParams(**body, structured={"json": json.dumps(schema)})
    for j, choice in enumerate(answer["choices"]):
        assert choice["finish_reason"] == "stop" and set(json.loads(choice["text"])) == {"n", "k"}, choice
        assert choice["token_ids"] == offline(dataclasses.replace(params, seed=sample_seed(params.seed, j)))


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    indoor: bool


def test_the_openai_clients_parse_with_a_pydantic_model_gets_an_instance_of_it(cluster):
    """What applications send: `chat.completions.parse(response_format=<pydantic model>)`, which
    asks for a strict json_schema and parses the answer into the model (it raises on anything
    else), streamed too."""
    with openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120) as oa:
        r = oa.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet, please."}],
                                      response_format=Pet, max_tokens=80, n=2, seed=3, temperature=1.0)
        assert [type(c.message.parsed) for c in r.choices] == [Pet, Pet], r
        with oa.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Another."}],
                                        response_format=Pet, max_tokens=80, temperature=0) as stream:
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Pet), final


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["c", "f"]


def served_prompt(body: dict, tools: list | None) -> list[int]:
    """The chat prompt as the server renders it (the built-in model's template), for the
    offline engine."""
    tok = byte_level_tokenizer()
    text = sandboxed_template(PLAIN_CHAT_TEMPLATE, bos_token=tok.bos_token, eos_token=tok.eos_token).render(
        messages=chat_messages(body), tools=tools, add_generation_prompt=True)
    return tok.encode(text)


def test_a_tool_calling_loop_with_the_openai_client_gets_well_formed_calls_whole_and_streamed(cluster):
    """An agent's loop with the official client: tool_choice "required" forces a call (the
    random model could not write one), its result goes back as a tool turn, and a named
    tool_choice forces the next. Each answer streamed assembles to the whole one, and the call
    equals the offline engine's on the prompt the template renders, across the handoff."""
    messages = [{"role": "user", "content": "The weather in Oslo, please."}]
    ask = {"model": MODEL, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "parallel_tool_calls": False}
    with openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120) as oa:
        whole = oa.chat.completions.create(messages=messages, tool_choice="required", **ask).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
        (call,) = whole.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        with oa.chat.completions.stream(messages=messages, tool_choice="required", **ask) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls" and len(streamed.message.tool_calls) == 1
        assert streamed.message.tool_calls[0].function.model_dump(include={"name", "arguments"}) == \
            call.function.model_dump(include={"name", "arguments"})
        _, use, forced = tool_use({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, "hermes")
        text = LLMEngine(EngineConfig(model=MODEL)).generate(
            [{"prompt_token_ids": served_prompt({"messages": messages}, TOOLS)}],
            SamplingParams(max_tokens=120, temperature=0, structured=forced))[0].text
        assert json.loads(text) == [{"name": call.function.name, "parameters": json.loads(call.function.arguments)}]

        messages += [whole.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snow"}]
        named = {"type": "function", "function": {"name": "search"}}
        after = oa.chat.completions.create(messages=messages, tool_choice=named, **ask).choices[0]
        assert after.finish_reason == "stop" and after.message.tool_calls[0].function.name == "search", after
        jsonschema.validate(json.loads(after.message.tool_calls[0].function.arguments), SCHEMAS["search"])
    nothing_left_running(cluster)


def test_the_openai_clients_parse_with_a_pydantic_tool_gets_its_arguments_as_an_instance(cluster):
    """`pydantic_function_tool` sends a strict function; parse() turns each call's arguments
    into the model (it raises on anything else), streamed too."""
    tool = openai.pydantic_function_tool(Weather)
    ask = {"model": MODEL, "tools": [tool], "tool_choice": "required", "max_tokens": 80, "parallel_tool_calls": False}
    with openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120) as oa:
        r = oa.chat.completions.parse(messages=[{"role": "user", "content": "Weather?"}], n=2, seed=3,
                                      temperature=1.0, **ask)
        for choice in r.choices:
            assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, Weather), choice
        with oa.chat.completions.stream(messages=[{"role": "user", "content": "And now?"}], temperature=0,
                                        **ask) as stream:
            final = stream.get_final_completion()
        assert all(isinstance(c.function.parsed_arguments, Weather) for c in final.choices[0].message.tool_calls)


def test_calls_the_model_writes_in_its_template_format_are_parsed_as_they_stream(cluster, client):
    """tool_choice auto: the answer is parsed for Hermes-style calls (the built-in template's
    format). A regex makes the random model write one after some text; the stream's content
    and call deltas assemble to the whole answer's message."""
    regex = (r"Checking\.\n<tool_call>\n\{\"name\": \"get_weather\", \"arguments\": "
             r"\{\"city\": \"(Paris|Rome)\", \"unit\": \"c\"\}\}\n</tool_call>")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "guided_regex": regex, "max_tokens": 120, "temperature": 0}
    whole = client.post("chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking.", whole
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["unit"] == "c"
    events = sse_events(client.post("chat/completions", json={**body, "stream": True}).text)
    content, args, finish = "", "", None
    for e in events[:-1]:
        delta = e["choices"][0]["delta"]
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            assert d["index"] == 0 and ("id" not in d or d["function"]["name"] == "get_weather")
            args += d["function"]["arguments"]
        finish = e["choices"][0]["finish_reason"] or finish
    assert (content, args, finish) == ("Checking.", call["function"]["arguments"], "tool_calls")
    plain = client.post("chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"].startswith("Checking.\n<tool_call>")


# Each sampling feature whose state crosses the handoff: penalty counts, the logit bias and
# min_tokens (EOS masked until then), min_p, a grammar's matcher.
FEATURES = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    "logit_bias_min_tokens": {"logit_bias": {"101": 8, "102": -100}, "min_tokens": 10, "ignore_eos": False},
    "min_p": {"min_p": 0.3},
    "bad_words": {"bad_words": ["e", "ab", " the"]},
    "json_schema": {"guided_json": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                                    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "b": {"enum": ["x", "yz"]}}}, "ignore_eos": False},
}


def set_decode_faults(cluster, plan: str) -> None:
    import ray
    handle = cluster.pools.active("decode")[0].handle
    ray.get(handle.__ray_call__.remote(lambda w, p: setattr(w, "faults", FaultPlan.parse(p)), plan), timeout=60)


def resumed_by_handoff(cluster) -> float:
    return cluster.server.metrics.registry.get_sample_value(
        "pdcluster:requests_resumed_total", {"cause": "handoff_failed"}) or 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_each_feature_through_a_failed_handoff_resumes_to_the_offline_engines_tokens(cluster, client, sampling):
    """Item 2: a request whose KV pull fails halfway resumes from its delivered tokens on a new
    attempt, which rebuilds its penalty counts, its grammar's matcher and its min_tokens count
    from them; every feature's answer is the offline engine's, token for token (colocated: the
    same answers with no handoff). A forced tool call goes through the same."""
    base = {**(GREEDY if sampling == "greedy" else SEEDED), "max_tokens": 24}
    failing = cluster.spec.mode == "disaggregated"
    # Every request through a handoff: local prefill (auto: on the decode worker while the prefill
    # pool has a queue, which a busy machine makes) would serve one without a pull to fail.
    placement = cluster.dispatcher.placement
    saved, placement.local_prefill_max_tokens = placement.local_prefill_max_tokens, 0
    try:
        run_features_through_a_failing_pull(cluster, client, base, failing)
    finally:
        placement.local_prefill_max_tokens = saved
    nothing_left_running(cluster)


def run_features_through_a_failing_pull(cluster, client, base: dict, failing: bool) -> None:
    for name, feature in FEATURES.items():
        body = {**base, **feature}
        if failing:
            set_decode_faults(cluster, "recv:mid_payload:fail*1")
        before = resumed_by_handoff(cluster)
        got = token_ids(completion(client, **body))[0]
        params = {k: v for k, v in body.items() if k != "guided_json"}
        if "guided_json" in body:
            params["structured"] = {"json": json.dumps(body["guided_json"])}
        if "bad_words" in params:
            tok = byte_level_tokenizer()
            params["bad_words_token_ids"] = bad_words_tokens(params.pop("bad_words"),
                                                             lambda t: tok.encode(t, add_special_tokens=False))
        if "logit_bias" in params:
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        assert got == offline(SamplingParams(**params)), name
        assert resumed_by_handoff(cluster) - before == failing, name
    messages = [{"role": "user", "content": "Weather?"}]
    ask = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
           **base, "max_tokens": 120, "ignore_eos": False}
    if failing:
        set_decode_faults(cluster, "recv:mid_payload:fail*1")
    before = resumed_by_handoff(cluster)
    (call,) = client.post("chat/completions", json=ask).json()["choices"][0]["message"]["tool_calls"]
    assert resumed_by_handoff(cluster) - before == failing
    _, _, forced = tool_use(ask, "hermes")
    text = LLMEngine(EngineConfig(model=MODEL)).generate(
        [{"prompt_token_ids": served_prompt(ask, TOOLS)}],
        SamplingParams(**{k: ask[k] for k in base}, structured=forced))[0].text
    assert json.loads(text) == [{"name": call["function"]["name"], "parameters": json.loads(call["function"]["arguments"])}]


def test_streamed_samples_carry_their_index_and_equal_the_whole_answer(cluster, client):
    whole = token_ids(completion(client, n=3, **SEEDED))
    r = client.post("completions", json={"model": MODEL, "prompt": PROMPT, "n": 3, "stream": True,
                                         "stream_options": {"include_usage": True}, **SEEDED})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
    ids, finishes = [[] for _ in range(3)], [[] for _ in range(3)]
    for e in events[:-2]:
        (choice,) = e["choices"]
        ids[choice["index"]] += choice["token_ids"]
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert ids == whole and finishes == [["length"]] * 3
    assert events[-2]["usage"]["completion_tokens"] == 24

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "n": 2, **GREEDY}
    whole = client.post("chat/completions", json=chat).json()
    alone = client.post("chat/completions", json={**chat, "n": 1}).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [alone["choices"][0]["message"]["content"]] * 2
    events = sse_events(client.post("chat/completions", json={**chat, "stream": True}).text)
    texts = ["", ""]
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    nothing_left_running(cluster)


def test_best_of_answers_the_likeliest_samples(cluster, client):
    # best_of=4, n=2 generates the 4 samples that n=4 gives (the same seeds) and answers the 2
    # of highest cumulative logprob, likeliest first; usage counts all 4.
    every = completion(client, n=4, logprobs=0, **SEEDED)["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = completion(client, n=2, best_of=4, **SEEDED)
    assert token_ids(best) == [c["token_ids"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])     # ranked by them, not asked for
    assert best["usage"]["completion_tokens"] == 32
    nothing_left_running(cluster)


def test_a_batch_of_prompts_with_n_samples_each(cluster, client):
    prompts = [PROMPT, [5, 6, 7]]
    batch = token_ids(completion(client, **{"prompt": prompts, "n": 2, **SEEDED}))
    each = [token_ids(completion(client, **{"prompt": p, "n": 2, **SEEDED})) for p in prompts]
    assert batch == each[0] + each[1]                # index = prompt x n + sample
    nothing_left_running(cluster)


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": 2.0}, "n"), ({"best_of": True}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": [[1, 2]] * 5, "n": 64}, "n"),
])
def test_bad_sample_counts_are_refused(client, body, param):
    r = client.post("completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_that_leaves_ends_every_sample(cluster, client):
    registry = cluster.server.metrics.registry

    def disconnects() -> float:
        return registry.get_sample_value("pdcluster:request_errors_total", {"reason": "client_disconnect"}) or 0.0
    before = disconnects()
    body = {"model": MODEL, "prompt": PROMPT, "n": 4, "stream": True, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    with client.stream("POST", "completions", json=body) as r:
        seen = set()
        for line in r.iter_lines():                      # until every sample has sent tokens
            if line.startswith("data: {"):
                seen.add(json.loads(line.removeprefix("data: "))["choices"][0]["index"])
                if len(seen) == 4:
                    break
    nothing_left_running(cluster)
    assert disconnects() - before == 4


@pytest.fixture
def failing_handoff(monkeypatch):
    """A cluster whose decode worker fails its first KV pull halfway (a fault drill)."""
    monkeypatch.setenv(FAULTS_ENV, "recv:mid_payload:fail*1")
    with api_cluster("disaggregated") as c:
        yield c


def test_samples_whose_shared_handoff_fails_resume_alone_and_equal_the_fault_free_run(ray_session, failing_handoff):
    cluster = failing_handoff
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        answer = token_ids(completion(client, n=3, **SEEDED))
    want = [offline(SamplingParams(**{**SEEDED, "seed": sample_seed(SEEDED["seed"], j)})) for j in range(3)]
    assert answer == want
    resumed = cluster.server.metrics.registry.get_sample_value(
        "pdcluster:requests_resumed_total", {"cause": "handoff_failed"})
    assert resumed == 3                                  # each sample, once, alone
    wait_for(lambda: metric_sum(cluster, "pdcluster:kv_transfer_failures_total"), lambda n: n >= 1)
    assert metric_sum(cluster, "pdcluster:kv_transfer_failures_total") == 1
    nothing_left_running(cluster)
