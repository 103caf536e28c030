"""`ddtree embed-pair`: a small target and its DFlash drafter (by default the bundled demo pair) embedded in a real
architecture's exact shapes, so the large pair computes the small pair's next-token function while every kernel
runs at real cost: benchmarks of speed under speculation at real shapes with real acceptance.

    ddtree embed-pair --shape qwen3-8b --out /tmp/pair8b   # -> /tmp/pair8b/target, /tmp/pair8b/drafter

OUT/target is a standard HF checkpoint (Qwen3ForCausalLM, or Qwen3_5ForCausalLM for a hybrid shape) with the small
target's tokenizer files and generation config; OUT/drafter a DFlash drafter in the published format; and
OUT/embedding.json records where the small pair sits (embed_layout.py, embed_vocab.py say how and why).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

from draft_server.dflash_config import DFlashConfig, default_target_layer_ids
from runtime.checkpoint import load_state_dict_files
from runtime.models import resolve_pair
from runtime.shapes import HYBRID_MODELS, HYBRID_SHAPES, SHAPES
from training.embed_drafter import DrafterEmbedding
from training.embed_layout import HeadMap, ResidualMap, rope_theta, spread, tap_layers
from training.embed_target import TargetEmbedding
from training.embed_vocab import drafter_bound, target_bound
from training.shard_writer import ShardWriter

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TARGET_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 2 << 30  # target shards; the drafter is one file, as published
EMBED_SHAPES = sorted(SHAPES) + sorted(HYBRID_MODELS)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed-pair", help="embed the demo pair in a real architecture's shapes (real cost, demo τ)")
    p.add_argument("--target", help="small Qwen3 target directory (default: the bundled demo target)")
    p.add_argument("--drafter", help="its DFlash drafter directory (default: the bundled demo drafter)")
    p.add_argument("--shape", required=True, choices=EMBED_SHAPES,
                   help="runtime/shapes.py name: a dense Qwen3 shape, or a hybrid (Qwen3.5-architecture) one")
    p.add_argument("--out", required=True, help="output directory: OUT/target, OUT/drafter, OUT/embedding.json")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the identity layers' random weights are drawn (the bulk of a large build's time)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target, drafter = resolve_pair(args.target, args.drafter)
    if drafter is None:
        raise FileNotFoundError(f"no drafter given and none beside {target}")
    start = time.perf_counter()
    try:
        record = embed_pair(Path(target), Path(drafter), args.shape, Path(args.out), DTYPES[args.dtype],
                            torch.device(args.device))
    except ValueError as exc:
        print(f"ddtree embed-pair: error: {exc}", file=sys.stderr)
        return 2
    gib = record["bytes"] / 2**30
    print(f"{args.shape} pair written to {args.out}: {gib:.2f} GiB in {time.perf_counter() - start:.1f} s")
    return 0


def large_target_config(shape: str, small: PretrainedConfig) -> PretrainedConfig:
    """The large target's HF config: the shape's layers, the small target's eps and special tokens, and the rope
    theta whose frequencies match the small target's (embed_layout.rope_theta). Qwen3.5's multimodal RoPE rotates
    text positions (equal on its three axes) as plain RoPE, so its sections need no change."""
    tokens = dict(bos_token_id=small.bos_token_id, eos_token_id=small.eos_token_id, pad_token_id=small.pad_token_id)
    theta = small.rope_parameters["rope_theta"]
    if shape in HYBRID_MODELS:
        release = HYBRID_MODELS[shape]
        config = Qwen3_5TextConfig(
            **HYBRID_SHAPES[shape], num_hidden_layers=release["num_hidden_layers"], rms_norm_eps=small.rms_norm_eps,
            max_position_embeddings=release["max_position_embeddings"],
            tie_word_embeddings=release["tie_word_embeddings"], **tokens,
        )
        config.architectures = ["Qwen3_5ForCausalLM"]
        # the rotated width is known once HF has filled in the rope parameters (partial_rotary_factor)
        config.rope_parameters["rope_theta"] = rope_theta(theta, small.head_dim, rotary_dim(config))
    else:
        s = SHAPES[shape]
        config = Qwen3Config(
            hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
            num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
            num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], vocab_size=s["vocab_size"],
            max_position_embeddings=s["max_position_embeddings"], tie_word_embeddings=s["tie_word_embeddings"],
            rms_norm_eps=small.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta(theta, small.head_dim, s["head_dim"])},
            **tokens,
        )
        config.architectures = ["Qwen3ForCausalLM"]
    return config


def rotary_dim(config: PretrainedConfig) -> int:
    """How many of a head's dims RoPE rotates (Qwen3.5 rotates a fraction of each head)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def drafter_shape(shape: str, small: DFlashConfig) -> dict:
    """The published drafter's layer shape for this target shape, with at least the small drafter's layers."""
    if shape in HYBRID_MODELS:
        spec = dict(HYBRID_MODELS[shape]["drafter"])
    else:
        s = SHAPES[shape]
        spec = {key: s[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")}
        spec["num_hidden_layers"] = s["drafter_layers"]
    spec["num_hidden_layers"] = max(spec["num_hidden_layers"], small.num_hidden_layers)
    return spec


def embed_pair(target_dir: Path, drafter_dir: Path, shape: str, out: Path, dtype: torch.dtype,
               draw_device: torch.device = torch.device("cpu")) -> dict:
    """Writes OUT/target, OUT/drafter and OUT/embedding.json; returns the record (with the bytes written)."""
    target = embed_target(target_dir, shape, dtype, draw_device)
    written = _write(target.tensors(), out / "target", SHARD_BYTES)
    target.large.dtype = dtype
    target.large.save_pretrained(out / "target")
    for name in TARGET_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / "target" / name)
    drafter = embed_drafter(drafter_dir, shape, target, dtype, draw_device)
    written += _write(drafter.tensors(), out / "drafter", 1 << 40)
    raw = drafter.large.to_dict()
    raw["torch_dtype"] = raw["dtype"] = str(dtype).removeprefix("torch.")
    (out / "drafter" / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    record = {
        "shape": shape, "dtype": raw["dtype"], "bytes": written, "residual": asdict(target.residual),
        "target": {
            "hosts": target.hosts, "q_heads": target.heads.q_heads, "kv_heads": target.heads.kv_heads,
            "rope_theta": target.large.rope_parameters["rope_theta"],
            "logit_bound": {**asdict(target.bound), "scale": target.bound.scale},
            "padded_logit_weight": target.padded_logit_weight,
        },
        "drafter": {
            "hosts": drafter.hosts, "q_heads": drafter.heads.q_heads, "kv_heads": drafter.heads.kv_heads,
            "target_layer_ids": drafter.large.target_layer_ids, "tap_blocks": drafter.tap_blocks,
            "rope_theta": drafter.large.rope_theta,
            "logit_bound": {**asdict(drafter.bound), "scale": drafter.bound.scale},
        },
    }
    (out / "embedding.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def embed_target(target_dir: Path, shape: str, dtype: torch.dtype, draw_device: torch.device) -> TargetEmbedding:
    small = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    if small.model_type != "qwen3":
        raise ValueError(f"the small target must be a Qwen3 model, not {small.model_type!r}")
    state = {k: v.float() for k, v in load_state_dict_files(target_dir).items()}
    head = state["model.embed_tokens.weight" if small.tie_word_embeddings else "lm_head.weight"]
    large = large_target_config(shape, small)
    residual = ResidualMap.fit(small.hidden_size, large.hidden_size, small.rms_norm_eps)
    heads = HeadMap.fit(small.num_attention_heads, small.num_key_value_heads, small.head_dim,
                        large.num_attention_heads, large.num_key_value_heads, large.head_dim, rotary_dim(large))
    attention_slots = [i for i, kind in enumerate(large.layer_types) if kind == "full_attention"]
    hosts = spread(small.num_hidden_layers, attention_slots)
    bound = target_bound(state, head, small.num_hidden_layers, small.num_attention_heads,
                         small.num_key_value_heads, small.rms_norm_eps)
    return TargetEmbedding(state, head, large, residual, heads, hosts, bound, dtype, draw_device)


def embed_drafter(drafter_dir: Path, shape: str, target: TargetEmbedding, dtype: torch.dtype,
                  draw_device: torch.device) -> DrafterEmbedding:
    small = DFlashConfig.from_dict(json.loads((drafter_dir / "config.json").read_text()))
    if small.hidden_size != target.residual.small or small.rms_norm_eps != target.large.rms_norm_eps:
        raise ValueError("the drafter's hidden size and eps must be its target's (they share the residual's layout)")
    state = {k: v.float() for k, v in load_state_dict_files(drafter_dir).items()}
    spec = drafter_shape(shape, small)
    if spec["hidden_size"] != target.large.hidden_size:
        raise ValueError(f"{shape}'s drafter must have its target's hidden size (it reads the target's residual)")
    layers = target.large.num_hidden_layers
    count = max(spec["num_hidden_layers"], small.num_taps)
    taps, blocks = tap_layers(small.target_layer_ids, target.hosts, count, default_target_layer_ids(layers, count),
                              layers)
    large = DFlashConfig(
        **spec, vocab_size=target.large.vocab_size, block_size=small.block_size, mask_token_id=small.mask_token_id,
        target_layer_ids=taps, num_target_layers=layers, rms_norm_eps=small.rms_norm_eps,
        max_position_embeddings=target.large.max_position_embeddings,
        rope_theta=rope_theta(small.rope_theta, small.head_dim, spec["head_dim"]),
    )
    heads = HeadMap.fit(small.num_attention_heads, small.num_key_value_heads, small.head_dim,
                        spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"], spec["head_dim"])
    hosts = spread(small.num_hidden_layers, list(range(spec["num_hidden_layers"])))
    bound = drafter_bound(state, small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads,
                          small.rms_norm_eps, target.state["model.embed_tokens.weight"], target.head)
    # it shares the target's lm_head and so its padded rows: its final norm's constant weight sets its own scale
    return DrafterEmbedding(state, small, large, target.residual, heads, hosts, blocks, bound,
                            bound.scale / target.bound.scale, dtype, draw_device)


def _write(tensors, path: Path, max_shard_bytes: int) -> int:
    writer = ShardWriter(path, max_shard_bytes)
    for key, tensor in tensors:
        writer.add(key, tensor)
    writer.close()
    return writer.total_bytes
