"""DFlash drafter training (the recipe, in our own code), for any HF causal target in a local directory.

One step: sample token windows from the corpus; run the frozen target once to get the tapped hidden states of
every position; pick random anchors a (in assistant text when the corpus is chat); each anchor's block is
[x_a, MASK * (B-1)] at positions a..a+B-1 and block position k must predict x_{a+k}. All blocks of a window go
through the drafter in ONE forward: block queries see the context strictly before their anchor plus their own
block, never another block (`block_attention_mask`), which is exactly what a block sees at inference time.
Position k's loss is weighted exp(-(k-1)/gamma): a miss at depth k discards everything deeper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_server.dflash import DFlashDrafter
from draft_server.dflash_config import DFlashConfig, default_target_layer_ids
from draft_server.target_head import TargetHead


@dataclass
class DrafterTrainConfig:
    block_size: int = 16
    num_layers: int = 2
    tap_layers: list[int] | None = None  # default: default_target_layer_ids(target layers, num_layers)
    blocks_per_window: int = 16
    window: int = 512
    batch_size: int = 16
    steps: int = 2000
    lr: float = 6e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    gamma: float = 7.0
    seed: int = 0


def drafter_config_for(target_config, mask_token_id: int, cfg: DrafterTrainConfig) -> DFlashConfig:
    """A drafter shaped like the target's layers (as published drafters are), with our tap choice."""
    t = target_config
    taps = cfg.tap_layers or default_target_layer_ids(t.num_hidden_layers, cfg.num_layers)
    rope = getattr(t, "rope_parameters", None) or {}
    return DFlashConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        vocab_size=t.vocab_size,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(taps),
        num_target_layers=t.num_hidden_layers,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 1_000_000.0))),
        max_position_embeddings=t.max_position_embeddings,
    )


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] weights for block positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_attention_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """anchors [b, n] -> mask [b, 1, n*B, ctx_len + n*B] bool (True = attend): block i's queries see context
    positions < anchors[i] and the B keys of block i itself. With a sliding_window (for sliding-attention layers) a
    query at position p sees only the context positions c with p - c < sliding_window, as at inference."""
    b, n = anchors.shape
    device = anchors.device
    block_of_query = torch.arange(n * block_size, device=device) // block_size  # [n*B]
    ctx_pos = torch.arange(ctx_len, device=device)[None, None, :]  # [1, 1, ctx]
    ctx_ok = ctx_pos < anchors[:, block_of_query, None]  # [b, n*B, ctx]
    if sliding_window is not None:
        query_pos = anchors[:, block_of_query] + torch.arange(n * block_size, device=device) % block_size  # [b, n*B]
        ctx_ok &= (query_pos[:, :, None] - ctx_pos) < sliding_window
    own = block_of_query[:, None] == block_of_query[None, :]  # [n*B, n*B]
    return torch.cat((ctx_ok, own[None].expand(b, -1, -1)), dim=-1)[:, None]


def sample_anchors(valid: torch.Tensor, n: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """valid [b, L] bool (token may be predicted) -> anchors [b, n] in [1, L-B], preferring anchors whose
    first predicted token is valid; sampling without replacement via random keys."""
    b, length = valid.shape
    usable = torch.zeros_like(valid)
    usable[:, 1 : length - block_size + 1] = valid[:, 2 : length - block_size + 2]
    keys = torch.rand(b, length, generator=generator, device=valid.device) + usable.float()
    keys[:, 0] = -1.0
    keys[:, length - block_size + 1 :] = -1.0
    return keys.topk(n, dim=-1).indices.sort(dim=-1).values


class TappedTarget:
    """The frozen target, returning the concatenated outputs of the tapped decoder layers for a batch."""

    def __init__(self, model: torch.nn.Module, taps: list[int]) -> None:
        self.model = model
        self.taps = taps
        self._out: dict[int, torch.Tensor] = {}
        layers = model.get_decoder().layers
        for t in taps:
            layers[t].register_forward_hook(self._hook(t))
        self.head = TargetHead.from_model(model)

    def _hook(self, layer_id: int):
        def hook(_m, _a, output):
            self._out[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, L] -> [b, L, taps*hidden]."""
        self._out = {}
        self.model.get_decoder()(input_ids=ids, use_cache=False)
        return torch.cat([self._out[t] for t in self.taps], dim=-1)


def block_logits(
    drafter: DFlashDrafter, head: TargetHead, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """ids [b, L], features [b, L, taps*hidden], anchors [b, n] -> logits [b, n, B-1, V] fp32: the block rooted at
    anchor a is [x_a, MASK * (B-1)] at positions a..a+B-1, sees the context before a, and its position k predicts
    the token at a + k, as a draft does at inference."""
    cfg = drafter.config
    bsz, length = ids.shape
    blk = cfg.block_size
    positions = anchors[:, :, None] + torch.arange(blk, device=ids.device)  # [b, n, B]
    block_ids = torch.full_like(positions, cfg.mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    ctx_kv = drafter.context_kv(features, torch.arange(length, device=ids.device).expand(bsz, -1))
    mask = block_attention_mask(anchors, length, blk)
    sliding = block_attention_mask(anchors, length, blk, cfg.sliding_window) if cfg.has_sliding_layers else None
    hidden = drafter(head.embed_tokens(block_ids.flatten(1)), positions.flatten(1), ctx_kv, mask, sliding)
    hidden = hidden.view(bsz, anchors.shape[1], blk, -1)[:, :, 1:]  # [b, n, B-1, hidden]
    return head.logits(hidden).float()


def drafter_loss(
    drafter: DFlashDrafter,
    head: TargetHead,
    ids: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, L], features [b, L, taps*hidden], anchors [b, n], valid [b, L] -> (weighted loss, per-position
    correctness [b, n, B-1] as float, NaN where the target token is not trained on)."""
    length = ids.shape[1]
    positions = anchors[:, :, None] + torch.arange(1, drafter.config.block_size, device=ids.device)  # [b, n, B-1]
    target_pos = positions.clamp(max=length - 1)
    targets = ids.gather(1, target_pos.flatten(1)).view_as(target_pos)
    keep = valid.gather(1, target_pos.flatten(1)).view_as(target_pos) & (positions < length)
    logits = block_logits(drafter, head, ids, features, anchors)  # [b, n, B-1, V]
    ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view_as(targets)
    w = weights.to(ce.device) * keep
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    correct = (logits.argmax(-1) == targets).float().masked_fill(~keep, float("nan"))
    return loss, correct


def lr_at(step: int, cfg: DrafterTrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def acceptance_stats(correct: torch.Tensor) -> tuple[list[float], float]:
    """correct [b, n, B-1] -> per-position accuracy, and the chain acceptance length it implies
    (1 + expected run of leading correct positions), the figure τ estimates during training."""
    per_pos = torch.nanmean(correct.flatten(0, 1), dim=0).tolist()
    full = torch.nan_to_num(correct, nan=0.0)
    tau = 1.0 + full.cumprod(dim=-1).sum(dim=-1).mean().item()
    return per_pos, tau
