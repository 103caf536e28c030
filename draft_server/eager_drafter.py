"""EagerDrafter: the drafter's eager path, the reference for the static one (static_drafter.py): a context cache
allocated per session, shapes that follow the context, nothing captured."""

from __future__ import annotations

import torch

from protos.types import DraftTree
from draft_server.dflash import DFlashDrafter, sliding_window_mask
from draft_server.session import DraftSession
from draft_server.target_head import TargetHead
from draft_server.tree import TreeLayouts, build_tree


class EagerDrafter:
    def __init__(self, drafter: DFlashDrafter, head: TargetHead) -> None:
        cfg = drafter.config
        self.drafter, self.head, self.config = drafter, head, cfg
        self.device, self.dtype = head.embed.device, head.embed.dtype
        self.layouts = TreeLayouts(cfg.block_size - 1, head.vocab_size, self.device)  # per tree shape, kept

    def caches(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A new session's context K and V, per layer [1, kv_heads, capacity, head_dim]."""
        cfg = self.config
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        return tuple(
            [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_hidden_layers)]
            for _ in range(2)
        )

    def append(self, sess: DraftSession, features: torch.Tensor) -> None:
        """features [m, taps*hidden] at positions [length, length+m) -> their K/V in the session's caches."""
        end = sess.length + features.shape[0]
        if end == sess.length:
            return
        positions = torch.arange(sess.length, end, device=self.device)[None]
        new_kv = self.drafter.context_kv(features.to(self.device, self.dtype)[None], positions)
        for layer, (k, v) in enumerate(new_kv):
            sess.ctx_k[layer][:, :, sess.length : end] = k
            sess.ctx_v[layer][:, :, sess.length : end] = v
        sess.length = end

    def tree(self, logprobs: torch.Tensor, root_token: int, budget: int, top_k: int | None) -> DraftTree:
        """build_tree over a block's log-probs [B-1, vocab]."""
        return build_tree(logprobs, root_token, budget, top_k, self.layouts.get(budget, top_k)[1])

    def block_logprobs(self, sess: DraftSession, root_token: int, root_position: int) -> torch.Tensor:
        """-> [B-1, vocab] fp32 log-probs; block position j predicts the token at root_position + j (no shift)."""
        cfg = self.config
        b = cfg.block_size
        ids = torch.full((1, b), cfg.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = root_token
        positions = torch.arange(root_position, root_position + b, device=self.device)[None]
        sliding = None
        # Through a sliding layer no block query reaches context before `lo` (the root's window reaches furthest
        # back), so those layers attend over [lo, length) only; the mask trims the later queries' windows.
        lo = max(0, root_position - cfg.sliding_window + 1) if cfg.has_sliding_layers else 0
        starts = [lo if kind == "sliding_attention" else 0 for kind in cfg.layer_types]
        ctx = [(k[:, :, s : sess.length], v[:, :, s : sess.length]) for s, k, v in zip(starts, sess.ctx_k, sess.ctx_v)]
        if cfg.has_sliding_layers:
            ctx_pos = torch.arange(lo, sess.length, device=self.device)[None]
            sliding = sliding_window_mask(positions, ctx_pos, cfg.sliding_window)  # [1, 1, B, length-lo+B]
        hidden = self.drafter(self.head.embed_tokens(ids), positions, ctx, sliding_mask=sliding)  # [1, B, hidden]
        return torch.log_softmax(self.head.logits(hidden[0, 1:]).float(), dim=-1)
