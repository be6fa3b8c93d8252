"""Reading a Prometheus /metrics page: {'name{label="value",...}': value}, and sums over series."""
from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """Every sample of a text exposition, keyed by its name and labels as Prometheus prints them
    (labels sorted, no braces when there are none): 'pdcluster:x_total{role="decode",worker="d-0"}'."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[key(s.name, s.labels)] = s.value
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """GET a /metrics URL and parse it; httpx.HTTPError on a failed request or a non-200 status."""
    resp = httpx.get(url, timeout=timeout_s, trust_env=False)
    resp.raise_for_status()
    return parse(resp.text)


def key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}}"


def split(series: str) -> tuple[str, dict[str, str]]:
    """'name{a="1"}' -> ('name', {'a': '1'})."""
    name, _, rest = series.partition("{")
    return name, {k: _unescape(v) for k, v in _LABEL.findall(rest)}


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the series called `name` whose labels include `labels` (0 when none)."""
    out = 0.0
    for series, value in metrics.items():
        n, ls = split(series)
        if n == name and all(ls.get(k) == v for k, v in labels.items()):
            out += value
    return out


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
