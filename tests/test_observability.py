"""Observability end to end: a real Prometheus scrapes a local cluster's router, and every
PromQL expression of the Grafana dashboard must return data; metric names agree across the
code, the README's metrics table and the dashboard.

Prometheus is the `prometheus` on PATH, else Debian's package that `make test` unpacks into
.tools/ (deploy/get-prometheus.sh); a missing binary fails the test with a message rather than
skipping it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from cluster.loadtest import promtext
from cluster.run.launcher import ClusterSpec
from common import free_port, wait_for
from cluster.run.serve import ServingCluster
from router.metrics import Metrics
from workers.checkpoint import builtin_config
from workers.kv_transfer import KVLayout

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "pdcluster.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
README = ROOT / "README.md"
LOCAL_BIN = ROOT / ".tools" / "bin"            # where deploy/get-prometheus.sh leaves Prometheus

# What Grafana substitutes for its built-in variables when it runs a query; the test's windows
# cover the whole run (Prometheus starts before the traffic, and scrapes every second).
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m", "__range_s": "300",
            "__range_ms": "300000", "__interval_ms": "15000"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# -- the dashboard ---------------------------------------------------------------------------
def load_dashboard() -> dict:
    import json
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])          # panels inside collapsed rows
    return out


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]


def variable_values(dashboard: dict) -> dict[str, str]:
    """A concrete value for each template variable: "All" (its allValue regex) for query
    variables, the current value for custom ones, the built-ins as Grafana fills them."""
    values = dict(BUILTINS)
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            assert v.get("includeAll") and v.get("allValue"), f"variable {v['name']} needs an All value"
            values[v["name"]] = v["allValue"]
        elif v["type"] in ("custom", "interval", "constant", "textbox"):
            values[v["name"]] = v["current"]["value"]
        elif v["type"] == "datasource":
            values[v["name"]] = "unused-in-promql"
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"the dashboard uses an unknown variable ${name} in {expr!r}"
        return values[name]
    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", one, expr)
    assert "$" not in out, out
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"pdcluster:[A-Za-z0-9_:]+", expr))


# -- the code and the documentation ----------------------------------------------------------
def code_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """name as exposed (counters with _total) -> (type, label names), from a live Metrics that
    has seen one of everything."""
    from workers.messages import LoadReport, TransferTotals
    m = Metrics()
    m.observe_load(LoadReport("decode-0", "decode", waiting=0, running=1, swapped=0, queued_prefill_tokens=0,
                              kv_blocks_used=3, kv_blocks_total=10, steps=1, receiving=1, prefix_cache_queries=5,
                              prefix_cache_hits=2, preemptions={"recompute": 1, "swap": 0},
                              kv_transfer=TransferTotals(bytes=100)))
    m.observe_samples("decode-0", "decode", {"step_s": [0.01], "step_cpu_s": [0.008], "batch_size": [2], "step_tokens": [2],
                                             "queue_s": [0.001], "kv_transfer_s": [0.002]})
    m.observe_finished(0.1, 0.5, 5)
    for h in (m.ttft, m.itl, m.queue_time):
        h.observe(0.01)
    out = {}
    for family in m.registry.collect():
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, labels)
    return out


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """The README's metrics table: | `name` | type | labels | meaning |."""
    rows = re.findall(r"^\|\s*`(pdcluster:[^`]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|[^|]+\|\s*$", README.read_text(),
                      re.MULTILINE)
    assert rows, "README.md has no metrics table (| `pdcluster:...` | type | labels | meaning |)"
    out = {}
    for name, kind, labels in rows:
        assert name not in out, f"{name} is documented twice"
        out[name] = (kind, frozenset(re.findall(r"`(\w+)`", labels)))
    return out


def exposed_family(name: str, code: dict) -> str:
    """pdcluster:x_bucket -> pdcluster:x when x is a histogram in the code."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and code.get(base, ("",))[0] == "histogram":
            return base
    return name


def test_metric_names_agree_across_code_docs_and_dashboard():
    code, docs = code_metrics(), documented_metrics()
    assert set(code) == set(docs), (f"in the code, not documented: {sorted(set(code) - set(docs))}; "
                                    f"documented, not in the code: {sorted(set(docs) - set(code))}")
    for name, (kind, labels) in code.items():
        assert docs[name] == (kind, labels), f"{name}: code says {kind} {sorted(labels)}, README says " \
                                             f"{docs[name][0]} {sorted(docs[name][1])}"
    used = {exposed_family(n, code) for _, e in dashboard_exprs(load_dashboard()) for n in metric_names(e)}
    assert used and used <= set(code), f"the dashboard reads unknown metrics: {sorted(used - set(code))}"
    # The list, by name (vLLM's where the meaning is the same).
    required = {"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "prompt_tokens_total", "generation_tokens_total",
                "request_success_total", "request_errors_total", "num_requests_running", "num_requests_waiting",
                "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                "num_preemptions_total", "kv_transfer_bytes_total", "kv_transfer_seconds",
                "kv_transfer_failures_total"}
    assert {"pdcluster:" + n for n in required} <= set(code)
    assert code["pdcluster:num_preemptions_total"][1] == {"worker", "role", "mode"}


# -- the pieces, without a cluster -----------------------------------------------------------
def test_slo_verdicts_and_sliding_window():
    from router.slo import SLOTargets, SLOWindow, judge
    t = SLOTargets(ttft_s=0.5, tpot_s=0.05, window_s=10)
    assert judge(t, 0.4, 0.4 + 9 * 0.04, 10) == (True, True)
    assert judge(t, 0.6, 1.0, 10) == (False, True)
    assert judge(t, 0.1, 5.0, 10) == (True, False)
    assert judge(t, 0.1, 0.1, 1).tpot                                # one token: no TPOT to miss
    now = [0.0]
    w = SLOWindow(10, clock=lambda: now[0])
    assert all(math.isnan(v) for v in w.attainment().values())
    w.record(judge(t, 0.1, 0.2, 3))
    now[0] = 5
    w.record(judge(t, 0.9, 1.0, 3))
    assert w.attainment() == {"ttft": 0.5, "tpot": 1.0, "both": 0.5}
    now[0] = 12                                                        # the first one left the window
    assert w.attainment() == {"ttft": 0.0, "tpot": 1.0, "both": 0.0} and len(w) == 1
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        SLOTargets(ttft_s=0)


def test_worker_counters_grow_from_cumulative_reports():
    from workers.messages import LoadReport, TransferTotals
    m = Metrics()
    base = LoadReport("prefill-0", "prefill", waiting=2, running=0, swapped=0, queued_prefill_tokens=0,
                      kv_blocks_used=5, kv_blocks_total=20, steps=1, pending=1, prefix_cache_queries=10,
                      prefix_cache_hits=4, preemptions={"swap": 1}, kv_transfer=TransferTotals(bytes=100))
    m.observe_load(base)
    m.observe_load(dataclasses.replace(base, prefix_cache_queries=30, kv_transfer=TransferTotals(bytes=250)))
    get = m.registry.get_sample_value
    labels = {"worker": "prefill-0", "role": "prefill"}
    assert get("pdcluster:prefix_cache_queries_total", labels) == 30
    assert get("pdcluster:prefix_cache_hits_total", labels) == 4
    assert get("pdcluster:num_preemptions_total", {**labels, "mode": "swap"}) == 1
    assert get("pdcluster:num_preemptions_total", {**labels, "mode": "recompute"}) == 0   # exists at 0
    assert get("pdcluster:num_requests_waiting", labels) == 3
    assert get("pdcluster:kv_cache_usage_perc", labels) == 0.25
    assert get("pdcluster:kv_transfer_bytes_total", labels) == 250
    assert get("pdcluster:request_errors_total", {"reason": "worker_failure"}) == 0
    assert get("pdcluster:pool_role_changes_total", {"from_role": "prefill", "to_role": "decode"}) == 0
    m.observe_finished(ttft_s=0.2, e2e_s=3.0, num_output_tokens=11)   # TPOT 0.28 s > 0.1 s default
    assert get("pdcluster:slo_requests_total") == 1
    assert get("pdcluster:slo_met_total", {"slo": "ttft"}) == 1
    assert get("pdcluster:slo_met_total", {"slo": "both"}) == 0
    assert get("pdcluster:slo_attainment", {"slo": "ttft"}) == 1.0


def test_the_workers_series_are_exported_by_the_leading_router_only():
    """A follower keeps the workers' series for itself; once it leads they are served, with its
    `router` label, and `router_leader` says which router that is."""
    from cluster.loadtest import promtext
    from workers.messages import LoadReport
    m = Metrics(router="r1", workers=False)
    m.observe_load(LoadReport("decode-0", "decode", waiting=0, running=2, swapped=0, queued_prefill_tokens=0,
                              kv_blocks_used=5, kv_blocks_total=20, steps=1, pending=0))
    m.observe_finished(ttft_s=0.2, e2e_s=1.0, num_output_tokens=5)

    def served() -> dict[str, float]:
        return promtext.parse(m.exposition().decode())
    running = 'pdcluster:num_requests_running{role="decode",router="r1",worker="decode-0"}'
    assert running not in served() and served()['pdcluster:router_leader{router="r1"}'] == 0
    assert served()['pdcluster:slo_requests_total{router="r1"}'] == 1        # its own requests' series are
    assert m.registry.get_sample_value("pdcluster:num_requests_running", {"worker": "decode-0", "role": "decode"}) == 2
    m.export_workers(True)
    assert served()[running] == 2 and served()['pdcluster:router_leader{router="r1"}'] == 1
    m.export_workers(False)
    assert running not in served() and served()['pdcluster:router_leader{router="r1"}'] == 0


def test_engine_reports_step_shape_and_queue_times_once():
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.engine import LLMEngine
    from workers.sequence import SamplingParams
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=64),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    prefix = list(range(1, 49))
    for tail in (100, 101, 102):
        engine.add_request(prompt_token_ids=prefix + [tail] * 20,
                           params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    shapes = []
    while engine.has_unfinished():
        engine.step()
        shapes.append(engine.last_step)
    assert sum(len(s.queue_times_s) for s in shapes) == 3            # one per request, when it starts
    assert all(q >= 0 for s in shapes for q in s.queue_times_s)
    assert all(0 < s.num_tokens <= 64 and 1 <= s.num_seqs <= 3 for s in shapes)
    assert shapes[-1].num_tokens == shapes[-1].num_seqs             # the last step only decodes


# -- against a real Prometheus ---------------------------------------------------------------
def prometheus_binary() -> str:
    path = shutil.which("prometheus") or shutil.which("prometheus", path=str(LOCAL_BIN))
    if path is None:
        pytest.fail("no `prometheus` binary on PATH or in .tools/bin: run deploy/get-prometheus.sh "
                    "(`make test` does)")
    return path


# The end-to-end test's cluster and traffic: tiny's KV in fp32, blocks of 16 tokens.
BLOCK_SIZE = 16
_TINY = builtin_config("tiny")
BYTES_PER_BLOCK = KVLayout(_TINY.num_hidden_layers, BLOCK_SIZE, _TINY.num_key_value_heads, _TINY.head_dim,
                           "float32").bytes_per_block
SHARED_PREFIX_LEN = 3 * BLOCK_SIZE
SHARED_MAX_TOKENS = 150


def test_prometheus_config_and_dashboard_queries_return_data(ray_session, tmp_path):
    binary = prometheus_binary()
    dashboard = load_dashboard()
    exprs = dashboard_exprs(dashboard)
    values = variable_values(dashboard)
    router_port, prom_port = free_port(), free_port()

    # Our prometheus.yml, its pdcluster job pointed at this test's router, scraping every second.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pdcluster")
    job.pop("file_sd_configs", None)
    job["static_configs"] = [{"targets": [f"127.0.0.1:{router_port}"], "labels": {"cluster": "test"}}]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"] = [job]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")
    prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{prom_port}"
    try:
        # A small KV pool (20 blocks of 16 tokens) so that concurrent long decodes preempt.
        spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=1, num_decode=1,
                           engine={"cache": {"num_blocks": 20, "block_size": BLOCK_SIZE},
                                   "scheduler": {"max_num_batched_tokens": 256}},
                           num_cpus_per_worker=0.5, lease_s=20, transfer_timeout_s=20)
        # Every prompt handed off (no local prefill while the prefill worker has a queue, serve's
        # default): the counts below are of handoffs, one per request.
        with ServingCluster(spec, port=router_port, local_prefill_max_tokens=0) as cluster:
            wait_for(lambda: _get(f"{api}/-/ready"), lambda r: r is not None and r.status_code == 200, 30,
                     lambda: f"Prometheus is not ready; its log:\n{(tmp_path / 'prometheus.log').read_text()}",
                     poll_s=0.1)
            # Two scrapes of every worker's series before the traffic: a counter's rate needs a
            # sample from before it grew.
            wait_for(lambda: query(api, "count_over_time(pdcluster:prefix_cache_queries_total[1m])"),
                     lambda r: len(r) == len(spec.roles()) and all(int(x["value"][1]) >= 2 for x in r), 30,
                     lambda: "Prometheus does not scrape the router", poll_s=0.1)
            metrics_url = f"http://127.0.0.1:{router_port}/metrics"
            before = promtext.scrape(metrics_url)
            sent = asyncio.run(drive_traffic(cluster.base_url))

            def grew(m: dict, name: str, **labels) -> float:
                return promtext.total(m, f"pdcluster:{name}", **labels) - \
                    promtext.total(before, f"pdcluster:{name}", **labels)

            # What the traffic must have done. Handoffs: each prompt's blocks, the last one partly
            # filled. Prefix hits (prefill worker): the four "shared" prompts (50 tokens) find
            # the warm-up's 3 full blocks; the second identical chat prompt finds the first's full
            # blocks, short of the one holding its last token (always recomputed).
            n = len(sent)
            prompt_tokens = sum(p for _, p, _ in sent)
            received = sum(r for _, _, r in sent)
            handoff_blocks = sum(-(-p // BLOCK_SIZE) for _, p, _ in sent)
            chat_len = next(p for kind, p, _ in sent if kind == "chat")
            hits = 4 * SHARED_PREFIX_LEN + (chat_len - 1) // BLOCK_SIZE * BLOCK_SIZE
            # The workers' counters come with their load reports: wait until those cover the
            # traffic (every prompt looked up, every handoff done, nothing running any more).
            final = wait_for(lambda: promtext.scrape(metrics_url),
                             lambda m: grew(m, "prefix_cache_queries_total") >= prompt_tokens
                             and grew(m, "kv_transfer_seconds_count") >= n
                             and promtext.total(m, "pdcluster:num_requests_running") == 0
                             and promtext.total(m, "pdcluster:num_requests_waiting") == 0, 30, poll_s=0.1)
            assert grew(final, "request_success_total") == grew(final, "request_success_total",
                                                                finished_reason="length") == n
            assert grew(final, "request_errors_total") == grew(final, "request_errors_total",
                                                               reason="invalid_request") == 1
            assert grew(final, "time_to_first_token_seconds_count") == n
            assert grew(final, "e2e_request_latency_seconds_count") == grew(final, "slo_requests_total") == n
            assert grew(final, "inter_token_latency_seconds_count") == received - n
            assert grew(final, "prompt_tokens_total") == grew(final, "prefix_cache_queries_total") == prompt_tokens
            assert grew(final, "generation_tokens_total") == received
            assert grew(final, "kv_transfer_seconds_count") == n and grew(final, "kv_transfer_failures_total") == 0
            # Each handed-off block either crossed or was in the decode worker's prefix cache
            # already (a prefix an earlier handoff brought: at most the prefill side's hits).
            reused = grew(final, "kv_blocks_reused_total")
            assert grew(final, "kv_transfer_bytes_total") == (handoff_blocks - reused) * BYTES_PER_BLOCK
            assert 0 <= reused <= hits // BLOCK_SIZE
            assert grew(final, "prefix_cache_hits_total") == hits
            assert grew(final, "num_preemptions_total", role="decode") > 0, "the small decode pool did not preempt"
            # Prometheus holds the same totals once it has scraped the settled router.
            want = {f"sum(pdcluster:{name})": promtext.total(final, f"pdcluster:{name}") for name in (
                "generation_tokens_total", "request_success_total", "kv_transfer_seconds_count",
                "prefix_cache_hits_total", "num_preemptions_total")}
            wait_for(lambda: {q: float(r[0]["value"][1]) if (r := query(api, q)) else None for q in want},
                     lambda got: got == want, 30,
                     lambda: f"Prometheus has not scraped the router since the traffic (router: {want})",
                     poll_s=0.1)
            # Every series the dashboard reads now holds post-traffic samples.
            empty = []
            for title, expr in exprs:
                result = query(api, substitute(expr, values))
                if not any(_finite(v) for v in result):
                    empty.append(f"{title}: {expr} -> {result}")
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


async def drive_traffic(base_url: str) -> list[tuple[str, int, int]]:
    """A mix: completions (whole and streamed) sharing a prompt prefix, chat, long enough
    decodes for the small KV pool to preempt, and one invalid request. Returns (kind, prompt
    tokens, tokens received) per successful request.

    The preemptions are certain: the four streamed requests grow to 50 + 150 tokens, 13 blocks
    each, and reach the decode worker within one prefill step of each other (one pull after
    another, each admitted while its 4 prompt blocks fit), so two or more decode side by side
    and need more than its 20 blocks before they finish."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    prefix = list(range(10, 10 + SHARED_PREFIX_LEN))
    try:
        # The prefix goes first alone, so the concurrent ones find it cached.
        r = await client.completions.create(model="tiny", prompt=prefix + [1], max_tokens=4,
                                            extra_body={"ignore_eos": True})
        warm = ("warm", r.usage.prompt_tokens, len(r.choices[0].token_ids))

        async def streamed(tail: int) -> tuple[str, int, int]:
            n, usage = 0, None
            async for chunk in await client.completions.create(
                    model="tiny", prompt=prefix + [tail, tail + 1], max_tokens=SHARED_MAX_TOKENS, stream=True,
                    temperature=0, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    n += len(chunk.choices[0].token_ids)
                else:
                    usage = chunk.usage
            assert usage.completion_tokens == n
            return "shared", usage.prompt_tokens, n

        async def chat() -> tuple[str, int, int]:
            r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, extra_body={"ignore_eos": True})
            return "chat", r.usage.prompt_tokens, r.usage.completion_tokens

        got = await asyncio.gather(*(streamed(t) for t in (100, 110, 120, 130)), chat(), chat())
        assert warm[1:] == (SHARED_PREFIX_LEN + 1, 4)
        assert [g[1:] for g in got[:4]] == [(SHARED_PREFIX_LEN + 2, SHARED_MAX_TOKENS)] * 4
        assert [g[2] for g in got[4:]] == [8, 8]
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=0)
        return [warm, *got]
    finally:
        await client.close()


def query(api: str, promql: str) -> list[dict]:
    r = httpx.get(f"{api}/api/v1/query", params={"query": promql}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    data = body["data"]
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def _finite(sample: dict) -> bool:
    values = [sample["value"]] if "value" in sample else sample.get("values", [])
    return any(math.isfinite(float(v)) for _, v in values)


def _get(url: str):
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def test_a_local_prometheus_reads_the_router_lists_in_deploy_targets(tmp_path):
    """The README's "without Docker" command (`prometheus --config.file=deploy/prometheus.yml`,
    from anywhere) picks up the routers listed in deploy/targets/, as the container does."""
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy, ignore=shutil.ignore_patterns("*.example"))
    (deploy / "targets" / "routers.yaml").write_text('- targets: ["127.0.0.1:1"]\n  labels: {cluster: listed}\n')
    port = free_port()
    with open(tmp_path / "prometheus.log", "w") as log:
        prom = subprocess.Popen([prometheus_binary(), f"--config.file={deploy / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        def listed():
            r = _get(f"http://127.0.0.1:{port}/api/v1/targets")
            if r is None or r.status_code != 200:
                return set()
            return {t["labels"].get("cluster") for t in r.json()["data"]["activeTargets"]}
        seen = wait_for(listed, lambda c: "listed" in c, 30, lambda: (tmp_path / "prometheus.log").read_text())
        assert "local" in seen                             # the static target too
    finally:
        prom.terminate()
        prom.wait(30)
