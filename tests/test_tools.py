"""Tool calls (issue 29, item 4), without a server: the checks of `tools` and `tool_choice`, the
parser that turns an answer into OpenAI's tool_calls, the chat template's rendering of tools,
and the forced calls of tool_choice "required" and a named function on the built-in model.

Oracles: calls written out by json.dumps in each model family's format (the parser must give
back each call's name and its arguments' exact text, whole or fed in any chunks); HF
transformers' apply_chat_template on the same template and conversation; jsonschema on the
arguments of calls the random built-in model was forced to make.
"""
from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest

from router.app import sandboxed_template
from router.protocol import APIError, chat_messages, sampling_params
from router.tools import (ToolCallParser, ToolError, ToolUse, deltas, fold, parser_for_template, tool_finish_reason,
                          tool_use)
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams
from workers.tokenizer import PLAIN_CHAT_TEMPLATE, byte_level_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "required": ["q"], "additionalProperties": False,
                                     "properties": {"q": {"type": "string", "maxLength": 12}}}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# Arguments that try the parser: braces and brackets inside strings, escaped quotes and
# backslashes, the tags themselves, non-ASCII, nesting, numbers at the end of an object.
ARGS = [{"city": "Paris", "unit": "c"}, {"q": "a}b]c{\"d"}, {"q": "<tool_call>x</tool_call>"},
        {"path": "C:\\dir\\", "n": [1, {"x": [2, {}]}], "ok": True}, {"text": "héllo ☃ 𝄞"}, {},
        {"x": None, "y": -1.5e3}, {"nested": {"a": {"b": {"c": "}}}"}}}}]
NAMES = ["get_weather", "search", "f", "a.b-c_d"]


def parse(use: ToolUse, text: str, seed: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of `text` pushed whole, or in random chunks of 1-5
    characters (a stream's deltas) when `seed` is given, folded as a whole answer is."""
    parser, pieces = ToolCallParser(use), []
    if seed is None:
        pieces += parser.push(text)
    else:
        rng, at = random.Random(seed), 0
        while at < len(text):
            step = rng.randint(1, 5)
            pieces += parser.push(text[at:at + step])
            at += step
    content, calls = fold(pieces + parser.finish())
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed_equals_whole(use: ToolUse, text: str) -> tuple[str, list[tuple[str, str]]]:
    whole = parse(use, text)
    for seed in range(12):
        assert parse(use, text, seed) == whole, (text, seed)
    return whole


def calls_written(rng: random.Random, k: int, key: str) -> list[tuple[str, str]]:
    """k calls: (name, its arguments as json.dumps writes them, in a style picked at random)."""
    style = rng.choice([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}])
    return [(rng.choice(NAMES), json.dumps(rng.choice(ARGS), **style)) for _ in range(k)]


@pytest.mark.parametrize("seed", range(40))
def test_hermes_calls_come_back_with_their_name_and_arguments_text(seed):
    rng = random.Random(seed)
    calls = calls_written(rng, rng.randint(1, 3), "arguments")
    before = rng.choice(["", "Let me look that up.", "  Sure:\n", "I'll use {braces} and <tags>."])
    text = before + "".join(
        f"{rng.choice(['', chr(10), '  '])}<tool_call>{rng.choice(['', chr(10)])}"
        + (json.dumps({"name": n})[:-1] + ', "arguments": ' + a + "}" if rng.random() < 0.7
           else '{"arguments": ' + a + ', "name": ' + json.dumps(n) + "}")
        + f"{rng.choice(['', chr(10)])}</tool_call>" for n, a in calls) + rng.choice(["", "\n", "  "])
    content, got = streamed_equals_whole(ToolUse("auto"), text)
    assert got == calls
    assert content == before.rstrip()            # whitespace touching a call is dropped
    for _, args in got:
        json.loads(args)


@pytest.mark.parametrize("seed", range(20))
def test_llama3_json_calls_and_the_forced_array_come_back_whole(seed):
    rng = random.Random(seed)
    calls = calls_written(rng, rng.randint(1, 3), "parameters")
    objects = [json.dumps({"name": n})[:-1] + ', "parameters": ' + a + "}" for n, a in calls]
    llama = rng.choice(["", "<|python_tag|>", " "]) + "; ".join(objects)
    assert streamed_equals_whole(ToolUse("auto", parser="llama3_json"), llama) == ("", calls)
    forced = "[" + ",".join(objects) + "]"
    assert streamed_equals_whole(ToolUse("required"), forced) == ("", calls)
    assert streamed_equals_whole(ToolUse("required", parallel=False), forced) == ("", calls[:1])
    assert streamed_equals_whole(ToolUse("named", name="f", parallel=False), calls[0][1]) == ("", [("f", calls[0][1])])


@pytest.mark.parametrize("text", [
    "Hello there ", "  leading and trailing  ", "{not a call}", '{"a": 1} is JSON', "<tool_ca", "a <tool_call> b",
    "<tool_call>{\"foo\": 1}</tool_call> after", "x < y and z > w", "<|python_tag|>print(1)", "",
    "emoji 🙂 and \\ backslash \" quote"])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_an_answer_that_makes_no_call_is_its_text_unchanged(text, parser):
    assert streamed_equals_whole(ToolUse("auto", parser=parser), text) == (text, [])


def test_only_the_first_call_without_parallel_calls_and_a_call_cut_short_keeps_what_came():
    two = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert streamed_equals_whole(ToolUse("auto", parallel=False), two) == ("", [("f", '{"a": 1}')])
    cut = 'Checking. <tool_call>{"name": "f", "arguments": {"a": [1, 2'
    assert streamed_equals_whole(ToolUse("auto"), cut) == ("Checking.", [("f", '{"a": [1, 2')])
    unnamed = '<tool_call>{"arguments": {"a": 1'
    assert streamed_equals_whole(ToolUse("auto"), unnamed) == (unnamed, [])


@pytest.mark.parametrize("shape", ["arguments", "named"])
def test_a_long_call_is_read_in_time_linear_in_it(shape):
    """A long call pushed a few characters at a time, as a stream comes: ten times the text
    costs about ten times the time, not a hundred (it runs on the router's event loop). The
    best of three runs each, so a pause of the process counts for neither."""
    def answer(n: int) -> tuple[ToolUse, str]:
        args = json.dumps({"text": "x" * n})
        return {"arguments": (ToolUse("auto"), '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"),
                "named": (ToolUse("named", name="f", parallel=False), args)}[shape]

    def best_s(n: int) -> float:
        use, text = answer(n)
        times = []
        for _ in range(3):
            parser, t0 = ToolCallParser(use), time.perf_counter()
            for at in range(0, len(text), 3):
                parser.push(text[at:at + 3])
            parser.finish()
            times.append(time.perf_counter() - t0)
        return min(times)
    short, long = best_s(8_000), best_s(80_000)
    assert long < 40 * short, (short, long)


def test_stream_deltas_carry_the_call_start_once_then_its_arguments():
    parser = ToolCallParser(ToolUse("auto"))
    chunks = ['Hi <tool', '_call>{"name": "get_', 'weather", "arguments": {"city"', ': "Oslo"}}</tool_call>']
    sent = [deltas(parser.push(c)) for c in chunks] + [deltas(parser.finish())]
    assert [content for content, _ in sent] == ["Hi", "", "", "", ""]
    starts = [d for _, ds in sent for d in ds if "id" in d]
    assert len(starts) == 1 and starts[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert starts[0]["index"] == 0 and starts[0]["type"] == "function" and starts[0]["id"].startswith("call_")
    rest = "".join(d["function"]["arguments"] for _, ds in sent for d in ds if "id" not in d)
    assert rest == ': "Oslo"}'
    assert tool_finish_reason(ToolUse("auto"), "stop", 1) == "tool_calls"
    assert tool_finish_reason(ToolUse("auto"), "length", 1) == "length"
    assert tool_finish_reason(ToolUse("named", name="f"), "stop", 1) == "stop"
    assert tool_finish_reason(ToolUse("auto"), "stop", 0) == "stop"


# -- the request's fields ------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, says", [
    ({"tools": "x"}, "tools", "list"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "parameters"),
    ({"tools": [WEATHER] * 129}, "tools", "128"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_malformed_tools_are_refused_naming_the_field(body, param, says):
    with pytest.raises(ToolError) as e:
        tool_use(body, "hermes")
    assert e.value.param == param and says in str(e.value), str(e.value)


def test_tool_choice_sets_what_is_parsed_and_what_is_forced():
    assert tool_use({}, "hermes") == (None, None, None)
    assert tool_use({"tools": [], "tool_choice": "none"}, "hermes") == (None, None, None)
    tools, use, forced = tool_use({"tools": TOOLS}, "llama3_json")
    assert tools == TOOLS and use == ToolUse("auto", parser="llama3_json") and forced is None
    _, use, forced = tool_use({"tools": TOOLS, "tool_choice": "none"}, "hermes")
    assert not use.parses and forced is None
    _, use, forced = tool_use({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
                              "hermes")
    assert use.choice == "named" and use.name == "search" and json.loads(forced["json"]) == SCHEMAS["search"]
    _, use, forced = tool_use({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, "hermes")
    schema = json.loads(forced["json"])
    assert use.choice == "required" and not use.parallel and schema["maxItems"] == 1
    good = [{"name": "search", "parameters": {"q": "x"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "search", "parameters": {"q": 1}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_forced_call_cannot_be_shaped_by_another_structured_output_too():
    _, _, forced = tool_use({"tools": TOOLS, "tool_choice": "required"}, "hermes")
    with pytest.raises(APIError) as e:
        sampling_params({"response_format": {"type": "json_object"}}, 16, forced=("tools", forced))
    assert e.value.param == "response_format" and "tool_choice" in e.value.message
    assert sampling_params({}, 16, forced=("tools", forced)).structured == forced


@pytest.mark.parametrize("arguments, says", [
    ("[" * 5000 + "]" * 5000, "nest"), ("{not json", "not valid JSON"), ('"\\ud800"', "surrogate")])
def test_a_tool_call_in_the_history_with_hostile_arguments_is_a_400(arguments, says):
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(APIError) as e:
        chat_messages({"messages": messages})
    assert e.value.status == 400 and e.value.param == "messages" and says in e.value.message, e.value.message


def test_the_template_format_picks_the_parser():
    assert parser_for_template(PLAIN_CHAT_TEMPLATE) == "hermes"
    assert parser_for_template(LLAMA_STYLE) == "llama3_json"
    assert parser_for_template("{{ '<tool_call>' }} ipython") == "hermes"


# -- the chat template, as transformers renders it -------------------------------------------------
# A template in the style of Llama 3.1's (written for this test): tools as indented JSON in
# the first user turn, calls as {"name", "parameters"}, tool results as ipython turns; it uses
# what HF's environment gives templates (trimmed blocks, namespace, tojson's options, loop controls).
LLAMA_STYLE = """{{- bos_token }}
{%- set ns = namespace(first=true) %}
{%- for message in messages %}
    {%- if loop.index0 > 40 %}{% break %}{% endif %}
    <|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>

    {%- if tools and message.role == 'user' and ns.first %}
        {%- set ns.first = false %}
Use these functions, answering with {"name": ..., "parameters": ...}:
        {%- for t in tools %}
{{ t | tojson(indent=4) }}
        {%- endfor %}
    {%- endif %}
    {%- if message.tool_calls %}
        {%- for call in message.tool_calls %}
{{ {"name": call.function.name, "parameters": call.function.arguments} | tojson }}
        {%- endfor %}
    {%- else %}
{{ message.content }}
    {%- endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief <&> \"quoted\"."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snow ☃"},
    {"role": "user", "content": "And Rome?"}]


def as_transformers_takes_it(messages: list[dict]) -> list[dict]:
    """The conversation as a caller of apply_chat_template writes it: text content, and a
    call's arguments as an object (what templates print)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("template", [PLAIN_CHAT_TEMPLATE, LLAMA_STYLE], ids=["plain", "llama-style"])
@pytest.mark.parametrize("with_tools", [True, False])
def test_tools_and_calls_render_as_transformers_renders_them(tmp_path, template, with_tools):
    transformers = pytest.importorskip("transformers")
    tok = byte_level_tokenizer()
    tok.chat_template = template
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tools = TOOLS if with_tools else None
    want = hf.apply_chat_template(as_transformers_takes_it(CONVERSATION), tools=tools, add_generation_prompt=True,
                                  tokenize=False)
    ours = sandboxed_template(template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    got = ours.render(messages=chat_messages({"messages": CONVERSATION}), tools=tools, add_generation_prompt=True)
    assert got == want
    assert ("get_weather" in got) and (("maxLength" in got) == with_tools)


# -- forced calls on the built-in model -------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=str(tiny_dir), cache=CacheConfig(num_blocks=256)))


@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True), ("named", False)])
def test_the_random_model_forced_to_call_makes_calls_whose_arguments_validate(engine, choice, parallel):
    """The built-in model is random: without the forcing grammar it would never write a call.
    With parallel calls it may go on adding calls to max_tokens: the last one may be cut short
    (finish_reason length), every one before it is whole."""
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    _, use, forced = tool_use({"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel},
                              "hermes")
    prompts = [{"prompt_token_ids": [(11 * i + 5 * k) % 250 + 1 for i in range(20)]} for k in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=200, temperature=1.0, seed=5, structured=forced))
    whole = 0
    for out in outs:
        parser = ToolCallParser(use)
        content, calls = fold(parser.push(out.text) + parser.finish())
        assert content == "" and calls and (out.finish_reason == "stop" or parallel), out.text
        if out.finish_reason == "length":
            calls = calls[:-1]
        else:
            assert json.loads(out.text)                 # the forced output is JSON, whole
        for call in calls:
            name = call["function"]["name"]
            assert name in SCHEMAS and (choice == "required" or name == "get_weather")
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
            whole += 1
    assert whole >= len(prompts) - 1
