"""Plain data types shared by the drafter, the verifier and the round loop (never tied to a transport)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks a token at each node. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class DraftTree:
    """A draft tree. Index 0 is the root (the last committed token); every parent index is smaller than its
    child's, so the arrays are a topological order.

    tokens:  [N+1] int64, node tokens, root first
    parents: [N+1] int64, parent index per node, -1 for the root
    depths:  [N+1] int64, 0 for the root; the position of a node is root position + depth
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    max_depth: int  # host-side bound on depths (block size - 1), so device code needs no sync to know it

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root (what `budget` counts)."""
        return self.tokens.shape[0] - 1

    def cpu(self) -> DraftTree:
        """The tree on the host, in one device-to-host copy (a sync) rather than one per array."""
        if self.tokens.device.type == "cpu":
            return self
        host = torch.stack((self.tokens, self.parents, self.depths)).cpu()  # [3, N+1]
        return DraftTree(tokens=host[0], parents=host[1], depths=host[2], max_depth=self.max_depth)


@dataclass
class StepResult:
    """What one verifier step (prefill, verify or AR decode) commits.

    tokens:   the tokens committed by this step, in order; the last one is the new root (bonus) token
    features: [len(tokens), taps * hidden] target hidden states at the tapped layers for the positions whose
              K/V this step kept (prompt positions for prefill; root + accepted nodes for verify/decode),
              or None when the session taps no layers
    """

    tokens: list[int]
    features: torch.Tensor | None
    forward_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter reports about itself: the gateway taps the target and sizes trees and sessions from it."""

    block_size: int
    target_layer_ids: list[int]
    feature_dim: int  # len(target_layer_ids) * target hidden size
    vocab_size: int
    max_budget: int  # largest tree (nodes without the root) it drafts
    max_session_tokens: int  # largest session capacity it accepts
    max_sessions: int = 0  # sessions it holds at once (0: no fixed limit)


@dataclass(frozen=True)
class VerifierInfo:
    """What a verifier reports about its target and its limits."""

    model_name: str
    vocab_size: int
    max_context_length: int  # the target's max_position_embeddings
    eos_token_ids: list[int]
    num_layers: int
    hidden_size: int
    max_tree_size: int  # largest tree (nodes without the root) it verifies
    max_tree_depth: int
    max_session_tokens: int  # largest session capacity it accepts
    max_sessions: int = 0  # sessions it holds at once (0: no fixed limit)
