"""Hybrid targets (Gated DeltaNet linear attention + full attention: Qwen3.5, Qwen3-Next): tree verification equals
the target's own greedy decoding, deep acceptance keeps the recurrent state exact, and drafter sliding-window layers
see exactly their window."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from bench import hybrid_cost
from protos.types import SamplingParams
from draft_server.dflash import DFlashDrafter, apply_rope, init_drafter_weights
from draft_server.dflash_config import DFlashConfig
from draft_server.engine import DraftEngine
from draft_server.target_head import TargetHead
from training.drafter_loss import block_attention_mask
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds
from tests.conftest import HIDDEN, VOCAB, hf_greedy, make_drafter, make_hybrid_target
from tests.unit.test_verify import oracle_tree
from verify_server.linear_attention import tree_gated_delta_rule
from verify_server.state_cache import LinearLayout, StateCache, TreeScratch
from verify_server.tree_attention import ancestor_matrix
from verify_server.verify import VerifyEngine

MAX_NEW = 20


def random_tree(rng: random.Random, n: int) -> torch.Tensor:
    """parents [n] of a random tree in topological order (-1 for the root)."""
    return torch.tensor([-1] + [rng.randrange(i) for i in range(1, n)])


def test_tree_delta_rule_and_commit_follow_each_path() -> None:
    """Every node's output equals HF's token-by-token recurrence run along its own root path from the committed state,
    and committing a path leaves exactly that recurrence's final state and the path's last conv inputs."""
    torch.manual_seed(0)
    q, heads, dk, dv, kernel, conv_dim = 12, 2, 8, 6, 4, 5
    parents = random_tree(random.Random(3), q)
    anc = ancestor_matrix(parents)
    query, key = torch.randn(q, heads, dk), torch.randn(q, heads, dk)
    value, beta = torch.randn(q, heads, dv), torch.rand(q, heads)
    g = -torch.rand(q, heads) * 3
    layout = LinearLayout(layer_ids=(0,), conv_dim=conv_dim, kernel=kernel, heads=heads, key_dim=dk, value_dim=dv)
    cpu = torch.device("cpu")
    states, scratch = StateCache(layout, cpu, torch.float32), TreeScratch(layout, q, cpu, torch.float32)
    states.recurrent[0] = torch.randn(heads, dk, dv)
    states.conv[0] = torch.randn(kernel - 1, conv_dim)
    before_conv = states.conv[0].clone()
    out, k, delta, cum = tree_gated_delta_rule(query, key, value, g, beta, anc, states.recurrent[0])
    scratch.x[0], scratch.k[0], scratch.delta[0], scratch.decay[0] = torch.randn(q, conv_dim), k, delta, cum

    def recurrence(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        o, final = torch_recurrent_gated_delta_rule(
            query[path][None], key[path][None], value[path][None], g=g[path][None], beta=beta[path][None],
            initial_state=states.recurrent[0][None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        return o[0, -1], final[0]

    paths = [anc[i].nonzero().flatten().tolist() for i in range(q)]  # root..i, ancestors have smaller indices
    for i, path in enumerate(paths):
        torch.testing.assert_close(out[i], recurrence(path)[0], atol=1e-5, rtol=1e-5)
    deepest = max(range(q), key=lambda i: len(paths[i]))
    want_state = recurrence(paths[deepest])[1]
    states.commit(scratch, torch.tensor(paths[deepest]))
    torch.testing.assert_close(states.recurrent[0], want_state, atol=1e-5, rtol=1e-5)
    want_conv = torch.cat((before_conv, scratch.x[0, paths[deepest]]))[-(kernel - 1) :]
    torch.testing.assert_close(states.conv[0], want_conv)


def generate(verifier, drafter, prompt: list[int], spec: Speculation) -> list[int]:
    async def collect() -> list[int]:
        rounds = run_rounds(verifier, drafter, prompt, SamplingParams(), spec, MAX_NEW, [])
        return [t async for r in rounds for t in r.tokens]

    return asyncio.run(collect())


def test_greedy_equals_hf_generate(hybrid_targets: dict[str, Path], tmp_path: Path) -> None:
    target = hybrid_targets["qwen3_5"]
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    verifier, drafter = load_local(str(target), str(make_drafter(tmp_path / "drafter")), "cpu", torch.float32)
    engine = verifier.engine
    assert engine.kv_layers == [1]  # K/V only for the attention layer; the linear layers carry recurrent state
    rng = random.Random(5)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89] + [rng.randint(1, 120) for _ in range(10)]
    specs = [Speculation("ar"), Speculation("chain")] + [Speculation("ddtree", b) for b in (4, 64, 256)]
    for i, length in enumerate(lengths):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(length)]
        reference = hf_greedy(hf, prompt, MAX_NEW)
        for spec in specs:
            assert generate(verifier, drafter, prompt, spec) == reference, (i, spec)
    assert not engine.sessions


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_deep_acceptance_carries_the_accepted_state(kind: str, hybrid_targets: dict[str, Path]) -> None:
    """Trees hold the true continuation among decoys at several depths, in random topological order; a round only
    stays exact if the previous commit left the deepest accepted node's recurrent and conv state."""
    rng = random.Random(7)
    engine = VerifyEngine.from_pretrained(hybrid_targets[kind], max_tree_size=64)
    hf = AutoModelForCausalLM.from_pretrained(hybrid_targets[kind]).eval()
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]):
        truth = hf_greedy(hf, prompt, 70)
        engine.start_session("s", 200, SamplingParams(), taps=[1, 3])
        got = list(engine.prefill("s", prompt).tokens)
        accepted = []
        while len(got) < 60:
            max_depth = rng.randint(1, 7)
            true_depth = rng.choice([max_depth, max_depth, rng.randint(0, max_depth)])
            step = engine.verify("s", oracle_tree(rng, got[-1], truth[len(got) :], true_depth, max_depth))
            assert step.tokens == truth[len(got) : len(got) + true_depth + 1]
            assert step.features.shape == (true_depth + 1, 2 * HIDDEN)
            accepted.append(len(step.tokens))
            got += step.tokens
        got += engine.decode("s").tokens + engine.decode("s").tokens  # AR steps continue from the committed state
        assert got == truth[: len(got)]
        assert sum(accepted) / len(accepted) > 3
        engine.end_session("s")


def test_published_checkpoint_layout_decodes_exactly(tmp_path: Path) -> None:
    """Qwen3.5 / 3.6 checkpoints are Qwen3_5ForConditionalGeneration: the loader must serve their text model."""
    target = make_hybrid_target("qwen3_5_vl", tmp_path / "vl", seed=4)
    engine = VerifyEngine.from_pretrained(target, max_tree_size=8)
    assert engine.linear.layer_ids == (0, 2, 3) and engine.kv_layers == [1]
    prompt = [5, 1, 7, 7, 2, 9]
    engine.start_session("s", 64, SamplingParams(), taps=[])
    got = engine.prefill("s", prompt).tokens
    for _ in range(7):
        got += engine.decode("s").tokens
    assert got == hf_greedy(AutoModelForCausalLM.from_pretrained(target).eval(), prompt, len(got))


def sliding_drafter(window: int) -> tuple[DFlashDrafter, TargetHead]:
    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, block_size=6, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2],
        num_target_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=window,
    )
    model = DFlashDrafter(DFlashConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))))  # the saved format parses
    init_drafter_weights(model, std=0.25, seed=2)
    return model.eval(), TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))


def windowed_reference(model: DFlashDrafter, head: TargetHead, features: torch.Tensor, root: int) -> torch.Tensor:
    """The drafter written the slow, obvious way: context recomputed from all features, an explicit per-layer mask
    built element by element (sliding layers: context key c visible to the query at p iff p - c < window)."""
    cfg = model.config
    c, blk = features.shape[0], cfg.block_size
    x = head.embed[torch.tensor([root] + [cfg.mask_token_id] * (blk - 1))][None]
    ctx = model.hidden_norm(model.fc(features[None]))
    cos, sin = model.rotary.cos_sin(torch.arange(c + blk)[None], x.dtype)
    for layer, kind in zip(model.layers, cfg.layer_types):
        visible = torch.ones(blk, c + blk, dtype=torch.bool)
        for j in range(blk):
            for key in range(c):
                visible[j, key] = kind == "full_attention" or (c + j) - key < cfg.sliding_window
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        both = torch.cat((ctx, h), dim=1)
        qs = attn.q_norm(attn.q_proj(h).view(1, blk, -1, cfg.head_dim)).transpose(1, 2)
        ks = attn.k_norm(attn.k_proj(both).view(1, c + blk, -1, cfg.head_dim)).transpose(1, 2)
        vs = attn.v_proj(both).view(1, c + blk, -1, cfg.head_dim).transpose(1, 2)
        qs, ks = apply_rope(qs, cos[:, :, c:], sin[:, :, c:]), apply_rope(ks, cos, sin)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = (qs @ ks.transpose(-1, -2) / cfg.head_dim**0.5).masked_fill(~visible, float("-inf"))
        x = x + attn.o_proj((scores.softmax(-1) @ vs).transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return torch.log_softmax(model.norm(x)[0, 1:] @ head.lm_head.T, dim=-1)


def test_sliding_window_drafter_matches_explicit_mask() -> None:
    torch.manual_seed(0)
    model, head = sliding_drafter(window=4)
    engine = DraftEngine(model, head)
    features = torch.randn(14, 2 * HIDDEN)
    engine.start_session("s", capacity=32)
    seen = 0
    for chunk, root in ((2, 3), (5, 9), (7, 2)):  # contexts shorter and longer than the window
        seen += chunk
        engine.draft("s", features[seen - chunk : seen], root, seen, budget=4)
        got = engine._block_logprobs(engine.session("s"), root, seen)  # noqa: SLF001 - the raw distributions
        torch.testing.assert_close(got, windowed_reference(model, head, features[:seen], root), atol=1e-4, rtol=1e-4)
    wide, _ = sliding_drafter(window=1000)  # same weights, window never binding: the window really changed something
    wide_engine = DraftEngine(wide, head)
    wide_engine.start_session("s", capacity=32)
    wide_engine.draft("s", features, 2, seen, budget=4)
    unwindowed = wide_engine._block_logprobs(wide_engine.session("s"), 2, seen)  # noqa: SLF001
    assert not torch.allclose(unwindowed, got, atol=1e-3)


def test_training_mask_applies_the_window() -> None:
    anchors, ctx_len, blk, window = torch.tensor([[2, 7], [4, 9]]), 12, 3, 4
    mask = block_attention_mask(anchors, ctx_len, blk, sliding_window=window)[:, 0]
    for b in range(2):
        for i, anchor in enumerate(anchors[b].tolist()):
            for j in range(blk):
                row = mask[b, i * blk + j]
                want_ctx = [key < anchor and (anchor + j) - key < window for key in range(ctx_len)]
                assert row[:ctx_len].tolist() == want_ctx
                assert row[ctx_len:].tolist() == [k // blk == i for k in range(2 * blk)]


def test_hybrid_cost_bench_runs_tiny(capsys) -> None:
    hybrid_cost.main(["--tiny", "--device", "cpu", "--repeat", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["layers"] == 4 and set(result["verify_ms"]) == {"16", "64"} and result["ar_ms"] > 0
