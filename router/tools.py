"""Tool calls on chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

A request's tools are checked here (`tool_use`) and rendered by the model's chat template as HF
transformers renders them (`tools=` beside the messages). What the model answers becomes
OpenAI's `tool_calls` through a `ToolCallParser`, in one of four shapes:
  - "hermes" (Hermes, Qwen 2.5/3 templates; the built-in plain template): each call is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text;
  - "llama3_json" (Llama 3.1/3.2 templates): an answer that starts with `{` (after an optional
    `<|python_tag|>`) is calls `{"name": ..., "parameters": {...}}` separated by `;`;
  - tool_choice "required": the output is forced (structured output) to a JSON array of
    `{"name", "parameters"}` objects, one anyOf branch per tool, so that any model, the random
    built-in one too, emits well-formed calls (vLLM forces it the same way);
  - a named tool_choice: the output is forced to that function's parameters: the arguments.
The parser reads text as it comes and yields pieces (content text, a call's start with its
name, a piece of its arguments); a stream sends them as OpenAI's deltas and a whole answer
folds the same pieces, so the two always agree. A call's arguments are the model's own text of
the JSON value, unchanged. Plain Python: no per-request state outside the parser.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from workers.sequence import show

MAX_TOOLS = 128                         # OpenAI's limit on `tools`
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # fullmatch; OpenAI's rule (plus "." as vLLM takes)
PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")   # either name is taken for a call's arguments, in any shape


class ToolError(ValueError):
    """A tools field is malformed: its message names the problem, `param` the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks of its tools: `choice` "none" (the tools are shown to the model,
    nothing is parsed), "auto" (calls parsed in the template's `parser` format), "required" or
    "named" (`name`: forced by structured output); `parallel`: more than one call allowed."""
    choice: str
    parser: str = "hermes"
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches: Llama 3's JSON when it speaks of
    `<|python_tag|>` or ipython turns without Hermes' tags, else Hermes' (the plain template's)."""
    t = template or ""
    if HERMES_OPEN not in t and (PYTHON_TAG in t or "ipython" in t):
        return "llama3_json"
    return "hermes"


def tool_use(body: dict, parser: str) -> tuple[list[dict] | None, ToolUse | None, dict | None]:
    """(the tools as the chat template sees them, what is asked of them, the structured output
    that forces the call: `SamplingParams.structured`, or None). Raises ToolError naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {show(parallel)}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):           # (auto with no tools: nothing to call)
            raise ToolError(f"tool_choice {show(choice)} needs tools; the request has none", "tool_choice")
        return None, None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions, got {show(tools)}", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}, got {show(tool)}", "tools")
        name = fn.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', "
                            f"got {show(name)}", "tools")
        if name in functions:
            raise ToolError(f"tools[{i}]: the function name {show(name)} is given twice", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object, got {show(params)}",
                            "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        functions[name] = params if params is not None else {"type": "object"}
    use = _choice(choice, functions, parser, parallel is not False)
    return tools, use, _forcing(use, functions)


def _choice(choice, functions: dict, parser: str, parallel: bool) -> ToolUse:
    if choice is None or choice in ("none", "auto", "required"):
        return ToolUse(choice or "auto", parser, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        f"\"function\": {{\"name\": ...}}}}, got {show(choice)}", "tool_choice")
    if name not in functions:
        raise ToolError(f"tool_choice names the function {show(name)}, which is not among the tools", "tool_choice")
    return ToolUse("named", parser, name=name, parallel=False)


def _forcing(use: ToolUse, functions: dict) -> dict | None:
    """The structured output that forces the calls (required, named), as vLLM forces them."""
    if use.choice == "named":
        return {"json": json.dumps(functions[use.name])}
    if use.choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not use.parallel:
        schema["maxItems"] = 1
    return {"json": json.dumps(schema)}


# -- output -> tool_calls ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """What the parser read: `kind` "content" (text), "call" (call `index` starts: `text` is
    its function's name, `call_id` its id) or "args" (`text` more of call `index`'s arguments)."""
    kind: str
    text: str
    index: int = 0
    call_id: str = ""


class _CallObject:
    """One call's JSON object read a character at a time: its `name` once that string is whole,
    the raw text of its arguments value as it grows (`args`, trailing whitespace held back), and
    whether the object has closed (`done`). Tracks structure only (strings, escapes, nesting);
    the arguments are the model's text, not re-encoded."""

    def __init__(self):
        self.raw: list[str] = []
        self.depth = 0
        self.in_str = self.esc = False
        self.want = "key"                # at depth 1: key | colon | value | next
        self.key_start = self.value_start = -1
        self.key: str | None = None
        self.name: str | None = None
        self.args_start = self.args_end = -1
        self.done = False

    def feed(self, ch: str) -> None:
        at = len(self.raw)
        self.raw.append(ch)
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1:
                    self._string_closed(at)
            return
        if ch == '"':
            self.in_str = True
            if self.depth == 1:
                if self.want == "key":
                    self.key_start = at
                elif self.want == "value":
                    self._value_starts(at)
            return
        if ch in "{[":
            if self.depth == 1 and self.want == "value":
                self._value_starts(at)
            self.depth += 1
            return
        if ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.want == "in_value":
                self._value_ends(at + 1)
            elif self.depth == 0:
                if self.want == "in_value":          # a scalar value ends at the brace
                    self._value_ends(at)
                self.done = True
            return
        if self.depth != 1 or ch.isspace():
            return
        if ch == ":" and self.want == "colon":
            self.want = "value"
        elif ch == "," and self.want in ("in_value", "next"):
            if self.want == "in_value":
                self._value_ends(at)
            self.want = "key"
        elif self.want == "value":               # a number, true, false or null
            self._value_starts(at)

    def _value_starts(self, at: int) -> None:
        self.want, self.value_start = "in_value", at
        if self.key in ARGUMENT_KEYS and self.args_start < 0:
            self.args_start = at

    def _value_ends(self, end: int) -> None:
        text = "".join(self.raw[self.value_start:end]).strip()
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        if self.value_start == self.args_start:
            self.args_end = self.value_start + len(text)
        self.want = "next"

    def _string_closed(self, at: int) -> None:
        if self.want == "key":
            try:
                self.key = json.loads("".join(self.raw[self.key_start:at + 1]))
            except ValueError:
                self.key = None
            self.want = "colon"
        elif self.want == "in_value":
            self._value_ends(at + 1)

    def args_after(self, sent: int) -> str:
        """The arguments' text after its first `sent` characters, as far as it has come (all of
        it once the value has ended), trailing whitespace held back: a call's next delta."""
        if self.args_start < 0:
            return ""
        end = self.args_end if self.args_end >= 0 else len(self.raw)
        if self.args_end < 0 and end > 0 and self.raw[end - 1].isspace():
            return ""                    # (a run of whitespace is joined once, when it ends)
        return "".join(self.raw[self.args_start + sent:end]).rstrip()

    def text(self) -> str:
        return "".join(self.raw)


class ToolCallParser:
    """Turns a chat answer's text into content and tool calls as it arrives (`push`, then
    `finish` once). `use` says which shape the text has (see the module's docstring). Outside
    text is content, but whitespace that touches a call (before or after it) is dropped."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.out: list[Piece] = []
        self.calls = 0                      # calls started
        self.obj: _CallObject | None = None
        self.announced = False              # the current object's call start went out
        self.skipped = False                # the current object is a call dropped (parallel_tool_calls false)
        self.sent = 0                       # characters of its arguments sent
        self.held = ""                      # outside text not yet known to be content
        self.after_call = False             # a call came just before the held text
        self.prefix = ""                    # the text before the current object (content if it is no call)
        self.gap = ""                       # (hermes) whitespace before an opening tag, held with it
        self.state = "start"
        if use.choice == "named":
            self._start_call(use.name)

    def push(self, text: str) -> list[Piece]:
        for ch in text:
            self._feed(ch)
        if self.obj is not None:            # a call's arguments so far: once per push (the text is
            self._progress()                # joined each time: per character it would be quadratic)
        return self._take()

    def finish(self) -> list[Piece]:
        """The last pieces: what was held back, and a call cut short (its arguments as far as
        they came: the finish reason says why)."""
        if self.obj is not None:
            self._progress()
            if self.use.choice == "auto" and not (self.announced or self.skipped):
                self._content(self.prefix + self.obj.text())   # no call after all (forced ones: cut short)
        held = self.held.lstrip() if self.after_call else self.held
        if self.state == "close" and HERMES_CLOSE.startswith(held):
            held = ""                               # a closing tag cut short
        if self.state == "open":                    # "<tool_call>" and whitespace, nothing after
            held = self.gap + HERMES_OPEN + held
        self._content(held)
        self.held = ""
        return self._take()

    # -- the shapes ------------------------------------------------------------------------------
    def _feed(self, ch: str) -> None:
        if self.use.choice == "named":
            self._named(ch)
        elif self.use.choice == "required":
            self._sequence(ch, "[", ",", "]")
        elif self.use.parser == "llama3_json":
            self._sequence(ch, None, ";", None)
        else:
            self._hermes(ch)

    def _named(self, ch: str) -> None:
        """The whole output is the named function's arguments."""
        if self.obj is None:
            if ch.isspace():
                return
            self.obj = _CallObject()
            self.obj.key, self.obj.args_start = "arguments", 0
        if not self.obj.done:
            self.obj.feed(ch)
            if self.obj.done:
                self.obj.args_end = len(self.obj.raw)

    def _sequence(self, ch: str, opener: str | None, sep: str, closer: str | None) -> None:
        """Calls one after another (Llama 3's `;`-separated objects, or the forced JSON array);
        an answer that does not start as calls is content, and so is any text after them that
        is not another call."""
        if self.state == "content":
            self.held += ch
            self._release()
        elif self.obj is not None:
            self._object(ch)
        elif self.state == "start":
            self.held += ch
            lead = self.held.lstrip()
            if opener is None:
                if PYTHON_TAG.startswith(lead):
                    return                          # maybe Llama's python tag: wait
                if lead.startswith(PYTHON_TAG):
                    lead = lead[len(PYTHON_TAG):].lstrip()
            if not lead:
                return
            if lead == (opener or "{"):
                before, self.held, self.state = self.held[:-1], "", "between"
                if opener is None:
                    self._new_object(ch, before)
            else:
                self.state = "content"
                self._release()
        elif ch == "{":
            self._new_object(ch)
        elif not (ch.isspace() or ch == sep or ch == closer):
            self.state, self.held = "content", ch
            self._release()

    def _hermes(self, ch: str) -> None:
        """Calls between <tool_call> and </tool_call> anywhere in the text."""
        if self.obj is not None:
            self._object(ch)
            return
        self.held += ch
        if self.state == "open":                    # after <tool_call>: whitespace, then the object
            if ch == "{":
                before, self.held, self.state = self.gap + HERMES_OPEN + self.held[:-1], "", "call"
                self._new_object(ch, before)
            elif not ch.isspace():
                self.state, self.held = "start", self.gap + HERMES_OPEN + self.held
                self._release(HERMES_OPEN)
            return
        if self.state == "close":                   # after a call: its </tool_call>, or more text
            lead = self.held.lstrip()
            if HERMES_CLOSE.startswith(lead):
                if lead == HERMES_CLOSE:
                    self.held, self.state = "", "start"
                return
            self.state = "start"
        if self.held.endswith(HERMES_OPEN):
            before = self.held[:-len(HERMES_OPEN)]
            kept = before.strip() if self.after_call else before.rstrip()
            self._content(kept)
            self.gap = before[len(before.rstrip()):] if kept or not self.after_call else ""
            self.held, self.state = "", "open"
            return
        self._release(HERMES_OPEN)

    # -- helpers --------------------------------------------------------------------------------
    def _new_object(self, ch: str, prefix: str = "") -> None:
        self.obj, self.announced, self.skipped, self.sent = _CallObject(), False, False, 0
        self.prefix = prefix
        self._object(ch)

    def _object(self, ch: str) -> None:
        obj = self.obj
        obj.feed(ch)
        if obj.name is not None and not (self.announced or self.skipped):
            self._progress()                        # the call starts as soon as its name is known
        if not obj.done:
            return
        self._progress()
        is_call = self.announced or self.skipped
        if not is_call and self.use.choice == "auto":   # an object that was no call: content after all
            self._content(self.prefix + obj.text())
        self.obj, self.held, self.after_call = None, "", is_call
        if self.use.choice == "auto" and self.use.parser == "hermes":
            self.state = "close" if is_call else "start"
        elif not is_call:
            self.state = "content"

    def _progress(self) -> None:
        """Starts the current call once its name is known, then sends its arguments' growth."""
        obj = self.obj
        if not (self.announced or self.skipped) and obj.name is not None:
            if self.calls and not self.use.parallel:
                self.skipped = True                 # parallel_tool_calls false: the first call only
            else:
                self._start_call(obj.name)
        if self.announced:
            more = obj.args_after(self.sent)
            if more:
                self.out.append(Piece("args", more, self.calls - 1))
                self.sent += len(more)

    def _start_call(self, name: str) -> None:
        self.out.append(Piece("call", name, self.calls, "call_" + uuid.uuid4().hex[:24]))
        self.calls += 1
        self.announced, self.sent = True, 0

    def _release(self, hold: str = "") -> None:
        """Sends the held outside text as content, but for its trailing whitespace (dropped if a
        call follows) and a tail that could still grow into `hold` (the opening tag)."""
        text = self.held
        if text[-1:].isspace():
            return                                  # nothing new to send (a run of it is rstripped once;
            #                                         still copied as it grows: memcpy-quadratic, 75 ms at 40k)
        keep = next((k for k in range(min(len(hold) - 1, len(text)), 0, -1) if hold.startswith(text[-k:])), 0)
        body = text[:len(text) - keep].rstrip()
        send = body.lstrip() if self.after_call else body
        if send:
            self._content(send)
            self.after_call = False
            self.held = text[len(body):]

    def _content(self, text: str) -> None:
        if text:
            self.out.append(Piece("content", text))

    def _take(self) -> list[Piece]:
        out, self.out = self.out, []
        return out


def tool_finish_reason(use: ToolUse, reason: str | None, calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" when an answer that ended on its own made calls
    (a named tool_choice ends with "stop", as OpenAI's does)."""
    return "tool_calls" if reason == "stop" and calls and use.choice in ("auto", "required") else reason


def fold(pieces: list[Piece]) -> tuple[str, list[dict]]:
    """A whole answer from its pieces: (content, OpenAI's tool_calls)."""
    content, calls = [], []
    for p in pieces:
        if p.kind == "content":
            content.append(p.text)
        elif p.kind == "call":
            calls.append({"id": p.call_id, "type": "function", "function": {"name": p.text, "arguments": ""}})
        else:
            calls[p.index]["function"]["arguments"] += p.text
    return "".join(content), calls


def deltas(pieces: list[Piece]) -> tuple[str, list[dict]]:
    """A stream chunk's delta from its pieces: (content, OpenAI's tool_calls deltas), a call's
    start and its arguments so far in one entry."""
    content, calls = [], []
    for p in pieces:
        if p.kind == "content":
            content.append(p.text)
        elif p.kind == "call":
            calls.append({"index": p.index, "id": p.call_id, "type": "function",
                          "function": {"name": p.text, "arguments": ""}})
        elif calls and calls[-1]["index"] == p.index:
            calls[-1]["function"]["arguments"] += p.text
        else:
            calls.append({"index": p.index, "function": {"arguments": p.text}})
    return "".join(content), calls
