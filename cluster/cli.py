"""`pdcluster` command line."""
from __future__ import annotations

import argparse
import json
import logging
import sys

PROG = "pdcluster"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="built-in model (tiny, small) or a HF checkpoint directory")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory-mib", type=int, default=256, help="memory budget of the KV cache")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides the memory budget)")
    g.add_argument("--swap-space-mib", type=int, default=256, help="host memory for swapped-out blocks")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="cap on running sequences")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"])
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "flash"])
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(a: argparse.Namespace):
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, seed=a.seed,
        attention_backend=a.attention_backend,
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory_bytes=a.kv_cache_memory_mib * 2**20,
                          num_blocks=a.num_kv_blocks, swap_space_bytes=a.swap_space_mib * 2**20,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs, preemption_mode=a.preemption_mode,
                                  policy=a.scheduling_policy))


def cmd_generate(a) -> int:
    from cluster.offline import read_jsonl, run
    from workers.engine import LLMEngine
    requests = read_jsonl(a.input)
    engine = LLMEngine(engine_config_from_args(a))
    results = run(engine, requests)
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
    from cluster.demo import run_offline_demo
    return run_offline_demo(engine_config_from_args(a), a.num_prompts)


def cmd_serve(a) -> int:
    import dataclasses

    from cluster.launcher import ClusterSpec
    from cluster.serve import ServingCluster, serve_forever
    from router.slo import SLOTargets
    slo = SLOTargets(a.slo_ttft_ms / 1000, a.slo_tpot_ms / 1000, a.slo_window_s)
    engine = dataclasses.asdict(engine_config_from_args(a))
    engine.pop("model")
    spec = ClusterSpec(model=a.model, mode=a.mode, num_prefill=a.prefill, num_decode=a.decode,
                       num_colocated=a.workers, engine=engine, kv_transport=a.kv_transport,
                       address=a.address, num_cpus_per_worker=a.cpus_per_worker,
                       num_gpus_per_worker=a.gpus_per_worker)
    return serve_forever(ServingCluster(spec, a.host, a.port, a.api_key, a.policy, a.max_pending,
                                        a.served_model_name, slo=slo))


def cmd_bench(a) -> int:
    from cluster.bench import cmd_bench as run
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
    s.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    s.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    s.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    s.add_argument("--workers", type=int, default=2, help="workers (colocated)")
    s.add_argument("--kv-transport", default="auto", choices=["auto", "gloo", "nccl"],
                   help="KV handoff transport; auto: nccl on GPUs, gloo on CPU")
    s.add_argument("--policy", default="p2c", choices=["p2c", "random", "round-robin"],
                   help="how the router picks workers")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--max-pending", type=int, default=512, help="requests in flight before 429")
    s.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)")
    s.add_argument("--cpus-per-worker", type=float, default=0.5)
    s.add_argument("--gpus-per-worker", type=float, default=None, help="default: 1 on GPU clusters, else 0")
    s.add_argument("--slo-ttft-ms", type=float, default=1000.0,
                   help="TTFT target: requests are judged against it in the SLO metrics")
    s.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT (time per output token) target")
    s.add_argument("--slo-window-s", type=float, default=60.0,
                   help="window of the router's pdcluster:slo_attainment gauge")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    from cluster.bench import add_bench_args
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server: latency, throughput, goodput",
                       description="Load-test an OpenAI-compatible server (pdcluster, vLLM, SGLang) with "
                       "streaming requests; flags follow `vllm bench serve`. --launch starts a local "
                       "pdcluster first.")
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

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
