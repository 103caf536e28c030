"""Speculation chosen per step (verify_server/tree_fit.py): a drafted tree's prefix is the best smaller tree, a
round's accepted path read back as node ranks, the cost curves, and each step's choice by its load: trees cut to k
nodes, or AR where no tree pays for its draft."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from draft_server.tree import build_tree
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.types import DraftTree, SamplingParams, StepResult
from verify_server import tree_fit
from verify_server.tree_fit import TreeFit, batch_rows, cut, path_ranks, sampling_class, tree_arrays


def drafted(budget: int, seed: int = 0, depths: int = 7, vocab: int = 50, wire: bool = True) -> DraftTree:
    """A tree as the drafter builds it from random per-depth log-probs: as the verifier receives it from a drafter
    service (a WireDraftTree), or as an in-process drafter hands it over (torch tensors)."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(depths, vocab, generator=generator).log_softmax(-1)
    tree = build_tree(logprobs, 3, budget)
    return tensors.WireDraftTree(tensors.tree_to_pb(tree)) if wire else tree


def nodes_of(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree's tokens, parents and depths, read back through its wire form (which also checks it is well formed)."""
    back = tensors.tree_from_pb(tensors.tree_to_pb(tree))
    return back.tokens, back.parents, back.depths


@pytest.mark.parametrize("wire", [True, False], ids=["wire", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_a_trees_first_k_nodes_are_the_best_tree_of_k_nodes(seed, wire):
    """What makes a cut free: the drafter's tree of budget k is the first k nodes of its larger tree."""
    full = drafted(48, seed, wire=wire)
    before = tree_arrays(full).copy()
    for k in (1, 2, 5, 16, 31, 47):
        small = drafted(k, seed, wire=False)
        got = cut(full, k)
        assert type(got) is type(full) and got.num_nodes == k and got.max_depth == full.max_depth
        for name, value in zip(("tokens", "parents", "depths"), nodes_of(got)):
            assert torch.equal(value, getattr(small, name)), (k, name)
            assert torch.equal(getattr(got, name).cpu(), getattr(small, name)), (k, name)
        assert np.array_equal(tree_arrays(got), tree_arrays(small))
        assert (got.parents[1:] < torch.arange(1, k + 1)).all()  # every parent kept, before its child
    assert np.array_equal(tree_arrays(full), before)  # the drafted tree itself is left as it was


@pytest.mark.parametrize("wire", [True, False], ids=["wire", "torch"])
def test_cut_leaves_a_smaller_tree_alone(wire):
    tree = drafted(8, wire=wire)
    assert cut(tree, 20) is tree and cut(tree, 8) is tree


def test_tree_arrays_read_both_forms_alike():
    tree = drafted(32, seed=5, wire=False)
    wire = tensors.WireDraftTree(tensors.tree_to_pb(tree))
    assert np.array_equal(tree_arrays(wire), tree_arrays(tree))
    assert tree_arrays(wire).shape == (3, 33) and wire._decoded is None  # read from its bytes, nothing decoded


def test_path_ranks_follow_the_accepted_tokens_through_the_tree():
    tree = tree_arrays(drafted(32, seed=1))
    tokens, parents = tree[0], tree[1]
    deepest = int(np.argmax(tree[2]))
    path = []
    node = deepest
    while node:
        path.append(node)
        node = int(parents[node])
    path.reverse()
    accepted = [int(tokens[n]) for n in path] + [7]  # the path's tokens, then the target's own
    assert path_ranks(tree, accepted) == path
    assert path_ranks(tree, [int(tokens[path[0]]), 7]) == path[:1]
    assert path_ranks(tree, [9999]) == []  # the target's own token right away: nothing accepted


def measured(fit: TreeFit, rates: list[float], cost_of: dict[int, float], overhead_s: float,
             draft_of: dict[int, float] | None = None) -> None:
    """Puts known acceptance rates by rank, a known cost curve and (draft_of) a draft's known costs into `fit`."""
    fit.pooled.hits[1 : len(rates) + 1] = rates
    fit.pooled.trials[1 : len(rates) + 1] = 1.0
    fit.pooled.rounds = tree_fit.WARM_ROUNDS
    fit.costs = dict(cost_of)
    fit.overhead_s = overhead_s
    fit.draft_costs = dict(draft_of or {})


def test_few_requests_keep_their_trees_many_get_them_cut():
    fit = TreeFit()
    assert fit.size([32] * 4) == 32  # nothing measured yet: no cut
    rates = [0.9 * 0.93**i for i in range(32)]  # later ranks are accepted less often
    # nearly flat up to 128 rows, then each row costs (a weight-bound forward turning compute-bound)
    measured(fit, rates, {16: 5.0e-3, 128: 5.5e-3, 512: 18e-3}, overhead_s=10e-3)
    one, four, sixteen = fit.size([32]), fit.size([32] * 4), fit.size([32] * 16)
    assert one == 32
    assert sixteen < four <= one
    # the choice is the best one on the model: no other size commits more tokens per second
    k = np.arange(1, 33)
    gain = np.cumsum(rates)
    rows = np.array([batch_rows(16, n) for n in k])  # 16 trees, each padded to its query bucket
    rate = 16 * (1 + gain) / (10e-3 + fit.cost(rows))
    assert rate[sixteen - 1] == rate.max()
    assert sixteen + 1 in (16, 32) or sixteen == 32  # the largest tree of its bucket: a smaller one costs as much
    assert fit.size([32, 3] * 8) <= 32  # a request's own smaller budget is its ceiling, never raised


def test_the_cost_curve_interpolates_and_extrapolates_by_rows():
    fit = TreeFit()
    fit.costs = {32: 4e-3, 128: 6e-3}
    got = fit.cost(np.array([1, 32, 80, 128, 256]))
    assert got == pytest.approx([4e-3, 4e-3, 5e-3, 6e-3, 12e-3])


def test_measurements_from_rounds_and_batches():
    fit = TreeFit()
    tree = tree_arrays(drafted(8, seed=2))
    child = int(np.flatnonzero(tree[1] == 0)[0])
    for _ in range(10):
        fit.observe_round(tree, [int(tree[0][child]), 5])
    rates = fit.rates()
    assert rates[child] == pytest.approx(1.0)
    assert rates[1 : 9].sum() == pytest.approx(1.0)  # one node of the 8 on every path
    assert rates[9:].sum() == 0  # ranks no tree had
    fit.observe_batch(48, 0.010, sent=time.perf_counter(), drafted_s=0.0)
    assert fit.costs == {48: 0.010} and fit.overhead_s is None  # no step before it: no gap yet
    answered = fit._answered
    fit.observe_batch(48, 0.020, sent=answered + 0.004, drafted_s=0.0)
    assert fit.costs[48] == pytest.approx(0.010 + tree_fit.COST_WEIGHT * 0.010)
    assert fit.overhead_s == pytest.approx(0.004)
    fit.observe_batch(16, 0.010, sent=fit._answered + 0.004)  # an AR step's gap is no drafting step's work
    assert fit.overhead_s == pytest.approx(0.004) and fit.costs[16] == 0.010


def test_a_step_measures_its_sessions_rounds_and_its_forward():
    """observe_step: the round of each session that committed, in its own class (a session that failed counts no
    round), and the forward's seconds at the step's rows."""
    fit = TreeFit()
    trees = [drafted(8, seed=2), drafted(8, seed=2, wire=False), drafted(8, seed=3)]
    arrays = tree_arrays(trees[0])
    child = int(np.flatnonzero(arrays[1] == 0)[0])
    accepted = StepResult([int(arrays[0][child]), 5], None)
    sent = time.perf_counter()
    fit.observe_step(trees, [accepted, accepted, RuntimeError("its own failure")], [0.0, 0.7, 0.0], 5, sent)
    assert fit.failures == 0 and fit.pooled.rounds == 2
    assert fit.classes[0.0].rounds == 1 and fit.classes[0.7].rounds == 1
    assert fit.pooled.rates()[child] == pytest.approx(1.0) and fit.classes[0.7].rates()[child] == pytest.approx(1.0)
    # 3 trees of 8 nodes beside 2 AR steps: a batch of 8 trees (5 padded to a power of two) of bucket 16
    assert list(fit.costs) == [8 * 16] and 0 < fit.costs[128] < time.perf_counter() - sent


def test_a_batch_that_waited_on_something_else_moves_the_costs_little():
    """A verify batch 10 times its row count's usual time (it waited for a graph's capture, or behind a prompt
    forward) counts as OUTLIER times the mean; a cost that truly rises is still followed within some samples."""
    fit = TreeFit()
    fit.observe_batch(16, 0.010, sent=time.perf_counter())
    fit.observe_batch(16, 0.100, sent=time.perf_counter())
    assert fit.costs[16] == pytest.approx(0.010 + tree_fit.COST_WEIGHT * (tree_fit.OUTLIER - 1) * 0.010)
    for _ in range(30):
        fit.observe_batch(16, 0.030, sent=time.perf_counter())
    assert fit.costs[16] == pytest.approx(0.030, rel=0.01)


def test_fit_cuts_the_steps_trees_and_reports_the_size():
    chosen = Histogram("chosen", "test", buckets=(0, 1, 4, 8, 16, 32), registry=CollectorRegistry())
    fit = TreeFit(chosen)
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)  # rows cost, ranks > 2 never pay
    trees = [drafted(32, seed=i, wire=i != 1) for i in range(3)]  # a step's trees, whichever drafter drew them
    before = [tree_arrays(tree).copy() for tree in trees]
    nodes = fit.choose([32] * 3, [0.0] * 3, other_rows=1)  # beside one AR step
    got = fit.fit(trees, nodes)
    sizes = [tree.num_nodes for tree in got]
    assert len(set(sizes)) == 1 and 0 < sizes[0] < 32
    assert sizes[0] == nodes == fit.size([32] * 3, 1, [0.0] * 3)
    for tree, cut_tree, arrays in zip(trees, got, before):
        assert type(cut_tree) is type(tree)
        assert np.array_equal(tree_arrays(cut_tree), arrays[:, : sizes[0] + 1])
        assert np.array_equal(tree_arrays(tree), arrays)  # the drafted trees are left as they were
    reported = {sample.name: sample.value for sample in chosen.collect()[0].samples}
    assert reported["chosen_count"] == 1 and reported["chosen_sum"] == sizes[0]  # one step, its size


def test_a_steps_other_rows_count_in_its_cost():
    """AR steps beside the trees are rows of the same forward: where they take the step past the cost curve's knee,
    its trees' rows cost and are cut shorter."""
    fit = TreeFit()
    measured(fit, [0.9 * 0.85**i for i in range(32)], {16: 5.0e-3, 128: 5.5e-3, 512: 18e-3}, overhead_s=10e-3)
    alone, beside = fit.choose([32] * 4, [0.0] * 4, other_rows=0), fit.choose([32] * 4, [0.0] * 4, other_rows=64)
    assert 0 < beside < alone
    assert (alone, beside) == (fit.size([32] * 4, 0), fit.size([32] * 4, 64))


def test_seeded_sessions_trees_are_cut_like_any_other():
    """A seeded session's numbers are its positions', not its trees' nodes': its trees are cut with the others'."""
    fit = TreeFit()
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)
    trees = [drafted(32, seed=i) for i in range(3)]
    classes = [0.0, sampling_class(SamplingParams(temperature=0.8, seed=1)), 0.0]
    sizes = [tree.num_nodes for tree in fit.fit(trees, fit.choose([32] * 3, classes, 0))]
    assert sizes[0] == sizes[1] == sizes[2] < 32


def test_trees_larger_than_the_counted_ranks_go_uncut():
    fit = TreeFit()
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)
    assert fit.size([tree_fit.MAX_RANK + 8, 32]) == tree_fit.MAX_RANK + 8


def test_each_sampling_class_counts_its_own_rates():
    """Greedy rounds that accept deep paths and sampled rounds that accept nothing: each class's rates are its own
    once it has WARM_ROUNDS rounds (the pooled ones until then), and a step of sampled trees is cut shorter than a
    step of greedy ones under the same cost curve."""
    fit = TreeFit()
    tree = np.stack([100 + np.arange(17), np.arange(-1, 16), np.arange(17)]).astype(np.int32)  # a chain of 16
    tokens, deep = tree[0], list(range(1, 17))  # every node of it accepted
    greedy, sampled = tree_fit.sampling_class(SamplingParams()), tree_fit.sampling_class(SamplingParams(temperature=0.74))
    assert (greedy, sampled) == (0.0, 0.7)
    for _ in range(tree_fit.WARM_ROUNDS):
        fit.observe_round(tree, [int(tokens[n]) for n in deep] + [5], greedy)
    assert np.array_equal(fit.rates(sampled), fit.rates(greedy))  # no rounds of its own yet: the pooled rates
    for _ in range(tree_fit.WARM_ROUNDS):
        fit.observe_round(tree, [99999], sampled)
    assert fit.rates(sampled).sum() == 0 and fit.rates(greedy)[deep].min() > 0.99
    fit.costs, fit.overhead_s = {16: 1e-3, 1024: 1.01e-3}, 1e-3  # rows nearly free: only acceptance decides
    assert fit.size([16] * 16, kinds=[sampled] * 16) < fit.size([16] * 16, kinds=[greedy] * 16)


def step_tree(nodes: int, seed: int, wire: bool = True) -> DraftTree:
    """A tree of `nodes` nodes (0: the root alone, as a grammar that leaves one choice drafts it)."""
    if nodes == 0:
        return cut(drafted(1, seed, wire=wire), 0)
    return drafted(nodes, seed, depths=8, vocab=max(8, nodes), wire=wire)


@pytest.mark.parametrize("wire", [True, False], ids=["wire", "torch"])
def test_trees_without_nodes_stay_so(wire):
    """A grammar that leaves one token drafts a root alone: cut to any size, it stays the root alone, beside a full
    tree cut to the step's size."""
    fit = TreeFit()
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)
    assert fit.size([]) == 0
    roots = [step_tree(0, i, wire) for i in range(2)]
    assert [tree.num_nodes for tree in roots] == [0, 0]
    nodes = fit.choose([32] * 3, [0.0] * 3, 0)
    sizes = [tree.num_nodes for tree in fit.fit(roots + [step_tree(32, 3, wire)], nodes)]
    assert sizes[:2] == [0, 0] and sizes[2] == nodes and 1 <= nodes < 32
    assert fit.failures == 0


def test_a_step_goes_ar_where_no_tree_pays_for_its_draft_and_speculates_again_as_the_load_falls():
    """A draft that costs as much as a forward: few sessions still speculate (their trees commit more than the draft
    costs), many go AR (their AR rows cost next to nothing more, a draft a step's time); and as sessions leave, the
    same measurements choose trees again. Until a draft's cost is measured, no step goes AR."""
    fit = TreeFit()
    rates = [0.6 * 0.9**i for i in range(32)]
    costs = {16: 5.0e-3, 64: 5.5e-3, 128: 7e-3, 512: 25e-3, 2048: 100e-3}
    measured(fit, rates, costs, overhead_s=1e-3)
    assert fit.size([32] * 64) > 0  # no draft measured: no ground for AR
    measured(fit, rates, costs, overhead_s=1e-3, draft_of={8: 6e-3, 64: 8e-3})
    one, many = fit.size([32]), fit.size([32] * 64)
    assert one > 0 and many == 0
    # the choice is the best on the model: AR's rate above every tree size's
    # the choice is the best on the model: AR's rate above every tree size's, the AR step paying no host overhead
    # (it goes behind the step in flight), a drafting one its overhead and its draft
    k = np.arange(0, 33)
    gain = np.concatenate(([0.0], np.cumsum(rates)))
    seconds = fit.cost(np.array([batch_rows(64, n) for n in k])) + np.where(k > 0, 1e-3 + fit.draft_cost(64), 0.0)
    rate = 64 * (1 + gain) / seconds
    assert rate[0] == rate.max()
    assert fit.size([32] * 2) > 0  # the load falls: trees again
    chosen = Histogram("chosen", "test", buckets=(0, 1, 32), registry=CollectorRegistry())
    fit.chosen = chosen
    assert fit.choose([32] * 64, [0.0] * 64, 0) == 0
    assert [s.value for s in chosen.collect()[0].samples if s.name == "chosen_bucket"][0] == 1  # (le=0)
    # one step in EXPLORE_EVERY takes the other choice: among AR steps, every session's best tree (its rounds measure
    # the acceptance, its draft and verify their costs at this load), AR among tree steps (an AR step's cost)
    picks = [fit.choose([32] * 64, [0.0] * 64, 0) for _ in range(3 * tree_fit.EXPLORE_EVERY)]
    explored = fit.size([32] * 64, 0, ar=False)
    assert explored > 0 and picks.count(explored) == 3 and picks.count(0) == len(picks) - 3
    picks = [fit.choose([32], [0.0], 0) for _ in range(3 * tree_fit.EXPLORE_EVERY)]
    assert picks.count(0) == 3 and set(picks) == {0, fit.size([32])}


def test_a_steps_ar_rows_commit_their_tokens_too():
    """The AR steps beside a step's trees commit a token each whatever the trees: counted in the step's tokens, they
    make the step's time matter less per tree, so trees are cut no shorter than the same step's trees alone would
    be at the same rows' cost."""
    fit = TreeFit()
    measured(fit, [0.9 * 0.85**i for i in range(32)], {16: 5.0e-3, 128: 5.5e-3, 512: 18e-3}, overhead_s=10e-3,
             draft_of={8: 2e-3})
    k = np.arange(0, 33)
    gain = np.concatenate(([0.0], np.cumsum([0.9 * 0.85**i for i in range(32)])))
    rows = np.array([batch_rows(64, n) for n in k])  # the AR rows padded to the trees' bucket too
    rate = (60 + 4 * (1 + gain)) / (fit.cost(rows) + np.where(k > 0, 10e-3 + 2e-3, 0.0))
    assert fit.size([32] * 4, 60) == len(rate) - 1 - int(np.argmax(rate[::-1]))


def test_a_batch_launched_behind_another_counts_from_that_ones_answer():
    """An AR step sent while the one before it is on the device waits for it there: its cost is its time past that
    one's answer, not the wait."""
    fit = TreeFit()
    sent = time.perf_counter()
    fit.observe_batch(16, 0.010, sent=sent)
    fit.observe_batch(16, 0.500, sent=sent)  # called with the first, answered after it
    assert fit.costs[16] < 0.010 + tree_fit.COST_WEIGHT * 0.010


def test_draft_costs_by_trees_a_call():
    fit = TreeFit()
    fit.observe_draft(3, 0.004)
    fit.observe_draft(20, 0.008)
    assert fit.draft_costs == {8: 0.004, 24: 0.008}
    assert fit.draft_cost(1) == pytest.approx(0.004) and fit.draft_cost(16) == pytest.approx(0.006)
    assert fit.draft_cost(48) == pytest.approx(0.016)  # past the largest measured: its cost per tree
    answered = time.perf_counter()
    fit._answered = answered
    fit.observe_batch(16, 0.010, sent=answered + 0.007, drafted_s=0.005)
    assert fit.overhead_s == pytest.approx(0.002)  # the gap less the draft call in it


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trees=st.lists(st.tuples(st.integers(0, 48), st.sampled_from([0.0, 0.3, 0.7, 1.0]), st.booleans(),
                             st.booleans(), st.integers(1, 48)),
                   min_size=1, max_size=12),
    decodes=st.integers(0, 8),
    rates=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=64),
    costs=st.dictionaries(st.integers(1, 2048), st.floats(1e-6, 1.0), max_size=6),
    draft_costs=st.dictionaries(st.integers(1, 64), st.floats(0.0, 1.0), max_size=3),
    overhead_s=st.one_of(st.none(), st.floats(0.0, 0.1)),
    rounds=st.integers(0, 2 * tree_fit.WARM_ROUNDS),
)
def test_the_fit_handles_every_step(trees, decodes, rates, costs, draft_costs, overhead_s, rounds):
    """Arbitrary budgets and drafted tree sizes (none included) in either form, sampling classes, seeded sessions, AR
    steps beside them, acceptance rates, cost curves and warm-up states: the choice never raises and lies within the
    largest budget, AR only once a draft's cost is known; a cut never raises, leaves every tree at most the chosen
    size (a tree with no nodes stays so), and every cut tree is its own first nodes, in its own form."""
    fit = TreeFit()
    fit.pooled.hits[1 : len(rates) + 1] = rates
    fit.pooled.trials[1 : len(rates) + 1] = 1.0
    fit.pooled.rounds = rounds
    fit.costs = dict(costs)
    fit.draft_costs = {int(tree_fit._quantum(n, tree_fit.TREE_QUANTUM)): seconds for n, seconds in draft_costs.items()}
    fit.overhead_s = overhead_s
    classes, step = [], []
    for i, (nodes, temperature, seeded, wire, _) in enumerate(trees):
        classes.append(sampling_class(SamplingParams(temperature=temperature, seed=i if seeded and temperature else None)))
        step.append(step_tree(nodes, i, wire))
    budgets = [budget for *_, budget in trees]
    chosen = fit.choose(budgets, classes, decodes)
    assert fit.failures == 0 and 0 <= chosen <= max(budgets)
    assert chosen or fit.draft_costs
    if not chosen:
        return
    drafted_arrays = [tree_arrays(tree).copy() for tree in step]
    after = fit.fit(step, chosen)
    assert fit.failures == 0 and len(after) == len(step)
    assert all(got.num_nodes <= min(chosen, nodes) or got.num_nodes == nodes == 0
               for (nodes, *_), got in zip(trees, after))
    for (nodes, *_), got, tree, before in zip(trees, after, step, drafted_arrays):
        assert type(got) is type(tree) and got.num_nodes <= nodes
        if nodes == 0:
            assert got.num_nodes == nodes
        assert np.array_equal(tree_arrays(got), before[:, : got.num_nodes + 1])
        assert np.array_equal(tree_arrays(tree), before)
    fit.observe_step(after, [StepResult([1, 2], None)] * len(after), classes, decodes + len(after),
                     time.perf_counter())
    assert fit.failures == 0 and fit.pooled.rounds == rounds + len(after)


def test_the_warm_ups_times_stand_for_shapes_not_met_yet_moved_by_the_measured_gap():
    """Before the load meets a batch shape, its cost is the warm-up's replay of its graph, moved by how much slower
    the shapes met so far ran served than in the warm-up (the host's work on a batch); a shape met is its own."""
    fit = TreeFit()
    fit.seed({16: 5e-3, 256: 8e-3, 1024: 20e-3})
    assert fit.cost(np.array([16, 256, 1024, 512])) == pytest.approx([5e-3, 8e-3, 20e-3, 12e-3])
    fit.costs = {16: 6e-3}
    assert fit.cost(np.array([16, 256, 1024])) == pytest.approx([6e-3, 9e-3, 21e-3])
    fit.costs = {16: 6e-3, 256: 8.5e-3}  # the mean gap of both
    assert fit.cost(np.array([16, 256, 1024])) == pytest.approx([6e-3, 8.5e-3, 20.75e-3])
    assert fit.cost(np.array([4096])) == pytest.approx([4 * 20.75e-3])  # past the largest: its cost per row


def test_seeded_by_the_warm_up_the_fit_chooses_what_commits_most_at_every_load():
    """A device whose forward costs one reading of the weights up to 256 rows and then each row: where the load has
    met only AR steps and small trees (after an AR spell), the warm-up's times still price every shape, and the
    fit's choice at 1, 16 and 64 sessions is the size that commits the most tokens per second on that device,
    trees at 1 and 16 sessions."""

    def forward(rows: int) -> float:
        return 6e-3 + max(0, rows - 256) * 16e-6

    def draft(trees: int) -> float:
        return 1.5e-3 + trees * 60e-6

    overhead = 2.5e-3
    rates = [0.85 * 0.9**i for i in range(32)]
    fit = TreeFit()
    fit.seed({batch_rows(count, nodes): forward(batch_rows(count, nodes))
              for count in (2, 4, 8, 16, 32, 64) for nodes in (0, 3, 7, 15, 31, 32)})
    live = {rows: forward(rows) + 0.4e-3 for rows in (1, 16, 64, 64 * 4)}  # the shapes met, served
    measured(fit, rates, live, overhead, {int(tree_fit._quantum(n, tree_fit.TREE_QUANTUM)): draft(n)
                                          for n in (1, 16, 64)})
    gain = np.concatenate(([0.0], np.cumsum(rates)))
    for sessions in (1, 16, 64):
        k = np.arange(33)
        seconds = np.array([forward(batch_rows(sessions, n)) + 0.4e-3 for n in k])
        seconds[1:] += overhead + draft(sessions)
        best = sessions * (1 + gain) / seconds
        chosen = fit.size([32] * sessions)
        assert best[chosen] >= 0.98 * best.max(), (sessions, chosen, int(best.argmax()))
        if sessions < 64:
            assert chosen > 0
