"""Flags-with-env-fallback derived from a config dataclass (FlagConfig), and the settings both model services
share (ServiceConfig).

Each service has ONE frozen config dataclass (draft_server/config.py, verify_server/config.py, gateway/config.py)
extending FlagConfig. Every field becomes a flag `--field-name` whose default comes from the env var
`<ENV_PREFIX><FIELD_NAME>` when set, else from the dataclass; the field's `help` metadata is the flag's help.
A field made with `option` is a setting an operator sets, listed first; one made with `knob` is a tuning knob,
listed under "advanced" with a help line that says what it trades. `ddtree serve` builds its flags for the model
services from the same fields (FlagConfig.add_flag), so each option has one definition.
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
MAX_MESSAGE_HELP = ("largest gRPC or lane message, in bytes (a prompt's features come in one): longer prompts' "
                    "features against the memory one message may take")
AUTH_TOKEN_HELP = (
    "shared secret between the gateway and the model services: a service with one answers gRPC calls and round "
    "lane connections without it UNAUTHENTICATED (health checks stay open); give it to the gateway, the drafter "
    "and the verifier alike, through the env var (the process list shows flags)"
)
BUSY_POLL_HELP = (
    "microseconds the event loop polls its sockets after its last I/O before it sleeps: a round's message lands "
    f"sooner at each hop, for a busy core while sessions run (0: off; default: {AUTO_WINDOW_US} where "
    f"{AUTO_MIN_CPUS} or more CPUs are usable, else 0)"
)
ADVANCED_TITLE = "advanced"
ADVANCED_DESCRIPTION = "tuning knobs: the defaults fit most machines; each line says what the knob trades"
_GIVEN = object()  # add_flag's default: the service's own (its env var, else the field's)


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field that is also a command-line flag, one an operator sets (listed first)."""
    return field(default=default, metadata={"help": help, **metadata})


def knob(default: Any, trade: str, **metadata: Any) -> Any:
    """A config field that is a tuning knob: its flag is listed under "advanced", `trade` saying what it trades."""
    return option(default, trade, advanced=True, **metadata)


def advanced_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The argument group of a command's tuning knobs, listed after the options an operator sets."""
    return parser.add_argument_group(ADVANCED_TITLE, ADVANCED_DESCRIPTION)


@dataclass(frozen=True, kw_only=True)
class FlagConfig:
    """A frozen config dataclass whose fields are also command-line flags with env-var defaults."""

    ENV_PREFIX: ClassVar[str] = "DDTREE_"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                      advanced: argparse._ArgumentGroup | None = None) -> None:
        """One flag per field but `exclude` (fields a wrapper such as `ddtree serve` sets itself): the options on
        `parser`, the knobs in `advanced` (a group made here unless given)."""
        inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        names = [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
        names.sort(key=lambda name: name in inherited)  # a service's own settings (its models) before the shared ones
        if advanced is None and any(cls.is_knob(name) for name in names):
            advanced = advanced_group(parser)
        for name in names:
            cls.add_flag(advanced if cls.is_knob(name) else parser, name)

    @classmethod
    def is_knob(cls, name: str) -> bool:
        return bool(cls.__dataclass_fields__[name].metadata.get("advanced"))

    @classmethod
    def add_flag(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *, flag: str | None = None,
                 default: Any = _GIVEN, help: str | None = None, env: bool = True) -> None:
        """The flag of field `name`, by default as the service's own command has it: `--field-name`, its default the
        env var's value when set, else the field's. A wrapper that hands the value on (`ddtree serve`) passes
        env=False, and `default` where it differs from the field's (None: nothing handed on unless given, so the
        service's own default or env var holds; the help shows the field's), `flag` or `help` where its meaning
        differs."""
        f = cls.__dataclass_fields__[name]
        kind = _scalar_type(typing.get_type_hints(cls)[name])
        flag = flag or "--" + name.replace("_", "-")
        if default is _GIVEN:
            default = f.default
            if env and os.environ.get(cls.env_var(name)):
                text = os.environ[cls.env_var(name)]
                try:
                    default = _parse_bool(text) if kind is bool else kind(text)
                except ValueError:
                    raise SystemExit(f"error: env {cls.env_var(name)}={text!r} is not a valid {kind.__name__}") from None
        if env:
            suffix = f" [env {cls.env_var(name)}" + ("]" if default is None else "; default: %(default)s]")
        elif default is not None:
            suffix = " [default: %(default)s]"
        else:
            suffix = "" if f.default is None else f" [default: {f.default}]"
        help = (help or f.metadata["help"]) + suffix
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
    max_session_tokens: int | None = option(
        None, "largest session capacity accepted, prompt and answer (default: derived from the model's "
        "max_position_embeddings)"
    )
    gpu_memory_utilization: float | None = option(
        None, "share of the GPU's memory this service holds: its weights, its largest step (measured in warm-up) and "
        "its caches, sized from what remains and reserved at start-up, so that no request fails later for device "
        "memory; a device without that much free refuses the start. Default 0.9; CUDA devices only"
    )
    max_sessions: int = option(
        64, "sessions held at once, each a cache slot allocated on first need (on a GPU the drafter holds as many as "
        "its reserved memory has context slots for)"
    )
    session_ttl: float = knob(300.0, "seconds a session may stay idle before the server ends it: a slow client "
                                     "keeps its session, against a vanished one's memory freed later")
    eager: bool = knob(False, "every step eager, no static buffers or CUDA graphs: any model runs, each step far "
                              "slower (for debugging)")
    compile: bool | None = knob(
        None, "torch.compile the captured steps in warm-up: fewer, fused kernels, for a longer start (default: on "
        "with a CUDA device)"
    )
    lane_port: int = knob(
        0, "TCP port of the round lane, a session's round calls as gRPC's messages over plain TCP: less per-round "
        "overhead than gRPC streams, another port to open (0: any free port; -1: no lane, gRPC only)"
    )
    max_lane_connections: int = knob(
        1024, "round-lane connections held at once (a session holds a few), one more refused RESOURCE_EXHAUSTED: "
        "more peers against more sockets"
    )
    lane_peer_timeout: float = knob(
        30.0, "seconds a round-lane peer may take over its hello or the rest of a frame before it is closed: "
        "patience with slow peers against sockets held by stuck ones"
    )
    max_message_bytes: int = knob(MAX_MESSAGE_BYTES, MAX_MESSAGE_HELP)
    busy_poll_us: int | None = knob(None, BUSY_POLL_HELP)
    shutdown_grace: float = knob(5.0, "seconds in-flight calls get to finish on SIGINT/SIGTERM: gentler stops "
                                      "against slower restarts")
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
