"""The recurrent state of a hybrid target's linear-attention (Gated DeltaNet) layers.

Such a layer keeps no K/V. What the next token needs from the past is, per layer, the last K-1 inputs of its short
causal convolution and a [heads, d_k, d_v] recurrent state. A session holds both as of its committed prefix
x[0..n-1): like the root's K/V, the root's contribution is written by the next step.

A verify step must leave them untouched until the walk has chosen the accepted path. The tree forward
(verify_server/linear_attention.py) therefore writes per-node factors into a `TreeScratch` instead, and
`StateCache.commit` folds the accepted path's factors into the committed state: that is the deepest accepted node's
state, computed from this step's factors alone, without recomputing the prefix or the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearLayout:
    """Shapes of a target's gated-delta layers (identical across its layers)."""

    layer_ids: tuple[int, ...]  # decoder layers that are linear attention, increasing
    conv_dim: int  # channels of the causal convolution: q, k and v projections side by side
    kernel: int  # convolution width K
    heads: int  # value heads; key heads are repeated up to this count before the delta rule
    key_dim: int  # per-head key width d_k
    value_dim: int  # per-head value width d_v

    @property
    def slots(self) -> dict[int, int]:
        """decoder layer id -> index along the first axis of the state tensors."""
        return {layer: i for i, layer in enumerate(self.layer_ids)}


class StateCache:
    """One session's committed linear-attention state; allocated once at session start, updated in place.

    conv:      [L, K-1, conv_dim] model dtype, the last K-1 convolution inputs, oldest first (zeros = empty prefix)
    recurrent: [L, heads, d_k, d_v] fp32, the delta-rule state (fp32 like HF's kernels: it accumulates over the
               whole sequence)
    L is the number of linear-attention layers.
    """

    def __init__(self, layout: LinearLayout, device: torch.device, dtype: torch.dtype) -> None:
        n = len(layout.layer_ids)
        self.layout = layout
        self.slot = layout.slots
        self.conv = torch.zeros(n, layout.kernel - 1, layout.conv_dim, device=device, dtype=dtype)
        state_shape = (n, layout.heads, layout.key_dim, layout.value_dim)
        self.recurrent = torch.zeros(state_shape, device=device, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def commit(self, scratch: "TreeScratch", keep: torch.Tensor) -> None:
        """Advances every layer's state past the accepted path of the step held in `scratch`.

        keep [m] are the path's node indices, root first, each the parent of the next. With G the cumulative log
        decay along the path and (k_j, delta_j) each node's key and delta-rule correction, the deepest node d's
        state is  S_d = exp(G_d) S_0 + sum_j exp(G_d - G_j) k_j delta_j^T  (every exponent <= 0: no overflow)."""
        decay = scratch.decay[:, keep]  # [L, m, heads], G along the path; G_d is the last
        to_end = (decay[:, -1:] - decay).exp()  # [L, m, heads], decay from each path node to the deepest
        keys = scratch.k[:, keep] * to_end[..., None]  # [L, m, heads, d_k]
        update = torch.einsum("lmhk,lmhv->lhkv", keys, scratch.delta[:, keep])  # [L, heads, d_k, d_v]
        self.recurrent.mul_(decay[:, -1].exp()[..., None, None]).add_(update)
        # The convolution window after the path: its last K-1 inputs, reaching into the old window when m < K-1.
        inputs = torch.cat((self.conv, scratch.x[:, keep]), dim=1)  # [L, K-1+m, conv_dim]
        self.conv.copy_(inputs[:, -(self.layout.kernel - 1) :])


class TreeScratch:
    """Per-node factors of the verify step in flight, for every linear layer; preallocated for the largest tree.

    One engine runs one forward at a time, so one scratch serves all its sessions (a session's memory stays at
    `StateCache.nbytes` whatever the tree size). Per node and layer it costs 4*heads*(d_k + d_v + 1) bytes plus
    conv_dim model-dtype elements, against 4*heads*d_k*d_v bytes for a materialised per-node state.

    x:     [L, N, conv_dim] model dtype, each node's convolution input (the commit extends the conv window with them)
    k:     [L, N, heads, d_k] fp32, l2-normalised keys
    delta: [L, N, heads, d_v] fp32, delta-rule corrections (what each node writes into the state)
    decay: [L, N, heads] fp32, cumulative log decay from the root through the node, root's own gate included
    """

    def __init__(self, layout: LinearLayout, max_nodes: int, device: torch.device, dtype: torch.dtype) -> None:
        n, h = len(layout.layer_ids), layout.heads
        self.x = torch.empty(n, max_nodes, layout.conv_dim, device=device, dtype=dtype)
        self.k = torch.empty(n, max_nodes, h, layout.key_dim, device=device, dtype=torch.float32)
        self.delta = torch.empty(n, max_nodes, h, layout.value_dim, device=device, dtype=torch.float32)
        self.decay = torch.empty(n, max_nodes, h, device=device, dtype=torch.float32)

    @property
    def max_nodes(self) -> int:
        """Largest step (root included) it holds."""
        return self.x.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.k, self.delta, self.decay))
