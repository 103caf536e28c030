"""The DFlash drafter's configuration, as the published checkpoints' config.json states it (4.57-era and 5.x)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread taps from layer 1 to layer L-3, the convention of published drafters without an explicit
    list (for very shallow targets the range shrinks to fit)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    return sorted({round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)})


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported drafter layer type {unknown[0]!r}")
        if self.has_sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (DFlash drafters use silu)")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    @classmethod
    def from_dict(cls, raw: dict) -> "DFlashConfig":
        """Accepts both 4.57-era configs (top-level `rope_theta`, `rope_scaling`) and 5.x ones (`rope_parameters`)."""
        try:
            dflash = raw.get("dflash_config") or {}
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"unsupported rope type {rope_type!r} in drafter config")
            rope_theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
            num_layers = raw["num_hidden_layers"]
            num_target_layers = raw["num_target_layers"]
            return cls(
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=num_layers,
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                vocab_size=raw["vocab_size"],
                block_size=raw["block_size"],
                mask_token_id=dflash["mask_token_id"],
                target_layer_ids=list(
                    dflash.get("target_layer_ids") or default_target_layer_ids(num_target_layers, num_layers)
                ),
                num_target_layers=num_target_layers,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=raw.get("max_position_embeddings", 40960),
                attention_bias=raw.get("attention_bias", False),
                hidden_act=raw.get("hidden_act", "silu"),
                layer_types=list(raw.get("layer_types") or []),
                sliding_window=raw.get("sliding_window"),
            )
        except KeyError as exc:
            raise ValueError(f"drafter config.json lacks required key {exc.args[0]!r}") from None

    def to_dict(self) -> dict:
        """The published (4.57-era, z-lab) layout, so other DFlash tooling can read what is saved here."""
        raw = asdict(self)
        dflash = {"mask_token_id": raw.pop("mask_token_id"), "target_layer_ids": raw.pop("target_layer_ids")}
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **raw,
            "dflash_config": dflash,
            "rope_scaling": None,
            "use_sliding_window": self.sliding_window is not None,
            "tie_word_embeddings": False,
        }
