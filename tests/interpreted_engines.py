"""The engine checks of tests/triton_interpreted.py: the drafter's and the verifier's engines with their Triton
kernels in the loop (the static drafter, the batched drafts, captured verify rounds and batches, the warm-ups'
captures, the deterministic mode's bitwise equalities), through Triton's interpreter or compiled on a GPU."""

from __future__ import annotations

import torch

from verify_server.step_attention import FLASH
from verify_server.tree_attention import ancestor_matrix
from tests.graph_replay import ReplayRecorder
from tests.interpreted_kernels import DEVICE


def check_drafter() -> None:
    """The static drafter with its tree built by the kernels and its block's projections through the rows kernel
    drafts the eager drafter's trees, round after round (on a GPU the kernels are its default for small drafters;
    on the CPU they are switched on here)."""
    from tests.unit.test_drafter_static import FEATURE_DIM, ROUNDS, engines, run_rounds, sliding_drafter

    torch.manual_seed(0)
    eager, static = engines(sliding_drafter(), DEVICE.type, max_sessions=2, max_context=256)
    static.static.trees.tree_kernel = True
    static.static.blocks.fused_rows = True  # the block's projections through the rows kernel (fp32 in the interpreter)
    # the rows kernel sums its dot products in another order than torch: the log-probs agree to float noise (the
    # trees exactly)
    run_rounds(eager, static, torch.randn(sum(r[0] for r in ROUNDS), FEATURE_DIM, device=DEVICE), atol=1e-4)
    print("drafter ok", len(ROUNDS), "rounds")


def check_verify() -> None:
    """The verifier's captured rounds through the batch op and the batch compaction (plain calls in the
    interpreter, replayed graphs on a GPU): lone rounds (batches of one), a session's rounds back to back and
    batches of two sessions, trees and AR steps, give the target's own greedy tokens, deep acceptance included."""
    import random
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from protos.types import DraftTree, SamplingParams
    from tests.conftest import hf_greedy, make_target
    from tests.unit.test_verify import oracle_tree
    from verify_server.verify import VerifyEngine

    with tempfile.TemporaryDirectory() as tmp:
        target = make_target("qwen3", Path(tmp))
        engine = VerifyEngine.from_pretrained(target, device=DEVICE)
        model = AutoModelForCausalLM.from_pretrained(target).eval()
    if DEVICE.type == "cpu":  # the GPU's captured code, its flash kernels through the interpreter
        engine.fused.static = True
        engine.fused.decoder.attention = FLASH
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8]}
    truths = {name: hf_greedy(model, prompt, 60) for name, prompt in prompts.items()}
    got = {}
    for name, prompt in prompts.items():
        engine.start_session(name, 200, SamplingParams(), taps=[1, 3])
        got[name] = list(engine.prefill(name, prompt).tokens)
    rng = random.Random(5)

    def tree(name: str, root: int, at: int, depth: int):
        made = oracle_tree(rng, root, truths[name][at:], depth, depth + 1)
        # on the device, as a co-located drafter's
        return DraftTree(made.tokens.to(DEVICE), made.parents.to(DEVICE), made.depths.to(DEVICE), made.max_depth)

    for round_ in range(6):
        if round_ % 3 == 0:  # a batch of both sessions
            calls = [(name, tree(name, got[name][-1], len(got[name]), rng.randint(1, 5))) for name in prompts]
            steps = dict(zip(prompts, engine.verify_batch(calls)))
        elif round_ % 3 == 1:  # each alone: a batch of one
            steps = {name: engine.verify(name, tree(name, got[name][-1], len(got[name]), 4)) for name in prompts}
        else:  # session a's two rounds back to back, the second from the first's outcome
            first = engine.verify("a", tree("a", got["a"][-1], len(got["a"]), 3))
            at = len(got["a"]) + len(first.tokens)
            steps = {"a": first, "a2": engine.verify("a", tree("a", first.tokens[-1], at, 2))}  # checked in order
        for name, step in steps.items():
            session = name[0]
            want = truths[session][len(got[session]) : len(got[session]) + len(step.tokens)]
            assert step.tokens == want, (round_, name, step.tokens, want, len(got[session]))
            got[session] += step.tokens
    assert sum(len(tokens) for tokens in got.values()) > 40  # deep acceptance
    # AR steps of two sessions without taps, batched (one replay each), then a lone one
    from verify_server.step_inputs import ROOT_ONLY

    for name in ("a", "b"):
        engine.start_session(f"{name}-ar", 200, SamplingParams(), taps=[])
        assert engine.prefill(f"{name}-ar", prompts[name]).tokens == truths[name][:1]
    for n in range(1, 4):
        batch = engine.verify_batch([("a-ar", ROOT_ONLY), ("b-ar", ROOT_ONLY)])
        assert [step.tokens for step in batch] == [truths["a"][n : n + 1], truths["b"][n : n + 1]], (n, batch)
    assert engine.decode("a-ar").tokens == truths["a"][4:5]
    check_prompt_batch(engine, model)
    print("verify ok", {name: len(tokens) for name, tokens in got.items()}, "tokens; batched AR steps ok; "
          "prompts in one forward ok")


def check_prompt_batch(engine, model) -> None:
    """Several sessions' prompts in one forward (prefill_batch): their chunks as chains through the batch op, on the
    captured path where the engine's steps are static (the batched rounds' scores step), tapped and untapped, one of
    them a chunk after 6 committed rows, of lengths that are no multiple of 16; each session's first token and AR
    steps after it are the target's own."""
    from protos.types import SamplingParams
    from tests.conftest import VOCAB, hf_greedy
    from verify_server.prefill import PrefillCall

    captured = []
    prompt_hidden = engine.fused.trees.prompt_hidden

    def counted(items, taps, graphs):
        outcome = prompt_hidden(items, taps, graphs)
        captured.append(outcome is not None)
        return outcome

    engine.fused.trees.prompt_hidden = counted

    prompts = {name: [(7 * i + 3 * len(name)) % VOCAB for i in range(length)]
               for name, length in (("c", 5), ("dd", 23), ("e", 17), ("ff", 9))}
    truths = {name: hf_greedy(model, prompt, 6) for name, prompt in prompts.items()}
    for name in prompts:
        engine.start_session(name, 200, SamplingParams(), taps=[1, 3] if len(name) == 1 else [])
    engine.prefill("e", prompts["e"][:6], more=True)
    calls = [PrefillCall(name, prompt[6:] if name == "e" else prompt) for name, prompt in prompts.items()]
    for name, step in zip(prompts, engine.prefill_batch(calls)):
        assert step.tokens == truths[name][:1], (name, step)
        assert [engine.decode(name).tokens[0] for _ in range(5)] == truths[name][1:6], name
    if engine.fused.by_address:  # captured batches of several sessions find their slots by address
        assert captured == [True, True], captured  # the tapped two, the untapped two


def check_deterministic() -> None:
    """The verifier's deterministic mode (attention INVARIANT) in bf16: two sessions with the same prompt, one
    decoding step by step, one verifying branching trees, commit the same tokens, and every node on an accepted path
    gets bitwise the logits of the decode step at its position; several sessions' trees (a decode step among them)
    in one step get bitwise each one's logits alone, and a batch's rounds commit what those logits choose; a prompt
    prefilled in chunks leaves bitwise the K/V and next logits it leaves prefilled whole; a seeded sampled session
    samples the same tokens alone and batched with others. Steps run
    through the captured code (plain calls in the interpreter, graphs on a GPU: trees padded to their bucket, a
    batch filled up with a filler tree) and, every other one, uncaptured too (FusedRunner.forward,
    TreeSteps.forward)."""
    import itertools
    import random
    import tempfile
    from pathlib import Path

    from protos.types import DraftTree, SamplingParams
    from tests.conftest import make_target
    from tests.unit.test_verify import oracle_tree
    from verify_server.step_attention import INVARIANT
    from verify_server.step_inputs import ROOT_ONLY
    from verify_server.tree_batch import BatchTree
    from verify_server.verify import VerifyEngine

    with tempfile.TemporaryDirectory() as tmp:  # two layers: the interpreter's time goes by programs
        engine = VerifyEngine.from_pretrained(make_target("qwen3", Path(tmp), layers=2), DEVICE, torch.bfloat16,
                                              attention=INVARIANT)
    fused = engine.fused
    fused.static = True  # the GPU's captured steps (on the CPU, run as plain calls)
    taps = (0, 1)
    calls = itertools.count()

    def scores(name: str, tree: DraftTree) -> torch.Tensor:
        """The session's tree's logits [q, V], captured, and every other call uncaptured alike; nothing committed."""
        sess = engine.session(name)
        captured = fused.tree_forward(sess.cache, taps, tree, sess.root)[0]
        if next(calls) % 2 == 0:
            ids = tree.tokens.clone()
            ids[0] = sess.root
            uncaptured = fused.forward(sess.cache, taps, ids.to(DEVICE), (sess.cache.length + tree.depths).to(DEVICE),
                                       ancestor_matrix(tree.parents).to(DEVICE), last_only=False)[0]
            assert torch.equal(captured, uncaptured), name
        return captured

    def greedy_path(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """The walk the logits [q, V] choose: its nodes from the root, and the tokens it commits (the bonus last)."""
        nodes, tokens = [0], []
        while True:
            tokens.append(int(logits[nodes[-1]].argmax()))
            child = [i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))
                     if p == nodes[-1] and t == tokens[-1]]
            if not child:
                return nodes, tokens
            nodes.append(child[0])

    prompts = {"ar": [3, 1, 4, 1, 5, 9, 2, 6], "tree": [3, 1, 4, 1, 5, 9, 2, 6], "b1": [7] * 5,
               "b2": [2, 7, 1, 8, 2, 8] * 10, "b3": [1, 6, 1, 8] * 17}  # b2's trees cross a key chunk's end
    for name, prompt in prompts.items():
        engine.start_session(name, 160, SamplingParams(), list(taps))
        engine.prefill(name, prompt)
    assert engine.session("ar").root == engine.session("tree").root
    # AR: one-node steps along the greedy path, each committed by decode(); step j's logits pick token j
    ar_logits, ar_tokens = [], []
    while len(ar_tokens) < 16:
        logits = scores("ar", ROOT_ONLY)[0]
        ar_tokens += engine.decode("ar").tokens
        assert ar_tokens[-1] == int(logits.argmax())
        ar_logits.append(logits)
    # the same prompt's trees: the true path to a random depth, a wrong token after it, decoys everywhere
    rng = random.Random(3)
    done = 0  # tokens the tree session has committed
    while True:
        depth = rng.randint(1, 3)
        if done + depth + 1 >= len(ar_tokens):
            break
        tree = oracle_tree(rng, engine.session("tree").root, ar_tokens[done:], depth, depth + 1)
        logits = scores("tree", tree)
        nodes, tokens = greedy_path(tree, logits)
        step = engine.verify("tree", tree).tokens  # captured: forward, walk and compaction
        assert step == tokens == ar_tokens[done : done + len(step)], (done, step, tokens)
        for i, node in enumerate(nodes):
            assert torch.equal(logits[node], ar_logits[done + i]), (done, i)
        done += len(step)
    assert done >= 10
    # several sessions' trees in one step, the AR session's decode step among them, against each alone
    names = ["b1", "b2", "b3", "ar"]
    trees = [oracle_tree(rng, 0, [rng.randrange(48) for _ in range(3)], 2, 3) for _ in names[:3]] + [ROOT_ONLY]
    alone = [scores(name, tree) for name, tree in zip(names, trees)]
    items = [BatchTree(engine.session(n).cache, t, engine.session(n).root) for n, t in zip(names, trees)]
    together, _, batch, _ = fused.batch_forward(items, taps)
    captured, _, _, qb = fused.batch_scores(items, taps)
    for b, tree in enumerate(trees):
        q = tree.tokens.shape[0]
        assert torch.equal(together[batch.tree_rows(b)], alone[b]), names[b]
        assert torch.equal(captured[b * qb : b * qb + q], alone[b]), names[b]
    # three sessions' greedy rounds in one captured step (filled up to four trees), as their logits alone choose
    for b, step in enumerate(engine.verify_batch(list(zip(names[:3], trees[:3])))):
        assert step.tokens == greedy_path(trees[b], alone[b])[1], names[b]
    # a prompt's K/V and its next step's logits, the prompt prefilled whole or in chunks (one of them a single
    # token): the same bits, whatever the cut (a prefix cache's restored blocks are such a cut)
    prompt = prompts["b3"]
    for name, cuts in (("whole", [len(prompt)]), ("chunks", [5, 1, 30, len(prompt) - 36])):
        engine.start_session(name, 160, SamplingParams(), list(taps))
        at = 0
        for i, n in enumerate(cuts):
            engine.prefill(name, prompt[at : at + n], more=i + 1 < len(cuts))
            at += n
    whole, chunks = engine.session("whole"), engine.session("chunks")
    assert whole.root == chunks.root
    assert torch.equal(whole.cache.k[..., : len(prompt), :], chunks.cache.k[..., : len(prompt), :])
    assert torch.equal(whole.cache.v[..., : len(prompt), :], chunks.cache.v[..., : len(prompt), :])
    assert torch.equal(scores("whole", ROOT_ONLY), scores("chunks", ROOT_ONLY))
    # seeded sampling: a session verified alone and its twin verified among two other sampled sessions (one batch
    # of three trees, which would run together anyway) take the same draws from the same logits: the same text
    for name, seed in (("alone", 11), ("crowded", 11), ("s1", 1), ("s2", 2)):
        engine.start_session(name, 160, SamplingParams(temperature=0.9, seed=seed), list(taps))
        engine.prefill(name, prompts["b2"])
    texts: dict[str, list[int]] = {"alone": [], "crowded": []}
    for _ in range(4):
        root = engine.session("alone").root
        assert engine.session("crowded").root == root
        tree = oracle_tree(rng, root, [rng.randrange(48) for _ in range(3)], 2, 3)
        texts["alone"] += engine.verify("alone", tree).tokens
        others = [(n, oracle_tree(rng, engine.session(n).root, [rng.randrange(48) for _ in range(2)], 1, 2))
                  for n in ("s1", "s2")]
        texts["crowded"] += engine.verify_batch([("crowded", tree), *others])[0].tokens
    assert texts["alone"] == texts["crowded"] and len(texts["alone"]) >= 4
    print("deterministic ok", len(ar_tokens), "decode steps,", done, "tokens in trees, batches of", len(names),
          "and 3 trees, a prompt whole and in", len(cuts), "chunks, a seeded session's", len(texts["alone"]),
          "sampled tokens alone and in a batch")


def check_warm_up() -> None:
    """_warm_up for sessions without taps (plain AR and trees), then a verifier of fewer slots."""
    from verify_server.warm_up import capture_rounds

    engine, met = _warm_up([])
    for fewer in (1, 2):  # a verifier of fewer slots (--max-sessions) holds no more warm-up sessions at once
        engine.fused.slots.max_sessions = fewer
        capture_rounds(engine, [], 7, 64)
    print("warm_up ok", met, "round shapes met, all captured in warm-up")


def check_warm_up_tapped() -> None:
    """_warm_up for sessions with the drafter's taps."""
    _, met = _warm_up([1, 3])
    print("warm_up_tapped ok", met, "round shapes met, all captured in warm-up")


def _warm_up(tapped: list[int]):  # noqa: ANN202 - (the VerifyEngine it warmed up, the round shapes met)
    """The verifier's warm-up captures (verify_server/warm_up.py, capture_rounds) every round graph that requests
    of its taps and tree size then meet, greedy and of both sampled kinds, alone and up to five at once, at contexts
    within its key buckets, and, tapped (a drafter's trees), their trees cut by the gateway's fit to any smaller
    size: none of their round steps has a shape the warm-up has not run, and
    replaying what it captured gives each round the tokens the same engine gives without graphs; capture_prompts
    captures every prompt bucket, whose graphs serve every slot. One set of taps a check: each half takes about as
    long."""
    import random
    import tempfile
    from pathlib import Path

    from kernels.cuda_graphs import key_buckets
    from protos.types import SamplingParams
    from tests.conftest import make_target
    from verify_server.verify import VerifyEngine
    from verify_server.warm_up import _chain, capture_prompts, capture_rounds, fitted_node_counts

    with tempfile.TemporaryDirectory() as tmp:
        target = make_target("qwen3", Path(tmp))
        engine, plain = (VerifyEngine.from_pretrained(target, device=DEVICE) for _ in range(2))
    for e in (engine, plain):
        e.fused.static = True
        e.fused.decoder.attention = FLASH
    engine.fused.graphs = recorder = ReplayRecorder()
    nodes, most_keys = (20, 128) if tapped else (7, 128)
    cuts = fitted_node_counts(nodes) if tapped else []  # 20 nodes, bucket 32: a cut to 1-15 nodes is bucket 16's
    assert cuts == ([15] if tapped else [])
    capture_rounds(engine, tapped, nodes, most_keys)
    capture_prompts(engine, tapped)
    warm = {key for key in recorder.seen if "prefill" not in key}
    warm_prompts = {key for key in recorder.seen if "prefill" in key}
    # params (greedy, sampled in the graph, sampled after it), 1, 2, 4 or 8 trees (max_batch 8), AR step, tree or cut
    # tree, key buckets
    assert not engine.sessions and len(warm) == 3 * 4 * (2 + len(cuts)) * len(key_buckets(most_keys)), len(warm)
    recorder.seen.clear()
    rng = random.Random(1)
    # a top-p session's choices are made after the graph alike whatever its taps: met once, tapped
    filtered = (SamplingParams(temperature=1.1, top_p=0.9, seed=4),) if tapped else ()
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3), *filtered):
        # contexts in every key bucket of the warm-up's (below 128 keys with a tree's bucket after them)
        for prompt in (3, 40, 70) if tapped else (3, 50, 100):
            sessions = {f"{tapped}-{params.temperature}-{prompt}-{i}": None for i in range(5)}
            for name in sessions:
                ids = [rng.randrange(engine.vocab_size) for _ in range(prompt + rng.randint(0, 8))]
                for e in (engine, plain):
                    e.start_session(name, most_keys, params, tapped)
                sessions[name] = engine.prefill(name, ids).tokens[-1]
                assert plain.prefill(name, ids).tokens[-1] == sessions[name]
            for _ in range(3):
                size = rng.choice([0, nodes, *(rng.randint(1, cut) for cut in cuts)])  # cut trees: a step's fit's
                together = rng.sample(list(sessions), rng.choice([1, 2, 3, 5]))  # batches of 1, 2, 4, 8
                trees = [(name, _chain(sessions[name], size)) for name in together]
                steps = engine.verify_batch(trees)
                assert [step.tokens for step in steps] == [step.tokens for step in plain.verify_batch(trees)]
                for name, step in zip(together, steps):
                    sessions[name] = step.tokens[-1]
            for name in sessions:
                for e in (engine, plain):
                    e.end_session(name)
    met = {key for key in recorder.seen if "prefill" not in key}
    assert met and met <= warm, sorted(met - warm)
    # prompts too replay graphs the warm-up captured, which serve every slot (their K/V written by address), in
    # whichever slot a session took: the tokens above are the plain engine's
    prompts = {key for key in recorder.seen if "prefill" in key}
    assert prompts and prompts <= warm_prompts, sorted(prompts - warm_prompts)
    assert not any(part[:1] == ("slot",) for key in prompts for part in key if isinstance(part, tuple))
    return engine, len(met)


def _flash_drafter():  # noqa: ANN202 - a DFlashDrafter
    """A tiny drafter whose head_dim the flash kernels take."""
    from draft_server.dflash import DFlashDrafter, init_drafter_weights
    from draft_server.dflash_config import DFlashConfig
    from tests.conftest import HIDDEN, VOCAB

    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, block_size=6, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2],
        num_target_layers=4,
    )
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.25, seed=2)
    return model.eval()


def check_draft_batch() -> None:
    """Several sessions' draft blocks through the batch op (draft_server/block_forward.py's flash path; captured on a
    GPU, plain calls in the interpreter): each session's tree is the one the eager engine drafts for it alone, new
    features of several sizes and contexts of several key buckets included."""
    import random

    from draft_server.session import DraftCall
    from tests.conftest import VOCAB
    from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines

    torch.manual_seed(0)
    eager, static = engines(_flash_drafter(), device=DEVICE.type, max_sessions=4, max_context=200, max_batch=4)
    static.static.blocks.flash = True  # the GPU's kernel paths (already so on a GPU): the batch op, the tree kernels
    static.static.trees.tree_kernel = True
    rng = random.Random(0)
    lengths = [0, 0, 0]
    for engine in (eager, static):
        for s in range(3):
            engine.start_session(f"s{s}", 200)
    for round_ in range(4):
        calls = []
        for s in range(3):
            m = rng.randint(20, 70) if round_ == 0 else rng.choice([0, 1, 5])
            lengths[s] += m
            calls.append(DraftCall(f"s{s}", torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[s], 8))
        for call, result in zip(calls, static.draft_batch(calls)):
            assert_same_tree(result.tree, eager.draft(*call).tree)
    assert static.static._block_batches  # noqa: SLF001 - the blocks went together
    print("draft_batch ok", max(lengths), "positions")


def check_draft_warm_up() -> None:
    """The drafter's warm-up (draft_server/warm_up.py) captures a batch of blocks of every size that sessions'
    drafts then form (2 to 8 sessions, filled up to 2, 4 or 8 blocks) in every key bucket of their contexts: none
    of their batches has a shape the warm-up has not run, and replaying what it captured drafts each session's
    tree as the eager engine drafts it alone. Then sessions drafting alone in slots other than the first: their
    single drafts (found by address) replay the graphs the warm-up captured in the first slot, and draft the eager
    trees."""
    import random

    from draft_server.session import DraftCall
    from draft_server.warm_up import warm_up
    from tests.conftest import VOCAB
    from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines

    torch.manual_seed(0)  # the features: the batch kernel and the eager attention differ by float noise, which a
    # near-tie between two tokens' scores could turn into different trees
    eager, engine = engines(_flash_drafter(), device=DEVICE.type, max_sessions=8, max_context=200, max_batch=8)
    engine.static.blocks.flash = True
    engine.static.graphs = recorder = ReplayRecorder()
    warm_up(engine, budgets=(4,))
    captured = set(recorder.seen)
    batches = ("block-batch", "batch-trees")
    warm = {key for key in recorder.seen if key[0] in batches}
    # 2, 4, 8 blocks in key buckets 64 to 256; the trees of 2 to 8 blocks, chains or of 4 nodes; those of the
    # whole drafts of 2 and 3 sessions before them (budget B - 1)
    assert not engine.sessions and len(warm) == 3 * 5 + 7 * 2 + 2, sorted(warm)
    recorder.seen.clear()
    rng = random.Random(3)
    for count in (2, 3, 5, 8):
        sessions = {f"{count}-{i}": 0 for i in range(count)}
        for name in sessions:
            engine.start_session(name, 200)
            eager.start_session(name, 200)
        while max(sessions.values()) < 180:
            calls = []
            for name, length in sessions.items():
                m = rng.randint(1, 40) if length == 0 else rng.randint(0, 12)
                sessions[name] = min(length + m, 194)
                m = sessions[name] - length
                calls.append(DraftCall(name, torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), sessions[name], 4))
            for call, result in zip(calls, engine.draft_batch(calls)):
                assert not isinstance(result, Exception), result
                assert_same_tree(result.tree, eager.draft(*call).tree)
        for name in sessions:
            engine.end_session(name)
            eager.end_session(name)
    met = {key for key in recorder.seen if key[0] in batches}
    assert met and met <= warm, sorted(met - warm)
    singles = ("append", "block", "tree")
    recorder.seen.clear()
    lengths = {"idle": 0, "a": 0, "b": 0}  # "idle" holds the first slot
    for name in lengths:
        engine.start_session(name, 200)
        eager.start_session(name, 200)
    while max(lengths.values()) < 180:
        for name in ("a", "b"):
            m = rng.randint(1, 40) if lengths[name] == 0 else rng.randint(0, 12)
            m = min(lengths[name] + m, 194) - lengths[name]
            lengths[name] += m
            call = (name, torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[name], 4)
            assert_same_tree(engine.draft(*call).tree, eager.draft(*call).tree)
    assert {engine.session(name).slot for name in ("a", "b")} == {1, 2}
    lone = {key for key in recorder.seen if key[0] in singles}
    assert {key[0] for key in lone} == set(singles) and lone <= captured, sorted(lone - captured)
    print("draft_warm_up ok", len(met), "batch shapes and", len(lone), "single draft shapes met, all captured in "
          "warm-up")
