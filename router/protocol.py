"""OpenAI request validation: JSON bodies in, a typed request or an `APIError` out."""
from __future__ import annotations

from dataclasses import dataclass

from workers.sequence import SAMPLING_FIELDS, SamplingParams


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


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """The request's sampling fields (SamplingParams' own names, plus OpenAI's spellings:
    max_completion_tokens, chat's logprobs=true + top_logprobs); SamplingParams validates."""
    kw = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if "max_tokens" not in kw and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    kw.setdefault("max_tokens", default_max_tokens)
    logprobs = kw.pop("logprobs", None)
    if body.get("top_logprobs") is not None:       # chat: logprobs=true, top_logprobs=N
        logprobs = body["top_logprobs"] if logprobs else None
    elif logprobs is True:
        logprobs = 0
    elif logprobs is False:
        logprobs = None
    if logprobs is not None:
        kw["logprobs"] = logprobs
    n = body.get("n", 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param if param in kw else None) from None
