"""Chunked prefill (PrefillRequest.more): a prompt sent in several calls leaves the session exactly as one call does
(features, first token, every round after), on the fused and the generic path, for hybrid targets (whose chunks
continue the committed recurrent state), through tensor parallelism and through the service. Features kept by the
verifier (PrefillRequest.keep_features) are taken later, in call order, equal to those the answers would carry."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams, StepResult
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from tests.conftest import HIDDEN, VOCAB, hf_greedy
from tests.services import VERIFIER_SERVICE, free_ports, launch, wait_serving
from tests.unit.test_verify import PATHS, make_engine, oracle_tree
from verify_server import prefill as prefill_module
from verify_server.prefill import PrefillCall
from verify_server.session import CapacityError, SessionError
from verify_server.tensor_parallel import TensorParallelGroup
from verify_server.verify import VerifyEngine

TAPS = [1, 3]
# How far two fp32 results of the same exact computation may be apart, as a fraction of the largest value (the tiny
# targets' hidden states reach ~60): fp32 rounding differs with the rows a matmul runs at once, a few ulps on dense
# targets. HF's chunked gated delta rule loses more in fp32 (its triangular solves): one call and chunks alike are
# ~2e-5 of the largest value off the same prefill with an fp64 rule and state, which agrees chunked and unchunked to
# ~1e-15. A wrong mask or state is off by whole units.
DENSE_TOL, HYBRID_TOL = 4e-6, 5e-5
# chunk sizes before the last chunk (the rest): a one-token first chunk, and chunks at start > 0 of 1 to 17 tokens
SPLITS = [(1, 5, 17), (12, 1, 2, 9)]


def make_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Equal up to `tol` of expected's largest value (DENSE_TOL, HYBRID_TOL)."""
    torch.testing.assert_close(actual, expected, atol=tol * expected.abs().max().item(), rtol=1e-5)


def prefill_chunks(engine, session: str, prompt: list[int], sizes: tuple[int, ...]) -> list[StepResult]:
    """The prompt in len(sizes) + 1 calls, the last one the rest; each call's result."""
    results, start = [], 0
    for size in sizes:
        results.append(engine.prefill(session, prompt[start : start + size], more=True))
        start += size
    return results + [engine.prefill(session, prompt[start:])]


def assert_chunks_equal_one_call(
    chunks: list[StepResult], whole: StepResult, sizes: tuple[int, ...], tol: float = DENSE_TOL
) -> None:
    """Every `more` call returns its chunk's features and no token; together they are the one call's features,
    and the last call picks the one call's first token."""
    assert [len(r.tokens) for r in chunks] == [0] * len(sizes) + [1]
    assert [tuple(r.features.shape) for r in chunks[:-1]] == [(size, len(TAPS) * HIDDEN) for size in sizes]
    assert_fp32_close(torch.cat([r.features for r in chunks]), whole.features, tol)
    assert chunks[-1].tokens == whole.tokens


def assert_same_rounds(
    engine, sessions: tuple[str, str], truth: list[int], seed: int, length: int = 50, tol: float = DENSE_TOL
) -> None:
    """The same deep trees verified in both sessions: the target's own continuation, equal features, both."""
    rng = random.Random(seed)
    got, accepted = [truth[0]], []
    while len(got) < length:
        max_depth = rng.randint(3, 7)
        tree = oracle_tree(rng, got[-1], truth[len(got) :], max_depth, max_depth)
        a, b = (engine.verify(s, tree) for s in sessions)
        assert a.tokens == b.tokens == truth[len(got) : len(got) + len(a.tokens)]
        assert_fp32_close(b.features, a.features, tol)
        accepted.append(len(a.tokens))
        got += a.tokens
    a, b = (engine.decode(s) for s in sessions)
    assert a.tokens == b.tokens == truth[len(got) : len(got) + 1]
    assert sum(accepted) / len(accepted) > 3  # deep acceptance: later rounds read much of the chunked prefix's K/V


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prefill_equals_one_call(path: str, qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, path)
    prompt = make_prompt(40)
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 60)
    for i, sizes in enumerate(SPLITS):
        for session in ("whole", "chunked"):
            engine.start_session(session, 200, SamplingParams(), TAPS)
        whole = engine.prefill("whole", prompt)
        chunks = prefill_chunks(engine, "chunked", prompt, sizes)
        assert_chunks_equal_one_call(chunks, whole, sizes)
        assert whole.tokens == truth[:1]
        assert engine.sessions["chunked"].cache.length == len(prompt)
        assert_same_rounds(engine, ("whole", "chunked"), truth, seed=i)
        for session in ("whole", "chunked"):
            engine.end_session(session)


@pytest.mark.parametrize("path", PATHS)
def test_kept_features_are_taken_in_call_order(path: str, qwen3_target: Path) -> None:
    """keep_features: the calls' answers carry no features; take_features hands them out oldest first, equal to
    the features the calls would have answered, and refuses once none is left. Ending a session drops its kept
    features."""
    engine = make_engine(qwen3_target, path)
    prompt, sizes = make_prompt(30, seed=6), (7, 9)
    for session in ("sent", "kept", "ended"):
        engine.start_session(session, 64, SamplingParams(), TAPS)
    sent = prefill_chunks(engine, "sent", prompt, sizes)
    kept = [engine.prefill("kept", prompt[:7], more=True, keep_features=True),
            engine.prefill("kept", prompt[7:16], more=True, keep_features=True),
            engine.prefill("kept", prompt[16:], keep_features=True)]
    assert [r.features for r in kept] == [None] * 3 and kept[-1].tokens == sent[-1].tokens
    taken = [engine.take_features("kept") for _ in kept]
    assert_chunks_equal_one_call([StepResult([], t.features) for t in taken[:-1]] + [StepResult(kept[-1].tokens,
                                 taken[-1].features)], StepResult(sent[-1].tokens, torch.cat([r.features for r in
                                 sent])), sizes)
    with pytest.raises(SessionError, match="no kept prompt features"):
        engine.take_features("kept")
    engine.prefill("ended", prompt, keep_features=True)
    assert len(engine.sessions["ended"].kept_features) == 1 and engine.end_session("ended")
    assert engine.decode("kept").tokens == engine.decode("sent").tokens


@pytest.mark.parametrize("path", PATHS)
def test_sampled_session_draws_the_same_tokens_chunked(path: str, qwen3_target: Path) -> None:
    """`more` chunks pick no token, so they draw nothing from the session's generator: the chunked session samples
    the same first token and the same tokens after it as the one-call session with the same seed."""
    engine = make_engine(qwen3_target, path)
    prompt = make_prompt(30, seed=1)
    params = SamplingParams(temperature=1.5, seed=1234)
    for session in ("whole", "chunked"):
        engine.start_session(session, 200, params, TAPS)
    whole = engine.prefill("whole", prompt)
    assert_chunks_equal_one_call(prefill_chunks(engine, "chunked", prompt, SPLITS[0]), whole, SPLITS[0])
    rng = random.Random(2)
    got = list(whole.tokens)
    for i in range(16):
        tree = oracle_tree(rng, got[-1], [VOCAB - 1] * 2, 0, 2) if i % 2 else None  # root and decoys
        a, b = (engine.verify(s, tree) if tree is not None else engine.decode(s) for s in ("whole", "chunked"))
        assert a.tokens == b.tokens
        got += a.tokens
    greedy = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, len(got))
    assert got != greedy  # really sampled: a draw from the wrong generator state would show


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_chunks_continue_the_committed_state(kind: str, hybrid_targets: dict[str, Path]) -> None:
    """Gated DeltaNet layers: each chunk starts from the recurrent state and the last conv inputs the chunks before
    left, including chunks shorter than the convolution window. The one call spans two of HF's kernel chunks."""
    engine = VerifyEngine.from_pretrained(hybrid_targets[kind], max_tree_size=64)
    prompt = make_prompt(80, seed=2)
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(hybrid_targets[kind]).eval(), prompt, 60)
    sizes = (1, 2, 5, 17)
    for session in ("whole", "chunked"):
        engine.start_session(session, 200, SamplingParams(), TAPS)
    whole = engine.prefill("whole", prompt)
    assert whole.tokens == truth[:1]
    assert_chunks_equal_one_call(prefill_chunks(engine, "chunked", prompt, sizes), whole, sizes, HYBRID_TOL)
    whole_states, chunked_states = engine.sessions["whole"].states, engine.sessions["chunked"].states
    assert_fp32_close(chunked_states.conv, whole_states.conv, HYBRID_TOL)
    assert_fp32_close(chunked_states.recurrent, whole_states.recurrent, HYBRID_TOL)
    assert_same_rounds(engine, ("whole", "chunked"), truth, seed=3, tol=HYBRID_TOL)


@pytest.mark.parametrize("path", PATHS)
def test_refused_chunks_leave_the_session_intact(path: str, qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, path)
    prompt = make_prompt(11, seed=3)
    engine.start_session("s", 12, SamplingParams(), TAPS)  # the prompt and its first token, nothing more
    first = engine.prefill("s", prompt[:4], more=True)
    with pytest.raises(SessionError, match="chunk is empty"):
        engine.prefill("s", [], more=True)
    with pytest.raises(CapacityError, match="needs 13 KV slots"):
        engine.prefill("s", prompt[4:] + [0], more=True)
    tree = oracle_tree(random.Random(0), 0, [1, 2], 2, 2)
    for step in (lambda: engine.decode("s"), lambda: engine.verify("s", tree)):
        with pytest.raises(SessionError, match="must be prefilled"):
            step()
    last = engine.prefill("s", prompt[4:])
    for more in (True, False):
        with pytest.raises(SessionError, match="already prefilled"):
            engine.prefill("s", [1], more=more)
    engine.start_session("whole", 12, SamplingParams(), TAPS)
    whole = engine.prefill("whole", prompt)
    assert_chunks_equal_one_call([first, last], whole, (4,))
    assert engine.decode("s").tokens == engine.decode("whole").tokens


@pytest.mark.parametrize("path", ["fused", "fused-static"])
@pytest.mark.parametrize("batched", [False, True])
def test_a_failed_first_token_leaves_the_session_as_before(
    path: str, batched: bool, qwen3_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whose first-token choice fails (made to here, once) fails uncommitted, alone or in a shared forward:
    its session's cache (the prefix cache's restored blocks freed again) and the prompt tokens its repetition penalty
    reads as before it, so that another prompt then answers as a fresh session's does."""
    engine = make_engine(qwen3_target, path)
    engine.enable_prefix_cache(2**24)
    params = SamplingParams(repetition_penalty=50.0)
    shared, prompt = make_prompt(40, seed=5), make_prompt(6, seed=6)
    engine.start_session("cached", 100, SamplingParams(), TAPS)
    engine.prefill("cached", shared)  # two full blocks of `shared` in the prefix cache
    engine.end_session("cached")
    engine.start_session("fresh", 100, params, TAPS)
    first = engine.prefill("fresh", shared[:33] + prompt).tokens
    failing = shared[:33] + first * 5  # restores two blocks; its tokens, were they kept, would be penalized
    real = prefill_module.first_token

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(prefill_module, "first_token", real)
        raise RuntimeError("the choice failed")

    for session_id in ("s", "other"):
        engine.start_session(session_id, 100, params, TAPS)
    monkeypatch.setattr(prefill_module, "first_token", fail_once)
    calls = [PrefillCall("s", failing)] + ([PrefillCall("other", make_prompt(9, seed=7))] if batched else [])
    outcome = engine.prefill_batch(calls)[0] if batched else None
    if batched:
        assert isinstance(outcome, RuntimeError), outcome
    else:
        with pytest.raises(RuntimeError, match="the choice failed"):
            engine.prefill("s", failing)
    assert engine.session("s").cache.length == 0 and engine.session("s").root is None
    assert engine.prefill("s", shared[:33] + prompt).tokens == first
    assert [engine.decode("s").tokens for _ in range(6)] == [engine.decode("fresh").tokens for _ in range(6)]


def test_tensor_parallel_chunks_equal_one_call(hybrid_targets: dict[str, Path]) -> None:
    """`more` reaches the other rank: a hybrid target sharded over 2 CPU ranks prefills a chunked prompt as one
    call does (a rank that ended the prompt early would refuse the next chunk and leave rank 0's collectives
    without a peer: an error within the group's timeout)."""
    target = hybrid_targets["qwen3_5"]
    prompt = make_prompt(40, seed=4)
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(target).eval(), prompt, 40)
    group = TensorParallelGroup(str(target), 2, "cpu", torch.float32, timeout_s=60, max_tree_size=64)
    try:
        engine = group.engine
        for session in ("whole", "chunked"):
            engine.start_session(session, 200, SamplingParams(), TAPS)
        whole = engine.prefill("whole", prompt)
        assert whole.tokens == truth[:1]
        chunks = prefill_chunks(engine, "chunked", prompt, SPLITS[1])
        assert_chunks_equal_one_call(chunks, whole, SPLITS[1], HYBRID_TOL)
        assert_same_rounds(engine, ("whole", "chunked"), truth, seed=5, length=30, tol=HYBRID_TOL)
        engine.start_session("kept", 200, SamplingParams(), TAPS)  # rank 0 keeps the features; the others do not
        assert engine.prefill("kept", prompt, keep_features=True).features is None
        assert_fp32_close(engine.take_features("kept").features, whole.features, HYBRID_TOL)
        assert engine.decode("kept").tokens == truth[1:2]
    finally:
        group.close()


def test_service_prefills_in_chunks(qwen3_target: Path, tmp_path: Path) -> None:
    """Through a verifier process: `more` answers carry their chunk's features and no token, the last call the
    first token; together they equal a one-call prefill, and so do the features a session's TakeFeatures calls
    take after chunks sent with keep_features. A chunk after the prompt ended, an empty chunk, a Decode before the
    prompt ended and a take with nothing kept are INVALID_ARGUMENT, and the sessions go on alike."""
    ports = free_ports(2)
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target)], (ports[0], ports[1]),
                      tmp_path)
    prompt, sizes = make_prompt(30, seed=5), (1, 12)
    try:
        wait_serving(verifier)
        with grpc.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            whole, chunked, kept = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
            for session in (whole, chunked, kept):
                request = pb.VerifierStartSessionRequest(session_id=session, capacity=64, tap_layers=TAPS)
                stub.StartSession(request, timeout=30)

            def prefill(session: str, chunk: list[int], more: bool = False, keep: bool = False) -> pb.StepResponse:
                request = pb.PrefillRequest(session_id=session, prompt=chunk, more=more, keep_features=keep)
                return stub.Prefill(request, timeout=30)

            def take() -> pb.StepResponse:
                return stub.TakeFeatures(pb.TakeFeaturesRequest(session_id=kept), timeout=30)

            def refusal(call) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                return err.value.code(), err.value.details()

            one_call = prefill(whole, prompt)
            answers = [prefill(chunked, prompt[:1], more=True)]
            decode_early = refusal(lambda: stub.Decode(pb.DecodeRequest(session_id=chunked), timeout=30))
            answers += [prefill(chunked, prompt[1:13], more=True), prefill(chunked, prompt[13:])]
            after_end = refusal(lambda: prefill(chunked, [1], more=True))
            empty = refusal(lambda: prefill(chunked, []))
            kept_answers = [prefill(kept, prompt[:1], more=True, keep=True),
                            prefill(kept, prompt[1:13], more=True, keep=True), prefill(kept, prompt[13:], keep=True)]
            taken = [take() for _ in kept_answers]
            none_left = refusal(take)
            decoded = [stub.Decode(pb.DecodeRequest(session_id=s), timeout=30).tokens for s in (whole, chunked, kept)]
    finally:
        exit_code = verifier.stop()
    assert exit_code == 0
    assert_chunks_equal_one_call([tensors.step_from_pb(a) for a in answers], tensors.step_from_pb(one_call), sizes)
    assert decode_early[0] == grpc.StatusCode.INVALID_ARGUMENT and "must be prefilled" in decode_early[1]
    assert after_end[0] == grpc.StatusCode.INVALID_ARGUMENT and "already prefilled" in after_end[1]
    assert empty[0] == grpc.StatusCode.INVALID_ARGUMENT and "empty" in empty[1]
    assert not any(a.HasField("features") for a in kept_answers) and kept_answers[-1].tokens == answers[-1].tokens
    taken_steps = [tensors.step_from_pb(t) for t in taken]
    taken_steps[-1].tokens = list(kept_answers[-1].tokens)
    assert_chunks_equal_one_call(taken_steps, tensors.step_from_pb(one_call), sizes)
    assert none_left[0] == grpc.StatusCode.INVALID_ARGUMENT and "no kept prompt features" in none_left[1]
    assert decoded[0] == decoded[1] == decoded[2] and len(decoded[0]) == 1


@pytest.mark.gpu(reason="the flash and memory-efficient SDPA kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_on_gpu_equal_one_call(dtype: torch.dtype, qwen3_target: Path) -> None:
    """Chunks of hundreds of tokens after the first run SDPA's lower-right causal kernels on a GPU (flash in bf16,
    memory-efficient in fp32, K/V heads repeated for them), where the CPU materialises the mask: the same
    features and first token as one call (the uncaptured prompt step: 900 tokens are past the captured buckets),
    and in fp32 the same decode steps after."""
    engine = VerifyEngine.from_pretrained(qwen3_target, "cuda", dtype)
    prompt = make_prompt(900, seed=4)
    for session in ("whole", "chunks"):
        engine.start_session(session, 1000, SamplingParams(), TAPS)
    whole = engine.prefill("whole", prompt)
    chunks = prefill_chunks(engine, "chunks", prompt, (600, 200))
    features = torch.cat([r.features for r in chunks]).float()
    tol = DENSE_TOL * 25 if dtype == torch.float32 else 3e-2
    assert_fp32_close(features, whole.features.float(), tol)
    assert chunks[-1].tokens == whole.tokens
    if dtype == torch.float32:
        assert [engine.decode("whole").tokens for _ in range(8)] == [engine.decode("chunks").tokens for _ in range(8)]


@pytest.mark.gpu(reason="the kept features' asynchronous copy needs a GPU")
def test_kept_features_on_gpu_are_whole_when_taken(qwen3_target: Path) -> None:
    """On a GPU a prefill call returns before its kept features' copy to pinned memory is done (the first token
    does not wait for it); a take right after the calls waits for it: the taken features equal those the calls
    answer without keeping them, bit for bit."""
    engine = VerifyEngine.from_pretrained(qwen3_target, "cuda", torch.float32)
    prompt, sizes = make_prompt(900, seed=9), (600, 200)
    for session in ("sent", "kept"):
        engine.start_session(session, 1000, SamplingParams(), TAPS)
    sent = prefill_chunks(engine, "sent", prompt, sizes)
    kept = [engine.prefill("kept", prompt[:600], more=True, keep_features=True),
            engine.prefill("kept", prompt[600:800], more=True, keep_features=True),
            engine.prefill("kept", prompt[800:], keep_features=True)]
    taken = [engine.take_features("kept").features for _ in kept]
    assert kept[-1].tokens == sent[-1].tokens
    assert all(t.device.type == "cpu" and t.is_pinned() for t in taken)
    assert torch.equal(torch.cat(taken), torch.cat([r.features for r in sent]).cpu())
