"""GatewayConfig: every setting of the gateway, from flags with DDTREE_GATEWAY_* env fallbacks.

A FlagConfig (runtime/config.py), like the model services': each field is a flag `--field-name` whose
default comes from `DDTREE_GATEWAY_<FIELD_NAME>` when set, else from the dataclass.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from runtime.event_loop import check_busy_poll_us
from runtime.models import resolve_pair
from runtime.auth import check_token
from runtime.config import AUTH_TOKEN_HELP, BUSY_POLL_HELP, MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP, FlagConfig, knob, option

SPEC_MODES = ("ddtree", "chain", "off")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(FlagConfig):
    ENV_PREFIX: ClassVar[str] = "DDTREE_GATEWAY_"

    target: str | None = option(
        None, "target model directory, or hub id in the local Hugging Face cache: its tokenizer and chat template "
              "(default: the bundled demo target)"
    )
    verifier: str = option("127.0.0.1:50062", "verify service HOST:PORT")
    drafter: str = option("127.0.0.1:50061", "draft service HOST:PORT; 'none': always decode autoregressively")
    host: str = option("0.0.0.0", "interface the HTTP API listens on")
    port: int = option(8000, "HTTP port of the OpenAI-compatible API and /metrics")
    served_model_name: str | None = option(None, "the model name clients send (default: the verifier's)")
    spec_mode: str = option("ddtree", "speculation of requests that do not choose ('off': autoregressive)",
                            choices=SPEC_MODES)
    budget: int = option(32, "tree nodes per round of requests that do not choose (ddtree mode)")
    max_running: int = option(64, "requests decoding at once, at most (the model services' sessions, which on a GPU "
                                  "follow from the memory each reserves, bound it too); later ones wait in a queue")
    max_waiting: int | None = option(None, "requests waiting in that queue at most; more get 429 with Retry-After "
                                           "(default: 4 x max_running)")
    max_client_requests: int = option(0, "POST requests one client (one peer address) may have in flight at once, "
                                         "waiting, running or being read; more get 429 with Retry-After while other "
                                         "clients are served (waiting requests are admitted in turns by client "
                                         "either way); 0: no limit")
    max_n: int = option(8, "most choices (n) one request may ask for; each decodes as a request of its own")
    request_timeout: float = option(0.0, "seconds a request may wait and decode in all; past them it ends with a "
                                         "504 in OpenAI's shape (a stream: an error event, then [DONE]); 0: no limit")
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the target tokenizer's")
    api_key: str | None = option(None, "clients must send `Authorization: Bearer KEY` (else 401); prefer the env "
                                       "var, which other users cannot read in the process list")
    auth_token: str | None = option(None, AUTH_TOKEN_HELP)
    max_budget: int = knob(256, "largest per-request budget accepted (the verifier's limit applies too): larger "
                                "trees on request against one step's rows")
    open_paths: str = knob("/health,/metrics", "comma-separated paths served without the API key when --api-key is "
                                               "set: open probes and scrapes against what they expose (empty: none)")
    health_interval: float = knob(5.0, "seconds between health checks of the backends (also their time limit): a "
                                       "down or returning service seen sooner against more checks")
    rpc_timeout: float = knob(30.0, "deadline of one drafter/verifier call, in seconds: a stuck service noticed "
                                    "sooner against slow calls (long prompts on a CPU) cut off")
    lanes: bool = knob(True, "round calls over a backend's round lane when it announces one (gRPC's messages over "
                             "plain TCP): less per-step overhead than unary gRPC calls (off: gRPC only)")
    max_step_tokens: int = knob(2048, "prompt tokens a step carries at most: a longer prompt runs in chunks over "
                                      "several steps, the running streams' steps between them, against more steps "
                                      "for its first token")
    max_request_bytes: int = knob(4 * 2**20, "largest HTTP request body, in bytes, a larger one refused 413 before "
                                             "it is parsed: longer prompts against the memory one request may take")
    max_message_bytes: int = knob(MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP)
    busy_poll_us: int | None = knob(None, BUSY_POLL_HELP)
    shutdown_grace: float = knob(5.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM: gentler stops "
                                      "against slower restarts")

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("the gateway needs the target directory (for its tokenizer)")
        if self.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.spec_mode!r}")
        if not 1 <= self.budget <= self.max_budget:
            raise ValueError(f"budget must be in [1, max_budget={self.max_budget}], got {self.budget}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if min(self.max_running, self.max_n, self.health_interval, self.rpc_timeout, self.max_message_bytes,
               self.max_request_bytes) <= 0:
            raise ValueError("max_running, max_n, health_interval, rpc_timeout, max_message_bytes and "
                             "max_request_bytes must be > 0")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat template file {self.chat_template} does not exist")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if any(not p.startswith("/") for p in self.open_path_set):
            raise ValueError(f"open_paths must be paths starting with '/', got {self.open_paths!r}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_client_requests < 0:
            raise ValueError(f"max_client_requests must be >= 0, got {self.max_client_requests}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.request_timeout < 0:
            raise ValueError(f"request_timeout must be >= 0, got {self.request_timeout}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        check_busy_poll_us(self.busy_poll_us)  # (the automatic value is worked out once, when serving)
        check_token(self.auth_token)

    @property
    def open_path_set(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.open_paths.split(",") if p.strip())

    @property
    def drafter_address(self) -> str | None:
        return None if self.drafter.lower() in ("", "none") else self.drafter

    @classmethod
    def from_args(cls, args: argparse.Namespace, **chosen: Any) -> GatewayConfig:
        """`chosen`: values for the excluded fields."""
        values = {**cls.values_from_args(args, exclude=tuple(chosen)), **chosen}
        values["target"] = resolve_pair(values["target"], None)[0]
        return cls(**values)
