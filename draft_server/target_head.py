"""The two target tensors the drafter borrows: `embed_tokens` and `lm_head`, read straight from the target's
checkpoint so the drafter service never loads the whole target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.checkpoint import checkpoint_keys, load_state_dict_files


@dataclass
class TargetHead:
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "TargetHead":
        """Shares the tensors of an already loaded HF causal LM (in-process use, training)."""
        return cls(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())

    @classmethod
    def load(cls, target_dir: str | Path, device: str | torch.device, dtype: torch.dtype) -> "TargetHead":
        target_dir = Path(target_dir)
        config = json.loads((target_dir / "config.json").read_text())
        text_config = config.get("text_config", config)
        keys = checkpoint_keys(target_dir)
        embed_key = _find_key(keys, "embed_tokens.weight", target_dir)
        tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        head_key = embed_key if tied or "lm_head.weight" not in keys else "lm_head.weight"
        state = load_state_dict_files(target_dir, sorted({embed_key, head_key}))
        return cls(state[embed_key].to(device, dtype), state[head_key].to(device, dtype))


def _find_key(keys: set[str], suffix: str, where: Path) -> str:
    matches = sorted(k for k in keys if k.endswith(suffix))
    if not matches:
        raise ValueError(f"target checkpoint {where} has no tensor ending in {suffix!r}")
    return min(matches, key=len)  # 'model.embed_tokens.weight' over e.g. a vision tower's
