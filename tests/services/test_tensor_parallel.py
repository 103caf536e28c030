"""The target sharded over 2 CPU ranks (gloo): greedy output identical to the unsharded verifier in every mode and
under grammars, and a dead rank surfaces as an error instead of a hang."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from protos.types import SamplingParams
from ddtree.local import load_local
from runtime.grammar import json_schema_grammar, tool_calls_grammar
from runtime.models import read_eos_ids, resolve_pair
from gateway.rounds import Round, Speculation, run_rounds
from tests.conftest import hf_greedy
from tests.unit.test_exactness import prompts
from verify_server.session import MemoryShortError
from verify_server.tensor_parallel import TensorParallelGroup, shard_model

SPECS = [Speculation("ar"), Speculation("chain"), Speculation("ddtree", 4), Speculation("ddtree", 64)]


def test_sharded_greedy_equals_unsharded(qwen3_target: Path, drafter_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32, tp=2)
    try:
        assert verifier.engine.engine.num_kv_heads == 1  # rank 0 really holds half of the 2 KV heads
        for prompt in prompts(6):
            reference = hf_greedy(hf, prompt, 16)
            for spec in SPECS:
                async def collect():
                    return [r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, 16, [])]

                assert [t for r in asyncio.run(collect()) for t in r.tokens] == reference, spec
        # logits processors and logprobs: every rank runs them on the same logits, and the sharded engine's
        # output is the unsharded one's (the params cross the ranks' channel in the wire's encoding)
        params = SamplingParams(temperature=0.8, seed=7, logprobs=2, logit_bias=((5, 1.0),), min_tokens=6,
                                repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_p=0.05)
        unsharded, local_drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
        outputs = []
        for v, d in ((verifier, drafter), (unsharded, local_drafter)):
            async def sampled() -> list[Round]:
                return [r async for r in run_rounds(v, d, prompts(2)[1], params, Speculation("ddtree", 16), 16, [3])]

            outputs.append(asyncio.run(sampled()))
        assert [t for r in outputs[0] for t in r.tokens] == [t for r in outputs[1] for t in r.tokens]
        assert torch.allclose(torch.tensor([v for r in outputs[0] for v in r.logprobs.logprobs]),
                              torch.tensor([v for r in outputs[1] for v in r.logprobs.logprobs]), atol=1e-4)
    finally:
        verifier.close()


def test_generate_cli_tp2_matches_tp1_on_llama(llama_target: Path, drafter_dir: Path) -> None:
    outputs = []
    for tp in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-m", "ddtree.cli", "generate", "--target", str(llama_target), "--drafter", str(drafter_dir),
             "--prompt-ids", "3,1,4,1,5,9,2,6", "--mode", "ddtree", "--budget", "16", "--max-new-tokens", "24",
             "--tp", tp, "--json"],
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr
        outputs.append(json.loads(out.stdout.strip().splitlines()[-1])["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24


def test_shard_rejects_indivisible_heads(qwen3_target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_target)
    with pytest.raises(ValueError, match="must divide"):
        shard_model(model, 0, 3)


def test_dead_rank_is_an_error_not_a_hang(qwen3_target: Path) -> None:
    group = TensorParallelGroup(str(qwen3_target), 2, "cpu", torch.float32, timeout_s=20)
    try:
        group.engine.start_session("s", 64, SamplingParams(), [])
        group.engine.prefill("s", [1, 2, 3])
        group.followers[0].kill()
        group.followers[0].join()
        assert not group.alive()
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo reports a lost peer as RuntimeError or DistBackendError
            for _ in range(3):
                group.engine.decode("s")
        assert time.monotonic() - start < 60
    finally:
        group.close()


def test_sharded_memory_limits_and_untaps_hold_on_every_rank(qwen3_target: Path) -> None:
    """--kv-cache-gib on a sharded verifier limits every rank's caches alike: a prompt whose session cannot grow,
    and a session that does not fit, are refused (MemoryShortError) with nothing changed on any rank, and the
    group goes on in lockstep; a session untapped (its drafter gone) goes on with AR steps on every rank. The
    tokens are the target's own greedy ones throughout."""
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    prompt = prompts(1)[0]
    truth = hf_greedy(hf, prompt, 6)
    group = TensorParallelGroup(str(qwen3_target), 2, "cpu", torch.float32, timeout_s=20)
    engine = group.engine
    try:
        engine.start_session("s", 600, SamplingParams(), [1, 3])
        engine.limit_kv_caches(engine.caches.held_bytes * 3 // 2)  # the first session's cache, not another
        with pytest.raises(MemoryShortError):
            engine.prefill("s", [1] * 300)  # past its first cache's room: a larger one does not fit
        with pytest.raises(MemoryShortError):
            engine.start_session("t", 64, SamplingParams(), [])
        assert list(engine.sessions) == ["s"]
        first = engine.prefill("s", prompt)
        assert first.tokens == truth[:1] and first.features is not None
        engine.untap("s")
        steps = [engine.decode("s") for _ in range(5)]
        assert [t for step in steps for t in step.tokens] == truth[1:6]
        assert all(step.features is None for step in steps)
        engine.end_session("s")
        engine.start_session("t", 64, SamplingParams(), [])
        assert engine.prefill("t", prompt).tokens == truth[:1]
        assert group.alive()
    finally:
        group.close()


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended while we listed
            continue
    return kids


def test_verify_service_tp2_serves_exactly_and_stops_when_a_rank_dies(qwen3_target: Path, drafter_dir: Path, tmp_path: Path) -> None:
    import os
    import signal

    from runtime.drafter_client import GrpcDrafter
    from gateway.grpc_verifier import GrpcVerifier
    from tests.services import DRAFTER_SERVICE, VERIFIER_SERVICE, free_ports, launch, wait_serving

    ports = free_ports(4)
    drafter = launch(
        DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter_dir), "--target", str(qwen3_target)], (ports[2], ports[3]), tmp_path
    )
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target), "--tp", "2",
                                         "--drafter", f"127.0.0.1:{ports[2]}"], (ports[0], ports[1]), tmp_path)
    try:
        wait_serving(verifier, drafter)
        prompt = [2, 7, 1, 8, 2, 8]
        reference = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 20)

        async def remote(spec: Speculation) -> list[int]:
            async with GrpcVerifier(verifier.address) as v, GrpcDrafter(drafter.address) as d:
                await d.info()
                return [t async for r in run_rounds(v, d, prompt, SamplingParams(), spec, 20, []) for t in r.tokens]

        for spec in (Speculation("ar"), Speculation("ddtree", 16)):
            assert asyncio.run(remote(spec)) == reference, spec
        assert verifier.metric("ddtree_verify_active_sessions") == 0
        assert drafter.metric("ddtree_draft_requests_total", rpc="Draft", code="OK") > 0  # the verifier's drafts

        rank1 = _children(verifier.process.pid)
        assert rank1, "the verifier started no other rank"
        for pid in rank1:
            os.kill(pid, signal.SIGKILL)
        verifier.process.wait(timeout=60)  # the service notices, goes NOT_SERVING and stops instead of hanging
        assert "tensor-parallel rank died" in verifier.log()
    finally:
        drafter.stop()
        if verifier.process.poll() is None:
            verifier.process.kill()


def test_hybrid_target_sharded_equals_hf(tmp_path: Path) -> None:
    """Qwen3.5 hybrid (Gated DeltaNet + attention) over 2 ranks: linear-attention heads sharded too."""
    from tests.conftest import make_drafter
    from tests.conftest import make_hybrid_target

    target = make_hybrid_target("qwen3_5", tmp_path / "hybrid")
    drafter_dir = make_drafter(tmp_path / "drafter", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    verifier, drafter = load_local(str(target), str(drafter_dir), "cpu", torch.float32, tp=2)
    try:
        layout = verifier.engine.engine.linear
        assert (layout.heads, verifier.engine.engine.num_kv_heads) == (2, 1)  # rank 0 holds half of 4 and of 2
        for prompt in prompts(4):
            reference = hf_greedy(hf, prompt, 16)
            for spec in (Speculation("ar"), Speculation("ddtree", 64)):
                async def collect():
                    return [r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, 16, [])]

                assert [t for r in asyncio.run(collect()) for t in r.tokens] == reference, spec
    finally:
        verifier.close()


def test_sharded_grammars_equal_unsharded() -> None:
    """A json_schema and a tool_calls grammar over 2 ranks: every rank compiles the session's grammar from the
    target's tokenizer and masks its own full-vocabulary logits alike, so the output is the unsharded verifier's,
    token for token."""
    target, drafter_path = resolve_pair(None, None)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "The weather in Oslo, as JSON?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    grammars = (json_schema_grammar(schema), tool_calls_grammar([("weather", city)], parallel=False))
    eos = read_eos_ids(target)
    outputs = []
    for tp in (1, 2):
        verifier, drafter = load_local(str(target), str(drafter_path), "cpu", torch.float32, tp=tp)
        try:
            async def collect(grammar: str) -> list[int]:
                return [t async for r in run_rounds(verifier, drafter, prompt, SamplingParams(grammar=grammar),
                                                    Speculation("ddtree", 16), 64, eos) for t in r.tokens]

            outputs.append([asyncio.run(collect(g)) for g in grammars])
        finally:
            verifier.close()
    assert outputs[0] == outputs[1]
    json_text, call_text = (tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs[0])
    assert json.loads(json_text)["city"] in ("Paris", "Oslo")  # the grammars held: whole JSON, a whole call
    assert call_text.startswith('<tool_call>\n{"name": "weather", "arguments": ') and \
        call_text.endswith("}\n</tool_call>")
