"""The generic path: any HF causal LM through its own modules, with the verifier's tree attention over its KV cache
(verify_server/tree_attention.py) and, on hybrid targets, the gated-delta layers' tree forward
(verify_server/linear_attention.py). Targets of the Qwen3 / Llama / Qwen2 family take the fused path instead
(verify_server/fused_runner.py), unless asked not to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from verify_server.linear_attention import LINEAR_STEP_KWARG, LinearStep, install_linear_attention
from verify_server.session import VerifySession
from verify_server.state_cache import TreeScratch
from verify_server.tree_attention import STEP_KWARG, AttentionStep


class HFForward:
    """The target's decoder and lm_head, its gated-delta layers (if any) rewired for trees, its layers hooked to tap
    their outputs. linear: the hybrid's layout (None for a plain target); scratch: the per-node factors of the tree
    in flight, for trees of up to max_nodes nodes (root included): one forward runs at a time, so one scratch
    serves every session."""

    def __init__(self, model: PreTrainedModel, max_nodes: int) -> None:
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        weight = self.lm_head.weight
        # Hybrid targets (Qwen3.5 / Qwen3-Next): gated-delta layers keep recurrent state instead of K/V.
        self.linear = install_linear_attention(model)
        self.scratch = TreeScratch(self.linear, max_nodes, weight.device, weight.dtype) if self.linear else None
        # Tapped layer outputs of the forward in flight, filled by hooks: layer id -> [1, q, hidden].
        self._want_taps: frozenset[int] = frozenset()
        self._taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.decoder.layers):
            layer.register_forward_hook(self._tap_hook(i))

    def _tap_hook(self, layer_id: int) -> Callable[..., None]:
        def hook(_module, _args, output):
            if layer_id in self._want_taps:
                self._taps[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def forward(
        self, sess: VerifySession, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [q], tree [q, q] bool (None: causal, a prompt chunk after every committed slot) -> logits
        [q or 1, V] fp32, features [q, taps*hidden] (None without taps). New K/V go to the session's slots
        [length, length+q); a prompt chunk's recurrent state (hybrids) is committed once every layer has run."""
        step = AttentionStep(sess.cache, sess.cache.length, ids.shape[0], positions, tree)
        steps: dict[str, AttentionStep | LinearStep] = {STEP_KWARG: step}
        linear = None
        if sess.states is not None:
            linear = steps[LINEAR_STEP_KWARG] = LinearStep(step, sess.states, self.scratch)
        self._want_taps, self._taps = frozenset(sess.taps), {}
        try:
            out = self.decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False, **steps)
            taps = [self._taps[t][0] for t in sess.taps]
        finally:
            self._want_taps, self._taps = frozenset(), {}
        hidden = out.last_hidden_state[0]  # [q, hidden]
        logits = self.lm_head(hidden[-1:] if last_only else hidden).float()
        if linear is not None:
            linear.commit_prefill()  # only now that every layer ran: a chunk failing midway leaves the state as it was
        return logits, torch.cat(taps, dim=-1) if taps else None
