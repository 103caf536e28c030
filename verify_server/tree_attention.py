"""Tree attention as a transformers attention function over the verifier's own KV cache.

HF model classes (Qwen3, Llama, ...) compute q/k/v, norms and RoPE as usual, then call the function registered
under ATTENTION_NAME. The step (cache, slot offset, visibility) comes through the forward's kwargs; the function
writes the new K/V into the cache at their slots and attends over the committed prefix plus the new tokens. Masks,
batching and graph capture thereby stay the verifier's while every HF architecture keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from kernels.ancestors import ancestors, ancestors_supported
from kernels.sdpa import attention
from verify_server.kv_cache import KVCache

ATTENTION_NAME = "ddtree_tree"
STEP_KWARG = "ddtree_step"


def ancestor_matrix(parents: torch.Tensor, steps: int | None = None) -> torch.Tensor:
    """parents [n] (-1 or 0 for the root, parent index < own index) -> anc [n, n] bool, anc[i, j] = j is i or one
    of its ancestors. No host sync, no per-node loop on the host. On a GPU one kernel (kernels/ancestors.py).
    Elsewhere by pointer doubling: after step k each row holds the ancestors less than 2**k levels up, so `steps` =
    ceil(log2(n)) (the default) covers any tree of n nodes; a captured step passes the bound of its largest bucket
    instead, a constant, so that the code depends on neither the tree's depth nor its size."""
    n = parents.shape[0]
    if n == 1:  # an AR step's root
        return torch.ones(1, 1, dtype=torch.bool, device=parents.device)
    if ancestors_supported(parents):
        return ancestors(parents)
    up = parents.clamp(min=0)  # [n] the 2**k-th ancestor; the root is its own parent, so walking past it stays put
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)  # [n, n] ancestors less than 1 level up: itself
    for _ in range((n - 1).bit_length() if steps is None else steps):
        anc = anc | anc[up]  # [n, n] and those of the 2**k-th ancestor
        up = up[up]
    return anc


@dataclass
class AttentionStep:
    """One forward's view of the cache.

    new tokens go to slots [start, start+q); `tree` [q, q] bool says which new tokens each new token sees (None
    means causal order); `positions` [q] are the RoPE positions (needed only for sliding-window layers).
    """

    cache: KVCache
    start: int
    num_new: int
    positions: torch.Tensor
    tree: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[1, 1, q, start+q] bool (True = attend), or None when plain causal attention over the new tokens is
        exactly right (a single token, or a prompt with nothing before it). Built once per step, shared by layers."""
        if sliding_window not in self._masks:
            self._masks[sliding_window] = self._build(sliding_window)
        return self._masks[sliding_window]

    def _build(self, sliding_window: int | None) -> torch.Tensor | None:
        q, start = self.num_new, self.start
        if self.tree is None and sliding_window is None and (q == 1 or start == 0):
            return None
        device = self.positions.device
        new = self.tree if self.tree is not None else torch.ones(q, q, dtype=torch.bool, device=device).tril()
        mask = torch.cat((torch.ones(q, start, dtype=torch.bool, device=device), new), dim=1)
        if sliding_window is not None:
            key_pos = torch.cat((torch.arange(start, device=device), self.positions))
            mask &= (self.positions[:, None] - key_pos[None, :]) < sliding_window
        return mask[None, None]


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, q, d], key/value [1, kv_heads, q, d] for the new tokens -> out [1, q, heads, d]."""
    step: AttentionStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention needs `{STEP_KWARG}` in the forward kwargs")
    keys, values = step.cache.write(module.layer_idx, step.start, key, value)
    mask = step.mask(sliding_window)
    out = attention(query, keys, values, mask, is_causal=mask is None and step.num_new > 1, scale=scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, tree_attention)
