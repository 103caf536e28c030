"""VerifyServerConfig: every setting of the verifier service, from flags with DDTREE_VERIFY_* env fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from runtime.models import is_hub_id, resolve_pair
from runtime.config import ServiceConfig, knob, option


PREFIX_CACHE_GIB = (4.0, 0.25)  # the default on a GPU, on a CPU


@dataclass(frozen=True, kw_only=True)
class VerifyServerConfig(ServiceConfig):
    ENV_PREFIX: ClassVar[str] = "DDTREE_VERIFY_"

    target: str | None = option(None, "target model directory (HF layout), or hub id in the local Hugging Face "
                                      "cache (default: the bundled demo target)")
    model_name: str | None = option(None, "model name reported by Info (default: the target's hub id where it "
                                          "is named by one, else its directory's name)")
    drafter: str | None = option(None, "the drafter service's HOST:PORT, which the verifier asks for each step's "
                                       "trees and sends the target's features (none: AR steps only)")
    port: int = option(50062, "gRPC port (0: any free port, logged)")
    metrics_port: int = option(9462, "Prometheus metrics port (0: any free port, logged)")
    tp: int = option(1, "tensor-parallel ranks: the target is sharded over cuda:0..N-1 (or N CPU processes)")
    deterministic: bool = option(
        False, "row-invariant verification: each tree node's logits are bitwise the target's own decode step's, so "
        "greedy output in bf16 equals AR decoding's; slower (uncompiled invariant kernels). A CUDA GPU with Triton, a "
        "Qwen3 / Llama / Qwen2 target; not with --tp > 1, --eager or --compile"
    )
    max_tree_size: int = knob(1024, "largest tree (nodes without the root) Verify accepts: larger trees on request "
                                    "against one call's rows")
    max_tree_depth: int = knob(64, "largest max_depth (drafter block size - 1) Verify accepts: deeper drafters "
                                   "against one call's rows")
    fused_rows: int = knob(
        -1, "steps of up to N rows run their projections as fused Triton kernels (Qwen3 / Llama on a GPU), which beat "
        "cuBLAS on few rows and lose on many (0: none; -1: by the target's size)"
    )
    max_batch: int = knob(
        16, "sessions' steps verified in one forward: tokens/s under load against a longer step (1: one at a time)"
    )
    fit_trees: bool = knob(True, "cut each step's trees to the size that commits the most tokens per second at its "
                                 "load, or run the step AR where no tree pays for its draft (the budget stays the "
                                 "ceiling): tokens/s under load against the longest paths (off: trees as drafted)")
    max_step_tokens: int = knob(
        2048, "prompt tokens a step carries at most (the gateway's --max-step-tokens; ddtree serve passes it): the "
        "chunks waiting at once share one forward up to it, which the warm-up captures"
    )
    warm_up_taps: str = knob(
        "", "the target layers the drafter in front taps (its target_layer_ids, comma-separated): the warm-up "
        "captures their sessions' rounds too, so first requests wait for no capture, for a longer start (ddtree "
        "serve passes them)"
    )
    warm_up_nodes: int = knob(32, "the tree size requests ask for most (the gateway's --budget): its rounds are "
                                  "captured in warm-up, for a longer start (at most max_tree_size)")
    prefix_cache_gib: float | None = knob(
        None, "device memory (GiB) for the prefix cache of committed tokens' K/V and drafter features: a prompt that "
        "begins as an earlier one skips that part of its prefill, against memory for sessions (default 4 on a GPU, "
        "0.25 on a CPU; 0: off; hybrid targets and --tp > 1 cache nothing)"
    )
    kv_cache_gib: float | None = knob(
        None, "device memory (GiB) the sessions' KV caches may hold together, below what the memory share leaves: "
        "room kept for others on the device against sessions held; a request that runs short pauses and resumes "
        "(default: the share's rest on a GPU, no limit on a CPU; with --tp > 1, on each GPU)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target is None:
            raise ValueError("the verifier service needs a target directory")
        if self.fused_rows < -1:
            raise ValueError(f"fused_rows must be >= -1, got {self.fused_rows}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        try:
            taps = self.warm_up_tap_list
        except ValueError:
            raise ValueError(f"warm_up_taps must be comma-separated integers, got {self.warm_up_taps!r}") from None
        if any(t < 0 for t in taps):
            raise ValueError(f"warm_up_taps must be layer indices >= 0, got {taps}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.prefix_cache_gib is not None and self.prefix_cache_gib < 0:
            raise ValueError(f"prefix_cache_gib must be >= 0, got {self.prefix_cache_gib}")
        if self.warm_up_nodes < 0:
            raise ValueError(f"warm_up_nodes must be >= 0, got {self.warm_up_nodes}")
        if self.deterministic and (self.tp > 1 or self.eager or self.compile):
            given = "--tp > 1" if self.tp > 1 else "--eager" if self.eager else "--compile"
            raise ValueError(f"--deterministic runs the fused path on one GPU, uncompiled: not with {given}")
        if self.max_tree_size < 1 or self.max_tree_depth < 1:
            raise ValueError(
                f"max_tree_size and max_tree_depth must be >= 1, got {self.max_tree_size}, {self.max_tree_depth}"
            )

    @property
    def warm_up_tap_list(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.warm_up_taps.split(",") if t.strip())

    @property
    def compiles(self) -> bool:
        """ServiceConfig's choice, off in the deterministic mode (compiled kernels reduce in orders chosen by the row
        count)."""
        return not self.deterministic and super().compiles

    @property
    def prefix_cache_bytes(self) -> int:
        """prefix_cache_gib in bytes, or its default for the device."""
        return self.device_gib_bytes(self.prefix_cache_gib, *PREFIX_CACHE_GIB)

    @property
    def kv_cache_bytes(self) -> int | None:
        """kv_cache_gib in bytes; None: no limit."""
        return None if self.kv_cache_gib is None else self.device_gib_bytes(self.kv_cache_gib, 0, 0)

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.target).resolve().name

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VerifyServerConfig:
        values = cls.values_from_args(args)
        # a target named by its hub id is served under that id, as vLLM does, not its snapshot's hash
        name = values["model_name"] or (values["target"] if is_hub_id(values["target"]) else None)
        return cls(**{**values, "target": resolve_pair(values["target"], None)[0], "model_name": name})
