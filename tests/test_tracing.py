"""Request traces (issue 31): a disaggregated cluster (1 prefill + 2 decode workers, `tiny`,
every request handed off) serves with `otlp_traces_endpoint` set to an OTLP/HTTP receiver in
this process, which decodes the protobuf payloads as a collector does. The oracles: the
client's own trace id and measured time to first token, the workers' own KV transfer totals,
the offline engine's tokens."""
from __future__ import annotations

import gzip
import json
import http.server
import os
import signal
import threading
import time

import httpx
import pytest
import ray
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                     ExportTraceServiceResponse)

from cluster.cli import main
from common import free_port, nothing_left_running, sse_events, wait_for
from router.tracing import AFTER_FIRST_TOKEN, TTFT_PHASES
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

MODEL = "tiny"
PROMPT = list(range(100, 160))


def spans_of(req: ExportTraceServiceRequest) -> list[tuple[str, dict]]:
    """(trace id, span) of each span an export holds, decoded as a collector reads it."""
    out = []
    for rs in req.resource_spans:
        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {}
                for a in s.attributes:
                    v = a.value
                    attrs[a.key] = getattr(v, v.WhichOneof("value"))
                out.append((s.trace_id.hex(), {
                    "name": s.name, "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                    "start": s.start_time_unix_nano / 1e9, "end": s.end_time_unix_nano / 1e9, "kind": s.kind,
                    "attrs": attrs, "events": [(e.name, e.time_unix_nano / 1e9, e.attributes[0].value.int_value)
                                               for e in s.events],
                    "error": s.status.code == s.status.STATUS_CODE_ERROR, "service": service}))
    return out


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, decoded, by trace id."""

    def __init__(self):
        self.spans: dict[str, list[dict]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.take(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, req) -> None:
        with self.lock:
            for trace_id, span in spans_of(req):
                self.spans.setdefault(trace_id, []).append(span)

    def trace(self, trace_id: str) -> list[dict]:
        """The trace's spans once its request span has come (it ends last)."""
        def spans():
            with self.lock:
                return list(self.spans.get(trace_id, []))
        return wait_for(spans, lambda s: any(x["name"] == "request" for x in s), 60,
                        describe=lambda: f"spans so far: {sorted(x['name'] for x in spans())}")

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cluster(ray_session, receiver):
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=2, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 512}})
    with ServingCluster(spec, port=free_port(), admission="queue", local_prefill_max_tokens=0,
                        otlp_traces_endpoint=receiver.url) as c:
        yield c


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def client(cluster):
    """One connection for the module's requests (a new httpx client costs tens of ms of setup,
    which a client's TTFT would count)."""
    with httpx.Client(base_url=cluster.base_url, timeout=120) as c:
        assert c.get("/models").status_code == 200
        yield c


def stream(client, max_tokens: int, header: str, on_chunk=None, sent: list | None = None) -> tuple[list[int], float]:
    """A greedy streamed completion sent with `header` as its traceparent: its token ids and the
    client's time to its first token (and into `sent`, when given, the wall-clock time it sent the
    request: the router's spans are on the same clock here)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    ids, ttft = [], None
    t0 = time.time()
    if sent is not None:
        sent.append(t0)
    with client.stream("POST", "/completions", json=body, headers={"traceparent": header}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.time() - t0
            event = sse_events(line + "\n\n")[0]
            ids += event["choices"][0]["token_ids"]
            if on_chunk is not None:
                on_chunk(len(ids))
    return ids, ttft


def offline(max_tokens: int) -> list[int]:
    engine = LLMEngine(EngineConfig(model=MODEL))
    return engine.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def transferred(cluster) -> int:
    """KV bytes the decode workers say they have pulled (their own totals)."""
    return sum(ray.get(w.handle.stats.remote(), timeout=30).kv_transfer.bytes
               for w in cluster.workers if w.role == "decode")


def by_name(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


def test_each_request_is_one_trace_across_router_and_workers_whose_phases_add_up_to_its_ttft(cluster, client,
                                                                                          receiver):
    bytes_before = transferred(cluster)
    want = offline(16)
    handoff_bytes = 0
    for _ in range(3):
        header, trace_id, client_span = traceparent()
        sent: list[float] = []
        ids, client_ttft = stream(client, 16, header, sent=sent)
        assert ids == want
        spans = receiver.trace(trace_id)
        named = by_name(spans)
        (root,) = named["request"]
        assert root["parent"] == client_span                       # the client's trace, continued
        assert root["attrs"]["pdcluster.finish_reason"] == "length"
        assert root["attrs"]["pdcluster.completion_tokens"] == 16
        ids_of = {s["span_id"]: s for s in spans}

        def parent(s):
            return ids_of[s["parent"]]["name"]
        for name in ("router.validate", "router.admission", "attempt"):
            assert [parent(s) for s in named[name]] == ["request"], name
        (attempt,) = named["attempt"]
        for name in ("router.gate", "prefill", "decode.queue", "handoff", "decode"):
            assert [parent(s) for s in named[name]] == ["attempt"], name
        for name in ("prefill.queue", "prefill.compute"):
            assert [parent(s) for s in named[name]] == ["prefill"], name
        # The workers' spans name the worker that timed them: the prefill and a decode worker.
        (prefill,), (decode,) = named["prefill"], named["decode"]
        assert prefill["attrs"]["pdcluster.worker"].startswith("prefill")
        assert decode["attrs"]["pdcluster.worker"].startswith("decode")
        assert named["handoff"][0]["attrs"]["pdcluster.worker"] == decode["attrs"]["pdcluster.worker"]
        assert named["prefill.compute"][0]["events"] and len(decode["events"]) == 15   # a step each
        # In time order on one machine's clock: each phase starts after the one before it.
        (queue,), (compute,) = named["prefill.queue"], named["prefill.compute"]
        assert root["start"] <= attempt["start"] <= prefill["start"] <= queue["end"] <= compute["end"]
        assert prefill["end"] <= named["handoff"][0]["start"] <= decode["start"] <= decode["end"] <= root["end"]
        assert named["handoff"][0]["attrs"]["pdcluster.transport"] == "shm"   # two workers of one node
        handoff_bytes += named["handoff"][0]["attrs"]["pdcluster.bytes"]

        # The phases of its first token add up to the router's TTFT, and within the client's
        # (which adds the request's and the chunk's way over loopback and the HTTP parsing: 1-3
        # ms on a quiet box; the bound leaves room for a busy one's scheduling).
        phases = httpx.get(f"http://{cluster.host}:{cluster.port}/debug/phases", timeout=30).json()
        assert phases["tracing"] is True
        p = phases["requests"][trace_id]
        assert all(p[k] >= -0.002 for k in (*TTFT_PHASES, *AFTER_FIRST_TOKEN)), p
        assert abs(sum(p[k] for k in TTFT_PHASES) - p["ttft"]) < 1e-6
        assert p["ttft"] <= client_ttft + 0.002
        assert client_ttft - p["ttft"] < 0.1 + 0.5 * client_ttft, (client_ttft, p)
        # On one clock the router's TTFT lies inside the client's: it starts after the client
        # sent and its first token goes out before the client read it, so what the client
        # measured beyond the phases is the loopback and HTTP way alone.
        assert sent[0] - 0.001 <= root["start"]
        assert root["start"] + p["ttft"] <= sent[0] + client_ttft + 0.001, (sent, root["start"], p, client_ttft)
        assert p["handoff_bytes"] == named["handoff"][0]["attrs"]["pdcluster.bytes"] > 0
    assert transferred(cluster) - bytes_before == handoff_bytes       # every pull is in a trace, bytes exact
    nothing_left_running(cluster)


def test_a_request_whose_decode_worker_is_killed_has_a_resume_span_and_its_tokens_unchanged(cluster, client,
                                                                                            receiver):
    max_tokens = 400
    want = offline(max_tokens)
    header, trace_id, _ = traceparent()
    killed = []

    def kill_its_decode_worker(n: int) -> None:
        if killed or n < 20:
            return
        for w in cluster.workers:
            if w.role == "decode" and ray.get(w.handle.stats.remote(), timeout=10).running > 0:
                os.kill(cluster.answering()[w.worker_id].pid, signal.SIGKILL)
                killed.append(w.worker_id)
                return
    ids, _ = stream(client, max_tokens, header, kill_its_decode_worker)
    assert killed and ids == want
    named = by_name(receiver.trace(trace_id))
    (resume,) = named["resume"]
    assert resume["attrs"]["pdcluster.cause"] in ("worker_died", "worker_hung"), resume
    assert resume["attrs"]["pdcluster.tokens_delivered"] >= 20
    first, second = sorted(named["attempt"], key=lambda s: s["start"])
    assert first["error"] and not second["error"]
    assert first["end"] <= resume["start"] <= second["start"] + 0.002
    # The resumed attempt ran on the workers again: its prefill and decode spans are there.
    assert {s["parent"] for s in named["decode"]} == {second["span_id"]}
    wait_for(lambda: sorted(cluster.answering()), lambda ws: len(ws) == 3, 120)
    nothing_left_running(cluster)


def test_samples_of_one_shared_start_are_traced_and_unchanged(cluster, client, receiver):
    """n = 2: the shared start (one prefill and handoff for both samples) is an attempt of its
    own with its prefill and handoff spans; the samples equal those of the untraced request."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 2,
            "ignore_eos": True}
    header, trace_id, _ = traceparent()
    traced = client.post("/completions", json=body, headers={"traceparent": header}).json()
    plain = client.post("/completions", json=body).json()
    assert [c["token_ids"] for c in traced["choices"]] == [c["token_ids"] for c in plain["choices"]]
    named = by_name(receiver.trace(trace_id))
    attempts = {s["attrs"]["pdcluster.rid"]: s for s in named["attempt"]}
    (carrier,) = [s for rid, s in attempts.items() if rid.endswith(".carrier")]
    assert len(attempts) == 3                                         # the carrier and each sample
    assert {s["parent"] for s in named["prefill"]} == {carrier["span_id"]}
    assert {s["parent"] for s in named["handoff"]} == {carrier["span_id"]}
    nothing_left_running(cluster)

def test_the_load_test_breaks_ttft_down_by_phase_and_names_the_slowest_traces(cluster, receiver, tmp_path, capsys):
    rc = main(["bench", "--disable-tqdm", "--base-url", f"http://{cluster.host}:{cluster.port}",
               "--dataset-name", "random", "--num-prompts", "24", "--random-input-len", "48",
               "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "6", "--metric-percentiles", "50,90",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    b = r["ttft_phases"]
    assert b["requests"] == b["of"] == 24 and "24 of 24 requests traced" in out
    for name, row in b["by_percentile"].items():
        assert abs(sum(row[k] for k in TTFT_PHASES) - row["ttft"]) < 1e-6, name
        assert row["handoff"] > 0 and row["prefill_compute"] > 0, row
    assert b["by_percentile"]["p50"]["ttft"] <= b["by_percentile"]["p90"]["ttft"]
    # The slowest requests are named by trace id, the client's slowest first, and each is a trace
    # the collector has.
    ttft_of = dict(zip(r["trace_ids"], r["ttfts"]))
    slowest = [x["trace_id"] for x in b["slowest"]]
    assert slowest == sorted(r["trace_ids"], key=lambda t: -ttft_of[t])[:5]
    assert all(receiver.trace(t) for t in slowest)
    assert (tmp_path / "r-ttft-phases.png").stat().st_size > 10_000
    nothing_left_running(cluster)



def test_a_colocated_worker_traces_a_request_it_prefills_and_decodes(ray_session, receiver):
    """The other way a request runs: one worker prefills and decodes it (colocated here; also a
    disaggregated cluster's short prompts, prefilled on their decode worker): its prefill and
    decode spans come from that worker, with no handoff between them."""
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    spec = ClusterSpec(model=MODEL, mode="colocated", num_colocated=1, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 512}})
    with ServingCluster(spec, port=free_port(), admission="queue", otlp_traces_endpoint=receiver.url) as c, \
            httpx.Client(base_url=c.base_url, timeout=120) as client:
        header, trace_id, _ = traceparent()
        ids, client_ttft = stream(client, 16, header)
        assert ids == offline(16)
        named = by_name(receiver.trace(trace_id))
        (attempt,), (prefill,), (decode,) = named["attempt"], named["prefill"], named["decode"]
        assert prefill["parent"] == decode["parent"] == attempt["span_id"] and "handoff" not in named
        assert prefill["attrs"]["pdcluster.worker"] == decode["attrs"]["pdcluster.worker"]
        assert decode["start"] == prefill["end"] and len(decode["events"]) == 15
        p = httpx.get(f"http://{c.host}:{c.port}/debug/phases", timeout=30).json()["requests"][trace_id]
        assert abs(sum(p[k] for k in TTFT_PHASES) - p["ttft"]) < 1e-6 and p["ttft"] <= client_ttft + 0.002
        nothing_left_running(c)

# -- a worker's records made into spans, without a cluster -----------------------------------
class Seq:
    def __init__(self, seq_id: str):
        self.seq_id = seq_id


def in_memory_tracing():
    """A Tracing whose exports land in a list (flushed by hand), and a reader of its spans."""
    from router.tracing import Tracing
    payloads: list[bytes] = []
    tracing = Tracing("http://127.0.0.1:9", sink=payloads.append, export_delay_s=3600)

    def exported() -> dict[str, dict]:
        tracing.flush()
        spans = {}
        for b in payloads:
            req = ExportTraceServiceRequest()
            req.ParseFromString(b)
            spans.update({s["name"]: {**s, "trace_id": t} for t, s in spans_of(req)})
        return spans
    return tracing, exported


def test_a_colocated_request_has_its_prefill_and_decode_parts_from_one_worker_and_its_phases():
    """The path the cluster test does not take: a GenerateOp (colocated, or prefilled on its
    decode worker) is one record until its first token, then a decode part from there."""
    from workers.traces import WorkerTraces
    tracing, exported = in_memory_tracing()
    header, trace_id, client_span = traceparent()
    trace = tracing.start({"traceparent": header})
    trace.validated()
    trace.admission(time.time(), True, 0.05)
    rid = "router~x/r0.0"
    tp = trace.attempt(rid, 0)
    trace.submitted(rid)
    worker = WorkerTraces("colocated-0")
    worker.begin(rid, tp, "prefill", time.time(), decodes_here=True)
    t = time.time()
    worker.steps([(Seq(rid), 60), (Seq("untraced"), 1)], t, t + 0.01)
    prefill = worker.output(rid, False, t + 0.01)
    assert prefill is not None and prefill.part == "prefill" and rid in worker
    trace.worker(prefill)
    trace.first_token()
    for k in range(3):
        worker.steps([(Seq(rid), 1)], t + 0.02 + k / 100, t + 0.025 + k / 100)
        assert worker.output(rid, False, t + 0.025 + k / 100) is None
    decode = worker.output(rid, True, t + 0.05)
    assert decode.part == "decode" and rid not in worker and not worker
    trace.worker(decode)
    trace.finished("length", 4)
    trace.end(200)
    spans = exported()
    assert {s["trace_id"] for s in spans.values()} == {trace_id}
    assert spans["request"]["parent"] == client_span and spans["request"]["service"] == "pdcluster"
    attempt = spans["attempt"]["span_id"]
    assert spans["prefill"]["parent"] == attempt and spans["decode"]["parent"] == attempt
    assert spans["prefill.compute"]["parent"] == spans["prefill"]["span_id"]
    assert [n for _, _, n in spans["prefill.compute"]["events"]] == [60]
    assert len(spans["decode"]["events"]) == 3 and "handoff" not in spans
    assert abs(spans["decode"]["start"] - (t + 0.01)) < 1e-6                # from its first token
    p = tracing.phases[trace_id]
    assert abs(sum(p[k] for k in TTFT_PHASES) - p["ttft"]) < 1e-9 and "handoff" not in p
    tracing.close()


def test_an_untraced_op_is_not_kept_and_a_broken_record_costs_its_spans_only():
    from workers.messages import TraceRecord
    from workers.traces import WorkerTraces
    worker = WorkerTraces("w")
    worker.begin("r", "", "prefill", time.time())
    assert not worker and worker.output("r", True, time.time()) is None
    tracing, exported = in_memory_tracing()
    trace = tracing.start({"traceparent": "00-zz-not-a-traceparent"})       # malformed: a trace of its own
    trace.worker(TraceRecord("00-garbage", "w", "prefill", {}))          # no marks at all
    trace.end(200)
    spans = exported()
    assert list(spans) == ["request"] and spans["request"]["parent"] == ""
    tracing.close()


def test_the_endpoint_is_a_base_or_the_traces_url_and_grpcs_port_is_named(caplog):
    from router.tracing import Tracing, collector_url
    assert collector_url("http://h:4318") == collector_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert collector_url("https://t.example/otlp/v1/traces") == "https://t.example/otlp/v1/traces"
    with caplog.at_level("WARNING", logger="router.tracing"):
        Tracing("http://127.0.0.1:4317", sink=lambda b: None).close()
    assert "4317 is OTLP/gRPC's port" in caplog.text
