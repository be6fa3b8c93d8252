"""OpenAI request validation: JSON bodies in, a typed request or an `APIError` out."""
from __future__ import annotations

from dataclasses import dataclass

from workers.sequence import SamplingParams


class APIError(Exception):
    """Rendered as OpenAI's error JSON with the HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass(slots=True)
class GenerationRequest:
    kind: str                                  # "completion" | "chat"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0


_SAMPLING = {"max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
             "seed": int, "ignore_eos": bool, "stop_token_ids": list}


def _typed(body: dict, name: str, types, default=None):
    """body[name] if it has one of `types` (a JSON true is not an integer here), else a 400."""
    v = body.get(name, default)
    if v is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
        raise bad_request(f"'{name}' must be {_type_name(types)}, got {json_type(v)}", name)
    return v


def json_type(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def _type_name(types) -> str:
    if types == (int, float):
        return "a number"
    names = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", str: "a string"}
    return names.get(types, getattr(types, "__name__", str(types)))


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    kw = {}
    for name, types in _SAMPLING.items():
        v = _typed(body, name, types)
        if v is not None:
            kw[name] = v
    if "max_tokens" not in kw and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = _typed(body, "max_completion_tokens", int)
    kw.setdefault("max_tokens", default_max_tokens)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise bad_request("'stop' must be a string or a list of strings", "stop")
        kw["stop"] = stop
    logprobs = body.get("logprobs")
    if body.get("top_logprobs") is not None:       # chat: logprobs=true, top_logprobs=N
        logprobs = _typed(body, "top_logprobs", int) if logprobs else None
    elif logprobs is True:
        logprobs = 0
    elif logprobs is False:
        logprobs = None
    if logprobs is not None:
        if not isinstance(logprobs, int):
            raise bad_request("'logprobs' must be an integer", "logprobs")
        kw["logprobs"] = logprobs
    n = body.get("n", 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param if param in kw else None) from None
