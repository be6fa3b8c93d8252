"""The router's settings: where it listens, who may call it, how it picks and admits, its SLOs."""
from __future__ import annotations

from dataclasses import dataclass, field

from router.admission import ADMISSION_POLICIES
from router.picker import check_local_prefill
from router.slo import SLOTargets
from router.tools import PARSERS
from workers.names import AUTO, P2C, PICKING_POLICIES, check_name


TOOL_PARSERS = (AUTO, *PARSERS)

API_KEY_ENV = "PDCLUSTER_API_KEY"         # the API key, when neither --api-key nor --api-key-file gives it


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)   # require 'Authorization: Bearer KEY' (a secret)
    served_model_name: str | None = None      # the model name clients send (default: the model)
    policy: str = P2C                         # one of PICKING_POLICIES
    local_prefill_max_tokens: int | str = AUTO  # disaggregated: prefill on the decode worker up to this many tokens (0: never)
    max_pending: int = 512                    # requests in flight before 429
    decode_gate: bool = True                  # disaggregated: hold new requests before prefill while decode is full
    admission: str = "slo"                    # one of ADMISSION_POLICIES (router/admission.py)
    max_body_bytes: int = 8 * 2**20           # larger request bodies get 413, unread
    max_retries: int = 2                      # resumes in a row that make no progress, then an error
    worker_hang_timeout_s: float = 10.0       # a worker that answers no poll for this long is restarted
    drain_timeout_s: float = 30.0             # on shutdown: how long in-flight requests may still run
    client_stall_timeout_s: float = 30.0      # a stream whose client takes no chunk for this long is ended
    request_timeout_s: float = 600.0          # a request still running this long after it arrived ends (504)
    body_timeout_s: float = 30.0              # a request body not whole within this long is refused (408)
    max_validating: int = 64                  # request bodies being read or validated at once, past it 429
    max_refusals_per_s: float = 500.0         # a full server's 429s answered per second at most (held up to 1 s)
    tool_call_parser: str = AUTO              # how answers call tools: one of TOOL_PARSERS (auto: by the chat template)
    slo: SLOTargets = field(default_factory=SLOTargets)
    router_id: str = "router"                 # its name on the workers (its requests' owner tag starts with it)
    otlp_traces_endpoint: str = ""            # an OTLP/HTTP collector to send request traces to ("": none)

    def __post_init__(self):
        check_name(self.router_id)
        if self.policy not in PICKING_POLICIES:
            raise ValueError(f"--policy must be one of {PICKING_POLICIES}, got {self.policy!r}")
        check_local_prefill(self.local_prefill_max_tokens)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"--admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
        if self.max_pending < 1:
            raise ValueError(f"--max-pending must be >= 1, got {self.max_pending}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-mib must be >= 1, got {self.max_body_bytes / 2**20:g}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        if not self.worker_hang_timeout_s > 0:
            raise ValueError(f"--worker-hang-timeout-s must be > 0, got {self.worker_hang_timeout_s}")
        for flag, value in (("--request-timeout-s", self.request_timeout_s), ("--body-timeout-s", self.body_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {TOOL_PARSERS}, got {self.tool_call_parser!r}")
        if not self.max_refusals_per_s > 0:       # NaN too
            raise ValueError(f"--max-refusals-per-s must be > 0, got {self.max_refusals_per_s}")
        if self.max_validating < 1:
            raise ValueError(f"--max-validating must be >= 1, got {self.max_validating}")
        if self.otlp_traces_endpoint and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL (an OTLP/HTTP collector), "
                             f"got {self.otlp_traces_endpoint!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a non-empty key, or none")
        if not self.client_stall_timeout_s > 0:
            raise ValueError(f"--client-stall-timeout-s must be > 0, got {self.client_stall_timeout_s}")
        if not self.drain_timeout_s >= 0:          # NaN too
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
