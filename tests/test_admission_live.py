"""SLO admission on the real local cluster (1 prefill + 1 decode `tiny` workers, `serve` with its
default `--admission slo`): a closed loop of clients that the cluster serves within its SLOs
gets no 429 (vLLM's benchmark client counts each as a failure); offered three times what the
cluster measurably serves, it answers only 200 or 429 (with Retry-After, at once: faster than
the served requests' first tokens), and the requests it admits keep their SLOs: goodput stays
at least 90 % of the goodput at capacity.

First, after a few requests one at a time, a closed loop of 8 clients with 128-token prompts
(each sends its next request when its last one ends; vLLM's benchmark's shape), then
capacity, measured in the same run: a closed loop of 32, completions per second. Then open-loop
Poisson arrivals at that rate, then at three times it, 15 s each. Last, a burst of eight times
what the cluster serves within the TTFT target, all at once.

The clients run in a process of their own (tests/slo_client.py), as a user's do. On the test's
own thread and event loop, they shared the interpreter with the router: at 3x, sending some 150
requests a second and reading their answers took the router's turns, and the goodput at 3x fell
below 0.9 of that at capacity for a cost no deployment has (CI failed on it twice: 43.8 against
54.4 req/s; `bench --launch`, which serves so, read TPOT about twice what a client in its own
process reads: BENCHMARKS.md, simulator fidelity). On the router's loop, earlier, the requests
served at 3x fell to 436-535 against 523-589 at capacity."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.run.launcher import ClusterSpec
from cluster.run.serve import ServingCluster
from common import free_port, wait_for
from router.slo import SLOTargets
from slo_client import OUTPUT, PHASE_S

SLO = SLOTargets(ttft_s=1.0, tpot_s=0.1)
CLIENT = Path(__file__).with_name("slo_client.py")


def clients(base_url: str, *args: str) -> dict:
    """tests/slo_client.py's phases against `base_url`, run in a process of their own."""
    done = subprocess.run([sys.executable, str(CLIENT), base_url, *args], capture_output=True, text=True,
                          timeout=360)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def goodput(results: list[tuple], seconds: float) -> float:
    return sum(s == 200 and ttft <= SLO.ttft_s and tpot <= SLO.tpot_s for s, _, ttft, tpot, *_ in results) / seconds


def test_three_times_capacity_gets_200s_and_429s_and_keeps_the_goodput(ray_session, alone):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    with ServingCluster(spec, port=free_port(), slo=SLO) as c:
        assert c.server.admission is not None                       # the default
        # Before any request: prompts are priced on the prefill shapes one worker timed at start
        # (no decode shapes: the model of both step kinds waits for served decode steps).
        fit = c.server.admission.fit
        assert fit.prefill_model() is not None and fit.current() is None

        run = clients(c.base_url, "drive")
        closed, capacity, at_capacity, overload = (run[k] for k in ("closed", "capacity", "at_capacity", "overload"))
        wait_for(lambda: c.server.pending, lambda n: n == 0, deadline_s=60)
        burst_size = min(400, max(256, round(8 * capacity * SLO.ttft_s)))

        burst = clients(c.base_url, "burst", str(burst_size))["burst"]
        shed = c.server.metrics.registry.get_sample_value("pdcluster:request_errors_total",
                                                          {"reason": "slo_unattainable"})
    # The closed loop well within capacity: served within the SLOs, and so nothing refused.
    assert [r[0] for r in closed] == [200] * len(closed), (
        [r[5] for r in closed if r[0] != 200][:3], sorted(r[2] for r in closed if r[0] == 200)[-5:])
    assert goodput(closed, 1.0) >= 0.9 * len(closed), sorted((r[2], r[3]) for r in closed)[-5:]
    statuses = {r[0] for r in at_capacity + overload}
    assert statuses <= {200, 429}, statuses
    refused = [r for r in overload if r[0] == 429]
    assert refused, (capacity, len(overload), sorted(r[2] for r in overload)[-5:])
    assert all(r[1] is not None and int(r[1]) >= 1 for r in refused)
    served_ttft = sorted(r[2] for r in overload if r[0] == 200)
    assert sorted(r[2] for r in refused)[len(refused) // 2] < served_ttft[len(served_ttft) // 2]   # refused at once
    # Every refusal is counted (the capacity loop's too, whose results are not kept). Not judged:
    # how the refusals split between the phases, which follows the box's load (a CI run refused
    # 18 at capacity and 9 at 3x when the capacity loop had left the box busier than it measured).
    assert shed >= len(refused) + sum(r[0] == 429 for r in at_capacity), (
        shed, len(refused), sum(r[0] == 429 for r in at_capacity), {r[5][:120] for r in refused})
    # A burst is checked request by request against the line of the burst's requests let in
    # before it, counted from their admission, not from when their responses begin (which let
    # in 65 of 256 here, to first tokens of 2.5 s, where the cluster served 19.6 a second; with
    # the pledges, 13 of 256 at 16.5 a second, within 0.9 s).
    let_in = sum(r[0] == 200 for r in burst)
    assert {r[0] for r in burst} <= {200, 429} and 0 < let_in <= 2 * capacity * SLO.ttft_s, (
        let_in, burst_size, capacity, sorted(r[2] for r in burst if r[0] == 200)[-5:])
    served = [r for r in at_capacity + overload if r[0] == 200]
    assert all(r[4] == OUTPUT for r in served)                      # nothing admitted was cut short
    g1, g3 = goodput(at_capacity, PHASE_S), goodput(overload, PHASE_S)
    served3 = [r for r in overload if r[0] == 200]
    assert g3 >= 0.9 * g1, (f"capacity {capacity:.1f} req/s: goodput {g1:.2f} at it, {g3:.2f} at 3x "
                            f"({len(refused)} of {len(overload)} refused, {len(served3)} served: "
                            f"{sum(r[2] > SLO.ttft_s for r in served3)} missed TTFT, "
                            f"{sum(r[3] > SLO.tpot_s for r in served3)} TPOT); served at 3x (TTFT, TPOT): "
                            + ", ".join(f"({r[2]:.2f}, {r[3]:.3f})" for r in served3))
