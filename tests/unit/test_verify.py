"""The verifier alone: trees that hold the target's true continuation among decoys at several depths, so every
round accepts deeply and later rounds only stay exact if KV compaction is right."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import DraftTree, SamplingParams
from verify_server.cache_slots import size_class
from verify_server.step_inputs import ANCESTOR_STEPS, MAX_GRAPH_NODES
from verify_server.session import SessionError
from verify_server.tree_attention import ancestor_matrix
from verify_server.verify import VerifyEngine
from tests.conftest import VOCAB, hf_greedy


def oracle_tree(rng: random.Random, root: int, truth: list[int], true_depth: int, max_depth: int) -> DraftTree:
    """The true continuation down to `true_depth`, a wrong token at the next depth, and random decoy branches
    everywhere; nodes shuffled into a random topological order."""
    nodes: list[tuple[int, int]] = []  # (parent node id, token), node id = index + 1, root = 0
    path_parent = 0
    for d in range(max_depth):
        used = set()
        if d < true_depth:
            nodes.append((path_parent, truth[d]))
            used.add(truth[d])
            next_parent = len(nodes)
        for _ in range(rng.randint(1, 3)):  # decoy siblings, each with a small subtree
            tok = rng.choice([t for t in range(VOCAB) if t not in used and t != truth[d]])
            used.add(tok)
            nodes.append((path_parent, tok))
            decoy = len(nodes)
            for _ in range(rng.randint(0, 2)):
                nodes.append((decoy, rng.randrange(VOCAB)))
        if d >= true_depth:
            break
        path_parent = next_parent
    # random topological order
    children: dict[int, list[int]] = {}
    for i, (parent, _) in enumerate(nodes, start=1):
        children.setdefault(parent, []).append(i)
    order, ready = [], list(children.get(0, []))
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        ready += children.get(i, [])
    new_index = {0: 0, **{old: new for new, old in enumerate(order, start=1)}}
    tokens = [root] + [nodes[i - 1][1] for i in order]
    parents = [-1] + [new_index[nodes[i - 1][0]] for i in order]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), max_depth=max_depth)


PATHS = ["hf", "fused", "fused-static"]


def make_engine(target: Path, path: str) -> VerifyEngine:
    """hf: the generic HF modules; fused: our forward, unpadded on CPU; fused-static: the code path CUDA graphs
    replay (bucket padding, whole-slot attention under a device-built mask), forced on so the CPU runs it."""
    engine = VerifyEngine.from_pretrained(target, eager=path == "hf")
    if path == "fused-static":
        engine.fused.static = True
    return engine


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_deep_acceptance_with_compaction(kind: str, path: str, qwen3_target: Path, llama_target: Path) -> None:
    target = qwen3_target if kind == "qwen3" else llama_target
    rng = random.Random(7)
    engine = make_engine(target, path)
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]):
        truth = hf_greedy(AutoModelForCausalLM.from_pretrained(target).eval(), prompt, 80)
        engine.start_session("s", 200, SamplingParams(), taps=[1, 3])
        step = engine.prefill("s", prompt)
        got = list(step.tokens)
        accepted_lengths = []
        while len(got) < 60:
            max_depth = rng.randint(1, 7)
            true_depth = rng.choice([max_depth, max_depth, rng.randint(0, max_depth)])
            tree = oracle_tree(rng, got[-1], truth[len(got):], true_depth, max_depth)
            step = engine.verify("s", tree)
            assert step.tokens == truth[len(got) : len(got) + true_depth + 1]  # path + the target's bonus
            assert step.features.shape == (true_depth + 1, 2 * 64)
            accepted_lengths.append(len(step.tokens))
            got += step.tokens
        assert got == truth[: len(got)]
        assert sum(accepted_lengths) / len(accepted_lengths) > 3  # deep acceptance really happened
        assert engine.sessions["s"].cache.length == len(prompt) + len(got) - 1
        engine.end_session("s")


@pytest.mark.gpu(reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("prompt_len", [5, 600])
def test_graph_rounds_take_host_and_device_trees_on_gpu(prompt_len: int, qwen3_target: Path) -> None:
    """fp32 on the GPU, every round a graph replay: trees sent from the host (the service) and trees already on the
    device (a co-located drafter's) give the target's own greedy tokens, and an AR step copies only scalars. The
    prefill is captured (5 tokens) or, beyond the largest bucket, not (600)."""
    rng = random.Random(11)
    engine = VerifyEngine.from_pretrained(qwen3_target, device="cuda")
    assert engine.path == "fused+graphs"
    prompt = [3, 1, 4, 1, 5] if prompt_len == 5 else [(7 * i + 3) % 40 for i in range(prompt_len)]
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 80)
    engine.start_session("s", prompt_len + 100, SamplingParams(), taps=[1, 3])
    first = engine.prefill("s", prompt)
    assert first.features.shape == (prompt_len, 2 * 64)
    got = list(first.tokens)
    rounds = 0
    while len(got) < 60:
        max_depth = rng.randint(1, 7)
        tree = oracle_tree(rng, got[-1], truth[len(got):], max_depth, max_depth)
        if rounds % 2:
            tree = DraftTree(tree.tokens.cuda(), tree.parents.cuda(), tree.depths.cuda(), tree.max_depth)
        step = engine.verify("s", tree) if rounds % 3 else engine.decode("s")
        assert step.tokens == truth[len(got) : len(got) + len(step.tokens)]
        got += step.tokens
        rounds += 1
    assert len(got) - 1 > 2 * rounds  # deep acceptance
    assert len(engine.fused.graphs) > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_features_equal_device_features(device: str, qwen3_target: Path) -> None:
    """host_features (the service's rounds): a captured round hands its path's features over in host memory, copied
    within the round; they equal what the round leaves on the device for an in-process drafter, AR steps too."""
    rng = random.Random(5)
    engine = VerifyEngine.from_pretrained(qwen3_target, device=device)
    engine.fused.static = True  # the captured code path, on the CPU too
    prompt = [3, 1, 4, 1, 5]
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 40)
    for session in ("device", "host"):
        engine.start_session(session, 100, SamplingParams(), taps=[1, 3])
        engine.prefill(session, prompt)
    got = [truth[0]]
    previous = None  # the round before's host features and a copy: its buffer is reused only rounds later (FEATURE_RING)
    while len(got) < 30:
        depth = rng.randint(0, 6)
        tree = oracle_tree(rng, got[-1], truth[len(got):], depth, 6) if depth else None
        on_device, on_host = (
            engine.verify(session, tree, host_features=session == "host") if tree is not None
            else engine.decode(session, host_features=session == "host") for session in ("device", "host")
        )
        assert on_host.tokens == on_device.tokens == truth[len(got) : len(got) + len(on_host.tokens)]
        assert on_device.features.device.type == device and on_host.features.device.type == "cpu"
        assert on_host.features.is_pinned() == (device == "cuda")
        assert torch.equal(on_host.features, on_device.features.cpu())
        if previous is not None:
            assert torch.equal(previous[0], previous[1])
        previous = (on_host.features, on_host.features.clone())
        got += on_host.tokens


@pytest.mark.parametrize("path", PATHS)
def test_features_are_tapped_layer_outputs(path: str, qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, path)
    prompt = [5, 7, 11, 13]
    engine.start_session("s", 32, SamplingParams(), taps=[0, 2])
    features = engine.prefill("s", prompt).features
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    # hidden_states[l + 1] is the output of decoder layer l (layers 0 and 2 are never the final-normed one)
    torch.testing.assert_close(features, torch.cat((states[1][0], states[3][0]), dim=-1), atol=1e-5, rtol=1e-5)


def test_ancestor_matrix() -> None:
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    anc = ancestor_matrix(parents)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for i, want in expected.items():
        assert set(anc[i].nonzero().flatten().tolist()) == want


@pytest.mark.parametrize("n", [1, 2, 17, 64, 65, 300])
def test_ancestor_matrix_of_any_depth_equals_walking_up(n: int) -> None:
    """Pointer doubling (and on a GPU the kernel) against walking up node by node: a chain (depth n - 1, the
    deepest n nodes can be), a random tree, and the padded buckets' constant step count."""
    rng = random.Random(n)
    for parents in ([-1] + list(range(n - 1)), [-1] + [rng.randrange(i) for i in range(1, n)]):
        want = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                want[i, j] = True
                j = parents[j]
        assert torch.equal(ancestor_matrix(torch.tensor(parents)), want)
        if n <= MAX_GRAPH_NODES:
            assert torch.equal(ancestor_matrix(torch.tensor(parents), ANCESTOR_STEPS), want)
        if torch.cuda.is_available():  # the GPU's kernel (tests/interpreted_kernels.py checks it on the CPU)
            assert torch.equal(ancestor_matrix(torch.tensor(parents, device="cuda")).cpu(), want)


@pytest.mark.parametrize("path", PATHS)
def test_session_errors_leave_state_intact(path: str, qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, path)
    engine.start_session("s", 12, SamplingParams(), taps=[])
    with pytest.raises(SessionError, match="must be prefilled"):
        engine.decode("s")
    engine.prefill("s", [1, 2, 3])
    big = oracle_tree(random.Random(0), 0, list(range(20)), 7, 7)
    with pytest.raises(SessionError, match="KV slots"):
        engine.verify("s", big)
    with pytest.raises(SessionError, match="unknown verifier session"):
        engine.decode("other")
    assert len(engine.decode("s").tokens) == 1  # still usable after the rejected requests


def test_slots_of_other_sizes_give_way_with_their_graphs(qwen3_target: Path) -> None:
    """A session's cache grows with its prompt and output, from slot to larger slot. Once max_sessions cache slots
    exist, a session growing to a size none of them has takes the place of a free slot of another size: the slots
    never outnumber max_sessions however the sessions' sizes vary, a slot in use is never taken, the graphs
    captured for the slot given up go with it (shared ones stay), and the sessions' greedy tokens are the target's
    own throughout."""
    engine = make_engine(qwen3_target, "fused-static")
    engine.fused.slots.max_sessions = 2
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    fused, graphs = engine.fused, engine.fused.graphs._graphs  # noqa: SLF001 - planted entries, see below
    shared = (1, 16, 64, (), "batch")  # a round graph every slot replays
    graphs[shared] = (None, None)
    rng = random.Random(0)
    engine.start_session("held", 100, SamplingParams(), [])
    held_cache = engine.session("held").cache
    held = engine.prefill("held", [3, 1, 4, 1, 5]).tokens
    for length in (300, 700, 300, 900, 100):  # grown to size classes 512, 1024, 512, 1024, 256
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(length)]
        truth = hf_greedy(model, prompt, 3)
        engine.start_session("s", 4 * length, SamplingParams(), [])
        slot = fused.slots.slot_of(engine.session("s").cache)
        graphs[(16, (), "prefill", ("slot", slot))] = (None, None)  # as if a prompt had been captured in it
        got = engine.prefill("s", prompt).tokens
        got += engine.decode("s").tokens + engine.decode("s").tokens
        assert got == truth[: len(got)]
        assert engine.session("s").cache.room == size_class(length + 1)
        engine.end_session("s")
        assert fused.slots.allocated <= 2
    assert engine.session("held").cache is held_cache  # never taken, never moved
    assert engine.decode("held").tokens == hf_greedy(model, [3, 1, 4, 1, 5], 2)[1:2]
    assert held == hf_greedy(model, [3, 1, 4, 1, 5], 1)
    # each session's first slot was given up once it moved on (the pool one over its bound), the graph planted for
    # it with it; the shared one stayed
    assert list(graphs) == [shared]
