"""Speculation chosen per step: each step, before its drafts, whether its speculating sessions draft at all and to
how many nodes their trees are cut, whichever commits the most tokens per second for the whole step, from live
measurements: how likely each node of a tree is to be accepted, by its rank; what a verify forward of N rows costs
(the cost curve); what the drafter's call for n trees costs; and the rest of a step.

A drafter's tree lists its nodes best first (draft_server/tree.py: by path score, parents before children), so its
first k nodes are the best tree of k nodes, and cutting a tree to k nodes is taking a prefix. A verified tree tells
what every prefix of it would have accepted: the accepted path's nodes have increasing ranks, and a prefix of k
nodes keeps exactly the path's nodes of rank <= k. So the acceptance rate by rank, a(i), is counted from every
round, and a prefix of k nodes is expected to commit 1 + a(1) + ... + a(k) tokens (the 1: the target's own token
after the path).

A step of n trees cut to k nodes each, beside m AR steps, then commits m + n * (1 + A(k)) tokens in
F + D(n) + V(rows(k)); k = 0 is no draft at all, m + n tokens in V(rows(0)). The rows are those the forward runs:
its n + m trees padded to a power of two, each to the query bucket of the largest (a captured batch's shape,
verify_server/tree_steps.py), so that a tree of 3 nodes costs what one of the bucket's largest size costs, and AR
rows beside a tree cost that tree's bucket each. V is the verify batch's time at that many rows: measured per
shape while serving; before a shape is met, the warm-up's replay of its graph (`seed`) moved by how far the shapes
met so far are from their own warm-up times (the host's work on a batch); between and past those, interpolated. D
is the drafter's call for n trees (by n), F the rest of a drafting step (the hosts' work: the draft's features,
the trees, the gateway's turn), measured as the time from one verify batch's answer to the next one's call, less
the draft call in between. An AR step pays no F: it goes behind the step in flight and the verifier launches it
there (verify_server/decode_ahead.py), so its host work hides behind the device's. With few requests V is nearly
flat and the full trees win; with many, the rows cost, smaller buckets win, and past some load no tree pays for its
draft: the step goes AR. The choice is made again every step, so speculation comes back as the load falls (the
sessions stay tapped meanwhile: their features go to the drafter with their next draft, verify_server/step.py). A
request's own budget stays its ceiling: a tree is only ever cut.

Acceptance depends on how a request samples (a greedy round accepts more of a tree than one at T = 1), so the rates
are counted per sampling class (sampling_class: greedy, or the temperature to a tenth) as well as over all rounds,
and a step's expected tokens add up each tree's own class's rates (the pooled ones until its class has its own
WARM_ROUNDS). The step still cuts every tree to one size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
from prometheus_client import Histogram

from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.types import DraftTree, SamplingParams, StepResult
from verify_server.step_inputs import bucket

log = logging.getLogger("verify_server")
TREE_QUANTUM = 8  # the draft cost's resolution in trees a call
MAX_RANK = 1024  # ranks counted (a drafter's largest budget is below this)
WARM_ROUNDS = 64  # rounds counted before any tree is cut: until then every rank's rate is a guess
DECAY = 1 - 1 / 4096  # per counted round: the acceptance rates follow a workload that changes
COST_WEIGHT = 0.2  # weight of a new measurement in a row count's (or the overhead's) running mean
# A measurement past this many times its running mean counts as that many: a batch that waited on something else
# (a graph's capture, a prompt forward ahead of it on the verifier, a collector pause) must not move the mean as much
# as a slower forward would; a mean that truly rises still follows, by up to COST_WEIGHT * (OUTLIER - 1) a sample.
OUTLIER = 2.0
# A step in this many takes the other choice than the fit's: its best trees where it would go AR (an AR step
# measures no acceptance, nor the draft's and the trees' cost at this load), AR where it would draft (a tree step
# measures no AR step's cost), so that both sides' measurements follow the workload and the load, and a choice made
# on stale ones is seen to be wrong. Every asking session drafts: a batch pads its AR rows to the trees' bucket, so
# a few trees among AR rows would cost the forward of a full tree step and measure less.
EXPLORE_EVERY = 64
STALE_GAP_S = 1.0  # a gap between two verify batches longer than this is idleness, not a step's other work


def tree_arrays(tree: DraftTree) -> np.ndarray:
    """A tree's nodes -> [3, N+1] (tokens, parents, depths; the root first): a wire tree's as a view of its bytes."""
    if isinstance(tree, tensors.WireDraftTree):
        return np.frombuffer(tree.message.nodes, dtype=np.int32).reshape(3, -1)
    return torch.stack((tree.tokens, tree.parents, tree.depths)).cpu().numpy()


def cut(tree: DraftTree, nodes: int) -> DraftTree:
    """The tree's first `nodes` nodes (and its root): the best tree of that size."""
    if tree.num_nodes <= nodes:
        return tree
    if isinstance(tree, tensors.WireDraftTree):
        arrays = tree_arrays(tree)
        return tensors.WireDraftTree(pb.DraftTree(nodes=np.ascontiguousarray(arrays[:, : nodes + 1]).tobytes(),
                                                  max_depth=tree.max_depth))
    n = nodes + 1
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.max_depth)


def sampling_class(params: SamplingParams) -> float:
    """The class whose acceptance rates a request's rounds count in: 0 for greedy, else its temperature to a
    tenth."""
    return 0.0 if params.greedy else round(params.temperature, 1)




class AcceptanceRates:
    """Decayed counts of how often each rank of a tree was on the accepted path, over some rounds."""

    def __init__(self) -> None:
        self.hits = np.zeros(MAX_RANK + 1)  # [rank] decayed count of rounds whose path held the node of that rank
        self.trials = np.zeros(MAX_RANK + 1)  # [rank] decayed count of rounds whose tree had that rank
        self.rounds = 0

    def observe(self, size: int, ranks: Sequence[int]) -> None:
        """A round whose tree had `size` nodes and whose path held the nodes of `ranks`."""
        self.hits *= DECAY
        self.trials *= DECAY
        self.trials[1 : min(size, MAX_RANK) + 1] += 1
        for rank in ranks:
            if rank <= MAX_RANK:
                self.hits[rank] += 1
        self.rounds += 1

    def rates(self) -> np.ndarray:
        """[MAX_RANK + 1] the acceptance rate by rank (rank 0, the root, and ranks never tried: 0)."""
        return np.divide(self.hits, self.trials, out=np.zeros_like(self.hits), where=self.trials > 0)


def path_ranks(tree: np.ndarray, accepted: Sequence[int]) -> list[int]:
    """tree [3, N+1] (tree_arrays), accepted: the tokens a round committed after its root (the path's, then the
    target's own) -> the ranks (node indices) of the path's nodes, root excluded."""
    tokens, parents = tree[0], tree[1]
    ranks, node = [], 0
    for token in accepted[:-1]:  # the last one is the target's own choice after the path
        found = np.flatnonzero((parents == node) & (tokens == token))
        if not found.size:  # not in the tree: a path never leaves it, but the round may have ended at a stop
            break
        node = int(found[0])
        ranks.append(node)
    return ranks


def batch_rows(trees: int, nodes: int) -> int:
    """The rows a verify batch of `trees` trees (AR steps included, as trees of their root alone) whose largest has
    `nodes` nodes runs: its trees padded to a power of two, each to its query bucket (an eager tree, past the
    largest bucket: its own rows)."""
    if trees < 1:
        return 0
    return (1 << (trees - 1).bit_length()) * (bucket(nodes + 1) or nodes + 1)


class TreeFit:
    """The acceptance rate by rank, the verify and draft cost curves, measured from the steps that go by, and each
    step's choice: AR, or trees cut to k nodes."""

    def __init__(self, chosen: Histogram | None = None) -> None:
        """chosen: where each step's chosen size is reported (0: AR; the verifier's metrics)."""
        self.chosen = chosen
        self.pooled = AcceptanceRates()  # every round's
        self.classes: dict[float, AcceptanceRates] = {}  # sampling_class -> its rounds'
        self.costs: dict[int, float] = {}  # a batch's rows (batch_rows) -> running mean of its verify's seconds
        self.seeded: dict[int, float] = {}  # a batch's rows -> its graph's replay in the warm-up, seconds
        self.draft_costs: dict[int, float] = {}  # trees (a multiple of TREE_QUANTUM) -> running mean of a call's s
        self.overhead_s: float | None = None  # running mean of a drafting step's time outside its verify and draft
        self._answered: float | None = None  # when the last verify batch's answer came
        self._steps = 0  # steps chosen
        self.failures = 0  # choices and measurements that raised (their steps went with full trees)

    def seed(self, costs: dict[int, float]) -> None:
        """The warm-up's replay of each captured batch shape (its rows, batch_rows -> seconds): the cost curve's
        shape before the load has met it."""
        self.seeded = dict(costs)

    # ---- measurements ---------------------------------------------------------------------------------------

    def observe_round(self, tree: np.ndarray, accepted: Sequence[int], kind: float = 0.0) -> None:
        """A verified tree [3, N+1] and the tokens its round committed, of a request of sampling class `kind`."""
        size, ranks = tree.shape[1] - 1, path_ranks(tree, accepted)
        self.pooled.observe(size, ranks)
        self.classes.setdefault(kind, AcceptanceRates()).observe(size, ranks)

    def observe_draft(self, trees: int, seconds: float) -> None:
        """A drafter's call for `trees` trees took `seconds`."""
        key = int(_quantum(trees, TREE_QUANTUM))
        self.draft_costs[key] = _running_mean(self.draft_costs.get(key), seconds)

    def observe_batch(self, rows: int, seconds: float, sent: float, drafted_s: float | None = None) -> None:
        """A verify batch of `rows` rows (batch_rows) took `seconds` from its call (at `sent`, perf_counter) to its
        answer; a drafting step's (`drafted_s`: its draft call's seconds, before the call) also measures the step's
        other work. A batch called before the one before it was answered (launched behind it on the device) counts
        from that answer: its wait is the other batch's time."""
        now = time.perf_counter()
        if self._answered is not None and sent < self._answered:
            seconds = min(seconds, now - self._answered)
        self.costs[rows] = _running_mean(self.costs.get(rows), seconds)
        if drafted_s is not None and self._answered is not None and 0 <= sent - self._answered < STALE_GAP_S:
            self.overhead_s = _running_mean(self.overhead_s, max(0.0, sent - self._answered - drafted_s))
        self._answered = now

    def observe_step(self, trees: Sequence[DraftTree], results: Sequence[StepResult | Exception],
                     classes: Sequence[float], batch: int, sent: float, drafted_s: float = 0.0) -> None:
        """A step's verified trees and their outcomes (a StepResult each, or the session's own error), and its
        verify of `batch` trees and AR steps called at `sent` (perf_counter), `drafted_s` after its draft call
        began: each round's accepted path and the forward's cost at its rows. Never fails: the outcomes are the
        step's whatever the measurements make of them."""
        try:
            for tree, result, kind in zip(trees, results, classes):
                if isinstance(result, StepResult):
                    self.observe_round(tree_arrays(tree), result.tokens, kind)
            rows = batch_rows(batch, max((tree.num_nodes for tree in trees), default=0))
            self.observe_batch(rows, time.perf_counter() - sent, sent, drafted_s if trees else None)
        except Exception:
            self._failed("measure a step")

    # ---- the choice -----------------------------------------------------------------------------------------

    def rates(self, kind: float = 0.0) -> np.ndarray:
        """[MAX_RANK + 1] the acceptance rate by rank of class `kind`'s rounds, or of all rounds until it has
        WARM_ROUNDS of its own."""
        own = self.classes.get(kind)
        return (own if own is not None and own.rounds >= WARM_ROUNDS else self.pooled).rates()

    def cost(self, rows: np.ndarray) -> np.ndarray:
        """[m] batch rows (batch_rows) -> [m] a verify batch's expected seconds at each: measured where met, else the
        warm-up's time moved by the mean gap between the measured shapes and their warm-up times, interpolated
        between (_curve)."""
        both = [self.costs[key] - self.seeded[key] for key in self.costs if key in self.seeded]
        gap = float(np.mean(both)) if both else 0.0
        points = {key: max(seconds + gap, seconds / 2) for key, seconds in self.seeded.items()}
        return _curve({**points, **self.costs}, rows)

    def draft_cost(self, trees: int) -> float:
        """A drafter's call for `trees` trees: its expected seconds (_curve)."""
        return float(_curve(self.draft_costs, _quantum(np.array([trees]), TREE_QUANTUM))[0])

    def size(self, trees: Sequence[int], other_rows: int = 0, kinds: Sequence[float] | None = None,
             ar: bool = True) -> int:
        """The nodes to cut each tree of a step to, given its trees' sizes (and their requests' sampling classes,
        default greedy) and its AR steps' count: the size that commits the most tokens per second (the largest such),
        0 where no tree pays for its draft (once a draft's cost is measured, and where `ar`); the largest tree's size
        (no cut) until enough is measured."""
        largest = max(trees, default=0)
        if (largest < 1 or self.pooled.rounds < WARM_ROUNDS or not (self.costs or self.seeded)
                or self.overhead_s is None or largest > MAX_RANK):
            # (a step of trees without nodes, a grammar's single choice, has nothing to cut; ranks past MAX_RANK,
            # a drafter's --max-budget raised past it, are not counted)
            return largest
        kinds = [0.0] * len(trees) if kinds is None else list(kinds)
        order = sorted(set(kinds))
        # [classes, largest+1] A(k) of each class, A(0) = 0; each tree's class is a row of it
        gains = np.stack([np.concatenate(([0.0], np.cumsum(self.rates(kind)[1 : largest + 1]))) for kind in order])
        row_of = np.array([order.index(kind) for kind in kinds])  # [n]
        kept = np.minimum(np.asarray(trees)[None, :], np.arange(largest + 1)[:, None])  # [largest+1, n] nodes
        batch = len(trees) + other_rows  # (a cut to k nodes leaves the largest tree k nodes: its bucket's)
        rows = np.array([batch_rows(batch, k) for k in range(largest + 1)])  # [largest+1]
        tokens = other_rows + len(trees) + gains[row_of[None, :], kept].sum(axis=1)  # [largest+1] the step commits
        seconds = self.cost(rows)  # [largest+1]
        seconds[1:] += self.overhead_s + (self.draft_cost(len(trees)) if self.draft_costs else 0.0)
        rate = tokens / seconds
        if not (self.draft_costs and ar):
            rate[0] = -np.inf  # (what a draft costs is not known yet: no ground for going AR)
        if not np.isfinite(rate[1:]).all():  # a step measured as taking no time: no basis for a choice
            return largest
        return largest - int(np.argmax(rate[::-1]))  # the last maximum: ties go to the larger tree

    def choose(self, budgets: Sequence[int], classes: Sequence[float], other_rows: int) -> int:
        """A step's choice before its drafts, given its speculating sessions' budgets and sampling classes
        (sampling_class) and its AR steps' count -> 0: every session AR, else the nodes to cut each tree to. One
        step in EXPLORE_EVERY takes the other choice (once a draft's cost is known). An optimisation: should
        choosing fail, the step drafts its full trees, never fails."""
        try:
            nodes = self.size(budgets, other_rows, classes)
            self._steps += 1
            if self._steps % EXPLORE_EVERY == 0 and self.draft_costs:
                nodes = 0 if nodes else self.size(budgets, other_rows, classes, ar=False)
        except Exception:
            self._failed("choose a step's speculation")
            return max(budgets, default=0)
        if self.chosen is not None:
            self.chosen.observe(nodes)
        return nodes

    def fit(self, trees: list[DraftTree], nodes: int) -> list[DraftTree]:
        """A step's trees cut to `nodes` (choose's); should a cut fail, the trees as drafted."""
        try:
            return [cut(tree, nodes) for tree in trees]
        except Exception:
            self._failed("cut a step's trees")
            return trees

    def _failed(self, what: str) -> None:
        """A measurement or a choice that raised: logged with its trace the first time (it would repeat every
        step)."""
        self.failures += 1
        if self.failures == 1:
            log.warning("the tree fit could not %s; its steps go with their trees as drafted", what, exc_info=True)


def _curve(means: dict[int, float], keys: np.ndarray) -> np.ndarray:
    """[m] keys (rounded to their quantum) -> [m] expected seconds from the running means by key: the measured mean at
    that key, else linear between the nearest keys measured; below the least one its cost (a forward costs no less
    with fewer rows than its weights' reading), above the largest one its cost per unit."""
    known = np.array(sorted(means))
    values = np.array([means[k] for k in known])
    return np.where(keys > known[-1], values[-1] * keys / known[-1], np.interp(keys, known, values))


def _running_mean(mean: float | None, sample: float) -> float:
    """A running mean after one more sample, the sample clipped at OUTLIER times the mean (the first one: itself)."""
    if mean is None:
        return sample
    return mean + COST_WEIGHT * (min(sample, OUTLIER * mean) - mean)


def _quantum(count: np.ndarray | int, quantum: int) -> np.ndarray | int:
    """Counts rounded up to a curve's resolution (trees: TREE_QUANTUM)."""
    return np.maximum(quantum, -(-count // quantum) * quantum)
