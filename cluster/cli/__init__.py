"""`pdcluster` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from cluster.flags import (CLUSTER_FLAGS, ROUTER_FLAGS, SLO_FLAGS, add_engine_args, add_flags, add_router_flags,
                           cluster_spec_from_args, engine_config_from_args, router_config_from_args)
from cluster.run.spec import ClusterSpec
from router.slo import SLOTargets
from workers.names import check_name

PROG = "pdcluster"


def cmd_generate(a) -> int:
    from cluster.offline import read_jsonl, run
    from workers.engine import LLMEngine
    requests = read_jsonl(a.input)
    engine = LLMEngine(engine_config_from_args(a))
    try:
        results = run(engine, requests)
    finally:
        engine.close()
    with open(a.output, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(results)} results to {a.output}", file=sys.stderr)
    return 0


def cmd_export_model(a) -> int:
    from workers.checkpoint import export_builtin
    out = export_builtin(a.name, a.dir)
    print(f"wrote the built-in model {a.name!r} as a Hugging Face checkpoint in {out}")
    return 0


def cmd_demo(a) -> int:
    from cluster.cli.demo import run_offline_demo
    return run_offline_demo(engine_config_from_args(a), a.num_prompts)


def cmd_serve(a) -> int:
    from cluster.run.ports import check_port_free
    spec = cluster_spec_from_args(a, engine_config_from_args(a))
    router = router_config_from_args(a)
    if a.routers < 1:
        raise ValueError(f"--routers must be >= 1, got {a.routers}")
    # What can fail in a second fails before the seconds of imports, Ray and model loading.
    for port in range(router.port, router.port + a.routers):
        check_port_free(router.host, port)
    if spec.engine.device.startswith("cuda") and not (spec.address or os.environ.get("RAY_ADDRESS")):
        from workers.device import resolve_device      # a local Ray's workers run on this machine
        resolve_device(spec.engine.device)
    from cluster.run.launcher import check_fits, connect
    if connect(spec):
        check_fits(spec)
    from cluster.run.serve import ServingCluster, serve_forever
    return serve_forever(ServingCluster(spec, router), a.routers - 1, router_args(a))


def router_args(a: argparse.Namespace) -> list[str]:
    """The router and SLO flags given on this command line, as given (but the port and the
    router id, which each router has its own of)."""
    out = []
    for f in ROUTER_FLAGS + SLO_FLAGS:
        dest = f.flag.removeprefix("--").replace("-", "_")
        if hasattr(a, dest) and f.flag not in ("--port", "--router-id", "--api-key"):   # the key: by env
            out += [f.flag] if f.type is bool else [f.flag, str(getattr(a, dest))]
    return out


def _join(a, what: str) -> str:
    """Join the Ray cluster that `--address` (or RAY_ADDRESS) names, for a command on running
    pools; the address."""
    address = a.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(f"{what}: give their Ray cluster's address (--address, or RAY_ADDRESS; `pdcluster serve` "
                         "prints it)")
    if a.cluster_id is not None:
        check_name(a.cluster_id, "--cluster-id")
    from cluster.run.launcher import connect
    connect(ClusterSpec(address=address))
    return address


def cmd_router(a) -> int:
    from cluster.run.ports import check_port_free
    router = router_config_from_args(a)
    check_port_free(router.host, router.port)
    address = _join(a, "a router attaches to running pools")
    from cluster.run.launcher import find_cluster
    spec, members, infos, book = find_cluster(a.cluster_id, a.ready_timeout_s)
    # The launcher's settings, on this process's Ray address: workers it adds, should it lead, are
    # detached as the launcher's are.
    spec = dataclasses.replace(spec, address=address)
    from cluster.run.serve import ServingCluster, serve_forever
    return serve_forever(ServingCluster(spec, router, attach=(members, infos), book=book))


def cmd_down(a) -> int:
    if a.grace_s < 0:
        raise ValueError(f"--grace-s must be >= 0, got {a.grace_s:g}")
    _join(a, "down removes running pools")
    from cluster.run.launcher import remove_cluster
    cluster_id, n = remove_cluster(a.cluster_id, a.grace_s)
    print(f"{PROG}: removed cluster {cluster_id} ({n} worker{'s' if n != 1 else ''})")
    return 0


def cmd_bench(a) -> int:
    from cluster.loadtest.bench import cmd_bench as run
    return run(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Disaggregated prefill/decode LLM serving on Ray")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation: JSONL requests in, JSONL results out")
    g.add_argument("--input", required=True, help="JSONL: one request per line")
    g.add_argument("--output", required=True, help="JSONL: one result per line, in input order")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export-model", help="write a built-in model as a Hugging Face checkpoint")
    e.add_argument("name", help="tiny or small")
    e.add_argument("dir")
    e.set_defaults(func=cmd_export_model)

    s = sub.add_parser("serve", help="start the prefill and decode pools on Ray and the OpenAI-compatible router")
    add_flags(s.add_argument_group("cluster"), CLUSTER_FLAGS, ClusterSpec)
    add_router_flags(s)
    s.add_argument("--routers", type=int, default=1, help="routers over these pools: this process's, and N-1 "
                   "`pdcluster router` processes on the next ports (--port + 1, ...), each with the router flags "
                   "given here; they end with this one (default: 1)")
    add_flags(s.add_argument_group("SLOs"), SLO_FLAGS, SLOTargets)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="another router over running pools (those a `serve` launched)",
                       description="Serve the OpenAI API over pools another `pdcluster serve` launched, beside its "
                       "router: more front-end capacity, and one that a router's death does not take down. One "
                       "router leads (restarts of hung workers, drains, the controller, the workers' metrics): the "
                       "serve that launched the pools, and, should it die, one of the routers attached.")
    r.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS)")
    r.add_argument("--cluster-id", help="which pools (default: the only ones on that Ray cluster)")
    r.add_argument("--ready-timeout-s", type=float, default=60.0, help="seconds for the workers to answer")
    add_router_flags(r)
    add_flags(r.add_argument_group("SLOs"), SLO_FLAGS, SLOTargets)
    r.set_defaults(func=cmd_router)

    dn = sub.add_parser("down", help="remove a cluster's pools from a Ray cluster (a serve that died left them)",
                        description="Stop a cluster's workers and remove its book; its routers then stop. On a Ray "
                        "cluster the pools outlive the `serve` that launched them, should it die (its routers take "
                        "over); stopping that serve cleanly removes them, as this does.")
    dn.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS)")
    dn.add_argument("--cluster-id", help="which pools (default: the only ones on that Ray cluster)")
    dn.add_argument("--grace-s", type=float, default=5.0, help="seconds each worker gets to stop before it is killed")
    dn.set_defaults(func=cmd_down)

    from cluster.loadtest.bench import add_bench_args
    from cluster.capacity.commands import add_profile_args, add_simulate_args, cmd_profile, cmd_simulate
    from cluster.capacity.plan import add_plan_args, cmd_plan
    for name, add_args, func, help, description in (
            ("bench", add_bench_args, cmd_bench, "load-test an OpenAI-compatible server: latency, throughput, goodput",
             "Load-test an OpenAI-compatible server (pdcluster, vLLM, SGLang) with streaming requests; flags "
             "follow `vllm bench serve`. --launch starts a local pdcluster first."),
            ("profile", add_profile_args, cmd_profile, "measure this machine's engine steps and KV handoff; fit the "
             "cost model", "Time the engine over a grid of batch shapes, the KV handoff between two processes "
             "and the served path; write the fitted cost model (JSON) for `simulate --profile`."),
            ("simulate", add_simulate_args, cmd_simulate, "simulate a cluster on a virtual clock: bench's report "
             "without GPUs", "Discrete-event simulation of the cluster, running the real scheduler, KV cache "
             "manager and picker with a cost model in place of the model. Takes bench's workload flags and "
             "serve's cluster flags; writes bench's report and JSON."),
            ("plan", add_plan_args, cmd_plan, "find the placement with the highest goodput per GPU, by simulation",
             "Search placements (workers per pool, tensor-parallel degree per pool; colocated as the baseline) "
             "for the highest goodput per GPU at the SLOs, by simulated rate searches on bench's workload flags.")):
        c = sub.add_parser(name, help=help, description=description)
        add_args(c)
        c.set_defaults(func=func)

    d = sub.add_parser("demo", help="run the engine on the built-in model with a mixed workload and report")
    d.add_argument("--num-prompts", type=int, default=64)
    add_engine_args(d)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # User-caused problems: one line naming what is wrong, no traceback.
        print(f"{PROG} {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
