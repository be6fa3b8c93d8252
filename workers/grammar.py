"""Structured outputs: a request's grammar, compiled by llguidance, masks what it may sample.

A request asks with `SamplingParams.structured`, one of
    {"json": <JSON schema, as JSON text>}   {"json_object": ""}   {"regex": <pattern>}
    {"choice": [<string>, ...]}             {"grammar": <Lark grammar, or GBNF as llama.cpp and vLLM take>}
(router/protocol.py maps OpenAI's response_format and vLLM's guided_* and structured_outputs
onto it). llguidance (Microsoft's, the engine behind vLLM's `guidance` backend) is the grammar
engine: a wheel with no dependencies (xgrammar pulls triton and TVM's FFI), an Earley parser
over a lazy lexer, so a mask costs about as much for a large vocabulary as for a small one, and
matchers that copy cheaply (forks, a cache of compiled grammars).

A sequence's `GrammarState` follows its output tokens lazily: before each mask it consumes the
tokens it has not seen (`follow`), so on a decode worker after the handoff, or on any worker a
request resumes on, the matcher is rebuilt from the prompt's grammar and the tokens already
delivered, with nothing to carry across (what Dynamo cannot do: it restarts the grammar).
"""
from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from workers.sequence import check_structured

CACHE = 256                          # compiled grammars kept, by their text
# What one grammar may cost, so that no request's grammar holds up the step of the batch it
# shares (llguidance's fuel: about 50 units a microsecond to build the lexer's expressions,
# 14 a microsecond per mask). At the defaults (ten times these) `a{100000}` built for 0.2 s and
# then took 26 ms every step; at these it is refused, and what passes costs at most a few ms a
# step (BENCHMARKS.md, "Sampling parameters"). A limit reached on the first mask (computed when
# the grammar is compiled) refuses the request; one reached later ends it (finish_reason abort).
LIMITS = {"initial_lexer_fuel": 100_000, "step_lexer_fuel": 100_000, "verbose_errors": False}
# JSON as OpenAI's models write it: no whitespace between tokens but after ":" and "," (a weak
# model given free whitespace spends its tokens on it).
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: dict) -> str:
    """llguidance's grammar for a spec `check_structured` took (not yet compiled)."""
    (kind, value), = spec.items()
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=COMPACT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":          # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    try:                          # GBNF / EBNF (llama.cpp's, what vLLM's xgrammar takes) becomes Lark
        lark = any_to_lark(value)
    except Exception as e:        # its parser is plain Python: whatever a malformed grammar raises
        raise ValueError(f"structured grammar is neither Lark nor GBNF: {str(e)[:200]}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarState:
    """One sequence's matcher, its tokenizer's vocabulary size (the mask's width), and how many
    of its output tokens it has consumed."""
    __slots__ = ("matcher", "vocab_size", "consumed")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size, self.consumed = matcher, vocab_size, 0

    def follow(self, output_token_ids: list[int]) -> bool:
        """Consume the output tokens not seen yet; False once the matcher is in error."""
        if self.consumed < len(output_token_ids):
            self.matcher.consume_tokens(output_token_ids[self.consumed:])
            self.consumed = len(output_token_ids)
        return not self.matcher.is_error()

    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class Grammars:
    """Compiles grammars for one tokenizer (workers/tokenizer.py `Tokenizer`), caching the
    compiled matchers by grammar text; each sequence gets its own copy."""

    def __init__(self, tokenizer):
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), eos_token=tokenizer.eos_token_id)
        self.vocab_size = self.tokenizer.vocab_size
        self._limits = llguidance.LLParserLimits(**LIMITS)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def check(self, spec) -> str | None:
        """Why this spec cannot be served (its shape, or its grammar does not compile), or None."""
        try:
            check_structured(spec)
            self._compiled(spec)
        except ValueError as e:
            return str(e)
        return None

    def state(self, spec: dict) -> GrammarState:
        return GrammarState(self._compiled(spec).deep_copy(), self.vocab_size)

    def _compiled(self, spec: dict) -> llguidance.LLMatcher:
        text = grammar_text(spec)
        m = self._cache.get(text)
        if m is None:
            (kind, _), = spec.items()
            error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer, limits=self._limits)
            if error:
                raise ValueError(f"structured {kind} does not compile: {error.strip().splitlines()[0][:300]}")
            m = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self._limits)
            if not m.is_error():               # the first mask now: it builds the lexer (copies share it)
                m.compute_bitmask()
            if m.is_error():
                raise ValueError(f"structured {kind} is too large or complex to serve: "
                                 f"{m.get_error().strip().splitlines()[0][:300]}")
            self._cache[text] = m
            if len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return m
