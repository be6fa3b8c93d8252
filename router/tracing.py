"""OpenTelemetry traces of requests: one trace per request, across the router and the workers.
Off unless `--otlp-traces-endpoint` names an OTLP/HTTP collector (Jaeger, Tempo, the
OpenTelemetry Collector: `http://host:4318`, or the full `.../v1/traces`).

A request's spans (times from each process's own clock: the router's spans from the router's,
a worker's from the worker's, which it sends with the request's events):

    request                  the HTTP request, arrival to the response's end (a SERVER span; it
                             continues the client's W3C `traceparent` when one is sent)
      router.validate        the body read, parsed, tokenized (its wait in the validation line too)
      router.admission       admission's word: the predicted TTFT, admitted or refused
      attempt                one run on the workers (a resumed request has several)
        router.gate          the decode gate's wait (only the first attempt passes it)
        prefill              on the prefill worker (colocated: the worker), arrival to first token
          prefill.queue      arrival to its first engine step
          prefill.compute    its first step to its first token; an event per step (tokens computed)
        decode.queue         the decode worker: the handoff's wait for room
        handoff              the KV pull: bytes, blocks skipped (the decode side's prefix cache
                             held them), the transport (shm, gloo, nccl), streamed or not
        decode               from the KV committed (or the first token, colocated) to the end; an
                             event per step
      resume                 why an attempt ended (its cause) and the tokens delivered before it

The workers need no tracing library: an op carries the traceparent of its attempt's span
(`messages.GenerateOp.trace`), the worker times the request (workers/traces.py) and sends each
finished part with the request's events; the router makes the spans under that parent. The
router writes OTLP's protobuf itself (opentelemetry-proto's messages), a request's spans at its
end, in batches from a thread: the OpenTelemetry SDK's span objects and its exporter cost about
three times as much CPU per request (1.4 ms against 0.43 for a 64-token stream's 11 spans and
their 64 step events, the workers' records included), which the served path pays on the
router's core.

Each traced request's time to first token is also kept by phase (`RequestTrace.phases`): the
router's part (validation, admission, picking), the decode gate, the op's way to its worker,
the prefill queue and compute, the first token's way back; and after it the handoff's wait, its
pull and the decode queue. `GET /debug/phases` answers the recent ones by trace id, which
`pdcluster bench` reads for its report.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from workers.messages import TraceRecord

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_warned = False              # a record that could not be read has been logged
KEPT_PHASES = 16384          # traced requests whose phases /debug/phases keeps (the newest)
MAX_QUEUED_SPANS = 100_000   # spans waiting for their export, at most (past it the oldest requests' go)
EXPORT_TIMEOUT_S = 10.0
TTFT_PHASES = ("router", "gate", "dispatch", "prefill_queue", "prefill_compute", "return")
AFTER_FIRST_TOKEN = ("handoff_wait", "decode_queue", "handoff")


def _ns(t: float) -> int:
    return int(t * 1e9)


def collector_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint given as a base (OTEL_EXPORTER_OTLP_ENDPOINT's
    meaning: `/v1/traces` is added) or in full."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    """The router's tracer: spans queued by request, sent every `export_delay_s` to an OTLP/HTTP
    collector from a thread of its own (`sink(payload)` instead, when given: the serialized
    ExportTraceServiceRequest). A collector that fails costs the spans of that batch, said in
    the log once a minute, never a request."""

    def __init__(self, endpoint: str, service_name: str = "pdcluster", export_delay_s: float = 1.0, sink=None):
        self.endpoint = collector_url(endpoint)
        if httpx.URL(self.endpoint).port == 4317:
            log.warning("traces go to %s over OTLP/HTTP, but 4317 is OTLP/gRPC's port: a collector's OTLP/HTTP "
                        "receiver listens on 4318 by default", self.endpoint)
        self.resource = Resource(attributes=[_kv("service.name", service_name)])
        self.scope = InstrumentationScope(name="pdcluster")
        self.phases: OrderedDict[str, dict] = OrderedDict()      # trace id (hex) -> its request's phases
        self.sink = sink or self._post
        self.export_delay_s = export_delay_s
        self.dropped = 0                                          # spans lost to a full queue or a failed send
        self._queue: list[Span] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._said_at = -60.0
        self._http: httpx.Client | None = None
        self._thread = threading.Thread(target=self._run, name="trace-export", daemon=True)
        self._thread.start()

    def start(self, headers) -> RequestTrace:
        """A request's trace, from its arrival now; `headers`: its HTTP headers (lower-case
        names), whose `traceparent` it continues."""
        return RequestTrace(self, time.time(), headers.get(TRACEPARENT))

    def keep(self, trace_id: str, phases: dict) -> None:
        self.phases[trace_id] = phases
        while len(self.phases) > KEPT_PHASES:
            self.phases.popitem(last=False)

    def queue(self, spans: list[Span]) -> None:
        with self._lock:
            self._queue += spans
            over = len(self._queue) - MAX_QUEUED_SPANS
            if over > 0:
                del self._queue[:over]
                self.dropped += over

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.export_delay_s)
            self._wake.clear()
            self._send()

    def _send(self) -> bool:
        with self._lock:
            spans, self._queue = self._queue, []
        if not spans:
            return True
        payload = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=self.resource, scope_spans=[ScopeSpans(scope=self.scope, spans=spans)])]).SerializeToString()
        try:
            self.sink(payload)
            return True
        except Exception as e:
            self.dropped += len(spans)
            now = time.monotonic()
            if now - self._said_at >= 60:
                self._said_at = now
                log.warning("traces: %d spans not sent to %s: %s (%d lost so far; said at most once a minute)",
                            len(spans), self.endpoint, e, self.dropped)
            return False

    def _post(self, payload: bytes) -> None:
        if self._http is None:
            self._http = httpx.Client(timeout=EXPORT_TIMEOUT_S, trust_env=False)
        r = self._http.post(self.endpoint, content=payload, headers={"Content-Type": "application/x-protobuf"})
        if r.status_code >= 300:
            raise RuntimeError(f"the collector answered HTTP {r.status_code}")

    def flush(self) -> bool:
        """Send what is queued now (in the caller's thread); whether it went."""
        return self._send()

    def close(self) -> None:
        """Stop the export thread and send what is left."""
        self._stopping = True
        self._wake.set()
        self._thread.join(EXPORT_TIMEOUT_S + 5)
        self._send()
        if self._http is not None:
            self._http.close()


def _parse_traceparent(header: str | None) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) of a W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex>"), or None
    for a missing or malformed one (then the request starts a trace of its own)."""
    if not header or len(header) < 55:
        return None
    parts = header.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id


def _traceparent(trace_id: bytes, span_id: bytes) -> str:
    return f"00-{trace_id.hex()}-{span_id.hex()}-01"


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _attrs(attrs: dict) -> list[KeyValue]:
    """Span attributes under pdcluster's namespace (a key with a dot is kept as it is); None and
    NaN left out."""
    return [_kv(k if "." in k else f"pdcluster.{k}", v) for k, v in attrs.items()
            if v is not None and not (isinstance(v, float) and v != v)]


class RequestTrace:
    """One request's spans: the request's own from its arrival, each attempt's while it runs,
    the workers' parts as they come; all sent at its end. Event-loop only."""

    def __init__(self, tracing: Tracing, arrived: float, traceparent: str | None):
        self.tracing, self.arrived = tracing, arrived
        parent = _parse_traceparent(traceparent)
        self._tid, self._client_span = parent if parent is not None else (os.urandom(16), b"")
        self._root_id = os.urandom(8)
        self.trace_id = self._tid.hex()
        self._spans: list[Span] = []
        self._attempts: dict[str, tuple] = {}        # rid -> (span id, start, traceparent, number)
        self._tp_rid: dict[str, str] = {}            # an attempt's traceparent -> its rid
        self.marks: dict[str, float] = {}            # the router's instants: admitted, gate, submitted, ...
        self.prefill: TraceRecord | None = None      # the first prefill part a worker sent
        self.decode: TraceRecord | None = None       # and the first decode part
        self.finish_reason: str | None = None
        self.tokens = 0                              # output tokens of its requests that finished
        self.ended = False

    def _span(self, name: str, start: float, end: float, parent: bytes | None = None, attrs: dict | None = None,
              events=(), error: str | None = None, span_id: bytes | None = None, kind=Span.SPAN_KIND_INTERNAL,
              ) -> bytes:
        sid = span_id or os.urandom(8)
        self._spans.append(Span(
            trace_id=self._tid, span_id=sid, parent_span_id=self._root_id if parent is None else parent,
            name=name, kind=kind, start_time_unix_nano=_ns(start), end_time_unix_nano=_ns(max(start, end)),
            attributes=_attrs(attrs) if attrs else None, events=events or None,
            status=Status(code=Status.STATUS_CODE_ERROR, message=error) if error else None))
        return sid

    def validated(self) -> None:
        self.marks["validated"] = now = time.time()
        self._span("router.validate", self.arrived, now)

    def admission(self, start: float, admitted: bool, predicted_ttft_s: float, code: str = "") -> None:
        self._span("router.admission", start, time.time(), attrs={
            "admitted": admitted, "predicted_ttft_s": predicted_ttft_s, "refused_for": code or None})

    def attempt(self, rid: str, number: int) -> str:
        """An attempt starts: its span, whose traceparent its ops carry to the workers."""
        sid = os.urandom(8)
        tp = _traceparent(self._tid, sid)
        self._attempts[rid] = (sid, time.time(), tp, number)
        self._tp_rid[tp] = rid
        return tp

    def traceparent(self, rid: str) -> str:
        """What attempt `rid`'s ops carry ("" for one this trace did not start)."""
        a = self._attempts.get(rid)
        return "" if a is None else a[2]

    def gate(self, rid: str, start: float, end: float) -> None:
        self.marks.setdefault("gate_start", start)
        self.marks.setdefault("gate_end", end)
        if rid in self._attempts:
            self._span("router.gate", start, end, self._attempts[rid][0])

    def submitted(self, rid: str) -> None:
        self.marks[f"submitted:{rid}"] = time.time()

    def attempt_ended(self, rid: str, error: str | None = None) -> None:
        a = self._attempts.pop(rid, None)
        if a is not None:
            sid, start, _, number = a
            self._span("attempt", start, time.time(), attrs={"rid": rid, "attempt": number}, error=error,
                       span_id=sid)

    def resumed(self, cause: str, delivered: int, error: str) -> None:
        t = time.time()
        self._span("resume", t, t, attrs={"cause": cause, "tokens_delivered": delivered, "error": error})

    def first_token(self) -> None:
        self.marks.setdefault("first_token", time.time())

    def finished(self, reason: str | None, tokens: int) -> None:
        self.finish_reason = reason
        self.tokens += tokens

    def worker(self, rec: TraceRecord) -> None:
        """A worker's finished part of the request: its spans under the attempt it names. A
        record this router cannot read costs its spans, never the request."""
        try:
            self._worker(rec)
        except Exception:
            global _warned
            if not _warned:
                log.warning("a worker's trace record of %s could not be made into spans (said once)",
                            self.trace_id, exc_info=True)
                _warned = True

    def _worker(self, rec: TraceRecord) -> None:
        parent = _parse_traceparent(rec.parent)
        if parent is None or parent[0] != self._tid:
            raise ValueError(f"a record under {rec.parent!r}, not this trace")
        at, m = parent[1], rec.marks
        who = {"pdcluster.worker": rec.worker_id}
        steps = [Span.Event(time_unix_nano=_ns(start), name="step", attributes=[_kv("tokens", int(n))])
                 for start, _end, n in rec.steps]
        if rec.part == "prefill":
            if self.prefill is None:
                self.prefill = rec
            end = m.get("first_token", m["arrived"])
            first_step = m.get("first_step", end)
            top = self._span("prefill", m["arrived"], end, at, who)
            self._span("prefill.queue", m["arrived"], first_step, top, who)
            self._span("prefill.compute", first_step, end, top, who, steps)
            return
        if self.decode is None:
            self.decode = rec
        if "reserved" in m and "arrived" in m:
            self._span("decode.queue", m["arrived"], m["reserved"], at, who)
        if "pull_start" in m:
            self._span("handoff", m["pull_start"], m["pull_end"], at, {**who, **{
                k: rec.attrs[k] for k in ("bytes", "blocks_skipped", "transport", "streamed") if k in rec.attrs}})
        start = m.get("committed") or m.get("first_token") or m["arrived"]    # (colocated: from its first token)
        self._span("decode", start, m.get("finished", start), at,
                   {**who, "steps_left_out": rec.attrs.get("steps_left_out", 0)}, steps)

    def end(self, status: int) -> None:
        """The response is over (`status`: its HTTP status): every span goes to the export."""
        if self.ended:
            return
        self.ended = True
        for rid in list(self._attempts):
            self.attempt_ended(rid, "the response ended first")
        attrs = {"http.response.status_code": status, "pdcluster.completion_tokens": self.tokens,
                 "pdcluster.finish_reason": self.finish_reason}
        self._span("request", self.arrived, time.time(), self._client_span, attrs,
                   error=f"HTTP {status}" if status >= 400 else None, span_id=self._root_id,
                   kind=Span.SPAN_KIND_SERVER)
        self.tracing.queue(self._spans)
        self._spans = []
        phases = self.phases()
        if phases is not None:
            self.tracing.keep(self.trace_id, phases)

    def phases(self) -> dict | None:
        """Seconds of each part of the time to first token (TTFT_PHASES; their sum is the
        router's TTFT: arrival to its first token's chunk), then the parts after it
        (AFTER_FIRST_TOKEN); None when no worker sent a prefill part before the first token."""
        m, rec = self.marks, self.prefill
        if rec is None or "first_token" not in m:
            return None
        submitted = m.get(f"submitted:{self._tp_rid.get(rec.parent)}")
        if submitted is None:
            return None
        w = rec.marks
        first_step = w.get("first_step", w.get("first_token", w["arrived"]))
        worker_first = w.get("first_token", first_step)
        gate = m.get("gate_end", 0.0) - m.get("gate_start", 0.0)
        out = {"ttft": m["first_token"] - self.arrived,
               "router": submitted - self.arrived - gate, "gate": gate,
               "dispatch": w["arrived"] - submitted,
               "prefill_queue": first_step - w["arrived"],
               "prefill_compute": worker_first - first_step,
               "return": m["first_token"] - worker_first}
        d = self.decode
        if d is not None and "pull_start" in d.marks:
            dm = d.marks
            out["handoff_wait"] = dm["arrived"] - worker_first
            out["decode_queue"] = dm.get("reserved", dm["arrived"]) - dm["arrived"]
            out["handoff"] = dm["pull_end"] - dm["pull_start"]
            out["handoff_bytes"] = d.attrs.get("bytes", 0)
        return out
