"""The acceptance walk: which root-to-node path of a scored tree the target agrees with, on the device
(accept_path, which captured rounds run inside their graph), and the end of an uncaptured round around it: each
tree's choices (within its session's grammar, after its logits processors), walk and compaction, the committed tokens'
log-probabilities where asked, and the session's commit (walk_and_commit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels.device_copies import copy_together
from protos.types import StepResult
from runtime.timing import StepTimer
from verify_server.processors import PathLogprobs, path_logprobs, process_logits
from verify_server.sampling import TreeDraws, choose_tokens
from verify_server.grammar import TreeGrammar
from verify_server.session import VerifySession
from verify_server.state_cache import TreeScratch
from verify_server.tree_batch import BatchTree


def accept_path(
    ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    anc: torch.Tensor,
    choice: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, parents, depths [q] (the root's parent, -1 or 0, is never read); anc [q, q] bool ancestor-or-self
    matrix; choice [q]: the target's token after each node; valid [q] bool (None: all), False for padding nodes
    that must never be accepted -> packed [2 + q] = (accepted depth k, the bonus token, the path's tokens
    root..deepest, then filler) and path [q] = the path's node indices root..deepest, then q for the rest.

    A node is accepted when it and all its ancestors are the target's choices after their parents; the deepest
    accepted node ends the path. Fixed shapes and no host sync: the same code runs eagerly or inside a graph."""
    q = ids.shape[0]
    nodes = torch.arange(q, device=ids.device)
    match = (ids == choice[parents.clamp(min=0)]) | (nodes == 0)  # the root is given
    if valid is not None:
        match &= valid
    accepted = ~(anc & ~match[None, :]).any(dim=1)  # [q]
    # index_select with a device index, never t[0-d tensor]: that reads the index on the host (a sync, and an
    # error inside graph capture)
    deepest = torch.where(accepted, depths, -1).argmax().view(1)
    # A path holds one node per depth 0..k: node at depth d goes to row d (a scatter: cheaper than a sort by
    # index), every other node to a spare row q, dropped.
    row = torch.where(anc.index_select(0, deepest)[0], depths, q)  # [q]
    path = torch.full((q + 1,), q, dtype=nodes.dtype, device=ids.device).scatter(0, row, nodes)[:q]
    packed = torch.cat((depths.index_select(0, deepest), choice.index_select(0, deepest), ids[path.clamp(max=q - 1)]))
    return packed, path


class TreeRows(NamedTuple):
    """One tree's rows of a forward, on the device: what its sampling, walk and compaction read."""

    ids: torch.Tensor  # [q], the session's root first
    parents: torch.Tensor  # [q]
    depths: torch.Tensor  # [q]
    anc: torch.Tensor  # [q, q] ancestor-or-self
    logits: torch.Tensor  # [q, V] fp32
    features: torch.Tensor | None  # [q, taps*hidden]
    max_depth: int  # the deepest a path can reach (the drafter's block size - 1)


def walk_and_commit(
    sessions: list[VerifySession], trees: list[TreeRows], timer: StepTimer, host_features: bool,
    scratch: TreeScratch | None = None,
) -> list[StepResult]:
    """An uncaptured round's end, one tree or several (verify_batch's): each tree's choices (sampled with its
    session's draws), walk, compaction (and a hybrid target's recurrent state, from `scratch`), with one host
    sync for all. host_features: each path's features are queued to the session's host rows before that sync, as
    a captured round's are (read after it, they would cost the caller a second sync)."""
    timer.mark()
    packed, paths, kept, copies = [], [], [], []
    scored: list[PathLogprobs | None] = []
    for sess, tree in zip(sessions, trees):
        logits = tree.logits
        if sess.grammar is not None:  # the tree on the host: the grammar walks it there
            logits = sess.grammar.constrain(logits, tree.ids.tolist(), tree.parents.tolist())
        logits = process_logits(logits, sess.params, sess.history, tree.ids, tree.anc, tree.depths)  # [q, V]
        # [q] the target's token after each
        choice = choose_tokens(logits, sess.params, sess.draws, sess.cache.length, tree.depths)
        walked, path = accept_path(tree.ids, tree.parents, tree.depths, tree.anc, choice)
        packed.append(walked)
        paths.append(path)
        scored.append(None)
        if sess.params.logprobs is not None:  # at the path's nodes, each committed token's (raw) log-probability
            q = tree.ids.shape[0]
            rows = path[: min(tree.max_depth + 1, q)].clamp(max=q - 1)
            scored[-1] = path_logprobs(tree.logits, rows, choice.index_select(0, rows), sess.params.logprobs)
        if host_features and tree.features is not None:
            q = tree.ids.shape[0]
            # rows past the accepted depth point at the spare row q: clamped, they copy a row never read
            rows = tree.features.index_select(0, path[: min(tree.max_depth + 1, q)].clamp(max=q - 1))
            stored, rows_kept = sess.kept_rows(sess.next_ring(), rows, True)
            copies.append((stored, rows))
            kept.append(rows_kept)
        else:
            kept.append(None)
    copy_together(copies)
    host = timer.sync((packed[0] if len(packed) == 1 else torch.cat(packed)).tolist)  # the single host sync
    results, at = [], 0
    for i, (sess, path, tree) in enumerate(zip(sessions, paths, trees)):
        q = tree.ids.shape[0]
        answer = host[at : at + 2 + q]
        at += 2 + q
        k, bonus = answer[0], answer[1]
        keep = path[: k + 1]
        sess.cache.compact(sess.cache.length, keep)
        if sess.states is not None:
            sess.states.commit(scratch, keep)
        tokens = answer[3 : 3 + k] + [bonus]
        sess.took(tokens)
        features = kept[i][: k + 1] if kept[i] is not None else None if tree.features is None else tree.features[keep]
        logprobs = None if scored[i] is None else scored[i].read(k + 1)
        results.append(StepResult(tokens, features, logprobs=logprobs))
    return timed(results, timer)


def commit_captured(
    sessions: list[VerifySession], items: list[BatchTree],
    captured: tuple[torch.Tensor, torch.Tensor | None], timer: StepTimer, host_features: bool,
) -> list[StepResult]:
    """A captured batch (greedy, within grammars or not, or sampled in the graph): its walks and compactions ran in
    the graph; each tree's path features are queued to memory of their own as a lone round's are (as many rows as
    its path can have), then the host reads the outcomes and commits them (a grammar's state too)."""
    packed, features = captured  # [trees, 2 + qb], [trees, qb, taps*hidden] or None
    timer.mark()
    kept, copies = [], []
    if features is not None:
        for b, (sess, item) in enumerate(zip(sessions, items)):
            if not sess.taps:  # (an untapped session in a tapped graph: its features go nowhere)
                kept.append(None)
                continue
            rows = features[b, : min(item.tree.max_depth + 1, features.shape[1])]  # [advance, taps*hidden]
            stored, rows_kept = sess.kept_rows(sess.next_ring(), rows, host_features)
            copies.append((stored, rows))
            kept.append(rows_kept)
    copy_together(copies)
    host = timer.sync(packed.tolist)  # the batch's single host sync
    results = []
    for b, sess in enumerate(sessions):
        k, bonus = host[b][0], host[b][1]
        sess.cache.length += k + 1
        tokens = host[b][3 : 3 + k] + [bonus]
        sess.took(tokens)
        results.append(StepResult(tokens, kept[b][: k + 1] if kept and kept[b] is not None else None))
    return timed(results, timer)


def shared_taps(sessions: list[VerifySession]) -> tuple[int, ...]:
    """The layers a batch of sessions taps: those its tapped sessions share (one graph for all, whose features the
    untapped ones leave); none where none taps."""
    return next((tuple(sess.taps) for sess in sessions if sess.taps), ())


def session_grammars(sessions: list[VerifySession]) -> list[TreeGrammar | None] | None:
    """A captured batch's grammars, each session's (None for one without), where any session has one: the graph then
    masks every row (all tokens allowed in the rows of those without); None where none has one."""
    return [sess.grammar for sess in sessions] if any(sess.grammar for sess in sessions) else None


def session_draws(sessions: list[VerifySession], items: list[BatchTree]) -> Callable[[], list[TreeDraws]]:
    """What a captured sampled batch draws its trees' choices with: each session's numbers by depth from its
    tree's root (past the steps launched ahead of it), its temperature and min_p."""
    return lambda: [TreeDraws(sess.draws.by_depth(item.start, item.tree.tokens.shape[0]), sess.params.temperature,
                              sess.params.min_p) for sess, item in zip(sessions, items)]


def timed(results: list[StepResult], timer: StepTimer) -> list[StepResult]:
    """Every call of a round's forward (one tree's, or a batch's) reports its forward and walk times."""
    forward_s, walk_s = timer.split()
    for result in results:
        result.forward_s, result.timings = forward_s, {"walk_s": walk_s}
    return results
