"""The shape of a cluster: its mode, pool sizes, engine, transport and Ray resources (plain data)."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from cluster.run.controller import COOLDOWN_S, SHRINK_HOLD_S, ControllerConfig
from workers.config import EngineConfig
from workers.names import COLOCATED, DECODE, DISAGGREGATED, MODES, PREFILL, TRANSPORTS, check_name

PLACEMENTS = ("default", "spread")     # how Ray places the workers over the nodes (see launch)
# --controller: off; on (it changes the pools); advise (it reports what it would do and changes nothing)
CONTROLLER_MODES = ("off", "on", "advise")


@dataclass(slots=True)
class ClusterSpec:
    model: str = "tiny"                       # the engine's model (overrides engine.model)
    mode: str = DISAGGREGATED                 # one of MODES
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 2
    # Each pool's tensor-parallel size (None: the engine's --tensor-parallel-size).
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    engine: EngineConfig | dict = field(default_factory=EngineConfig)   # a dict: EngineConfig.from_dict
    kv_transport: str = "auto"                # one of TRANSPORTS
    address: str | None = None                # Ray address; None: RAY_ADDRESS or a local cluster
    num_gpus_per_worker: float | None = None   # None: 1 if the cluster has GPUs, else 0
    num_cpus_per_worker: float = 0.5
    placement: str = "default"               # one of PLACEMENTS; spread: round-robin over the nodes
    ready_timeout_s: float = 300.0
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    router_lease_s: float = 10.0              # a router silent this long loses its requests on a worker
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])   # names this cluster's actors
    # The pool-ratio controller (cluster/run/pool_control.py): off by default.
    controller: str = "off"                   # one of CONTROLLER_MODES (True and False: on and off)
    controller_interval_s: float = 10.0
    controller_window_s: float = 30.0
    controller_cooldown_s: float = COOLDOWN_S
    controller_forecast_s: float = 60.0       # its long interval (cluster/run/forecast.py); 0: no forecast
    controller_shrink_hold_s: float = SHRINK_HOLD_S   # elastic: no pool shrinks within this long of its growth
    controller_mixed: bool = False            # the controller may empty the prefill pool (the mixed role)
    max_workers: int | None = None            # the worker budget (default: the pools' sizes at launch)
    min_workers: int | None = None            # elastic: the controller shrinks the total to no fewer

    def __post_init__(self):
        if isinstance(self.engine, dict):
            self.engine = EngineConfig.from_dict(self.engine)
        self.engine = dataclasses.replace(self.engine, model=self.model)
        check_pools(self.mode, self.num_prefill, self.num_decode, self.num_colocated)
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if isinstance(self.controller, bool):
            self.controller = "on" if self.controller else "off"
        if self.controller not in CONTROLLER_MODES:
            raise ValueError(f"--controller must be one of {', '.join(CONTROLLER_MODES)}, got {self.controller!r}")
        if self.controls and self.mode != DISAGGREGATED:
            raise ValueError("--controller moves workers between the prefill and decode pools: it needs "
                             "--mode disaggregated")
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and self.mode != DISAGGREGATED:
                raise ValueError(f"--{name.replace('_', '-')} sizes a pool of --mode disaggregated; this cluster "
                                 "is colocated: use --tensor-parallel-size")
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_workers is not None and self.max_workers < len(self.roles()):
            raise ValueError(f"--max-workers {self.max_workers} is below the {len(self.roles())} workers launched")
        check_name(self.cluster_id, "--cluster-id")     # it names actors; `pdcluster router` finds them by it
        for name in ("lease_s", "transfer_timeout_s", "ready_timeout_s", "controller_interval_s",
                     "controller_window_s", "router_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.controller_cooldown_s >= 0:
            raise ValueError(f"--controller-cooldown-s must be >= 0, got {self.controller_cooldown_s}")
        if not self.controller_shrink_hold_s >= 0:
            raise ValueError(f"--controller-shrink-hold-s must be >= 0, got {self.controller_shrink_hold_s}")
        if not self.controller_forecast_s >= 0:
            raise ValueError(f"--controller-forecast-s must be >= 0, got {self.controller_forecast_s}")
        if self.min_workers is not None and not 2 <= self.min_workers <= self.budget:
            raise ValueError(f"--min-workers must be within 2 and the budget ({self.budget}), got {self.min_workers}")

    def controller_config(self) -> ControllerConfig:
        """The controller's policy settings (serve's and simulate's alike)."""
        return ControllerConfig.sized(self.budget, self.controller_cooldown_s, self.min_workers,
                                      self.controller_shrink_hold_s, self.controller_mixed)

    @property
    def controls(self) -> bool:
        """Whether the pool-ratio controller runs (acting, or advising)."""
        return self.controller != "off"

    @property
    def budget(self) -> int:
        """The most workers at once: --max-workers, else the launched pools."""
        return self.max_workers if self.max_workers is not None else len(self.roles())

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks per worker of a pool (a flipped worker keeps the size it started with)."""
        size = {PREFILL: self.prefill_tensor_parallel_size, DECODE: self.decode_tensor_parallel_size}.get(role)
        return size or self.engine.tensor_parallel_size

    @property
    def max_tensor_parallel_size(self) -> int:
        return max(self.tensor_parallel_size(role) for role in (PREFILL, DECODE, COLOCATED))

    def roles(self) -> list[tuple[str, str]]:
        if self.mode == COLOCATED:
            return [(f"{COLOCATED}-{i}", COLOCATED) for i in range(self.num_colocated)]
        return ([(f"{PREFILL}-{i}", PREFILL) for i in range(self.num_prefill)] +
                [(f"{DECODE}-{i}", DECODE) for i in range(self.num_decode)])


def check_pools(mode: str, num_prefill: int, num_decode: int, num_colocated: int) -> None:
    """A cluster's shape, served or simulated: a known mode, and its pools not empty."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
    if mode == DISAGGREGATED and (num_prefill < 1 or num_decode < 1):
        raise ValueError("disaggregated mode needs at least one prefill and one decode worker")
    if mode == COLOCATED and num_colocated < 1:
        raise ValueError("colocated mode needs at least one worker")
