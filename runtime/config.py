"""Flags-with-env-fallback derived from a config dataclass (FlagConfig), and the settings both model services
share (ServiceConfig).

Each service has ONE frozen config dataclass (draft_server/config.py, verify_server/config.py, gateway/config.py)
extending FlagConfig. Every field becomes a flag `--field-name` whose default comes from the env var
`<ENV_PREFIX><FIELD_NAME>` when set, else from the dataclass; the field's `help` metadata is the flag's help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from runtime.auth import check_token
from runtime.event_loop import AUTO_MIN_CPUS, AUTO_WINDOW_US, check_busy_poll_us
from runtime.memory import DEFAULT_UTILIZATION

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# gRPC caps a message at 2 GiB - 1, which is also the default: a prompt's features travel whole, verifier ->
# gateway -> drafter, and at an 8B target's shapes a long prompt's run to hundreds of MiB; the largest holds the
# whole context. Below 1 MiB not even a small prefill's features fit.
MAX_MESSAGE_BYTES = 2**31 - 1
_MESSAGE_BYTES_RANGE = (2**20, MAX_MESSAGE_BYTES)
MAX_MESSAGE_HELP = "largest gRPC or lane message sent or received, in bytes (a prompt's features come in one)"
AUTH_TOKEN_HELP = (
    "shared secret between the gateway and the model services: a service with one answers gRPC calls and round "
    "lane connections without it UNAUTHENTICATED (health checks stay open); give it to the gateway, the drafter "
    "and the verifier alike, through the env var (the process list shows flags)"
)
BUSY_POLL_HELP = (
    "microseconds the event loop keeps polling its sockets after its last I/O before it sleeps: a round's "
    "message then lands sooner at each hop (no wake-up from sleep), at the cost of a busy core while sessions run "
    f"(0: off; default: {AUTO_WINDOW_US} where {AUTO_MIN_CPUS} or more CPUs are usable, by affinity and cgroup quota, "
    "else 0)"
)


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field that is also a command-line flag."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True, kw_only=True)
class FlagConfig:
    """A frozen config dataclass whose fields are also command-line flags with env-var defaults."""

    ENV_PREFIX: ClassVar[str] = "DDTREE_"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """One flag per field but `exclude` (fields a wrapper such as `ddtree serve` sets itself)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            kind = _scalar_type(hints[f.name])
            env = cls.env_var(f.name)
            default = f.default
            if os.environ.get(env):
                try:
                    default = _parse_bool(os.environ[env]) if kind is bool else kind(os.environ[env])
                except ValueError:
                    parser.error(f"env {env}={os.environ[env]!r} is not a valid {kind.__name__}")
            flag = "--" + f.name.replace("_", "-")
            help = f"{f.metadata['help']} [env {env}; default: %(default)s]"
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)
            else:
                parser.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"), help=help)

    @classmethod
    def env_var(cls, field_name: str) -> str:
        return cls.ENV_PREFIX + field_name.upper()

    @classmethod
    def values_from_args(cls, args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in exclude}


@dataclass(frozen=True, kw_only=True)
class ServiceConfig(FlagConfig):

    host: str = option("127.0.0.1", "interface to listen on, for gRPC, the round lane and metrics (loopback unless "
                                    "told otherwise: a reachable service should also take --auth-token)")
    port: int = option(0, "gRPC port (0: any free port, logged)")
    metrics_port: int = option(0, "Prometheus metrics port (0: any free port, logged)")
    device: str = option("auto", "torch device: cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: str = option("auto", "model dtype (auto: bfloat16 on cuda, float32 on cpu)", choices=DTYPE_NAMES)
    session_ttl: float = option(300.0, "seconds a session may stay idle before the server ends it")
    max_session_tokens: int | None = option(
        None, "largest session capacity accepted (default: derived from the model's max_position_embeddings)"
    )
    gpu_memory_utilization: float | None = option(
        None, "share of the GPU's memory this service holds: its weights, its largest step (measured in warm-up) "
        "and its caches, which are sized from what remains and reserved at start-up, so that no request fails later "
        "for device memory; a device without that much free refuses the start. Default 0.9 (ddtree serve splits its "
        "own share between the drafter and the verifier on one device); CUDA devices only"
    )
    max_sessions: int = option(
        64, "sessions held at once (on a GPU, the drafter holds as many as its reserved memory has context slots "
        "for); the static (graph) path keeps at most this many cache slots, each allocated "
        "on first need (the verifier's in size classes: a new class takes a free slot's place once all exist)"
    )
    eager: bool = option(False, "run every step eagerly: no static buffers, no CUDA graphs (for debugging)")
    compile: bool | None = option(
        None, "torch.compile the captured steps (the verifier's fused Qwen3 / Llama layers and round; the drafter's "
        "block, context append and tree build), compiled in warm-up; fewer, fused kernels. Default: on with a CUDA "
        "device, off on the CPU"
    )
    lane_port: int = option(
        0, "TCP port of the round lane (a session's round calls as the same messages over plain TCP, announced "
        "through Info; 0: any free port; -1: no lane, rounds over gRPC only)"
    )
    max_lane_connections: int = option(
        1024, "round-lane connections held at once (a session holds a few); one more is refused RESOURCE_EXHAUSTED"
    )
    lane_peer_timeout: float = option(
        30.0, "seconds a round-lane peer may take to send its hello, or stay silent in the middle of a frame, before "
        "its connection is closed (a connection idle between whole requests stays open)"
    )
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP)
    busy_poll_us: int | None = option(None, BUSY_POLL_HELP)
    shutdown_grace: float = option(5.0, "seconds in-flight calls get to finish on SIGINT/SIGTERM")
    auth_token: str | None = option(None, AUTH_TOKEN_HELP)

    def __post_init__(self) -> None:
        check_token(self.auth_token)
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if not -1 <= self.lane_port <= 65535:
            raise ValueError(f"lane_port must be in [-1, 65535], got {self.lane_port}")
        if self.max_lane_connections < 1:
            raise ValueError(f"max_lane_connections must be >= 1, got {self.max_lane_connections}")
        if self.lane_peer_timeout <= 0:
            raise ValueError(f"lane_peer_timeout must be > 0, got {self.lane_peer_timeout}")
        if self.session_ttl <= 0:
            raise ValueError(f"session_ttl must be > 0, got {self.session_ttl}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.max_session_tokens is not None and self.max_session_tokens < 2:
            raise ValueError(f"max_session_tokens must be >= 2, got {self.max_session_tokens}")
        low, high = _MESSAGE_BYTES_RANGE
        if not low <= self.max_message_bytes <= high:
            raise ValueError(f"max_message_bytes must be in [{low}, {high}], got {self.max_message_bytes}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.torch_device().type != "cuda":
                raise ValueError("gpu_memory_utilization is a CUDA device's share: not with device "
                                 f"{self.torch_device()}")
        check_busy_poll_us(self.busy_poll_us)  # (the automatic value is worked out once, when serving)
        self.torch_device()  # a malformed device string fails at startup, not after loading

    @property
    def compiles(self) -> bool:
        """`compile`, or its default for the device."""
        return self.compile if self.compile is not None else self.torch_device().type == "cuda"

    @property
    def sweep_interval(self) -> float:
        """How often idle sessions are looked for: often enough that expiry lags the TTL by a quarter at most."""
        return min(max(self.session_ttl / 4, 0.05), 30.0)

    @property
    def memory_share(self) -> float | None:
        """gpu_memory_utilization, or its default on a CUDA device; None elsewhere (no reservation)."""
        if self.torch_device().type != "cuda":
            return None
        return self.gpu_memory_utilization if self.gpu_memory_utilization is not None else DEFAULT_UTILIZATION

    def device_gib_bytes(self, gib: float | None, default_gpu: float, default_cpu: float) -> int:
        """A memory budget flag in bytes: gib, or where unset its default for the device (a GPU's or a CPU's)."""
        if gib is None:
            gib = default_gpu if self.torch_device().type == "cuda" else default_cpu
        return int(gib * 2**30)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"bad device {self.device!r}: {exc}") from None

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

def _scalar_type(hint: Any) -> type:
    """`int | None` -> int; the flag's parser for a field."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint not in (str, int, float, bool):
        raise TypeError(f"config fields must be str, int, float or bool (optionally | None), not {hint}")
    return hint


def _parse_bool(text: str) -> bool:
    """An env var's boolean: 1/true/yes/on or 0/false/no/off, any case."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)
