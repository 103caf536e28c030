"""GatewayConfig: every setting of the gateway, from flags with DDTREE_GATEWAY_* env fallbacks.

A FlagConfig (runtime/config.py), like the model services': each field is a flag `--field-name` whose
default comes from `DDTREE_GATEWAY_<FIELD_NAME>` when set, else from the dataclass.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.event_loop import check_busy_poll_us
from runtime.models import resolve_pair
from runtime.config import BUSY_POLL_HELP, MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP, FlagConfig, option

SPEC_MODES = ("ddtree", "chain", "off")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(FlagConfig):
    ENV_PREFIX: ClassVar[str] = "DDTREE_GATEWAY_"

    target: str | None = option(
        None, "target model directory: its tokenizer and chat template (default: the bundled demo target)"
    )
    verifier: str = option("127.0.0.1:50062", "verify service HOST:PORT")
    drafter: str = option("127.0.0.1:50061", "draft service HOST:PORT; 'none': always decode autoregressively")
    host: str = option("0.0.0.0", "interface the HTTP API listens on")
    port: int = option(8000, "HTTP port of the OpenAI-compatible API and /metrics")
    served_model_name: str | None = option(None, "the model name clients send (default: the verifier's)")
    spec_mode: str = option("ddtree", "speculation of requests that do not choose ('off': autoregressive)",
                            choices=SPEC_MODES)
    budget: int = option(32, "tree nodes per round of requests that do not choose (ddtree mode)")
    max_budget: int = option(256, "largest per-request budget accepted (the verifier's limit applies too)")
    max_running: int = option(16, "requests decoding at once; later ones wait in a queue")
    health_interval: float = option(5.0, "seconds between health checks of the backends (also their time limit)")
    rpc_timeout: float = option(30.0, "deadline of one drafter/verifier call, in seconds")
    lanes: bool = option(True, "send a session's round calls over a backend's round lane when it announces one "
                               "(the same messages over plain TCP, faster than gRPC); false: over gRPC streams")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP)
    prefill_chunk: int = option(2048, "prompt tokens per verifier Prefill call: a longer prompt goes in chunks "
                                      "whose features the verifier keeps, so its first token comes after the "
                                      "forwards alone, and other requests' rounds run between them; the features "
                                      "then go to the drafter chunk by chunk; 0: every prompt in one call")
    max_request_bytes: int = option(4 * 2**20, "largest HTTP request body accepted, in bytes; a larger one gets a "
                                              "413 before any of it is parsed or tokenized")
    busy_poll_us: int | None = option(None, BUSY_POLL_HELP)
    shutdown_grace: float = option(5.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM")

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("the gateway needs the target directory (for its tokenizer)")
        if self.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.spec_mode!r}")
        if not 1 <= self.budget <= self.max_budget:
            raise ValueError(f"budget must be in [1, max_budget={self.max_budget}], got {self.budget}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if min(self.max_running, self.health_interval, self.rpc_timeout, self.max_message_bytes,
               self.max_request_bytes) <= 0:
            raise ValueError("max_running, health_interval, rpc_timeout, max_message_bytes and max_request_bytes "
                             "must be > 0")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        check_busy_poll_us(self.busy_poll_us)  # (the automatic value is worked out once, when serving)

    @property
    def drafter_address(self) -> str | None:
        return None if self.drafter.lower() in ("", "none") else self.drafter

    @classmethod
    def from_args(cls, args: argparse.Namespace, **chosen: Any) -> GatewayConfig:
        """`chosen`: values for the excluded fields."""
        values = {**cls.values_from_args(args, exclude=tuple(chosen)), **chosen}
        values["target"] = resolve_pair(values["target"], None)[0]
        return cls(**values)
