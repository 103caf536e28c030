"""The padded vocabulary of an embedded pair: rows past the small vocabulary that provably never win.

In a bias-free pre-norm model no logit is a constant: the final norm divides every logit by the rms of the last
residual. The embedded residual carries a constant dim c (embed_layout.ResidualMap), so after the final norm that
dim holds c * w / (kappa * rms), and a padded lm_head row reading only it gives every padded token the logit
-M / rms, rms being the small model's final rms (with eps). Both sides of the comparison are bounded for every
input:

- every real logit lies in [-L, L], L = sqrt(d) * max_v ||W_v * w_final||: the normed vector has norm < sqrt(d);
- rms <= R: the last residual is the embedding plus each sublayer's output, and each sublayer reads a normed
  (bounded) input: attention outputs convex combinations of bounded values, |silu(g) * u| <= |g| |u| bounds the
  MLP. Operator norms of the small model's weights give R.

With M = R (L + GAP) every padded logit sits at least GAP below every real one, whatever the input: it never wins
an argmax nor enters a top-k below the real vocabulary's size, and the padded softmax mass stays under
(padded rows) * e^-GAP. The bounds are loose, the margins seen in practice far larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GAP = 100.0  # padded logits sit at least this far below every real logit


@dataclass(frozen=True)
class LogitBound:
    logit: float  # L: real logits lie in [-L, L]
    rms: float  # R: the final norm's input rms (eps included) never exceeds it

    @property
    def scale(self) -> float:
        """M: padded logits are -M / rms <= -(L + GAP)."""
        return self.rms * (self.logit + GAP)


def _spectral(weight: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(weight.double(), ord=2).item()


def _normed(weight: torch.Tensor) -> float:
    """Largest norm of an RMSNorm's output: |w|_inf * sqrt(d) (the normalised vector's norm is below sqrt(d))."""
    return weight.abs().max().item() * math.sqrt(weight.numel())


def attention_bound(
    v_proj: torch.Tensor, o_proj: torch.Tensor, heads: int, kv_heads: int, value_norm: float
) -> float:
    """Largest attention output: each head averages values of its kv head, ||v_g|| <= |W_v,g| * value_norm."""
    per_kv = [_spectral(w) for w in v_proj.view(kv_heads, -1, v_proj.shape[-1])]
    group = heads // kv_heads
    concat = math.sqrt(sum(per_kv[h // group] ** 2 for h in range(heads)))
    return _spectral(o_proj) * concat * value_norm


def mlp_bound(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, input_norm: float) -> float:
    """Largest MLP output: ||silu(g) * u|| <= |g|_inf ||u||, |g_i| <= ||W_gate,i|| * input_norm."""
    gate_inf = gate.double().norm(dim=1).max().item() * input_norm
    return _spectral(down) * gate_inf * _spectral(up) * input_norm


def logit_bound(
    embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor, sublayers: float, eps: float
) -> LogitBound:
    """embed [v, d] (the inputs a residual can start from), head [v, d] (real lm_head rows), final_norm [d];
    sublayers: the sum of every sublayer's output bound."""
    d = final_norm.numel()
    logit = math.sqrt(d) * (head.double() * final_norm.double()).norm(dim=1).max().item()
    residual = embed.double().norm(dim=1).max().item() + sublayers
    return LogitBound(logit, math.sqrt(residual**2 / d + eps))


def target_bound(
    state: dict[str, torch.Tensor], head: torch.Tensor, layers: int, heads: int, kv_heads: int, eps: float
) -> LogitBound:
    """A small Qwen3 target (HF key names) and its lm_head [v, d]."""
    total = 0.0
    for i in range(layers):
        p = f"model.layers.{i}."
        total += attention_bound(state[p + "self_attn.v_proj.weight"], state[p + "self_attn.o_proj.weight"], heads,
                                 kv_heads, _normed(state[p + "input_layernorm.weight"]))
        total += mlp_bound(state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"],
                           state[p + "mlp.down_proj.weight"], _normed(state[p + "post_attention_layernorm.weight"]))
    return logit_bound(state["model.embed_tokens.weight"], head, state["model.norm.weight"], total, eps)


def drafter_bound(
    state: dict[str, torch.Tensor], layers: int, heads: int, kv_heads: int, eps: float, embed: torch.Tensor,
    head: torch.Tensor,
) -> LogitBound:
    """A small DFlash drafter (published key names) over its target's embed and lm_head: values come from the
    block stream and from the normed context alike."""
    context = _normed(state["hidden_norm.weight"])
    total = 0.0
    for i in range(layers):
        p = f"layers.{i}."
        values = max(context, _normed(state[p + "input_layernorm.weight"]))
        total += attention_bound(state[p + "self_attn.v_proj.weight"], state[p + "self_attn.o_proj.weight"], heads,
                                 kv_heads, values)
        total += mlp_bound(state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"],
                           state[p + "mlp.down_proj.weight"], _normed(state[p + "post_attention_layernorm.weight"]))
    return logit_bound(embed, head, state["norm.weight"], total, eps)
