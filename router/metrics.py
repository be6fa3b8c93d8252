"""Prometheus metrics of the router and, from their load reports, of the workers.

Names follow vLLM's where the meaning is the same, under the `pdcluster:` prefix; counters
are declared without `_total` (prometheus_client appends it). Workers are Ray actors with no
HTTP endpoint of their own: the router exports their metrics with `worker` and `role` labels,
so one scrape of the router's /metrics sees the whole cluster. With several routers, each
exports its own requests' series, and the one that leads exports the workers';
every series carries the exporting router's `router` label. The README's metrics table lists
them all.

Every labelled series a dashboard reads is created at 0 up front (finish reasons, error
reasons, preemption modes, SLOs, a worker's counters on its first report), so queries return
data before the first event of their kind.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from router.slo import RequestLog, SLOTargets, SLOWindow, judge
from workers.faults import FAILURE_POINTS
from router.pools import ACTIVE, DEAD, DRAINING, STARTING
from workers.messages import LoadReport
from workers.names import DECODE, PREEMPTION_KINDS, PREFILL, ROLES

P = "pdcluster:"
FINISH_REASONS = ("stop", "length")
ERROR_REASONS = ("invalid_request", "overloaded", "slo_unattainable", "worker_failure", "client_disconnect",
                 "slow_client", "shutdown", "request_timeout")
POOL_STATES = (STARTING, ACTIVE, DRAINING, DEAD)
ROLE_FLIPS = ((PREFILL, DECODE), (DECODE, PREFILL))
LOSS_CAUSES = ("died", "hung")
RESUME_CAUSES = ("handoff_failed", "worker_died", "worker_hung", "lease_expired", "worker_draining", "request_lost")

# Request latencies: 1 ms .. 80 s (TTFT of a long prompt under load, E2E of a long answer).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# One engine step: sub-millisecond (tiny model, CPU) to seconds (a long prefill chunk).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                1.0, 2.5, 5.0)
# Measured over predicted: 1 is exact; under 1 the prediction was pessimistic (it refuses too much).
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # as vLLM
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class Metrics:
    """`router`: this router's id, a label on every series it exports. `workers`: export the
    workers' and pools' series too (one router of several does: the one that leads; the others
    keep them for their own use, unexported, so that sums over routers count each worker once;
    `export_workers` switches as the lead moves)."""

    def __init__(self, slo: SLOTargets | None = None, router: str = "router", workers: bool = True):
        r = self.registry_own = CollectorRegistry()              # this router's own series
        self.worker_registry = CollectorRegistry()               # the workers' and the pools'
        self.registry = CollectorRegistry(auto_describe=False)   # both, for reading here
        self.registry.register(r)
        self.registry.register(self.worker_registry)
        self.exported = CollectorRegistry(auto_describe=False)   # what /metrics serves
        self.exported.register(_Labelled(r, "router", router))
        self._workers_exported = _Labelled(self.worker_registry, "router", router)
        self.exporting_workers = False
        self.slo = slo or SLOTargets()
        # -- requests, as the router sees them ------------------------------------------------
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive tokens",
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to last token",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Time a request waits in a worker's queue before its first scheduling",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.errors = Counter(P + "request_errors", "Failed requests", ["reason"], registry=r)
        self.running = Gauge(P + "router_requests_running", "Requests streaming tokens (first token sent)",
                             registry=r)
        self.waiting = Gauge(P + "router_requests_waiting", "Admitted requests not yet at their first token",
                             registry=r)
        self.gated = Gauge(P + "router_requests_gated", "Requests held before their prefill while the decode pool "
                           "is full (disaggregated)", registry=r)
        # -- SLO admission, checked against what happens (router/admission.py) -----------------
        self.admission_error = Histogram(P + "admission_ttft_observed_over_predicted", "Measured TTFT over SLO "
                                         "admission's prediction, per admitted request", registry=r,
                                         buckets=RATIO_BUCKETS)
        self.admission_refusals = Counter(P + "admission_refusals", "Requests SLO admission predicted to miss a "
                                          "target: refused, let in as a probe, or let in on the record of the load "
                                          "served lately", ["target", "verdict"], registry=r)
        self.admission_probes = Counter(P + "admission_probes", "Probes (requests predicted to miss, let in) "
                                        "that finished, by whether they met their targets", ["target", "outcome"],
                                        registry=r)
        for target in ("ttft", "tpot"):
            for verdict in ("refused", "probe", "on_record"):
                self.admission_refusals.labels(target, verdict)
            for outcome in ("met", "missed"):
                self.admission_probes.labels(target, outcome)
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        # -- SLOs --------------------------------------------------------------------------------
        Gauge(P + "slo_ttft_target_seconds", "Configured TTFT target", registry=r).set(self.slo.ttft_s)
        Gauge(P + "slo_tpot_target_seconds", "Configured TPOT target", registry=r).set(self.slo.tpot_s)
        self.slo_requests = Counter(P + "slo_requests", "Finished requests judged against the SLOs", registry=r)
        self.slo_met = Counter(P + "slo_met", "Finished requests that met the SLO", ["slo"], registry=r)
        for name in ("ttft", "tpot", "both"):
            self.slo_met.labels(name)
        self.slo_window = SLOWindow(self.slo.window_s)
        self.requests = RequestLog()           # what the pool controller reads
        r.register(_SLOWindowCollector(self.slo_window))
        self.local_prefills = Counter(P + "local_prefills", "Requests prefilled on their decode worker, with no "
                                      "KV handoff (--local-prefill-max-tokens)", registry=r)
        self.resumed = Counter(P + "requests_resumed", "Requests resumed on live workers after a fault "
                               "(prompt + delivered tokens prefilled again)", ["cause"], registry=r)
        for cause in RESUME_CAUSES:
            self.resumed.labels(cause)
        # -- workers, from their load reports and samples ------------------------------------
        r = self.worker_registry
        labels = ["worker", "role"]
        self.w_running = Gauge(P + "num_requests_running", "Sequences in the running batch", labels, registry=r)
        self.w_waiting = Gauge(P + "num_requests_waiting", "Sequences waiting for a slot (decode: for KV room)",
                               labels, registry=r)
        self.w_kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use", labels, registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                   labels, registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Sequences preempted", labels + ["mode"], registry=r)
        self.step_seconds = Histogram(P + "engine_step_duration_seconds", "Duration of one engine step",
                                      labels, registry=r, buckets=STEP_BUCKETS)
        # Against engine_step_duration_seconds_sum: the time steps waited for a core (a CPU host
        # whose cores the router and other workers share), or slept waiting for the device (a
        # CUDA sync that spins counts as CPU).
        self.step_cpu = Counter(P + "engine_step_cpu_seconds", "CPU time the engine's thread spent in its steps",
                                labels, registry=r)
        self.batch_size = Histogram(P + "engine_step_batch_size", "Sequences in one engine step", labels,
                                    registry=r, buckets=BATCH_SIZE_BUCKETS)
        self.step_tokens = Histogram(P + "iteration_tokens_total", "Tokens computed in one engine step",
                                     labels, registry=r, buckets=STEP_TOKEN_BUCKETS)
        # -- the KV handoff (reported by the decode worker that pulls) ---------------------------
        self.kv_transfer_bytes = Counter(P + "kv_transfer_bytes", "KV bytes received", labels, registry=r)
        self.kv_blocks_reused = Counter(P + "kv_blocks_reused", "KV blocks not pulled: the decode worker's prefix "
                                        "cache held them", labels, registry=r)
        self.kv_transfer_seconds = Histogram(P + "kv_transfer_seconds", "Duration of one KV pull (a pull streamed "
                                             "during the prefill: its seconds of copying)", labels,
                                             registry=r, buckets=TRANSFER_BUCKETS)
        self.kv_transfer_tail_seconds = Histogram(
            P + "kv_transfer_tail_seconds", "What a KV pull had left once the prompt was held: from the held KV "
            "reaching the decode worker (or the pull starting, if later) to its last byte", labels,
            registry=r, buckets=TRANSFER_BUCKETS)
        self.kv_streamed = Counter(P + "kv_streamed_handoffs", "Handoffs whose KV the decode worker began to copy "
                                   "while the prompt was still being prefilled (a prompt longer than a chunk)",
                                   registry=r)
        self.kv_transfer_failures = Counter(P + "kv_transfer_failures", "Failed KV pulls, by where they failed",
                                            labels + ["point"], registry=r)
        self.kv_in_flight = Gauge(P + "kv_transfers_in_flight", "KV pulls under way", labels, registry=r)
        # -- routers' leases on the workers (workers/leases.py) ------------------------------------
        self.lease_expiries = Counter(P + "router_lease_expiries", "Routers whose lease on a worker lapsed (the "
                                      "worker ended their requests)", labels, registry=r)
        self.lease_aborts = Counter(P + "router_lease_aborts", "Requests a worker ended because their router's "
                                    "lease lapsed", labels, registry=r)
        # -- pools -----------------------------------------------------------------------------
        self.pool_size = Gauge(P + "pool_workers", "Active workers per role (taking new work)", ["role"],
                               registry=r)
        self.pool_members = Gauge(P + "pool_workers_by_state", "Workers per role and state (starting, active, "
                                  "draining, dead; a draining worker counts in the role it leaves)",
                                  ["role", "state"], registry=r)
        self.role_changes = Counter(P + "pool_role_changes", "Workers moved from one pool to another",
                                    ["from_role", "to_role"], registry=r)
        self.controller_decisions = Counter(P + "controller_decisions", "Pool-ratio controller decisions, by "
                                            "action and reason (none: no change, with why)", ["action", "reason"],
                                            registry=r)
        self.controller_decisions.labels("none", "no_cost_model")
        self.controller_recommended = Gauge(P + "controller_recommended_workers", "The pool sizes the controller's "
                                            "latest decision leads to (what it would do, in advisory mode)", ["role"],
                                            registry=r)
        for role in ROLES:
            self.pool_size.labels(role)
            self.controller_recommended.labels(role)
            for state in POOL_STATES:
                self.pool_members.labels(role, state)
        for a, b in ROLE_FLIPS:
            self.role_changes.labels(a, b)
        # -- faults and recovery ---------------------------------------------------------------
        self.workers_lost = Counter(P + "workers_lost", "Workers that died or stopped answering", ["role", "cause"],
                                    registry=r)
        self.workers_replaced = Counter(P + "workers_replaced", "Lost workers back in their pool (restarted)",
                                        ["role"], registry=r)
        for role in ROLES:
            self.workers_replaced.labels(role)
            for cause in LOSS_CAUSES:
                self.workers_lost.labels(role, cause)
        self._last: dict[tuple, float] = {}      # (worker, counter) -> last cumulative value seen
        self.leader = Gauge(P + "router_leader", "1 while this router leads the cluster (it restarts hung workers, "
                            "drains, runs the controller, exports the workers' series)", registry=self.registry_own)
        self.export_workers(workers)

    def follow(self, leadership) -> None:
        """Export the workers' series while this router leads (router/leadership.py)."""
        leadership.subscribe(lambda resume: self.export_workers(True), lambda: self.export_workers(False))

    def export_workers(self, on: bool) -> None:
        """Serve the workers' and pools' series at /metrics too (the leading router does), or
        keep them for this router's own use only."""
        if on != self.exporting_workers:
            (self.exported.register if on else self.exported.unregister)(self._workers_exported)
            self.exporting_workers = on
        self.leader.set(1 if on else 0)

    # -- router side -----------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """What /metrics serves: every exported series, with this router's label."""
        return generate_latest(self.exported)

    def observe_offered(self, prompt_tokens: int, max_tokens: int) -> None:
        """A valid request reached admission, admitted or not: the demand the pool controller
        sizes the pools for (a refused request is demand the pools could not serve)."""
        self.requests.arrived(prompt_tokens, max_tokens)

    def observe_arrival(self, prompt_tokens: int) -> None:
        """An admitted request starts."""
        self.prompt_tokens.inc(prompt_tokens)

    def observe_prediction(self, predicted_s: float, measured_s: float) -> None:
        """A first token SLO admission predicted: how far off it was (nothing without a prediction)."""
        if predicted_s > 0:
            self.admission_error.observe(measured_s / predicted_s)

    def observe_finished(self, ttft_s: float, e2e_s: float, num_output_tokens: int, sent_at: float | None = None,
                         max_tokens: int = 0) -> None:
        """A request ended normally: E2E, and its verdict against the SLOs."""
        self.e2e.observe(e2e_s)
        verdict = judge(self.slo, ttft_s, e2e_s, num_output_tokens)
        if sent_at is not None:
            self.requests.finished(sent_at, num_output_tokens, max_tokens or num_output_tokens, verdict.ttft,
                                   verdict.tpot)
        self.slo_requests.inc()
        for name, met in (("ttft", verdict.ttft), ("tpot", verdict.tpot), ("both", verdict.both)):
            if met:
                self.slo_met.labels(name).inc()
        self.slo_window.record(verdict)

    # -- worker side -----------------------------------------------------------------------------
    def count_pools(self, pools) -> None:
        """The pool gauges from the registry (router/pools.py), after any change."""
        for role in ROLES:
            self.pool_size.labels(role).set(pools.count(role))
            for state in POOL_STATES:
                self.pool_members.labels(role, state).set(pools.count(role, (state,)))

    def forget_worker(self, worker: str, role: str) -> None:
        """A worker changed roles or left: drop its gauges under the old labels (its counters
        stay; they only grow, under the role it has now)."""
        for g in (self.w_running, self.w_waiting, self.w_kv_usage, self.kv_in_flight):
            try:
                g.remove(worker, role)
            except KeyError:
                pass

    def observe_load(self, r: LoadReport) -> None:
        w, role = r.worker_id, r.role
        self.w_running.labels(w, role).set(r.running)
        self.w_waiting.labels(w, role).set(r.waiting + r.pending)
        self.w_kv_usage.labels(w, role).set(r.kv_blocks_used / max(1, r.kv_blocks_total))
        self.kv_in_flight.labels(w, role).set(r.receiving)
        # Workers report cumulative totals; count what grew since their last report.
        self._grow(self.prefix_queries.labels(w, role), (w, "pq"), r.prefix_cache_queries)
        self._grow(self.prefix_hits.labels(w, role), (w, "ph"), r.prefix_cache_hits)
        for mode in PREEMPTION_KINDS:
            self._grow(self.preemptions.labels(w, role, mode), (w, "pre", mode), r.preemptions.get(mode, 0))
        self._grow(self.kv_transfer_bytes.labels(w, role), (w, "xb"), r.kv_transfer.bytes)
        self._grow(self.kv_blocks_reused.labels(w, role), (w, "xr"), r.kv_transfer.blocks_reused)
        self._grow(self.lease_expiries.labels(w, role), (w, "le"), r.lease_expiries)
        self._grow(self.lease_aborts.labels(w, role), (w, "la"), r.lease_aborts)
        for point in FAILURE_POINTS:
            self._grow(self.kv_transfer_failures.labels(w, role, point), (w, "xf", point),
                       r.kv_transfer.failures_by_point.get(point, 0))

    def observe_samples(self, worker: str, role: str, samples: dict) -> None:
        """Per-step and per-transfer samples a worker buffered since its last poll."""
        for histogram, kind in ((self.step_seconds, "step_s"), (self.batch_size, "batch_size"),
                                (self.step_tokens, "step_tokens"), (self.kv_transfer_seconds, "kv_transfer_s"),
                                (self.kv_transfer_tail_seconds, "kv_tail_s")):
            child = histogram.labels(worker, role)
            for v in samples.get(kind, ()):
                child.observe(v)
        if cpu := samples.get("step_cpu_s"):
            self.step_cpu.labels(worker, role).inc(sum(cpu))
        for v in samples.get("queue_s", ()):
            self.queue_time.observe(v)

    def _grow(self, counter, key: tuple, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total


class _Labelled:
    """Another registry's series, each with one label more (added at scrape time)."""

    def __init__(self, registry: CollectorRegistry, name: str, value: str):
        self.registry, self.name, self.value = registry, name, value

    def collect(self):
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, self.name: self.value}) for s in family.samples]
            yield out


class _SLOWindowCollector:
    """`slo_attainment{slo}`: the router's own sliding-window view, computed at scrape time."""

    def __init__(self, window: SLOWindow):
        self.window = window

    def collect(self):
        g = GaugeMetricFamily(P + "slo_attainment", f"Fraction of requests finished in the last "
                              f"{self.window.window_s:g}s that met the SLO (NaN: none finished)", labels=["slo"])
        for name, value in self.window.attainment().items():
            g.add_metric([name], value)
        yield g
        n = GaugeMetricFamily(P + "slo_window_requests", "Requests finished in the SLO window")
        n.add_metric([], len(self.window))
        yield n
