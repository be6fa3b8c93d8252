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
                             held them), the mover, streamed or not
        decode               from the KV committed (or the first token, colocated) to the end; an
                             event per step
      resume                 why an attempt ended (its cause) and the tokens delivered before it

The workers need no tracing library: an op carries the traceparent of its attempt's span
(`messages.GenerateOp.trace`), the worker times the request (workers/traces.py) and sends each
finished part with the request's events; the router makes the spans under that parent.

Each traced request's time to first token is also kept by phase (`RequestTrace.phases`): the
router's part (validation, admission, picking), the decode gate, the op's way to its worker,
the prefill queue and compute, the first token's way back; and after it the handoff's wait, its
pull and the decode queue. `GET /debug/phases` answers the recent ones by trace id, which
`pdcluster bench` reads for its report.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

from workers.messages import TraceRecord

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_warned = False              # a record that could not be read has been logged
KEPT_PHASES = 16384          # traced requests whose phases /debug/phases keeps (the newest)
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
    """The router's tracer: OTLP/HTTP export in batches from a thread of the SDK's own. Its own
    provider, not the process-wide one (Ray's tracing hooks read that)."""

    def __init__(self, endpoint: str, service_name: str = "pdcluster", export_delay_s: float = 1.0, exporter=None):
        """`exporter`: an OpenTelemetry SpanExporter to use instead of OTLP/HTTP to `endpoint`."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = collector_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = exporter if exporter is not None else OTLPSpanExporter(endpoint=self.endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_s * 1000))
        self.tracer = self.provider.get_tracer("pdcluster")
        self.propagator = TraceContextTextMapPropagator()
        self.phases: OrderedDict[str, dict] = OrderedDict()      # trace id (hex) -> its request's phases

    def start(self, headers: dict[str, str]) -> RequestTrace:
        """A request's trace, from its arrival now; `headers`: its HTTP headers (lower-case
        names), whose `traceparent` it continues."""
        return RequestTrace(self, time.time(), headers.get(TRACEPARENT))

    def context_of(self, traceparent: str | None):
        return self.propagator.extract({TRACEPARENT: traceparent} if traceparent else {})

    def traceparent_of(self, span) -> str:
        from opentelemetry import trace
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT, "")

    def keep(self, trace_id: str, phases: dict) -> None:
        self.phases[trace_id] = phases
        while len(self.phases) > KEPT_PHASES:
            self.phases.popitem(last=False)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's spans: the request's own from its arrival, each attempt's while it runs,
    the workers' parts as they come. Event-loop only."""

    def __init__(self, tracing: Tracing, arrived: float, traceparent: str | None):
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        self._trace = trace
        self.tracing, self.arrived = tracing, arrived
        self.root = tracing.tracer.start_span("request", context=tracing.context_of(traceparent),
                                              kind=SpanKind.SERVER, start_time=_ns(arrived))
        self.trace_id = f"{self.root.get_span_context().trace_id:032x}"
        self._attempts: dict[str, tuple] = {}        # rid -> (its span, its traceparent)
        self.marks: dict[str, float] = {}            # the router's instants: admitted, gate, submitted, ...
        self.prefill: TraceRecord | None = None      # the first prefill part a worker sent
        self.decode: TraceRecord | None = None       # and the first decode part
        self._tp_rid: dict[str, str] = {}            # an attempt's traceparent -> its rid
        self.finish_reason: str | None = None
        self.tokens = 0                              # output tokens of its requests that finished
        self.ended = False

    def _ctx(self, span):
        return self._trace.set_span_in_context(span)

    def span(self, name: str, start: float, end: float, parent=None, **attrs) -> None:
        """A finished child span (of the request's own, or of `parent`)."""
        s = self.tracing.tracer.start_span(name, context=self._ctx(parent or self.root),
                                           start_time=_ns(start), attributes=_attrs(attrs))
        s.end(end_time=_ns(end))

    def validated(self) -> None:
        self.marks["validated"] = now = time.time()
        self.span("router.validate", self.arrived, now)

    def admission(self, start: float, admitted: bool, predicted_ttft_s: float, code: str = "") -> None:
        now = time.time()
        self.span("router.admission", start, now, admitted=admitted, predicted_ttft_s=predicted_ttft_s,
                  refused_for=code)

    def attempt(self, rid: str, number: int) -> str:
        """An attempt starts: its span, whose traceparent its ops carry to the workers."""
        span = self.tracing.tracer.start_span("attempt", context=self._ctx(self.root),
                                              attributes=_attrs({"rid": rid, "attempt": number}))
        tp = self.tracing.traceparent_of(span)
        self._attempts[rid] = (span, tp)
        self._tp_rid[tp] = rid
        return tp

    def traceparent(self, rid: str) -> str:
        """What attempt `rid`'s ops carry ("" for one this trace did not start)."""
        return self._attempts.get(rid, (None, ""))[1]

    def gate(self, rid: str, start: float, end: float) -> None:
        self.marks.setdefault("gate_start", start)
        self.marks.setdefault("gate_end", end)
        if rid in self._attempts:
            self.span("router.gate", start, end, self._attempts[rid][0])

    def submitted(self, rid: str) -> None:
        self.marks[f"submitted:{rid}"] = time.time()

    def attempt_ended(self, rid: str, error: str | None = None) -> None:
        span, _ = self._attempts.pop(rid, (None, None))
        if span is not None:
            if error:
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
            span.end()

    def resumed(self, cause: str, delivered: int, error: str) -> None:
        t = time.time()
        self.span("resume", t, t, cause=cause, tokens_delivered=delivered, error=error)

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
        ctx = self.tracing.context_of(rec.parent)
        m, tracer = rec.marks, self.tracing.tracer
        who = {"pdcluster.worker": rec.worker_id}

        def child(name, start, end, parent_ctx, **attrs):
            s = tracer.start_span(name, context=parent_ctx, start_time=_ns(start), attributes={**who, **_attrs(attrs)})
            return s, end

        def steps(span, kind):
            for start, _end, tokens in rec.steps:
                span.add_event(kind, {"tokens": int(tokens)}, timestamp=_ns(start))

        if rec.part == "prefill":
            if self.prefill is None:
                self.prefill = rec
            end = m.get("first_token", m["arrived"])
            first_step = m.get("first_step", end)
            top, _ = child("prefill", m["arrived"], end, ctx)
            inner = self._ctx(top)
            q, _ = child("prefill.queue", m["arrived"], first_step, inner)
            q.end(end_time=_ns(first_step))
            c, _ = child("prefill.compute", first_step, end, inner)
            steps(c, "step")
            c.end(end_time=_ns(end))
            top.end(end_time=_ns(end))
            return
        if self.decode is None:
            self.decode = rec
        if "reserved" in m and "arrived" in m:
            s, end = child("decode.queue", m["arrived"], m["reserved"], ctx)
            s.end(end_time=_ns(end))
        if "pull_start" in m:
            attrs = {k: rec.attrs[k] for k in ("bytes", "blocks_skipped", "mover", "streamed") if k in rec.attrs}
            s, end = child("handoff", m["pull_start"], m["pull_end"], ctx, **attrs)
            s.end(end_time=_ns(end))
        start = m.get("committed") or m.get("first_token") or m["arrived"]    # (colocated: from its first token)
        end = m.get("finished", start)
        s, _ = child("decode", start, end, ctx, steps_left_out=rec.attrs.get("steps_left_out", 0))
        steps(s, "step")
        s.end(end_time=_ns(end))

    def end(self, status: int) -> None:
        """The response is over (`status`: its HTTP status)."""
        if self.ended:
            return
        self.ended = True
        for rid in list(self._attempts):
            self.attempt_ended(rid, "the response ended first")
        attrs = {"http.response.status_code": status, "pdcluster.completion_tokens": self.tokens}
        if self.finish_reason is not None:
            attrs["pdcluster.finish_reason"] = self.finish_reason
        self.root.set_attributes(attrs)
        if status >= 400:
            self.root.set_status(self._trace.Status(self._trace.StatusCode.ERROR, f"HTTP {status}"))
        self.root.end()
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


def _attrs(attrs: dict) -> dict:
    """Span attributes under pdcluster's namespace; None and NaN left out."""
    out = {}
    for k, v in attrs.items():
        if v is None or (isinstance(v, float) and v != v):
            continue
        out[k if "." in k else f"pdcluster.{k}"] = v
    return out
