"""DraftServerConfig: every setting of the drafter service, from flags with DDTREE_DRAFT_* env fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from runtime.models import resolve_pair
from runtime.config import ServiceConfig, knob, option

PREFIX_CACHE_GIB = (1.0, 0.25)  # the default on a GPU (tens of thousands of tokens of an 8B drafter), a CPU


@dataclass(frozen=True, kw_only=True)
class DraftServerConfig(ServiceConfig):
    ENV_PREFIX: ClassVar[str] = "DDTREE_DRAFT_"

    drafter: str | None = option(None, "DFlash drafter directory (default: the bundled demo drafter)")
    target: str | None = option(
        None, "target model directory, read for embed_tokens and lm_head only (default: the bundled demo target)"
    )
    port: int = option(50061, "gRPC port (0: any free port, logged)")
    metrics_port: int = option(9461, "Prometheus metrics port (0: any free port, logged)")
    max_budget: int = knob(1024, "largest tree (nodes without the root) a Draft call may ask for: larger trees on "
                                 "request against one call's work")
    max_batch: int = knob(
        16, "Draft calls waiting together (a gateway's step sends them so) drafted in one forward, each getting the "
        "tree it would alone: throughput under load against a longer step (1: each alone)"
    )
    constrained_trees: bool = knob(
        True, "a request with a grammar drafts only tokens its grammar allows, its tree built on the host: longer "
        "accepted paths (off: the verifier alone applies it, as measured against)"
    )
    prefix_cache_gib: float | None = knob(
        None, "device memory (GiB) for the prefix cache of prompt blocks' drafter context: a prompt that begins as "
        "an earlier one starts with it restored, against memory for sessions (default 1 on a GPU, 0.25 on a CPU; "
        "0: off)"
    )
    warm_up_budgets: str = knob(
        "32", "ddtree budgets drafted in warm-up besides the chain, comma-separated (the gateway's --budget): their "
        "first requests capture no graphs, for a longer start"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drafter is None or self.target is None:
            raise ValueError("the drafter service needs both a drafter and a target directory")
        if self.max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {self.max_budget}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefix_cache_gib is not None and self.prefix_cache_gib < 0:
            raise ValueError(f"prefix_cache_gib must be >= 0, got {self.prefix_cache_gib}")
        try:
            budgets = self.warm_up_budget_list
        except ValueError:
            raise ValueError(f"warm_up_budgets must be comma-separated integers, got {self.warm_up_budgets!r}") from None
        if any(not 1 <= b <= self.max_budget for b in budgets):
            raise ValueError(f"warm_up_budgets must each be in [1, max_budget={self.max_budget}], got {budgets}")

    @property
    def prefix_cache_bytes(self) -> int:
        """prefix_cache_gib in bytes, or its default for the device."""
        return self.device_gib_bytes(self.prefix_cache_gib, *PREFIX_CACHE_GIB)

    @property
    def warm_up_budget_list(self) -> tuple[int, ...]:
        return tuple(int(b) for b in self.warm_up_budgets.split(",") if b.strip())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DraftServerConfig:
        values = cls.values_from_args(args)
        target, drafter = resolve_pair(values["target"], values["drafter"])
        if drafter is None:
            raise ValueError("no --drafter given and no bundled demo drafter next to the demo target")
        return cls(**{**values, "target": target, "drafter": drafter})
