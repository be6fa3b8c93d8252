"""Structured outputs (workers/grammar.py, llguidance): what the engine samples under a JSON
schema, a JSON object, a regex, a choice or a Lark grammar is in that language, and a request
resumed from its delivered tokens (a handoff, a fault) continues exactly as it would have.

Oracles: an independent JSON Schema validator (jsonschema) and json.loads, Python's re for
regexes, the set of choices; the uninterrupted run for resumes. The request fields
(response_format, vLLM's guided_* and structured_outputs) are checked in router/protocol.py's
mapping, and a grammar that does not compile is a 400 naming its field."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from benchmarks.schemas import schema_suite
from common import assert_all_blocks_free
from router.protocol import APIError, sampling_params
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.grammar import Grammars
from workers.sequence import SamplingParams
from workers.tokenizer import byte_level_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "Q: What is the capital of France?\nA:"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "kind": {"enum": ["cat", "dog"]}}}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20,
                                                                     swap_space_bytes=0)))


def run(engine, spec: dict, max_tokens: int = 96, prompts=PROMPTS, **params):
    results = engine.generate(list(prompts), SamplingParams(max_tokens=max_tokens, structured=spec, **params))
    assert_all_blocks_free(engine)
    return results


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_json_schema_outputs_validate_against_the_schema(engine, sampling):
    for r in run(engine, {"json": json.dumps(SCHEMA)}, **sampling):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
def test_a_suite_of_fifty_schemas_every_output_validates(engine, sampling):
    """benchmarks/schemas.py: nested objects, arrays with bounds, enums, anyOf, integer ranges,
    string patterns and lengths, optional keys; two prompts each, in one batch. The random
    model's own output is no JSON at all."""
    suite = schema_suite()
    assert len(suite) >= 50
    prompts = PROMPTS[:2]
    for r in engine.generate(prompts, SamplingParams(max_tokens=64, **sampling)):
        with pytest.raises(ValueError):
            json.loads(r.text)
    results = engine.generate([{"prompt": p, "params": SamplingParams(max_tokens=512, structured={"json": json.dumps(s)},
                                                                      **sampling)} for s in suite for p in prompts])
    assert_all_blocks_free(engine)
    for i, r in enumerate(results):
        assert r.finish_reason == "stop", (i, r.text[:200])
        jsonschema.validate(json.loads(r.text), suite[i // len(prompts)])


def test_json_object_outputs_parse_as_objects(engine):
    """The random model's strings run to max_tokens; a bias towards a few characters (quotes,
    "1", "a", "}") makes short keys and values, and every object it ends parses, braces and
    quotes inside strings included."""
    bias = {str(ord(c)): b for c, b in (("}", 3.0), ("1", 6.0), ('"', 4.0), ("a", 5.0))}
    results = run(engine, {"json_object": ""}, temperature=0, logit_bias=bias, frequency_penalty=0.5)
    assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
    objects = [json.loads(r.text) for r in results]
    assert all(isinstance(o, dict) for o in objects) and any(o for o in objects), objects


def test_regex_choice_and_grammar_outputs_are_in_their_languages(engine):
    pattern = r"[a-c]{2,4}-[0-9]{2}( ok)?"
    for r in run(engine, {"regex": pattern}):
        assert re.fullmatch(pattern, r.text), r.text
    choices = ["yes", "no", "maybe", "it depends"]
    assert {r.text for r in run(engine, {"choice": choices})} <= set(choices)
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]{1,5}/'
    gbnf = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z] [a-z]?'   # vLLM's EBNF
    for grammar, pattern in ((lark, r"(hi|hello) [A-Z][a-z]{1,5}"), (gbnf, r"(hi|hello) [A-Z][a-z]{1,2}")):
        for r in run(engine, {"grammar": grammar}):
            assert re.fullmatch(pattern, r.text), (grammar, r.text)


def test_a_request_resumed_from_its_delivered_tokens_continues_as_it_would_have(engine):
    """What a decode worker after the handoff, or any worker after a fault, does: the prompt and
    the tokens already delivered come in, the matcher is rebuilt over them, and sampling goes
    on, greedy and seeded (the seeded stream depends on the position only)."""
    spec = {"json": json.dumps(SCHEMA)}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        params = SamplingParams(max_tokens=96, structured=spec, **sampling)
        whole = engine.generate(PROMPTS[:2], params)
        for prompt, w in zip(PROMPTS[:2], whole):
            for cut in (1, len(w.token_ids) // 2, len(w.token_ids) - 1):
                seq = engine.add_request(prompt, params, output_token_ids=w.token_ids[:cut])
                while engine.has_unfinished():
                    engine.step()
                assert engine.result(seq).token_ids == w.token_ids, (sampling, cut)
    assert_all_blocks_free(engine)


def test_penalties_and_a_grammar_together(engine):
    """The grammar's mask comes first: penalties and logit_bias change the choice among what
    it allows, never let in what it does not."""
    bias = {str(ord("9")): 50.0, str(ord("c")): 50.0}
    for r in run(engine, {"regex": r"[a-c]{3}[0-5]{2}"}, temperature=0, logit_bias=bias, frequency_penalty=1.0):
        assert re.fullmatch(r"[a-c]{3}[0-5]{2}", r.text), r.text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_grammar_penalties_and_seeds(tiny_dir, mode):
    """A pool too small for its batch preempts (by recompute, or by swap); each request's
    grammar matcher, penalty counts, banned words and seeded stream come back with it: the
    outputs are those of a pool large enough never to preempt."""
    rng = random.Random(3)
    kinds = [{"structured": {"json": json.dumps(SCHEMA)}, "temperature": 0},
             {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "temperature": 0},
             {"bad_words_token_ids": [[101], [32, 116]], "temperature": 1.0, "seed": 4},
             {"structured": {"regex": "[a-z]{5,40}( [a-z]{2,9}){3,8}"}, "temperature": 1.0, "seed": 9},
             {"min_tokens": 30, "logit_bias": {"257": 20.0}, "min_p": 0.1, "temperature": 1.0, "seed": 2}]
    requests = [{"prompt_token_ids": [rng.randrange(1, 250) for _ in range(rng.randrange(60, 120))],
                 "params": SamplingParams(max_tokens=128, **kinds[i % len(kinds)],
                                          ignore_eos=not ({"structured", "min_tokens"} & set(kinds[i % len(kinds)])))}
                for i in range(15)]
    roomy = LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(num_blocks=512)))
    want = [r.token_ids for r in roomy.generate(requests)]
    tight = LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(
        num_blocks=40, swap_space_bytes=8 * 2**20 if mode == "swap" else 0),
        scheduler=SchedulerConfig(preemption_mode=mode)))
    got = [r.token_ids for r in tight.generate(requests)]
    assert [len(ids) for ids in want[4::5]] == [31] * 3             # EOS held back by min_tokens, then taken
    assert tight.scheduler.stats.num_preemptions[mode] > 0, tight.scheduler.stats
    assert got == want
    assert_all_blocks_free(tight)


def test_a_grammar_past_the_limits_ends_its_own_request_and_changes_no_other(engine):
    """`a{100000}` would build a lexer for 0.2 s and then cost 26 ms a step at llguidance's
    default limits; at ours (workers/grammar.py LIMITS) it runs out of fuel on its second
    token and ends with finish_reason abort, while the requests in its batch generate what
    they generate without it."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [r.token_ids for r in engine.generate(PROMPTS[:3], params)]
    hostile = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=24, temperature=0,
                                                            structured={"regex": "a{100000}"}))
    others = [engine.add_request(p, params) for p in PROMPTS[:3]]
    while engine.has_unfinished():
        engine.step()
    ended = engine.result(hostile)
    assert ended.finish_reason == "abort" and len(ended.token_ids) < 4 and set(ended.text) <= {"a"}, ended
    assert [engine.result(s).token_ids for s in others] == alone
    assert_all_blocks_free(engine)


# -- the request fields -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammars():
    return Grammars(byte_level_tokenizer())


def params_of(grammars, **body) -> SamplingParams:
    return sampling_params({"model": "m", "prompt": "x", **body}, 16, 258, grammars.check)


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, {"json_object": ""}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     {"json": json.dumps(SCHEMA)}),
    ({"guided_json": SCHEMA}, {"json": json.dumps(SCHEMA)}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": ""}),
    ({"response_format": {"type": "text"}}, None),
])
def test_each_field_asks_for_its_grammar(grammars, body, want):
    assert params_of(grammars, **body).structured == want


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format"),
    ({"guided_regex": "[a-z"}, "guided_regex"),                                  # does not compile
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"), ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}, "guided_grammar"),   # nested past any parser
    ({"guided_regex": "x" * (64 * 1024 + 1)}, "guided_regex"),
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice"),        # two ask
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_a_grammar_that_cannot_be_served_is_a_400_naming_its_field(grammars, body, param):
    with pytest.raises(APIError) as e:
        params_of(grammars, **body)
    assert e.value.status == 400 and e.value.param == param, e.value
