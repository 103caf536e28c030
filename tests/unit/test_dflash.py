"""DFlash drafter: checkpoint format, loader errors, and the cached draft step against a cache-free reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draft_server.dflash import DFlashDrafter, Rotary, apply_rope, gather_cos_sin, load_drafter, save_drafter
from draft_server.engine import DraftEngine
from draft_server.session import SessionError
from draft_server.target_head import TargetHead
from tests.conftest import BLOCK, HIDDEN, VOCAB


def published_keys(num_layers: int) -> list[str]:
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return keys


def write_published_checkpoint(path: Path, source: DFlashDrafter, drop: str | None = None, extra: str | None = None) -> None:
    """A checkpoint as z-lab publishes it: 4.57-era config and unprefixed keys, written without our saver."""
    cfg = source.config
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids},
        "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size, "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "max_position_embeddings": 40960, "max_window_layers": cfg.num_hidden_layers, "model_type": "qwen3",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads, "num_target_layers": cfg.num_target_layers,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": cfg.vocab_size,
    }
    (path / "config.json").write_text(json.dumps(config))
    state = source.state_dict()
    tensors = {k: state[k].clone() for k in published_keys(cfg.num_hidden_layers) if k != drop}
    if extra:
        tensors[extra] = torch.zeros(1)
    save_file(tensors, path / "model.safetensors")


def test_published_format_loads_and_round_trips(drafter_dir: Path, tmp_path: Path) -> None:
    ours = load_drafter(drafter_dir)
    assert sorted(ours.state_dict()) == sorted(published_keys(ours.config.num_hidden_layers))
    write_published_checkpoint(tmp_path / "published", ours)
    published = load_drafter(tmp_path / "published")
    save_drafter(published, tmp_path / "resaved", dtype=torch.float32, max_shard_mb=0.05)  # forces shards
    assert len(list((tmp_path / "resaved").glob("model-*.safetensors"))) > 1
    resaved = load_drafter(tmp_path / "resaved")
    for key, value in ours.state_dict().items():
        assert torch.equal(value, resaved.state_dict()[key]), key
    assert resaved.config == ours.config


def test_missing_and_unexpected_keys_are_named(drafter_dir: Path, tmp_path: Path) -> None:
    source = load_drafter(drafter_dir)
    write_published_checkpoint(tmp_path / "missing", source, drop="layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing key 'layers\.1\.mlp\.up_proj\.weight'"):
        load_drafter(tmp_path / "missing")
    write_published_checkpoint(tmp_path / "extra", source, extra="model.embed_tokens.weight")
    with pytest.raises(ValueError, match=r"unexpected key 'model\.embed_tokens\.weight'"):
        load_drafter(tmp_path / "extra")
    config = json.loads((tmp_path / "extra" / "config.json").read_text())
    del config["block_size"]
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'block_size'"):
        load_drafter(tmp_path / "extra")


def reference_block_logprobs(model: DFlashDrafter, head: TargetHead, features: torch.Tensor, root: int) -> torch.Tensor:
    """The DFlash forward written the slow, obvious way: context K/V recomputed from all features, no cache."""
    cfg = model.config
    c = features.shape[0]
    ids = torch.tensor([root] + [cfg.mask_token_id] * (cfg.block_size - 1))
    x = head.embed[ids][None]
    ctx = model.hidden_norm(model.fc(features[None]))
    positions = torch.arange(c + cfg.block_size)[None]
    cos, sin = model.rotary.cos_sin(positions, x.dtype)
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        both = torch.cat((ctx, h), dim=1)
        q = attn.q_norm(attn.q_proj(h).view(1, -1, cfg.num_attention_heads, cfg.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(both).view(1, -1, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = attn.v_proj(both).view(1, -1, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, :, c:], sin[:, :, c:])
        k = apply_rope(k, cos, sin)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / cfg.head_dim**0.5, dim=-1)
        x = x + attn.o_proj((weights @ v).transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return torch.log_softmax(model.norm(x)[0, 1:] @ head.lm_head.T, dim=-1)


def test_cached_drafting_matches_reference(drafter_dir: Path) -> None:
    torch.manual_seed(0)
    model = load_drafter(drafter_dir)
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    engine = DraftEngine(model, head)
    features = torch.randn(13, 2 * HIDDEN)
    engine.start_session("s", capacity=32)
    seen = 0
    for chunk, root in ((5, 3), (1, 9), (4, 2), (3, 17)):  # context arrives in pieces, like prefill then rounds
        seen += chunk
        lp = engine._block_logprobs  # noqa: SLF001 - compare the raw distributions, not only the tree
        engine.draft("s", features[seen - chunk : seen], root, seen, budget=4)
        got = lp(engine.session("s"), root, seen)
        want = reference_block_logprobs(model, head, features[:seen], root)
        assert got.shape == (BLOCK - 1, VOCAB)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert engine.session("s").length == 13  # only context K/V is kept, never the block's


def test_draft_rejects_inconsistent_positions(drafter_dir: Path) -> None:
    engine = DraftEngine(load_drafter(drafter_dir), TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)))
    engine.start_session("s", capacity=16)
    with pytest.raises(SessionError, match="root must be at position 4"):
        engine.draft("s", torch.randn(4, 2 * HIDDEN), 1, 5, budget=4)
    with pytest.raises(SessionError, match="unknown drafter session"):
        engine.draft("nope", torch.randn(4, 2 * HIDDEN), 1, 4, budget=4)
    tree = engine.draft("s", torch.randn(4, 2 * HIDDEN), 1, 4, budget=4).tree  # the session is still usable
    assert tree.num_nodes == 4 and tree.parents[1].item() == 0


def test_fused_projections_share_the_weights_and_compute_the_same(drafter_dir: Path) -> None:
    """fuse() lays q|k|v and gate|up end to end: the checkpoint reads the same, no weight is held twice, and the
    block's and the context's projections come out as the separate modules compute them."""
    torch.manual_seed(0)
    plain, fused = load_drafter(drafter_dir), load_drafter(drafter_dir)
    fused.fuse()
    fused.fuse()  # idempotent
    state = fused.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    qkv = attn.qkv[0]
    assert attn.v_proj.weight.data_ptr() == qkv[qkv.shape[0] - attn.v_proj.out_features :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[mlp.gate_proj.out_features :].data_ptr()
    x, positions = torch.randn(1, BLOCK, HIDDEN), torch.arange(3, 3 + BLOCK)[None]
    cos, sin = fused.rotary.cos_sin(positions, x.dtype)
    for got, want in zip(attn.query_key_value(x, cos, sin), plain.layers[0].self_attn.query_key_value(x, cos, sin)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(mlp(x), plain.layers[0].mlp(x))
    features = torch.randn(1, 7, 2 * HIDDEN)
    for got, want in zip(fused.context_kv(features, positions[:, :7]), plain.context_kv(features, positions[:, :7])):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rope_table_gathers_what_cos_sin_computes(dtype: torch.dtype) -> None:
    """The static path's steps gather the rotation from a table (Rotary.table); any positions, in any order and
    batch shape, get the values cos_sin computes for them, bit for bit."""
    rotary = Rotary(64, 1_000_000.0)
    table = rotary.table(3000, dtype)  # [2, rows, head_dim]
    assert table.shape == (2, 3000, 64) and table.dtype == dtype
    positions = torch.tensor([[2999, 0, 17, 1024, 1025, 5], [3, 3, 2048, 511, 1, 2998]])
    for got, want in zip(gather_cos_sin(table, positions), rotary.cos_sin(positions, dtype)):
        assert got.shape == want.shape == (2, 1, 6, 64)
        assert torch.equal(got, want)
