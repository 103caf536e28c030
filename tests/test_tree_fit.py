"""Load-adaptive trees (gateway/tree_fit.py): a drafted tree's prefix is the best smaller tree, a round's accepted
path read back as node ranks, the cost curve, and the size chosen for a step by its load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from draft_server.tree import build_tree
from gateway import tree_fit
from gateway.tree_fit import SessionFit, TreeFit, cut, path_ranks, tree_arrays
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.types import SamplingParams


def drafted(budget: int, seed: int = 0, depths: int = 7, vocab: int = 50) -> pb.DraftTree:
    """A tree as the drafter builds it from random per-depth log-probs, in its wire form."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(depths, vocab, generator=generator).log_softmax(-1)
    return tensors.tree_to_pb(build_tree(logprobs, 3, budget))


@pytest.mark.parametrize("seed", range(4))
def test_a_trees_first_k_nodes_are_the_best_tree_of_k_nodes(seed):
    """What makes a cut free: the drafter's tree of budget k is the first k nodes of its larger tree."""
    full = drafted(48, seed)
    for k in (1, 2, 5, 16, 31, 47):
        small = tensors.tree_from_pb(drafted(k, seed))
        cut_tree = pb.DraftTree()
        cut_tree.CopyFrom(full)
        cut(cut_tree, k)
        got = tensors.tree_from_pb(cut_tree)  # also checks it is a well-formed wire tree
        assert got.num_nodes == k
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got, name), getattr(small, name)), (k, name)
        assert (got.parents[1:] < torch.arange(1, k + 1)).all()  # every parent kept, before its child


def test_cut_leaves_a_smaller_tree_alone():
    tree = drafted(8)
    before = tree.nodes
    cut(tree, 20)
    assert tree.nodes == before


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


def measured(fit: TreeFit, rates: list[float], cost_of: dict[int, float], overhead_s: float) -> None:
    """Puts known acceptance rates by rank and a known cost curve into `fit`."""
    fit.pooled.hits[1 : len(rates) + 1] = rates
    fit.pooled.trials[1 : len(rates) + 1] = 1.0
    fit.pooled.rounds = tree_fit.WARM_ROUNDS
    fit.costs = dict(cost_of)
    fit.overhead_s = overhead_s


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
    rows = 16 * (k + 1)
    rate = 16 * (1 + gain) / (10e-3 + fit.cost(rows))
    assert rate[sixteen - 1] == rate.max()
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
    fit.observe_batch(40, 0.010, sent=0.0)
    assert fit.costs == {48: 0.010} and fit.overhead_s is None  # no step before it: no gap yet
    answered = fit._answered
    fit.observe_batch(40, 0.020, sent=answered + 0.004)
    assert fit.costs[48] == pytest.approx(0.010 + tree_fit.COST_WEIGHT * 0.010)
    assert fit.overhead_s == pytest.approx(0.004)


def test_a_batch_that_waited_on_something_else_moves_the_costs_little():
    """A verify batch 10 times its row count's usual time (it waited for a graph's capture, or behind a prompt
    forward) counts as OUTLIER times the mean; a cost that truly rises is still followed within some samples."""
    fit = TreeFit()
    fit.observe_batch(16, 0.010, sent=0.0)
    fit.observe_batch(16, 0.100, sent=0.0)
    assert fit.costs[16] == pytest.approx(0.010 + tree_fit.COST_WEIGHT * (tree_fit.OUTLIER - 1) * 0.010)
    for _ in range(30):
        fit.observe_batch(16, 0.030, sent=0.0)
    assert fit.costs[16] == pytest.approx(0.030, rel=0.01)


def test_fit_cuts_the_verify_calls_trees_and_reports_the_size():
    chosen = Histogram("chosen", "test", buckets=(1, 4, 8, 16, 32), registry=CollectorRegistry())
    fit = TreeFit(chosen)
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)  # rows cost, ranks > 2 never pay
    calls = [pb.RoundCall(verify=pb.VerifyRequest(session_id=s, tree=drafted(32, seed=i)))
             for i, s in enumerate("abc")]
    calls.append(pb.RoundCall(decode=pb.DecodeRequest(session_id="d")))
    fit.fit(calls)
    sizes = [tensors.tree_from_pb(call.verify.tree).num_nodes for call in calls[:3]]
    assert len(set(sizes)) == 1 and sizes[0] < 32
    assert calls[3].HasField("decode")
    reported = {sample.name: sample.value for sample in chosen.collect()[0].samples}
    assert reported["chosen_count"] == 1 and reported["chosen_sum"] == sizes[0]  # one step, its size


def test_seeded_sessions_trees_go_as_drafted():
    """A sampled session with a seed draws from its generator once per tree node: its trees are never cut, so its
    text does not depend on who else is connected. Its rows still weigh in the others' size."""
    fit = TreeFit()
    measured(fit, [0.5] * 2 + [0.0] * 30, {16: 1e-3, 512: 512e-3}, overhead_s=1e-3)
    calls = [pb.RoundCall(verify=pb.VerifyRequest(session_id=s, tree=drafted(32, seed=i)))
             for i, s in enumerate("abc")]
    fit.fit(calls, {"b": SessionFit.of(SamplingParams(temperature=0.8, seed=1))})
    sizes = [tensors.tree_from_pb(call.verify.tree).num_nodes for call in calls]
    assert sizes[1] == 32 and sizes[0] == sizes[2] < 32


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
    fit.costs, fit.overhead_s = {16: 1e-3, 512: 1.5e-3}, 1e-3  # rows nearly free: only acceptance decides
    assert fit.size([16] * 16, kinds=[sampled] * 16) < fit.size([16] * 16, kinds=[greedy] * 16)
