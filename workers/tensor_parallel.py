"""Tensor parallelism: one worker's model split over N processes, rank 0 driving.

    rank 0 (the worker: engine, scheduler, sampler)        ranks 1..N-1 (`Rank` actors)
    ModelRunner.execute: prepare the step's tensors
      group.send(StepInputs) ─────broadcast─────────────▶ group.recv() in their serve thread
      run the model (its slice) ◀──all-reduce x 2/layer─▶ run the model (their slices)
      logits, sampling (hidden states are whole on every rank)

Each rank holds 1/N of every layer and 1/N of the KV heads, in a KV cache of its own with the
same block ids (rank 0's block pool decides for all). The ranks are Ray actors in one
STRICT_PACK placement group, so they share a node: the all-reduce runs over Gloo on CPU and
NCCL on GPU (step inputs always over Gloo: they are small host objects). The group meets at a
TCPStore rank 0 hosts, on the node's bind address only (loopback in a local cluster), under a
secret prefix rank 0 makes and hands the others through Ray. The step travels as typed msgpack
(workers/messages.py `TPStep`), never pickle: a rank decodes nothing but that type.

Faults: a rank that dies closes its sockets, and rank 0's next collective raises `RankLost`;
the worker then ends its process, so Ray restarts it with a fresh group (the router resumes its
requests, as for any lost worker). A rank that hangs does the same once an all-reduce has
waited `STEP_TIMEOUT_S` (the ranks of a step wait for each other only a layer's imbalance). The other ranks are owned by rank 0 and end with it; a rank whose rank 0
died sees the broadcast fail and leaves.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.model_runner import ModelRunner, StepInputs

log = logging.getLogger("pdcluster.tp")
# Ranks 1..N-1 wait in the step broadcast for as long as rank 0 is idle: that group's timeout
# is a day (a dead rank 0 fails it at once: its sockets close).
_IDLE_TIMEOUT = timedelta(hours=24)
# How long an all-reduce waits for the other ranks before the group counts as broken (a hung
# rank). They are in lockstep, layer by layer: this bounds a stall, not a step.
STEP_TIMEOUT_S = 300.0


class RankLost(RuntimeError):
    """Another rank of this worker's group failed: the group is unusable."""


def _wire_tensor(t):
    from workers.messages import TPTensor
    if t is None:
        return None
    t = t.detach().to("cpu").contiguous()
    return TPTensor(str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _tensor(w, device: torch.device):
    if w is None:
        return None
    dtype = getattr(torch, w.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a tensor type: {w.dtype!r}")
    if not w.data:
        return torch.empty(w.shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).reshape(w.shape).to(device)


def encode_step(step: StepInputs | None) -> bytes:
    """A step (None: stop) as typed msgpack (workers/messages.py TPStep)."""
    from workers.messages import TPChunk, TPMeta, TPStep, encode
    if step is None:
        return encode(TPStep(stop=True))
    m = step.meta
    meta = TPMeta(_wire_tensor(m.slot_mapping), m.num_decodes, m.decode_max_context, m.num_paged_rows,
                  _wire_tensor(m.paged_block_tables), _wire_tensor(m.paged_context_lens),
                  _wire_tensor(m.paged_cu_seqlens_q),
                  [TPChunk(c.start, c.end, c.num_context, _wire_tensor(c.block_table)) for c in m.prefills])
    return encode(TPStep([list(p) for p in step.copies], [list(p) for p in step.swap_out],
                         [list(p) for p in step.swap_in], _wire_tensor(step.input_ids), _wire_tensor(step.positions),
                         meta))


def decode_step(payload: bytes, device: torch.device) -> StepInputs | None:
    """The step (None: stop) out of `encode_step`'s bytes; anything else (a pickle, another
    message) raises ContractError."""
    from workers.attention import AttentionMetadata, PrefillChunk
    from workers.messages import ContractError, TPStep, decode
    try:
        w = decode(payload, TPStep)
    except ContractError:
        raise
    except Exception as e:              # not msgpack at all
        raise ContractError(f"not a tensor-parallel step: {type(e).__name__}: {e}") from None
    if w.stop:
        return None
    m = w.meta
    meta = AttentionMetadata(_tensor(m.slot_mapping, device), m.num_decodes, m.decode_max_context, m.num_paged_rows,
                             _tensor(m.paged_block_tables, device), _tensor(m.paged_context_lens, device),
                             _tensor(m.paged_cu_seqlens_q, device),
                             [PrefillChunk(c.start, c.end, c.num_context, _tensor(c.block_table, device))
                              for c in m.prefills])
    return StepInputs([tuple(p) for p in w.copies], [tuple(p) for p in w.swap_out], [tuple(p) for p in w.swap_in],
                      _tensor(w.input_ids, device), _tensor(w.positions, device), meta)


class TPGroup:
    """The collectives among one worker's ranks: `control` (Gloo) carries the step inputs and
    waits as long as rank 0 idles; `compute` (Gloo on CPU, NCCL on GPU) adds the partial sums,
    within `step_timeout`. `timeout` bounds the meeting, which waits for all of them."""

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout: timedelta, step_timeout: timedelta, store: dist.TCPStore | None = None,
                 secret: str = ""):
        if not secret:
            raise ValueError("a tensor-parallel group needs rank 0's secret")
        self.rank, self.size, self.device = rank, size, device
        self.store = store or dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        ours = dist.PrefixStore(f"tp/{secret}", self.store)

        def gloo(name: str, wait: timedelta):
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = wait
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            return dist.ProcessGroupGloo(dist.PrefixStore(name, ours), rank, size, opts)
        # Rank 0's sends wait for the others to take them (Gloo sends when the receiver is ready):
        # bounded there like the all-reduce; the others wait out rank 0's idle time.
        self.control = gloo("control", step_timeout if rank == 0 else _IDLE_TIMEOUT)
        self.broken = False             # a collective failed: the group is unusable
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = step_timeout
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", ours), rank, size, nccl)
        else:
            self.compute = gloo("compute", step_timeout)

    @staticmethod
    def host(host: str, timeout: timedelta) -> dist.TCPStore:
        """Rank 0's store, on a free port (`store.port`) of `host` only, for the others to meet at."""
        from workers.kv_transfer import listen_store
        return listen_store(host, timeout)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks, in place."""
        try:
            self.compute.allreduce([x]).wait()
        except RuntimeError as e:
            self.broken = True
            raise RankLost(f"a tensor-parallel rank failed during an all-reduce: {e}") from e

    def send(self, obj) -> None:
        """Rank 0: broadcast one object (None tells the others to stop)."""
        data = torch.frombuffer(bytearray(encode_step(obj)), dtype=torch.uint8)
        try:
            self.control.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0).wait()
            self.control.broadcast(data, 0).wait()
        except RuntimeError as e:
            self.broken = True
            raise RankLost(f"a tensor-parallel rank failed: {e}") from e

    def recv(self):
        """Ranks 1..N-1: the next step rank 0 broadcast (None: stop). Raises ContractError on
        anything but a typed step."""
        n = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(n, 0).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return decode_step(data.numpy().tobytes(), self.device)

    def close(self) -> None:
        for g in {id(self.control): self.control, id(self.compute): self.compute}.values():
            try:
                g.shutdown()
            except Exception:
                pass


class Rank:
    """Rank r > 0 of a tensor-parallel worker (a Ray actor): its slice of the model and its
    KV cache, stepped by rank 0's broadcasts."""

    def __init__(self, engine_cfg, rank: int, size: int, num_blocks: int, num_host_blocks: int,
                 num_threads: int = 1):
        from workers.checkpoint import load_model
        from workers.device import resolve_device, resolve_dtype
        from workers.model import Shard
        torch.set_num_threads(num_threads)
        torch.manual_seed(engine_cfg.seed)
        cfg, self.rank, self.size = engine_cfg, rank, size
        self.device, self.dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, cfg.device)
        self._shard = Shard(rank, size, self._all_reduce)
        model, _ = load_model(cfg.model, self.dtype, self.device, self._shard)
        self.runner = ModelRunner(model, num_blocks, cfg.cache.block_size, num_host_blocks, self.device,
                                  self.dtype, cfg.attention_backend, cfg.cache.shared_memory)
        self.group: TPGroup | None = None

    def _all_reduce(self, x):
        self.group.all_reduce(x)

    def pid(self) -> int:
        return os.getpid()

    def kv_segment(self) -> dict | None:
        """Where this rank's KV cache lives (rank 0 maps it to move the worker's KV in and out)."""
        from workers.node import node_id
        shared = self.runner.shared_kv
        return None if shared is None else shared.segment(node_id()).to_dict()

    def join(self, host: str, port: int, timeout_s: float, step_timeout_s: float, secret: str) -> int:
        """Meet the other ranks (waits for all of them) under rank 0's `secret` (given through
        Ray), then serve rank 0's steps in a thread."""
        self.group = TPGroup(self.rank, self.size, host, port, self.device, timedelta(seconds=timeout_s),
                             timedelta(seconds=step_timeout_s), secret=secret)
        threading.Thread(target=self._serve, name=f"tp-rank-{self.rank}", daemon=True).start()
        return self.rank

    def _serve(self) -> None:
        try:
            while (step := self.group.recv()) is not None:
                self.runner.run(step)
        except Exception as e:          # rank 0 is gone (or this rank broke): nothing to serve
            log.warning("tensor-parallel rank %d stops: %s", self.rank, e)
            os._exit(1)
        self.group.close()


class RankGroup:
    """Rank 0's side: starts ranks 1..N-1 in the placement group (they load their slices
    meanwhile), then `join` meets them."""

    def __init__(self, engine_cfg, size: int, num_blocks: int, num_host_blocks: int, placement=None,
                 timeout_s: float = 300.0):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if not ray.is_initialized():            # offline `generate`: RAY_ADDRESS, else a local Ray
            if os.environ.get("RAY_ADDRESS"):
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                from workers.node import start_local_ray        # all on loopback
                start_local_ray(include_dashboard=False, log_to_driver=False)
        from workers.device import resolve_device
        device = resolve_device(engine_cfg.device)
        self._own_pg = None
        if placement is None:                   # a group of our own for the other ranks
            bundle = {"CPU": 1, "GPU": 1} if device.type == "cuda" else {"CPU": 1}
            pg = self._own_pg = placement_group([bundle] * (size - 1), strategy="STRICT_PACK")
            first = 0
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                raise RuntimeError(f"--tensor-parallel-size {size}: Ray cannot place {size - 1} more rank(s) "
                                   f"of {bundle} on one node") from None
        else:                                   # the launcher's group: this worker is bundle 0
            pg, first = placement, 1
        self.size, self.device, self.timeout_s = size, device, timeout_s
        self.pids: list[int] = []               # ranks 1..N-1's processes, once they loaded
        self.group: TPGroup | None = None
        actor = ray.remote(Rank)
        gpus = 1 if device.type == "cuda" else 0
        self.ranks = [actor.options(
            num_cpus=0 if placement is not None else 1, num_gpus=gpus, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + r - 1),
        ).remote(engine_cfg, r, size, num_blocks, num_host_blocks) for r in range(1, size)]

    def all_reduce(self, x: torch.Tensor) -> None:
        self.group.all_reduce(x)

    def join(self) -> TPGroup:
        """Wait for the other ranks to load their slices, then meet them."""
        import ray
        try:
            self.pids = ray.get([a.pid.remote() for a in self.ranks], timeout=self.timeout_s)
            from workers.node import bind_host
            host = bind_host()
            timeout = timedelta(seconds=self.timeout_s)
            store = TPGroup.host(host, timeout)
            step_timeout_s = STEP_TIMEOUT_S
            secret = secrets.token_hex(16)
            joined = [a.join.remote(host, store.port, self.timeout_s, step_timeout_s, secret) for a in self.ranks]
            self.group = TPGroup(0, self.size, host, store.port, self.device, timeout,
                                 timedelta(seconds=step_timeout_s), store, secret)
            ray.get(joined, timeout=self.timeout_s)
        except Exception:
            self.close()
            raise
        log.info("tensor parallel: %d ranks joined", self.size)
        return self.group

    def close(self) -> None:
        """Stop the other ranks (they leave their loop at the None) and end their actors."""
        import ray
        group, self.group = self.group, None
        if group is not None:
            if not group.broken:        # a broken group's ranks are killed below
                try:
                    group.send(None)
                except RankLost:
                    pass
            group.close()
        for a in self.ranks:
            ray.kill(a)
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._own_pg)
            self._own_pg = None
