"""Where a small model's numbers sit inside a larger one of the same family (`ddtree embed-pair`): the residual
stream, the attention heads and the layers. Pure index and scale maps; embed_target.py and embed_drafter.py apply
them to checkpoints.

Residual stream. The small model's residual x [d] becomes X = [x, a*x, c, 0...] [D]: the small dims, a copy scaled
by a power of two a, and one constant c. Every RMSNorm of the large model then computes exactly the small one's:
sum(X^2) = (1 + a^2) sum(x^2) + c^2, so with kappa^2 = (1 + a^2) d / D and c^2 = D eps (kappa^2 - 1)

    mean(X^2) + eps = kappa^2 (mean(x^2) + eps)        (the same eps in both models)

and norm weights kappa * w on the small dims (zero elsewhere) give the small norm's output. Zero padding alone
would divide by sqrt(d/D) * rms and leave an eps mismatch that no single config eps removes for both the hidden
norms and the per-head q/k norms; the copy removes it. The constant dim is what the padded vocabulary's logits
read (embed_vocab.py); the layers never write to it, and the norms absorb it as part of eps.

Heads. Every small q head sits in a large q head of a kv group whose kv head carries its small kv head (a small kv
head is repeated over several large ones when the large groups are smaller). Head dims keep HF's rotate-half
pairs: small dims j and j + d_h/2 sit at large dims j and j + R/2 (R: the large rotary width), with the large rope
theta chosen so those frequencies equal the small ones. The q/k norms see the same trick as the residual: the head's
other dims hold exact copies of the small head (so the norm's mean is the small one's) and get zero norm weight, so
nothing but the placed dims survives the norm. Unused heads have zero weights and add nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ResidualMap:
    small: int  # d
    large: int  # D
    copy_scale: float  # a, a power of two (so copies stay exact in every dtype)
    constant: float  # c
    norm_scale: float  # kappa

    @classmethod
    def fit(cls, small: int, large: int, eps: float) -> "ResidualMap":
        """The smallest power-of-two copy scale with 1 + a^2 > D/d (so kappa > 1 and the constant is real)."""
        if large < 2 * small + 1:
            raise ValueError(f"a hidden size of {large} cannot hold {small} dims, their copy and a constant")
        a = 1.0
        while 1 + a * a <= large / small:
            a *= 2
        kappa2 = (1 + a * a) * small / large
        return cls(small, large, a, math.sqrt(large * eps * (kappa2 - 1)), math.sqrt(kappa2))

    @property
    def constant_dim(self) -> int:
        return 2 * self.small

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """An output into the residual, weight [d, n] -> [D, n]: the small rows and their scaled copy."""
        out = weight.new_zeros(self.large, *weight.shape[1:])
        out[: self.small] = weight
        out[self.small : 2 * self.small] = weight * self.copy_scale
        return out

    def cols(self, weight: torch.Tensor) -> torch.Tensor:
        """A read of a normed residual, weight [n, d] -> [n, D]: only the small dims are read."""
        out = weight.new_zeros(*weight.shape[:-1], self.large)
        out[..., : self.small] = weight
        return out

    def norm(self, weight: torch.Tensor, constant_weight: float = 0.0) -> torch.Tensor:
        """A norm's weight [d] -> [D]: kappa-scaled on the small dims; constant_weight on the constant dim (the
        final norms pass it to the padded vocabulary's logits)."""
        out = self.cols(weight * self.norm_scale)
        out[self.constant_dim] = constant_weight
        return out

    def embed(self, table: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """Token embeddings [v, d] -> [vocab, D] in dtype: lifted rows carrying the constant, rows past v zero.
        Built in place in the checkpoint's dtype (a vocabulary's table is the largest tensor of a small model's
        embedding; the copy's power-of-two scale is exact in any dtype)."""
        out = torch.zeros(vocab, self.large, dtype=dtype)
        real = table.shape[0]
        out[:real, : self.small] = table
        out[:real, self.small : 2 * self.small] = table * self.copy_scale
        out[:real, self.constant_dim] = self.constant
        return out

    def lift(self, x: torch.Tensor) -> torch.Tensor:
        """A small residual [..., d] -> the large one [..., D] (what the large model carries for it)."""
        out = self.rows(x.movedim(-1, 0)).movedim(0, -1)
        out[..., self.constant_dim] = self.constant
        return out


@dataclass(frozen=True)
class HeadMap:
    small_dim: int  # d_h
    large_dim: int  # D_h
    q_heads: tuple[int, ...]  # small q head -> large q head
    kv_heads: tuple[tuple[int, ...], ...]  # small kv head -> the large kv heads carrying it
    dims: tuple[int, ...]  # small head dim -> large head dim
    copies: tuple[tuple[int, ...], ...]  # per copy block: small head dim -> large head dim (the q/k norms' copies)

    @classmethod
    def fit(
        cls, small_q: int, small_kv: int, small_dim: int, large_q: int, large_kv: int, large_dim: int, rotary_dim: int
    ) -> "HeadMap":
        """Rotary_dim: how many of a large head's dims are rotated (its rotate-half pairs are j and j + R/2)."""
        if large_dim % small_dim or rotary_dim < small_dim:
            raise ValueError(f"head_dim {large_dim} (rotary {rotary_dim}) cannot hold copies of head_dim {small_dim}")
        small_group, large_group = small_q // small_kv, large_q // large_kv
        repeat = -(-small_group // large_group)  # large kv heads per small one
        if small_kv * repeat > large_kv:
            raise ValueError(f"{large_q}/{large_kv} heads cannot hold {small_q}/{small_kv} grouped-query heads")
        kv_heads = tuple(tuple(g * repeat + r for r in range(repeat)) for g in range(small_kv))
        q_heads = tuple(
            kv_heads[g][i // large_group] * large_group + i % large_group
            for g in range(small_kv) for i in range(small_group)
        )
        half = small_dim // 2
        dims = tuple(range(half)) + tuple(rotary_dim // 2 + j for j in range(half))
        free = [j for j in range(large_dim) if j not in set(dims)]
        copies = tuple(tuple(free[b * small_dim : (b + 1) * small_dim]) for b in range(large_dim // small_dim - 1))
        return cls(small_dim, large_dim, q_heads, kv_heads, dims, copies)

    @property
    def score_scale(self) -> float:
        """The attention scale's change, 1/sqrt(d_h) -> 1/sqrt(D_h), undone in the q norm's weights."""
        return math.sqrt(self.large_dim / self.small_dim)

    def _place(self, weight: torch.Tensor, pairs: list[tuple[int, int]], heads: int, copies: bool) -> torch.Tensor:
        """weight [small heads * d_h, n] -> [heads * D_h, n]: each (small, large) head pair's rows placed."""
        per_head = weight.view(-1, self.small_dim, weight.shape[-1])
        out = weight.new_zeros(heads, self.large_dim, weight.shape[-1])
        for small, large in pairs:
            out[large, list(self.dims)] = per_head[small]
            for block in self.copies if copies else ():
                out[large, list(block)] = per_head[small]
        return out.view(heads * self.large_dim, -1)

    def q_rows(self, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """q_proj [n_q * d_h, n] -> [heads * D_h, n], copies included (the q norm's mean)."""
        return self._place(weight, list(enumerate(self.q_heads)), heads, copies=True)

    def k_rows(self, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """k_proj [n_kv * d_h, n] -> [heads * D_h, n], each small kv head in all its large ones, copies included."""
        return self._place(weight, self._kv_pairs(), heads, copies=True)

    def v_rows(self, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """v_proj: as k_rows without copies (no norm reads v, and o_proj reads only the placed dims)."""
        return self._place(weight, self._kv_pairs(), heads, copies=False)

    def o_cols(self, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """o_proj [n, n_q * d_h] -> [n, heads * D_h]: each small head's columns at its large head's placed dims."""
        return self._place(weight.T.contiguous(), list(enumerate(self.q_heads)), heads, copies=False).T.contiguous()

    def q_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """[d_h] -> [D_h]: the placed dims, scaled by score_scale; zero on the copies."""
        out = weight.new_zeros(self.large_dim)
        out[list(self.dims)] = weight * self.score_scale
        return out

    def k_norm(self, weight: torch.Tensor) -> torch.Tensor:
        out = weight.new_zeros(self.large_dim)
        out[list(self.dims)] = weight
        return out

    def _kv_pairs(self) -> list[tuple[int, int]]:
        return [(g, large) for g, larges in enumerate(self.kv_heads) for large in larges]


def rope_theta(small_theta: float, small_dim: int, rotary_dim: int) -> float:
    """The large rope theta whose first d_h/2 frequencies equal the small ones:
    theta_L^(-2j/R) = theta_s^(-2j/d_h) for every j  <=>  theta_L = theta_s^(R/d_h)."""
    return small_theta ** (rotary_dim / small_dim)


def spread(count: int, slots: list[int]) -> list[int]:
    """`count` of `slots`, evenly spread from the first to the last."""
    if count > len(slots):
        raise ValueError(f"{len(slots)} layer slots cannot hold {count} layers")
    if count == 1:
        return [slots[-1]]
    return [slots[round(i * (len(slots) - 1) / (count - 1))] for i in range(count)]


def tap_layers(
    small_taps: list[int], hosts: list[int], count: int, default: list[int], num_layers: int
) -> tuple[list[int], list[int]]:
    """The large drafter's target_layer_ids (sorted, `count` of them) and where each small tap's block sits among
    them. A small tap l reads small layer l's output, which the large model holds right after hosts[l]; the other
    taps come from `default` (the published spread) and get zero fc columns."""
    taps = sorted({hosts[l] for l in small_taps})
    for layer in default + list(range(num_layers)):
        if len(taps) == count:
            break
        if layer not in taps:
            taps = sorted(taps + [layer])
    if len(taps) != count:
        raise ValueError(f"cannot choose {count} distinct tap layers")
    return taps, [taps.index(hosts[l]) for l in small_taps]
