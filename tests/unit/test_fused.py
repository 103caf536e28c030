"""The fused verifier path: its slot pool, its buckets, and its features against the generic HF path."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3Config

from protos.types import SamplingParams
from tests.conftest import hf_greedy
from tests.unit.test_verify import make_engine, oracle_tree
from verify_server.config import VerifyServerConfig
from verify_server.fused import fused_unsupported
from verify_server.kv_cache import KVCache
from verify_server.cache_slots import size_class
from verify_server.step_inputs import MAX_GRAPH_NODES, bucket
from verify_server.session import CapacityError
from verify_server.verify import VerifyEngine


def test_buckets_cover_every_query_count() -> None:
    assert bucket(1) == 1
    assert [bucket(q) for q in (2, 16, 17, 33, 128, 129, 257, MAX_GRAPH_NODES)] == [16, 16, 32, 48, 128, 256, 512, 512]
    assert bucket(MAX_GRAPH_NODES + 1) is None  # runs eagerly
    assert all(bucket(q) >= q for q in range(1, MAX_GRAPH_NODES + 1))
    assert [size_class(c) for c in (1, 256, 257, 3000)] == [256, 256, 512, 4096]


def test_fused_rows_are_checked_and_off_where_they_cannot_run(qwen3_target: Path) -> None:
    """A negative row limit is refused; on a CPU the fused projections are refused when asked for explicitly and
    configured off by default (they need Triton on a GPU)."""
    engine = VerifyEngine.from_pretrained(qwen3_target)
    decoder = engine.fused.decoder
    assert decoder.fused_rows == 0 and decoder.attention == "matmul"  # the CPU's defaults
    with pytest.raises(ValueError, match="fused_rows must be >= 0"):
        decoder.set_compiled(False, "sdpa", -1)
    with pytest.raises(ValueError, match="need Triton and a CUDA device"):
        decoder.set_compiled(False, "sdpa", 16)
    engine.fused.configure(graphs=False, fused_rows=64)  # asked for where it cannot run: off
    assert decoder.fused_rows == 0


def test_slot_pool_bounds_sessions_and_reuses_caches(qwen3_target: Path) -> None:
    engine = VerifyEngine.from_pretrained(qwen3_target, max_sessions=2)
    engine.start_session("a", 100, SamplingParams(), [])
    engine.start_session("b", 1000, SamplingParams(), [])
    with pytest.raises(CapacityError, match="all 2 session slots"):
        engine.start_session("c", 100, SamplingParams(), [])
    cache = engine.sessions["a"].cache
    engine.prefill("a", [1, 2, 3])
    engine.end_session("a")
    engine.start_session("c", 200, SamplingParams(), [])  # same size class: the freed cache, emptied
    assert engine.sessions["c"].cache is cache and cache.length == 0
    assert cache.capacity == size_class(200) + MAX_GRAPH_NODES  # room for the largest padded step


def test_caches_first_needed_inside_a_step_are_ordinary_tensors() -> None:
    # A scratch cache allocated mid-step (under inference mode) and a session's (outside it) must be one kind of
    # tensor: Dynamo guards on dispatch keys and compiled the prompt layer again for the other kind.
    with torch.inference_mode():
        inside = KVCache([0, 1], 2, 8, 16, torch.device("cpu"), torch.float32, zero=True)
    outside = KVCache([0, 1], 2, 8, 16, torch.device("cpu"), torch.float32, zero=True)
    for cache in (inside, outside):
        assert not cache.k.is_inference() and not cache.v.is_inference()
    assert torch._C._dispatch_keys(inside.k) == torch._C._dispatch_keys(outside.k)


@pytest.mark.parametrize(
    "kind,attention",
    [("qwen3", "sdpa"), ("qwen3", "grouped"), ("qwen3", "matmul"), ("llama", "sdpa"), ("llama", "grouped"),
     ("llama", "matmul"), ("qwen3", "matmul-compiled")],
)
def test_static_path_features_match_hf_path(kind: str, attention: str, qwen3_target: Path, llama_target: Path) -> None:
    """The padded, whole-slot step replays the HF path's accepted tokens AND its features (what the drafter sees);
    matmul-compiled: the layers, the buffer unpacking + ancestor matrix and the walk through torch.compile."""
    from transformers import AutoModelForCausalLM

    target = qwen3_target if kind == "qwen3" else llama_target
    prompt = [4, 8, 15, 16, 23, 42]
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(target).eval(), prompt, 70)
    runs = {}
    for path in ("hf", "fused-static"):
        engine = make_engine(target, path)
        if engine.fused is not None:
            engine.fused.configure(graphs=False, compile=attention.endswith("-compiled"), attention=attention.split("-")[0])
            engine.fused.static = True
        engine.start_session("s", 200, SamplingParams(), taps=[0, 2, 3])
        rng = random.Random(3)
        steps = [engine.prefill("s", prompt)]
        got = list(steps[0].tokens)
        while len(got) < 50:
            depth = rng.randint(2, 7)
            steps.append(engine.verify("s", oracle_tree(rng, got[-1], truth[len(got):], depth, depth)))
            got += steps[-1].tokens
        runs[path] = steps
    assert [s.tokens for s in runs["hf"]] == [s.tokens for s in runs["fused-static"]]
    for a, b in zip(runs["hf"], runs["fused-static"]):
        torch.testing.assert_close(a.features, b.features, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [100, MAX_GRAPH_NODES + 88])
def test_prompts_within_and_beyond_the_captured_prefill_match_the_hf_path(length: int, qwen3_target: Path) -> None:
    """A prompt up to the largest bucket is prefilled by the static (captured) step, padded into its bucket; a
    longer one by the uncaptured forward. Either way: the HF path's first token, its features for every prompt
    position, and the target's own greedy continuation."""
    from transformers import AutoModelForCausalLM

    prompt = [(7 * i + 3) % 40 for i in range(length)]
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 12)
    runs = {}
    for path in ("hf", "fused-static"):
        engine = make_engine(qwen3_target, path)
        engine.start_session("s", length + 100, SamplingParams(), taps=[1, 3])
        first = engine.prefill("s", prompt)
        assert first.features.shape[0] == length
        got = list(first.tokens)
        while len(got) < 12:
            got += engine.decode("s").tokens
        runs[path] = (first, got)
    assert runs["hf"][1] == runs["fused-static"][1] == truth
    torch.testing.assert_close(runs["hf"][0].features, runs["fused-static"][0].features, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt", [[5], [5, 9]])
def test_one_and_two_token_prompts_on_the_static_path(prompt: list[int], qwen3_target: Path) -> None:
    """The shortest prompts: a captured first chunk pads them into a bucket with unwritten rows after them."""
    from transformers import AutoModelForCausalLM

    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 10)
    engine = make_engine(qwen3_target, "fused-static")
    engine.start_session("s", 64, SamplingParams(), taps=[])
    got = list(engine.prefill("s", prompt).tokens)
    while len(got) < 10:
        got += engine.decode("s").tokens
    assert got == truth


def test_unsupported_architectures_take_the_hf_path(tmp_path: Path) -> None:
    assert fused_unsupported(Qwen3Config()) is None
    sliding = Qwen3Config(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    assert "sliding" in fused_unsupported(sliding)
    from transformers import Qwen3_5TextConfig

    assert "qwen3_5" in fused_unsupported(Qwen3_5TextConfig())
    assert fused_unsupported(AutoConfig.for_model("gpt2")) is not None
    dynamic = Qwen3Config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0})
    assert "dynamic" in fused_unsupported(dynamic)  # its frequencies depend on the step: no table, no graph


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_rotary_module_bit_for_bit(kind: str, dtype: torch.dtype) -> None:
    """The table's rows, gathered for any step's positions, are exactly what the model's rotary module computes
    for that step, before and after the table grows past a chunk of its filling."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from verify_server.rope import CHUNK, RopeTable, gather_rope

    config = Qwen3Config(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=2048,
                         rope_parameters=ROPES[kind])
    rotary = Qwen3RotaryEmbedding(config)
    table = RopeTable(rotary, 1000, torch.device("cpu"), dtype)
    probe, gen = torch.empty(0, dtype=dtype), torch.Generator().manual_seed(0)
    for rows in (1000, CHUNK + 3000):
        table.cover(rows)
        assert table.table.shape[0] >= rows
        for _ in range(20):
            positions = torch.randint(0, rows, (int(torch.randint(1, 80, (1,), generator=gen)),), generator=gen)
            want_cos, want_sin = rotary(probe, positions[None])  # [1, q, head_dim]
            cos, sin = gather_rope(table.table, positions)  # [q, 1, head_dim]
            assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])


def test_eager_fused_rows_and_compile_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(argv: list[str]) -> VerifyServerConfig:
        parser = argparse.ArgumentParser()
        VerifyServerConfig.add_arguments(parser)
        return VerifyServerConfig(**VerifyServerConfig.values_from_args(parser.parse_args(["--target", "t", *argv])))

    assert parse([]).eager is False
    assert parse(["--eager"]).eager is True
    monkeypatch.setenv("DDTREE_VERIFY_EAGER", "true")
    assert parse([]).eager is True
    assert parse(["--no-eager"]).eager is False
    monkeypatch.setenv("DDTREE_VERIFY_MAX_SESSIONS", "3")
    assert parse([]).max_sessions == 3
    assert parse([]).fused_rows == -1 and parse(["--fused-rows", "0"]).fused_rows == 0
    monkeypatch.setenv("DDTREE_VERIFY_FUSED_ROWS", "32")
    assert parse([]).fused_rows == 32
    with pytest.raises(ValueError, match="fused_rows"):
        parse(["--fused-rows", "-2"])
    # compile: on by default with a CUDA device only; a flag or the env var decides otherwise
    assert parse(["--device", "cpu"]).compiles is False and parse(["--device", "cuda"]).compiles is True
    assert parse(["--device", "cuda", "--no-compile"]).compiles is False
    assert parse(["--device", "cpu", "--compile"]).compiles is True
    monkeypatch.setenv("DDTREE_VERIFY_COMPILE", "off")
    assert parse(["--device", "cuda"]).compiles is False


def test_sampled_sessions_on_the_static_path_follow_the_hf_path(qwen3_target: Path) -> None:
    """Sampling is not captured (the walk runs after the graphed forward): with the same seed and the same logits
    up to float noise, both paths draw the same tokens, deep trees included."""
    params = SamplingParams(temperature=1.0, seed=123)
    runs = {}
    for path in ("hf", "fused-static"):
        engine = make_engine(qwen3_target, path)
        engine.start_session("s", 300, params, taps=[1])
        rng = random.Random(5)
        got = list(engine.prefill("s", [7, 3, 9, 1]).tokens)
        for _ in range(12):
            depth = rng.randint(1, 6)
            truth = [rng.randrange(40) for _ in range(depth)]
            got += engine.verify("s", oracle_tree(rng, got[-1], truth, depth, depth)).tokens
            got += engine.decode("s").tokens
        assert engine.sessions["s"].cache.length == 4 + len(got) - 1
        runs[path] = got
    assert runs["hf"] == runs["fused-static"]
