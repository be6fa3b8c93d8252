"""Offline generation: JSONL requests in, JSONL results out, through one engine.

Python API:

    from cluster.offline import generate
    results = generate([{"prompt": "Hi", "max_tokens": 8, "temperature": 0}], model="tiny")
    # -> [{"token_ids": [...], "text": "...", "finish_reason": "length"}]
"""
from __future__ import annotations

import json
from pathlib import Path

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SAMPLING_FIELDS, SamplingParams

REQUEST_FIELDS = set(SAMPLING_FIELDS) | {"prompt", "prompt_token_ids", "priority", "id"}


class RequestError(ValueError):
    """A request the user wrote is malformed; the message says where and what."""


def parse_request(obj, where: str) -> dict:
    """One request dict -> {"prompt" | "prompt_token_ids", "params", "priority"}."""
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - REQUEST_FIELDS
    if unknown:
        raise RequestError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(REQUEST_FIELDS)}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise RequestError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
    if has_text and not isinstance(obj["prompt"], str):
        raise RequestError(f"{where}: 'prompt' must be a string")
    if has_ids and not (isinstance(obj["prompt_token_ids"], list)
                        and all(isinstance(t, int) for t in obj["prompt_token_ids"])):
        raise RequestError(f"{where}: 'prompt_token_ids' must be a list of integers")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"{where}: priority must be an integer, got {priority!r}")
    try:
        params = SamplingParams(**{k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    except (TypeError, ValueError) as e:
        raise RequestError(f"{where}: {e}") from None
    if params.max_tokens == 0 or params.prompt_logprobs is not None:
        raise RequestError(f"{where}: max_tokens must be at least 1 and prompt_logprobs is not taken here (a "
                           "prompt's logprobs are served by `pdcluster serve`: completions with echo and logprobs)")
    return {"prompt": obj.get("prompt"), "prompt_token_ids": obj.get("prompt_token_ids"),
            "params": params, "priority": priority, "where": where}


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"input file {str(path)!r} does not exist")
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        requests.append(parse_request(obj, where))
    return requests


def generate(requests: list[dict], model: str = "tiny", engine: LLMEngine | None = None,
             **engine_kwargs) -> list[dict]:
    """Requests as dicts (the JSONL fields) -> results as dicts, in input order."""
    parsed = [parse_request(r, f"request {i}") for i, r in enumerate(requests)]
    engine = engine or LLMEngine(EngineConfig(model=model, **engine_kwargs))
    return run(engine, parsed)


def run(engine: LLMEngine, parsed: list[dict]) -> list[dict]:
    try:
        results = engine.generate(parsed)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return [r.to_json() for r in results]
