"""Chunked prefill (SessionStep.more): a prompt sent in several chunks leaves the session exactly as one call does
(features, first token, every round after), on the fused and the generic path, for hybrid targets (whose chunks
continue the committed recurrent state), through tensor parallelism and through the service (a chunk a Step
call). A chunk's features come in host memory where asked (host_features: they go to a remote drafter) and leave
out the positions below skip_features; through the service they reach the verifier's drafter, an Append a chunk,
equal to a one-call prefill's."""

from __future__ import annotations

import random
import time
import uuid
from concurrent import futures
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
def test_host_features_and_skipped_positions(path: str, qwen3_target: Path) -> None:
    """host_features: each chunk's features come in host memory, equal to those the calls answer without it.
    skip_features: the positions below it get none (a chunk wholly below it: None), the rest those of a call
    without it. Neither changes the tokens, the first or any after."""
    engine = make_engine(qwen3_target, path)
    prompt, sizes, skip = make_prompt(30, seed=6), (7, 9), 10
    for session in ("sent", "host", "skipped"):
        engine.start_session(session, 64, SamplingParams(), TAPS)
    sent = prefill_chunks(engine, "sent", prompt, sizes)
    host = [engine.prefill("host", prompt[:7], more=True, host_features=True),
            engine.prefill("host", prompt[7:16], more=True, host_features=True),
            engine.prefill("host", prompt[16:], host_features=True)]
    assert all(r.features.device.type == "cpu" for r in host)
    assert_chunks_equal_one_call(host, StepResult(sent[-1].tokens, torch.cat([r.features for r in sent])), sizes)
    skipped = [engine.prefill("skipped", prompt[:7], more=True, skip_features=skip),
               engine.prefill("skipped", prompt[7:16], more=True, skip_features=skip),
               engine.prefill("skipped", prompt[16:], skip_features=skip)]
    assert skipped[0].features is None and [len(r.features) for r in skipped[1:]] == [16 - skip, 30 - 16]
    assert_fp32_close(torch.cat([r.features for r in skipped[1:]]), torch.cat([r.features for r in sent])[skip:],
                      DENSE_TOL)
    assert host[-1].tokens == skipped[-1].tokens == sent[-1].tokens
    assert engine.decode("host").tokens == engine.decode("skipped").tokens == engine.decode("sent").tokens


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
        engine.start_session("host", 200, SamplingParams(), TAPS)  # rank 0 answers the features; the others do not
        host = engine.prefill("host", prompt, host_features=True)
        assert host.features.device.type == "cpu" and host.tokens == truth[:1]
        assert_fp32_close(host.features, whole.features, HYBRID_TOL)
        assert engine.decode("host").tokens == truth[1:2]
    finally:
        group.close()


class AppendRecorder(pb_grpc.DrafterServicer):
    """The verifier's drafter (--drafter) on loopback, as far as a prompt concerns it: each Append's session and
    features recorded as they come over the wire, answered with the rows it brought."""

    def __init__(self) -> None:
        self.appends: list[tuple[str, torch.Tensor]] = []

    def Info(self, request, context) -> pb.DrafterInfoResponse:
        return pb.DrafterInfoResponse()  # no round lane: the appends come as gRPC calls

    def Append(self, request: pb.AppendRequest, context) -> pb.AppendResponse:
        self.appends.append((request.session_id, tensors.tensor_from_pb(request.features)))
        return pb.AppendResponse(context_length=request.features.shape[0])

    def appended(self, session: str, calls: int) -> list[torch.Tensor]:
        """The session's appended features, once `calls` have come (they follow the prompt's answers)."""
        deadline = time.monotonic() + 30
        while len(got := [f for s, f in self.appends if s == session]) < calls and time.monotonic() < deadline:
            time.sleep(0.01)
        return got


def test_service_prefills_in_chunks(qwen3_target: Path, tmp_path: Path) -> None:
    """Through a verifier process, each chunk a prompt part of its own Step call: the answers carry tokens only
    (`more` ones none, the last the first token); each chunk's features go to the verifier's drafter as an Append,
    after the one before, past the positions skip_features leaves out (a chunk wholly below it: none), and together
    they equal a one-chunk prefill's. A chunk after the prompt ended, an empty chunk (`more` with no prompt) and a
    step before the prompt ended are INVALID_ARGUMENT (the part's status), and the sessions go on alike."""
    drafter = AppendRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_DrafterServicer_to_server(drafter, server)
    drafter_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports = free_ports(2)
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target),
                                         "--drafter", f"127.0.0.1:{drafter_port}"], (ports[0], ports[1]), tmp_path)
    prompt, sizes, skip = make_prompt(30, seed=5), (1, 12), 5
    try:
        wait_serving(verifier)
        with grpc.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            whole, chunked, skipped = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
            for session in (whole, chunked, skipped):
                request = pb.VerifierStartSessionRequest(session_id=session, capacity=64, tap_layers=TAPS)
                stub.StartSession(request, timeout=30)

            def chunk_outcome(session: str, chunk: list[int], more: bool = False, skip_features: int = 0
                              ) -> pb.StepOutcome:
                part = pb.SessionStep(session_id=session, prompt=chunk, more=more, skip_features=skip_features)
                (outcome,) = stub.Step(pb.StepRequest(sessions=[part]), timeout=30).outcomes
                return outcome

            def prefill(session: str, chunk: list[int], more: bool = False, skip_features: int = 0) -> pb.StepResponse:
                outcome = chunk_outcome(session, chunk, more, skip_features)
                assert outcome.status.code == 0, outcome.status
                return outcome.step

            def step(session: str) -> pb.StepOutcome:
                request = pb.StepRequest(sessions=[pb.SessionStep(session_id=session)])
                (outcome,) = stub.Step(request, timeout=30).outcomes
                return outcome

            def refusal(outcome: pb.StepOutcome) -> tuple[grpc.StatusCode, str]:
                code = next(code for code in grpc.StatusCode if code.value[0] == outcome.status.code)
                return code, outcome.status.details

            one_call = prefill(whole, prompt)
            answers = [prefill(chunked, prompt[:1], more=True)]
            step_early = step(chunked).status
            answers += [prefill(chunked, prompt[1:13], more=True), prefill(chunked, prompt[13:])]
            after_end = refusal(chunk_outcome(chunked, [1], more=True))
            empty = refusal(chunk_outcome(chunked, [], more=True))  # (no prompt and no `more`: an AR step)
            skipped_answers = [prefill(skipped, prompt[:1], more=True, skip_features=skip),
                               prefill(skipped, prompt[1:13], more=True, skip_features=skip),
                               prefill(skipped, prompt[13:], skip_features=skip)]
            appended = {session: drafter.appended(session, calls)
                        for session, calls in ((whole, 1), (chunked, 3), (skipped, 2))}
            decoded = [step(s).step.tokens for s in (whole, chunked, skipped)]
    finally:
        exit_code = verifier.stop()
        server.stop(None)
    assert exit_code == 0
    assert [list(a.tokens) for a in answers] == [[], [], list(one_call.tokens)] and len(one_call.tokens) == 1
    assert [list(a.tokens) for a in skipped_answers] == [[], [], list(one_call.tokens)]
    assert step_early.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "must be prefilled" in step_early.details
    assert after_end[0] == grpc.StatusCode.INVALID_ARGUMENT and "already prefilled" in after_end[1]
    assert empty[0] == grpc.StatusCode.INVALID_ARGUMENT and "empty" in empty[1]
    (whole_features,) = appended[whole]
    assert tuple(whole_features.shape) == (len(prompt), len(TAPS) * HIDDEN)
    chunks = [StepResult([], features) for features in appended[chunked][:-1]] + [
        StepResult(list(answers[-1].tokens), appended[chunked][-1])]
    assert_chunks_equal_one_call(chunks, StepResult(list(one_call.tokens), whole_features), sizes)
    assert [len(f) for f in appended[skipped]] == [13 - skip, len(prompt) - 13]  # the first chunk: none
    assert_fp32_close(torch.cat(appended[skipped]), whole_features[skip:], DENSE_TOL)
    assert len(drafter.appends) == 6  # nothing more: no session's step drafted
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


@pytest.mark.gpu(reason="features copied from the GPU to host memory need a GPU")
def test_host_features_on_gpu_equal_the_devices(qwen3_target: Path) -> None:
    """On a GPU, host_features answers each chunk's features in host memory: bit for bit those the same calls
    answer on the device, and the same tokens."""
    engine = VerifyEngine.from_pretrained(qwen3_target, "cuda", torch.float32)
    prompt, sizes = make_prompt(900, seed=9), (600, 200)
    for session in ("sent", "host"):
        engine.start_session(session, 1000, SamplingParams(), TAPS)
    sent = prefill_chunks(engine, "sent", prompt, sizes)
    host = [engine.prefill("host", prompt[:600], more=True, host_features=True),
            engine.prefill("host", prompt[600:800], more=True, host_features=True),
            engine.prefill("host", prompt[800:], host_features=True)]
    assert host[-1].tokens == sent[-1].tokens
    assert all(r.features.device.type == "cpu" for r in host) and all(r.features.is_cuda for r in sent)
    assert torch.equal(torch.cat([r.features for r in host]), torch.cat([r.features for r in sent]).cpu())
    assert [engine.decode("host").tokens for _ in range(4)] == [engine.decode("sent").tokens for _ in range(4)]
