"""Tensor parallelism: a model split over two ranks (Ray actors, all-reduce over Gloo) gives the
greedy outputs of one rank and of Hugging Face transformers on the same checkpoint, through the
`generate` command and under the cache's hard cases (chunked prefill, preemption by swap, whose
copies every rank must make); a lost rank fails the step at once instead of hanging it; a model
that cannot be split is refused before anything starts."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import openai
import pytest

from common import (MAX_NEW_TOKENS, PROMPTS, assert_all_blocks_free, pdcluster_cmd, random_prompts, subprocess_env,
                    wait_for, wait_pools_clean)
from test_hf_parity import assert_same_as_hf, generate_ids
from workers.checkpoint import builtin_config
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams


def _generate_cli(tmp_path, model: str, tp: int) -> list[list[int]]:
    src, out = tmp_path / "in.jsonl", tmp_path / f"out-tp{tp}.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                                       "ignore_eos": True}) + "\n" for p in PROMPTS))
    proc = subprocess.run(pdcluster_cmd("generate", "--model", model, "--input", str(src), "--output", str(out),
                                        "--tensor-parallel-size", str(tp), "--kv-cache-memory-mib", "16"),
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]


def test_generate_tp2_equals_tp1_and_hf(tiny_dir, hf_greedy, tmp_path, spawns):
    want = hf_greedy(PROMPTS)
    tp1 = generate_ids(LLMEngine(EngineConfig(model=tiny_dir, cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20))),
                       PROMPTS)
    tp2 = _generate_cli(tmp_path, tiny_dir, 2)
    assert_same_as_hf(tp1, want, PROMPTS)
    assert_same_as_hf(tp2, want, PROMPTS)


def test_tp2_under_chunking_and_swap_matches_hf(ray_session, tiny_dir, hf_greedy):
    # 40 blocks x 16 tokens for 16 prompts of up to 300 + 64 tokens: preemption by swap, whose
    # block copies rank 1 makes on its own cache from rank 0's broadcast; chunks of 48 tokens.
    engine = LLMEngine(EngineConfig(
        model=tiny_dir, tensor_parallel_size=2,
        cache=CacheConfig(num_blocks=40, swap_space_bytes=8 * 2**20),
        scheduler=SchedulerConfig(preemption_mode="swap", max_num_batched_tokens=48)))
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == engine.model_config.num_key_value_heads // 2
        got = generate_ids(engine, PROMPTS)
        assert engine.scheduler.stats.num_preemptions["swap"] > 0, engine.scheduler.stats
        assert_same_as_hf(got, hf_greedy(PROMPTS), PROMPTS)
        assert_all_blocks_free(engine)
    finally:
        engine.close()


def test_lost_rank_fails_the_step(ray_session, tiny_dir):
    import ray
    from workers.tensor_parallel import RankLost
    engine = LLMEngine(EngineConfig(model=tiny_dir, tensor_parallel_size=2,
                                    cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20, swap_space_bytes=0)))
    try:
        assert len(generate_ids(engine, PROMPTS[:2])) == 2
        rank1 = engine.ranks.ranks[0]
        pid = ray.get(rank1.pid.remote())
        ray.kill(rank1)
        wait_for(lambda: _alive(pid), lambda alive: not alive, deadline_s=30, describe="rank 1's process to end")
        with pytest.raises(RankLost):
            generate_ids(engine, PROMPTS[:2])
    finally:
        engine.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def test_unsplittable_model_is_refused_by_the_cli(tmp_path, spawns):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    proc = subprocess.run(pdcluster_cmd("generate", "--model", "tiny", "--input", str(src), "--output",
                                        str(tmp_path / "out.jsonl"), "--tensor-parallel-size", "3"),
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tensor-parallel-size 3 does not divide num_attention_heads=8" in proc.stderr
    assert "Traceback" not in proc.stderr


CLUSTER_PROMPTS = random_prompts(7, [1, 15, 16, 17, 40, 64, 100, 131, 200, 300])
CLUSTER_TOKENS = 16


@pytest.fixture(scope="module")
def cluster_reference():
    """The offline engine's greedy outputs (one rank; itself checked against HF above)."""
    engine = LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(temperature=0, max_tokens=CLUSTER_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in CLUSTER_PROMPTS], params)]


@pytest.mark.parametrize("transport,prefill_tp,decode_tp", [
    ("shm", 2, 1),      # the decode worker copies each prefill rank's heads out of its cache
    ("shm", 1, 2),      # ... and writes rank 1's heads into that rank's cache
    ("gloo", 2, 1),     # the prefill worker gathers its ranks' heads, sends them whole
    ("gloo", 1, 2),     # the decode worker receives them whole and scatters them to its ranks
])
def test_pools_of_different_tp_serve_the_offline_output(ray_session, cluster_reference, transport, prefill_tp,
                                                        decode_tp):
    from cluster.loadtest import promtext
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    from common import free_port
    spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=1, num_decode=1, kv_transport=transport,
                       prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                       num_cpus_per_worker=0.5, engine={"cache": {"num_blocks": 256}})
    with ServingCluster(spec, port=free_port(), admission="queue", local_prefill_max_tokens=0) as c:
        got = asyncio.run(_send_all(c.base_url, CLUSTER_PROMPTS, CLUSTER_TOKENS))
        assert got == cluster_reference
        wait_pools_clean(c)
        # Every prompt block crossed with all its heads (a half-sharded copy would be half the bytes).
        moved = promtext.total(promtext.scrape(f"http://{c.host}:{c.port}/metrics"), "pdcluster:kv_transfer_bytes_total")
        cfg = builtin_config("tiny")
        per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
        assert moved == sum(-(-len(p) // 16) for p in CLUSTER_PROMPTS) * per_block


async def _send_all(base_url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    try:
        rs = await asyncio.gather(*(client.completions.create(
            model="tiny", prompt=p, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
            for p in prompts))
        return [r.choices[0].token_ids for r in rs]
    finally:
        await client.close()


def test_a_dead_rank_restarts_its_worker_and_its_requests_complete(ray_session, cluster_reference):
    import ray

    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    from common import free_port
    spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=1, num_decode=1, kv_transport="shm",
                       prefill_tensor_parallel_size=2, num_cpus_per_worker=0.5, engine={"cache": {"num_blocks": 256}})
    with ServingCluster(spec, port=free_port(), admission="queue") as c:
        prefill = next(w for w in c.workers if w.role == "prefill")
        info = ray.get(prefill.handle.ready.remote())
        (rank1,) = info.rank_pids
        os.kill(rank1, signal.SIGKILL)
        # The prefill worker's next step finds the group broken and ends; Ray restarts it with
        # new ranks and the router resumes what it had (on the decode worker, whole, while the
        # prefill pool has no active worker): nothing lost, nothing changed.
        got = asyncio.run(_send_all(c.base_url, CLUSTER_PROMPTS, CLUSTER_TOKENS))
        assert got == cluster_reference
        # The restarted worker comes back to its pool and prefills again.
        wait_for(lambda: [m.worker_id for m in c.pools.active("prefill")], bool, deadline_s=120)
        after = ray.get(prefill.handle.ready.remote())
        assert after.pid != info.pid and rank1 not in after.rank_pids
        assert asyncio.run(_send_all(c.base_url, CLUSTER_PROMPTS, CLUSTER_TOKENS)) == cluster_reference
        wait_pools_clean(c)


def test_a_hung_rank_fails_the_step_within_the_step_timeout(ray_session, tiny_dir, monkeypatch):
    from workers import tensor_parallel
    monkeypatch.setattr(tensor_parallel, "STEP_TIMEOUT_S", 3.0)
    engine = LLMEngine(EngineConfig(model=tiny_dir, tensor_parallel_size=2,
                                    cache=CacheConfig(kv_cache_memory_bytes=8 * 2**20, swap_space_bytes=0)))
    (pid,) = engine.ranks.pids
    try:
        assert len(generate_ids(engine, PROMPTS[:2])) == 2
        os.kill(pid, signal.SIGSTOP)        # alive, its sockets open, answering nothing
        with pytest.raises(tensor_parallel.RankLost):
            generate_ids(engine, PROMPTS[:2])
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()
