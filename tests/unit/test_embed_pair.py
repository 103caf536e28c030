"""`ddtree embed-pair`: the demo pair embedded in real architectures' shapes computes the demo pair's next-token
function. Each piece of the embedding is checked on its own (norms, heads, RoPE, identity layers, taps, padded
vocabulary), then whole pairs against the demo pair: at the tiny shapes and at one real shape, qwen3-0.6b."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3_5TextConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding

from ddtree.cli import main as cli_main
from draft_server.dflash import load_drafter
from draft_server.target_head import TargetHead
from runtime.checkpoint import load_state_dict_files
from runtime.models import demo_dir
from runtime.shapes import HYBRID_MODELS, HYBRID_SHAPES, SHAPES
from tests.conftest import hf_greedy
from training.drafter_loss import TappedTarget, block_logits
from training.embed_layers import LayerShape, RandomWeights, identity_attention_layer
from training.embed_layout import HeadMap, ResidualMap, rope_theta
from training.embed_pair import embed_pair
from training.embed_vocab import GAP

DEMO = demo_dir()
SMALL = SHAPES["demo"]
EPS = 1e-6


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The bench prompts, chat-templated as served."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target", local_files_only=True)
    records = [json.loads(line) for line in (Path(__file__).resolve().parents[2] / "bench" / "prompts.jsonl").open()]
    chats = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=True)
             for r in records]
    return [list(chat["input_ids"]) for chat in chats]


@pytest.fixture(scope="module")
def demo_target():
    return AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()


def _build(out: Path, shape: str) -> tuple[Path, dict]:
    return out, embed_pair(DEMO / "target", DEMO / "drafter", shape, out, torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    out = tmp_path_factory.mktemp("tiny-embed")
    yield _build(out, "tiny-embed")
    shutil.rmtree(out)  # pytest keeps earlier runs' temporary directories, and pairs are large


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    shutil.rmtree(tmp_path)


@pytest.fixture(scope="module")
def tiny_target(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny[0] / "target", dtype=torch.float32).eval()


# ---- the pieces, at every named shape ---------------------------------------------------------------------------


def _large_shapes() -> list[tuple[int, int, int, int, int]]:
    """(hidden, heads, kv_heads, head_dim, rotary_dim) of every shape the demo embeds into."""
    dense = [(s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], s["head_dim"])
             for name, s in SHAPES.items() if name in ("qwen3-8b", "qwen3-0.6b", "tiny-embed")]
    hybrid = []
    for name in HYBRID_MODELS:
        s = HYBRID_SHAPES[name]
        factor = Qwen3_5TextConfig(**s, num_hidden_layers=4).rope_parameters["partial_rotary_factor"]
        hybrid.append((s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                       int(s["head_dim"] * factor)))
    return dense + hybrid


@pytest.mark.parametrize("large", sorted({s[0] for s in _large_shapes()}))
def test_residual_norms_match_exactly(large: int) -> None:
    """Every RMSNorm of the large model (one config eps) gives the small norm's output on the small dims (to fp32
    rounding: HF norms compute in fp32) and zero elsewhere, down to inputs whose mean square is near eps; also
    through Qwen3.5's (1 + weight) norm."""
    residual = ResidualMap.fit(SMALL["hidden_size"], large, EPS)
    assert residual.norm_scale > 1 and math.log2(residual.copy_scale).is_integer()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, SMALL["hidden_size"], generator=gen, dtype=torch.float64)
    x = x * torch.tensor([1e-4, 1e-3, 1e-2, 1.0, 10.0, 100.0], dtype=torch.float64)[:, None]  # rms down to ~eps
    weight = 1 + 0.1 * torch.randn(SMALL["hidden_size"], generator=gen, dtype=torch.float64)
    small_norm = Qwen3RMSNorm(SMALL["hidden_size"], EPS).double()
    small_norm.weight.data = weight
    want = small_norm(x)
    for norm, stored in ((Qwen3RMSNorm(large, EPS), residual.norm(weight)),
                         (Qwen3_5RMSNorm(large, EPS), residual.norm(weight) - 1)):
        norm = norm.double()
        norm.weight.data = stored
        got = norm(residual.lift(x))
        torch.testing.assert_close(got[:, : SMALL["hidden_size"]], want, rtol=1e-6, atol=0)
        assert got[:, SMALL["hidden_size"]:].abs().max() == 0
    # zero padding alone would be off by the eps mismatch at small rms (what the copy removes)
    padded = torch.nn.functional.pad(x, (0, large - SMALL["hidden_size"]))
    naive = padded * torch.rsqrt(padded.pow(2).mean(-1, keepdim=True) + EPS) * math.sqrt(SMALL["hidden_size"] / large)
    assert (naive[0, : SMALL["hidden_size"]] / (want[0] / weight) - 1).abs().max() > 1e-3


def test_hidden_size_must_hold_the_copy() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        ResidualMap.fit(384, 768, EPS)


@pytest.mark.parametrize("large", _large_shapes(), ids=lambda s: "x".join(map(str, s)))
def test_heads_grouped_queries(large: tuple[int, int, int, int, int]) -> None:
    """Each small q head sits in a large q head whose kv head carries the small q head's kv head; distinct heads
    stay distinct."""
    _, heads, kv_heads, head_dim, rotary = large
    m = HeadMap.fit(SMALL["num_attention_heads"], SMALL["num_key_value_heads"], SMALL["head_dim"], heads, kv_heads,
                    head_dim, rotary)
    small_group, large_group = SMALL["num_attention_heads"] // SMALL["num_key_value_heads"], heads // kv_heads
    assert len(set(m.q_heads)) == len(m.q_heads) and max(m.q_heads) < heads
    carriers = [h for hs in m.kv_heads for h in hs]
    assert len(set(carriers)) == len(carriers) and max(carriers) < kv_heads
    for small, large_head in enumerate(m.q_heads):
        assert large_head // large_group in m.kv_heads[small // small_group]
    # the o_proj columns of unused heads stay zero
    o = m.o_cols(torch.ones(5, SMALL["num_attention_heads"] * SMALL["head_dim"]), heads).view(5, heads, head_dim)
    assert set(o.abs().sum((0, 2)).nonzero().flatten().tolist()) == set(m.q_heads)


@pytest.mark.parametrize("large", _large_shapes(), ids=lambda s: "x".join(map(str, s)))
def test_q_k_norms_rope_and_scores_match(large: tuple[int, int, int, int, int]) -> None:
    """Through HF's q/k norms and rotary embeddings (Qwen3's full, Qwen3.5's partial rotary), the large heads'
    scaled scores q.k / sqrt(D_h) at any two positions equal the small heads' q.k / sqrt(d_h)."""
    hidden, heads, kv_heads, head_dim, rotary = large
    d_h = SMALL["head_dim"]
    m = HeadMap.fit(SMALL["num_attention_heads"], SMALL["num_key_value_heads"], d_h, heads, kv_heads, head_dim, rotary)
    small_cfg = Qwen3Config(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=d_h,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    theta = rope_theta(1e4, d_h, rotary)
    if rotary == head_dim:
        large_rope = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim,
                                                      rope_parameters={"rope_type": "default", "rope_theta": theta}))
    else:
        large_rope = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(
            hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim, num_hidden_layers=4,
            rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary / head_dim}))
    small_rope = Qwen3RotaryEmbedding(small_cfg)
    torch.testing.assert_close(large_rope.inv_freq[: d_h // 2], small_rope.inv_freq, rtol=5e-7, atol=0)

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, d_h, generator=gen)  # one small q head and one kv head, pre-norm
    q_w, k_w = 1 + 0.1 * torch.randn(2, d_h, generator=gen)
    place = m.q_rows(torch.eye(d_h).repeat(SMALL["num_attention_heads"], 1), heads)[: head_dim]  # [D_h, d_h]
    q_large, k_large = q @ place.T, k @ place.T  # placed plus copies
    positions = torch.tensor([[3, 1000]])
    scores = []
    for rope, norm_dim, qq, kk, qw, kw in ((small_rope, d_h, q, k, q_w, k_w),
                                           (large_rope, head_dim, q_large, k_large, m.q_norm(q_w), m.k_norm(k_w))):
        q_norm, k_norm = Qwen3RMSNorm(norm_dim, EPS), Qwen3RMSNorm(norm_dim, EPS)
        q_norm.weight.data, k_norm.weight.data = qw, kw
        cos, sin = rope(qq, positions if rope is small_rope or rotary == head_dim else positions[None].expand(3, 1, 2))
        width = cos.shape[-1]

        def rotate(x: torch.Tensor, i: int) -> torch.Tensor:
            r, rest = x[..., :width], x[..., width:]
            half = torch.cat((-r[..., width // 2 :], r[..., : width // 2]), -1)
            return torch.cat((r * cos[0, i] + half * sin[0, i], rest), -1)

        scores.append((rotate(q_norm(qq), 1) @ rotate(k_norm(kk), 0).T).item() / math.sqrt(norm_dim))
    assert scores[1] == pytest.approx(scores[0], rel=1e-5)


def test_identity_attention_layer_of_qwen3_5_adds_nothing() -> None:
    """An identity full-attention layer of a Qwen3.5 target (gated attention, (1 + weight) norms) leaves the
    residual as it was while its attention and MLP compute on random weights."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    cfg = Qwen3_5TextConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_hidden_layers=4, full_attention_interval=1)
    layer = Qwen3_5DecoderLayer(cfg, 0).eval()
    weights = identity_attention_layer(LayerShape(256, 512, 4, 2, 64, gated=True, centred=True),
                                       RandomWeights.seeded(0, torch.float32, torch.device("cpu")))
    layer.load_state_dict(weights)
    x = torch.randn(1, 5, 256)
    cos, sin = torch.ones(1, 5, 16), torch.zeros(1, 5, 16)
    assert torch.equal(layer(x, (cos, sin)), x)
    assert layer.self_attn(layer.input_layernorm(x), (cos, sin), None)[0].abs().sum() == 0
    assert layer.self_attn.q_proj(x).abs().sum() > 0 and layer.mlp.up_proj(x).abs().sum() > 0


# ---- the tiny dense pair --------------------------------------------------------------------------------------


def test_identity_layers_are_exact_and_compute(tiny, tiny_target, prompts) -> None:
    _, record = tiny
    hosts = record["target"]["hosts"]
    assert len(hosts) == 6 and hosts != list(range(6))  # spread, so identity layers sit between hosted ones
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        hidden = tiny_target(ids, output_hidden_states=True).hidden_states
    for i, layer in enumerate(tiny_target.model.layers):
        if i in hosts:
            continue
        assert layer.self_attn.o_proj.weight.abs().sum() == 0 and layer.mlp.down_proj.weight.abs().sum() == 0
        assert layer.self_attn.q_proj.weight.abs().min() > 0 and layer.mlp.gate_proj.weight.abs().min() > 0
        if i + 1 < len(hidden) - 1:  # HF's last entry is after the final norm
            assert torch.equal(hidden[i + 1], hidden[i])


def test_tiny_target_matches_demo(tiny, tiny_target, demo_target, prompts) -> None:
    """Every hosted layer's residual is the demo's lifted (copy and constant included), log-probs agree to fp32
    rounding, and greedy continuations are identical."""
    _, record = tiny
    residual = ResidualMap(**record["residual"])
    for prompt in prompts[:4]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            small = demo_target(ids, output_hidden_states=True)
            large = tiny_target(ids, output_hidden_states=True)
        for layer, host in enumerate(record["target"]["hosts"][:-1]):
            torch.testing.assert_close(large.hidden_states[host + 1], residual.lift(small.hidden_states[layer + 1]),
                                       rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(large.logits.log_softmax(-1)[..., : small.logits.shape[-1]],
                                   small.logits.log_softmax(-1), rtol=0, atol=1e-4)
    same = [hf_greedy(tiny_target, p, 24) == hf_greedy(demo_target, p, 24) for p in prompts[:4]]
    assert all(same), same


def _pad_figures(logits: torch.Tensor, real: int) -> dict[str, float]:
    """logits [..., V]: the worst margins of the padded rows over the k-th largest real logit, and their mass."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    pad_max = logits[:, real:].max(-1).values
    top = logits[:, :real].topk(128, dim=-1).values
    mass = logits.log_softmax(-1)[:, real:].exp().sum(-1)
    return {"margin_top1": (pad_max - top[:, 0]).max().item(), "margin_top128": (pad_max - top[:, 127]).max().item(),
            "mass": mass.max().item()}


def test_padded_vocabulary_never_wins(tiny, tiny_target, prompts, capsys) -> None:
    """On every bench prompt, the target's and the drafter's padded logits sit more than GAP below the 128th real
    one (the bound embed_vocab.py proves for any input), and their softmax mass vanishes."""
    path, record = tiny
    real = SMALL["vocab_size"]
    drafter = load_drafter(path / "drafter")
    tapped = TappedTarget(tiny_target, drafter.config.target_layer_ids)
    target_logits, drafter_logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            target_logits.append(tiny_target(ids).logits[0])
            anchors = torch.arange(len(prompt) - 1, 0, -12).flip(0)[None]  # the first draft and earlier blocks
            drafter_logits.append(block_logits(drafter, tapped.head, ids, tapped.features(ids), anchors).flatten(0, 2))
    figures = {"target": _pad_figures(torch.cat(target_logits), real),
               "drafter": _pad_figures(torch.cat(drafter_logits), real)}
    with capsys.disabled():
        print("\npadded vocabulary on the bench prompts:", figures)
    for side in figures.values():
        assert side["margin_top128"] < -GAP and side["margin_top1"] < -GAP and side["mass"] < 1e-30
    for side in ("target", "drafter"):
        bound = record[side]["logit_bound"]
        assert bound["scale"] == pytest.approx(bound["rms"] * (bound["logit"] + GAP))


def test_tiny_drafter_taps_and_blocks_match_demo(tiny, tiny_target, demo_target, prompts) -> None:
    """The large drafter's taps hold the demo taps' layer outputs, its extra taps and layers add nothing, and its
    block log-probs are the demo drafter's."""
    path, record = tiny
    small, large = load_drafter(DEMO / "drafter"), load_drafter(path / "drafter")
    s_cfg, l_cfg = small.config, large.config
    assert (l_cfg.mask_token_id, l_cfg.block_size) == (s_cfg.mask_token_id, s_cfg.block_size)
    hosts = record["target"]["hosts"]
    assert [l_cfg.target_layer_ids[b] for b in record["drafter"]["tap_blocks"]] == [hosts[t] for t in
                                                                                   s_cfg.target_layer_ids]
    hidden = l_cfg.hidden_size
    fc = large.fc.weight.view(hidden, l_cfg.num_taps, hidden)
    extra = [b for b in range(l_cfg.num_taps) if b not in record["drafter"]["tap_blocks"]]
    assert extra and fc[:, extra].abs().sum() == 0
    for i, layer in enumerate(large.layers):
        if i not in record["drafter"]["hosts"]:
            assert layer.self_attn.o_proj.weight.abs().sum() == 0 and layer.mlp.down_proj.weight.abs().sum() == 0
    small_tapped = TappedTarget(demo_target, s_cfg.target_layer_ids)
    large_tapped = TappedTarget(tiny_target, l_cfg.target_layer_ids)
    for prompt in prompts[:3]:
        ids = torch.tensor([prompt])
        anchors = torch.arange(1, len(prompt) - 1, 3)[None]
        with torch.no_grad():
            want = block_logits(small, small_tapped.head, ids, small_tapped.features(ids), anchors).log_softmax(-1)
            got = block_logits(large, large_tapped.head, ids, large_tapped.features(ids), anchors).log_softmax(-1)
        torch.testing.assert_close(got[..., : want.shape[-1]], want, rtol=0, atol=1e-4)


def _generate(capsys, target: Path, drafter: Path, prompt: list[int], tokens: int) -> dict:
    rc = cli_main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt-ids",
                   ",".join(map(str, prompt)), "--mode", "ddtree", "--budget", "32", "--max-new-tokens", str(tokens),
                   "--json"])
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _same_generation(capsys, pair: Path, prompts: list[list[int]], tokens: int) -> None:
    for prompt in prompts:
        demo = _generate(capsys, DEMO / "target", DEMO / "drafter", prompt, tokens)
        embedded = _generate(capsys, pair / "target", pair / "drafter", prompt, tokens)
        shape = json.loads((pair / "embedding.json").read_text())["shape"]
        with capsys.disabled():
            print(f"\n{shape}: tau demo {demo['tau']:.3f}, embedded {embedded['tau']:.3f}")
        assert embedded["token_ids"] == demo["token_ids"]
        assert embedded["tau"] == pytest.approx(demo["tau"], rel=0.03)


def test_tiny_pair_generates_as_demo(tiny, capsys, prompts) -> None:
    """`ddtree generate --mode ddtree --budget 32`: same tokens and τ as the demo pair."""
    _same_generation(capsys, tiny[0], prompts[1:3], 48)


def test_cli_refuses_a_shape_too_small(tmp_path, capsys) -> None:
    assert cli_main(["embed-pair", "--shape", "tiny", "--out", str(tmp_path / "pair")]) == 2
    assert "cannot hold" in capsys.readouterr().err


# ---- the tiny hybrid pair -------------------------------------------------------------------------------------


def test_tiny_hybrid_pair(scratch, demo_target, prompts, capsys) -> None:
    """Qwen3.5 architecture: the demo layers in full-attention slots (gate rows zero, o_proj doubled, (1 + weight)
    norms, partial rotary), every Gated DeltaNet layer an identity that still runs its recurrence; greedy log-probs
    and a ddtree generation as the demo's."""
    path, record = _build(scratch, "tiny-hybrid-embed")
    model = AutoModelForCausalLM.from_pretrained(path / "target", dtype=torch.float32).eval()
    cfg = model.config
    hosts = record["target"]["hosts"]
    assert all(cfg.layer_types[h] == "full_attention" for h in hosts)
    assert any(kind == "full_attention" and i not in hosts for i, kind in enumerate(cfg.layer_types))
    for h in hosts:
        q = model.model.layers[h].self_attn.q_proj.weight.view(cfg.num_attention_heads, 2, cfg.head_dim, -1)
        assert q[:, 1].abs().sum() == 0  # the gate rows: sigmoid(0) everywhere
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=True)
        small = demo_target(ids)
    linear = [i for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]
    assert linear
    for i in linear:
        assert model.model.layers[i].linear_attn.out_proj.weight.abs().sum() == 0
        assert torch.equal(out.hidden_states[i + 1], out.hidden_states[i])
        assert out.past_key_values.layers[i].recurrent_states[0].abs().sum() > 0  # the recurrence ran
    torch.testing.assert_close(out.logits.log_softmax(-1)[..., : small.logits.shape[-1]], small.logits.log_softmax(-1),
                               rtol=0, atol=1e-4)
    _same_generation(capsys, path, prompts[3:4], 32)


# ---- a real shape ---------------------------------------------------------------------------------------------


def test_qwen3_0_6b_pair_matches_demo(scratch, demo_target, prompts, capsys) -> None:
    """At qwen3-0.6b shapes (tied embeddings, groups of two q heads, so each demo kv head is carried twice):
    greedy continuations through HF, and a ddtree generation, as the demo pair's."""
    path, record = _build(scratch, "qwen3-0.6b")
    assert all(len(kv) == 2 for kv in record["target"]["kv_heads"])
    model = AutoModelForCausalLM.from_pretrained(path / "target", dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.shape == (151936, 1024)
    same = [hf_greedy(model, p, 24) == hf_greedy(demo_target, p, 24) for p in prompts[:4]]
    assert all(same), same
    with torch.no_grad():  # tied: the padded rows are embedding rows too, and real logits share a common shift
        figures = _pad_figures(torch.cat([model(torch.tensor([p])).logits[0] for p in prompts[:4]]), SMALL["vocab_size"])
    with capsys.disabled():
        print("\nqwen3-0.6b padded vocabulary:", figures)
    assert figures["margin_top128"] < -GAP and figures["mass"] < 1e-30
    del model
    _same_generation(capsys, path, prompts[:1], 48)


def test_checkpoint_keys_are_the_architectures(tiny) -> None:
    """The target loads as its HF class without missing or unexpected keys; the drafter has the published keys."""
    path, _ = tiny
    _, info = AutoModelForCausalLM.from_pretrained(path / "target", output_loading_info=True)
    assert not any(info.values()), info
    keys = set(load_state_dict_files(path / "drafter"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert TargetHead.load(path / "target", "cpu", torch.float32).vocab_size == SHAPES["tiny-embed"]["vocab_size"]
