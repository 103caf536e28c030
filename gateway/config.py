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
from runtime.config import AUTH_TOKEN_HELP, BUSY_POLL_HELP, MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP, FlagConfig, option

SPEC_MODES = ("ddtree", "chain", "off")
MAX_DECODE_STEPS = 32  # the verifier's limit on a Decode's steps
SPECULATE_UP_TO = 8  # where speculation stops paying at Qwen3-8B shapes on one H200 (bench/README.md)


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
    max_budget: int = option(256, "largest per-request budget accepted (the verifier's limit applies too)")
    max_running: int = option(64, "requests decoding at once, at most (the model services' sessions, which on a GPU "
                                  "follow from the memory each reserves, bound it too); later ones wait in a queue")
    max_waiting: int | None = option(None, "requests waiting in that queue at most; more get 429 with Retry-After "
                                           "(default: 4 x max_running)")
    max_client_requests: int = option(0, "POST requests one client (one peer address) may have in flight at once, "
                                         "waiting, running or being read; more get 429 with Retry-After while other "
                                         "clients are served (waiting requests are admitted in turns by client "
                                         "either way); 0: no limit")
    max_n: int = option(8, "most choices (n) one request may ask for; each decodes as a request of its own")
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the target tokenizer's")
    api_key: str | None = option(None, "clients must send `Authorization: Bearer KEY` (else 401); prefer the env "
                                       "var, which other users cannot read in the process list")
    open_paths: str = option("/health,/metrics", "comma-separated paths served without the API key when "
                                                 "--api-key is set (empty: every path needs it)")
    health_interval: float = option(5.0, "seconds between health checks of the backends (also their time limit)")
    rpc_timeout: float = option(30.0, "deadline of one drafter/verifier call, in seconds")
    request_timeout: float = option(0.0, "seconds a request may wait and decode in all; past them it ends with a "
                                         "504 in OpenAI's shape (a stream: an error event, then [DONE]); 0: no limit")
    lanes: bool = option(True, "send a session's round calls over a backend's round lane when it announces one "
                               "(the same messages over plain TCP, faster than gRPC); false: over gRPC streams")
    batch_steps: bool = option(True, "send the round calls of every running request to each service as one batch "
                                     "call per step (the step scheduler), which the service runs in one forward; "
                                     "false: each request's calls go alone and meet in the services by chance")
    step_wait_ms: float = option(2.0, "how long a step waits for a running request that is not yet waiting on a "
                                      "call before it leaves without it, in milliseconds")
    fit_trees: bool = option(True, "with batch steps, cut each step's trees to the size that commits the most "
                                   "tokens per second at the step's load, from the live acceptance by node rank and "
                                   "the verify cost by rows (a request's budget stays its ceiling); false: trees "
                                   "go as drafted")
    speculate_up_to: int = option(SPECULATE_UP_TO, "requests speculate only while at most this many decode at "
                                  "once, themselves included; a request that begins beyond that decodes "
                                  "autoregressively (its output the same; a seeded sampled request keeps its "
                                  "mode, and so its text; requests speculate again once at most half that many "
                                  "decode), since at that load AR steps commit more "
                                  "tokens per second for the whole batch: one weight read serves every session's "
                                  "token, where trees' rows and drafts no longer ride on it; 0: always speculate")
    decode_steps: int = option(1, "AR steps a request's Decode call asks for in a row (mode off): the verifier "
                                  "runs them back to back, chained on the device, so the host work and transport "
                                  "of a step are paid once per that many tokens; a new request joins the running "
                                  "ones after at most that many steps (1: a call a token). Pays where many "
                                  "sessions decode at once; costs time to first token where requests come and go")
    step_cohorts: int = option(1, "running requests step in this many cohorts, each on its own, so that one "
                                  "cohort's drafts run while another's verifies do (2: the drafter and the "
                                  "verifier on two GPUs)")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP)
    prefill_chunk: int = option(2048, "prompt tokens per verifier Prefill call: a longer prompt goes in chunks "
                                      "whose features the verifier keeps, so its first token comes after the "
                                      "forwards alone, and other requests' rounds run between them; the features "
                                      "then go to the drafter chunk by chunk; 0: every prompt in one call")
    max_request_bytes: int = option(4 * 2**20, "largest HTTP request body accepted, in bytes; a larger one gets a "
                                              "413 before any of it is parsed or tokenized")
    busy_poll_us: int | None = option(None, BUSY_POLL_HELP)
    auth_token: str | None = option(None, AUTH_TOKEN_HELP)
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
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if self.request_timeout < 0:
            raise ValueError(f"request_timeout must be >= 0, got {self.request_timeout}")
        if self.step_wait_ms < 0:
            raise ValueError(f"step_wait_ms must be >= 0, got {self.step_wait_ms}")
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be in [1, {MAX_DECODE_STEPS}], got {self.decode_steps}")
        if self.speculate_up_to < 0:
            raise ValueError(f"speculate_up_to must be >= 0, got {self.speculate_up_to}")
        if self.step_cohorts < 1:
            raise ValueError(f"step_cohorts must be >= 1, got {self.step_cohorts}")
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
