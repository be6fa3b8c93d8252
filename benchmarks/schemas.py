"""A suite of JSON schemas of the kinds applications send (nested objects, arrays with bounds,
enums, anyOf, numbers with ranges, string patterns), built from a seed: tests/test_structured.py
validates constrained outputs against each, benchmarks/bench_sampling_params.py times their
compilation. Every string is bounded (a pattern, an enum or maxLength), so that even a model
with random weights finishes each object well within a few hundred tokens."""
from __future__ import annotations

import random


def _leaf(rng: random.Random) -> dict:
    kind = rng.randrange(7)
    if kind == 0:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 9, 99, 999])}
    if kind == 1:     # (not a float range: nothing bounds a fraction's digits, and a random model's run on)
        return {"type": "integer", "exclusiveMinimum": -1, "exclusiveMaximum": rng.choice([2, 100])}
    if kind == 2:
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "none", "x"], rng.randrange(1, 5))}
    if kind == 3:
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^[A-Z][0-9]{3}$", r"^(yes|no)$"])}
    if kind == 4:
        return {"type": "string", "maxLength": rng.randrange(0, 6)}
    if kind == 5:
        return {"type": "boolean"}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}, {"enum": ["n/a"]}]}


def _node(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth < 3 and roll < 0.25:
        return _object(rng, depth + 1)
    if depth < 3 and roll < 0.45:
        lo = rng.randrange(0, 3)
        return {"type": "array", "items": _node(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randrange(0, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "tags", "size", "kind", "meta", "owner", "items", "score", "flag"],
                       rng.randrange(1, 5))
    props = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema_suite(n: int = 50, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]
