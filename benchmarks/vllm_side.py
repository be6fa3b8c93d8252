#!/usr/bin/env python
"""The vLLM half of benchmarks/bench_offline.py: run it in an environment with vLLM installed.

    .venv-vllm/bin/python benchmarks/vllm_side.py --model CKPT_DIR --requests A.json [B.json ...]

(`make vllm-env` builds .venv-vllm/.)

Each requests file is a JSON list of {"prompt_token_ids": [...], "max_tokens": n}
(bench_offline.py writes them). One vLLM engine, LLM(model=CKPT_DIR, skip_tokenizer_init=True,
dtype="float32"), is started once and warmed up (8 prompts of 64 tokens and one of 600, 16 new
tokens each: the same shapes pdcluster warms up with); then for each file, in order, the
requests go to LLM.generate as TokensPrompt with SamplingParams(temperature=0, max_tokens=n,
ignore_eos=True), timed, and one JSON line is printed:
    {"requests_file": ..., "tok_s": ..., "output_tokens": ..., "seconds": ..., ...}
Output tokens/s = generated tokens / wall time of the timed LLM.generate call. For repeated
runs give several files with different prompts (a repeated prompt would hit vLLM's prefix
cache). Imports nothing from pdcluster, so it runs under vLLM's own torch.

vLLM's CPU defaults are kept: on a 2-core box it reserves one core for its front end and runs
the model on one OpenMP thread (VLLM_CPU_OMP_THREADS_BIND=auto); set that variable to change it.
Two settings differ from vLLM's defaults because they must on a shared box: the KV cache is
given explicitly (--kv-cache-gib, default 1 GiB = 262k tokens of the tiny model), and
gpu_memory_utilization (on CPU: the share of the NUMA node's memory vLLM may reserve) is 0.5,
as the default 0.92 refuses to start when other processes hold memory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--requests", required=True, nargs="+",
                    help="JSON file(s), each a list of {prompt_token_ids, max_tokens}")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size (kv_cache_memory_bytes)")
    ap.add_argument("--memory-utilization", type=float, default=0.5,
                    help="gpu_memory_utilization: on CPU the share of the NUMA node's memory vLLM "
                         "may reserve (its default 0.92 fails on a shared box)")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", seed=0,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.memory_utilization,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    load_s = time.perf_counter() - t0

    def run(batch: list[dict]) -> tuple[float, int]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in batch]
        params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
                                 detokenize=False) for r in batch]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    rng = random.Random(5)
    warm = [{"prompt_token_ids": [rng.randrange(256) for _ in range(n)], "max_tokens": 16}
            for n in [64] * 8 + [600]]
    t0 = time.perf_counter()
    run(warm)
    warm_s = time.perf_counter() - t0

    ok = True
    for path in args.requests:
        with open(path) as f:
            reqs = json.load(f)
        dt, got = run(reqs)
        want = sum(r["max_tokens"] for r in reqs)
        ok &= got == want
        print(json.dumps({"requests_file": path, "tok_s": got / dt, "output_tokens": got,
                          "requested_tokens": want, "seconds": dt,
                          "load_s": load_s, "warmup_s": warm_s, "vllm_version": vllm.__version__,
                          "requests": len(reqs),
                          "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}),
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
