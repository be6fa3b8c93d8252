"""Prometheus metrics of the router and, from their load reports, of the workers.

Names follow vLLM's where the meaning is the same, under the `pdcluster:` prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "pdcluster:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive tokens",
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to last token",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduling",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Failed requests", ["reason"], registry=r)
        self.running = Gauge(P + "router_requests_running", "Requests in flight in the router", registry=r)
        labels = ["worker", "role"]
        self.w_running = Gauge(P + "num_requests_running", "Sequences in the running batch", labels, registry=r)
        self.w_waiting = Gauge(P + "num_requests_waiting", "Sequences waiting for a slot", labels, registry=r)
        self.w_kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use", labels, registry=r)
        self.kv_transfer_bytes = Counter(P + "kv_transfer_bytes", "KV bytes handed off", registry=r)
        self.kv_transfer_seconds = Histogram(P + "kv_transfer_seconds", "KV handoff latency", registry=r,
                                             buckets=TRANSFER_BUCKETS)
        self.kv_transfer_failures = Counter(P + "kv_transfer_failures", "Failed KV handoffs", registry=r)
        self.pool_size = Gauge(P + "pool_workers", "Workers per role", ["role"], registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                   labels, registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted", labels + ["mode"], registry=r)
        self._last: dict[tuple, float] = {}      # (worker, counter) -> last cumulative value seen

    def observe_load(self, report: dict) -> None:
        w, role = report["worker_id"], report["role"]
        self.w_running.labels(w, role).set(report["running"])
        self.w_waiting.labels(w, role).set(report["waiting"] + report.get("pending", 0))
        self.w_kv_usage.labels(w, role).set(report["kv_blocks_used"] / max(1, report["kv_blocks_total"]))
        # Workers report cumulative totals; count what grew since their last report.
        self._grow(self.prefix_queries.labels(w, role), (w, "pq"), report.get("prefix_cache_queries", 0))
        self._grow(self.prefix_hits.labels(w, role), (w, "ph"), report.get("prefix_cache_hits", 0))
        for mode, n in report.get("preemptions", {}).items():
            self._grow(self.preemptions.labels(w, role, mode), (w, "pre", mode), n)
        xfer = report.get("kv_transfer", {})
        self._grow(self.kv_transfer_bytes, (w, "xb"), xfer.get("bytes", 0))
        self._grow(self.kv_transfer_failures, (w, "xf"), xfer.get("failures", 0))

    def _grow(self, counter, key: tuple, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total
