"""Device memory reserved at start-up, as vLLM's --gpu-memory-utilization does it.

A model service on a GPU may hold a share of its device's memory. Its warm-up has run its largest steps, so the
peak the caching allocator reserved by then (weights, captured graphs, the largest step's activations) is its
working memory; the rest of the share is its caches'. Those bytes are then taken from the device at once and freed
into the caching allocator, which keeps them for this process: another process on the device (a second stack, an
embedding model) cannot take them, and neither the caches, within their limit, nor a step ever waits on the device
for memory. A share that does not hold the working memory, or a device that does not have the caches' bytes free,
refuses the start with what to change (MemoryMisfit).

Before loading, the same arithmetic sizes what depends on memory from the model configurations alone (session
tokens, and `ddtree serve`'s split of one share between a drafter and a verifier on one device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30
DEFAULT_UTILIZATION = 0.9  # of the device's memory, for everything on it of one stack (vLLM's default)
# Of the caches' bytes, the part kept out of every cache limit: graphs first captured while serving (a key bucket a
# long session reaches) and a step a little past the warm-up's largest come out of it rather than the device.
HEADROOM = 0.05
# A model service's exit status when its share does not hold it: a supervisor that starts it again gets the same.
MEMORY_MISFIT_EXIT = 3
TOKEN_QUANTUM = 256  # session tokens sized from memory are a multiple of this (the verifier's smallest size class)


class MemoryMisfit(ValueError):
    """The service cannot hold what it must within its share of the device: the message says what to change."""


@dataclass(frozen=True)
class CacheBudget:
    """What a service's share of its device leaves for caches, measured after its warm-up."""

    total: int  # the device's memory, bytes
    share: int  # what the service may hold (utilization x total)
    working: int  # its peak outside its caches: weights, graphs, the largest step
    caches: int  # share - working - headroom: what its caches (sessions', prefix blocks) may hold together

    def describe(self) -> str:
        return (f"{self.share / GIB:.1f} GiB of the device's {self.total / GIB:.1f} GiB: {self.working / GIB:.1f} "
                f"GiB weights and working memory, {self.caches / GIB:.1f} GiB caches")


def device_total(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def measure(device: torch.device, utilization: float, caches_held: int, what: str) -> CacheBudget:
    """The caches' bytes in `utilization` of `device`, from the peak the allocator reserved (the warm-up's largest
    step), less the `caches_held` then (caches the warm-up's sessions left, which the caches reuse); MemoryMisfit
    where the working memory alone passes the share. what: the service, for the message."""
    total = device_total(device)
    share = int(utilization * total)
    working = torch.cuda.max_memory_reserved(device) - caches_held
    caches = int((share - working) * (1 - HEADROOM))
    if caches <= 0:
        raise MemoryMisfit(
            f"the {what}'s weights and largest step take {working / GIB:.1f} GiB, more than its share of the device "
            f"({utilization:g} x {total / GIB:.1f} GiB): raise --gpu-memory-utilization, or lower --max-batch")
    return CacheBudget(total, share, working, caches)


def reserve(device: torch.device, budget: CacheBudget, what: str) -> None:
    """Takes the device memory the share holds beyond what this process reserved already, and frees it into the
    caching allocator, which keeps it. MemoryMisfit where the device has not that much free: another process holds
    it."""
    held: list[torch.Tensor] = []
    try:
        # a free block the allocator already caches is taken and held first, so that the next allocation grows the
        # reservation; each round either takes a cached block or grows it, so the loop ends
        while (missing := budget.share - torch.cuda.memory_reserved(device)) > 0:
            held.append(torch.empty(missing, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError:
        free, _ = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        raise MemoryMisfit(
            f"the {what} needs {budget.share / GIB:.1f} GiB of the device ({budget.describe()}) and holds "
            f"{reserved / GIB:.1f} GiB, but only {free / GIB:.1f} GiB more are free: other processes hold "
            f"{(budget.total - free - reserved) / GIB:.1f} GiB. Give each stack on this device a share that fits "
            "beside the others' (--gpu-memory-utilization), or set --kv-cache-gib lower") from None
    finally:
        del held


def memory_misfit_at_load(device: torch.device, what: str) -> MemoryMisfit:
    """Why a service whose weights or warm-up ran out of device memory cannot start, and what to change."""
    free, total = torch.cuda.mem_get_info(device)
    mine = torch.cuda.memory_reserved(device)
    return MemoryMisfit(
        f"the {what} ran out of device memory loading and warming up: the device has {free / GIB:.1f} GiB of "
        f"{total / GIB:.1f} GiB free, and other processes hold {(total - free - mine) / GIB:.1f} GiB. Give each stack "
        "on this device a share that fits beside the others' (--gpu-memory-utilization), or free the device")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(directory: str | Path, dtype: torch.dtype) -> int:
    """A model directory's weights at `dtype`, from its safetensors headers (no tensor is read)."""
    total = 0
    for path in Path(directory).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count * dtype_bytes(dtype)
    return total


def kv_bytes_per_token(config: dict, dtype: torch.dtype, layers: int | None = None) -> int:
    """One token's K and V over a model's attention layers, from its config.json."""
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return 2 * (layers or text["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes(dtype)


def working_guess(weights: int) -> int:
    """A service's working memory beside its weights before its warm-up has measured it: graphs, the largest
    step's activations, the allocator's rounding."""
    return 5 * GIB // 2 + weights // 8


def session_tokens(cache_bytes: int, sessions: int, per_token: int, context: int) -> int:
    """The session capacity, a multiple of TOKEN_QUANTUM within `context`, at which `sessions` sessions of
    `per_token` bytes a token fit `cache_bytes`; MemoryMisfit where not even TOKEN_QUANTUM tokens do."""
    tokens = cache_bytes // max(1, sessions * per_token) // TOKEN_QUANTUM * TOKEN_QUANTUM
    if tokens < TOKEN_QUANTUM:
        raise MemoryMisfit(
            f"{cache_bytes / GIB:.2f} GiB of caches do not hold {sessions} sessions of {TOKEN_QUANTUM} tokens: raise "
            "--gpu-memory-utilization, or lower --max-sessions")
    return min(tokens, context)


def head_bytes(target: str | Path, dtype: torch.dtype) -> int:
    """The target's embedding and output head, which the drafter holds (once where they are tied)."""
    config = read_config(target)
    text = config.get("text_config", config)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return (1 if tied else 2) * text["vocab_size"] * text["hidden_size"] * dtype_bytes(dtype)


def read_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


@dataclass(frozen=True)
class DrafterFootprint:
    """What a drafter holds on its device, from the configurations and checkpoint headers alone (before loading):
    the same figures for `ddtree serve`'s split and the drafter's own sizing, so that the two agree."""

    weights: int  # its weights and the target's embedding and head it borrows
    per_token: int  # one context token's K/V over its layers
    context: int  # its longest context

    @classmethod
    def of(cls, target: str | Path, drafter: str | Path, dtype: torch.dtype) -> DrafterFootprint:
        config = read_config(drafter)
        return cls(weight_bytes(drafter, dtype) + head_bytes(target, dtype), kv_bytes_per_token(config, dtype),
                   config.get("max_position_embeddings", 40960))

    def session_tokens(self, share: int, sessions: int, prefix: int) -> int:
        """The session capacity at which `sessions` context slots fit `share` bytes beside the weights, the working
        memory's guess and the prefix cache (session_tokens)."""
        return session_tokens(share - self.weights - working_guess(self.weights) - prefix, sessions, self.per_token,
                              self.context)

    def share(self, tokens: int, sessions: int, prefix: int) -> int:
        """The bytes that hold `sessions` slots of `tokens` beside the weights, the working memory's guess and the
        prefix cache: session_tokens' inverse."""
        return self.weights + working_guess(self.weights) + prefix + sessions * tokens * self.per_token


def drafter_share(total: int, utilization: float, target: str | Path, drafter: str | Path, dtype: torch.dtype,
                  sessions: int, prefixes: tuple[int, int]) -> float:
    """The part of `utilization` of a device of `total` bytes that a drafter takes beside its verifier on that
    device: its weights, its working memory's guess, its prefix cache and `sessions` context slots of the tokens
    each session gets where both services' per-token caches share what the weights leave (the drafter's slots hold
    their whole capacity; the verifier's caches hold what sessions commit, so the verifier gets the rest).
    prefixes: the verifier's and the drafter's prefix caches, bytes."""
    footprint = DrafterFootprint.of(target, drafter, dtype)
    weights_v = weight_bytes(target, dtype)
    left = (int(utilization * total) - weights_v - working_guess(weights_v) - footprint.weights
            - working_guess(footprint.weights) - sum(prefixes))
    per_token = kv_bytes_per_token(read_config(target), dtype) + footprint.per_token
    tokens = min(footprint.context, max(TOKEN_QUANTUM, left // max(1, sessions * per_token)))
    return min(footprint.share(tokens, sessions, prefixes[1]) / total, utilization / 2)
