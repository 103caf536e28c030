"""DraftEngine: the drafter's calls (transport-agnostic) on its sessions (session_table.py: their context caches,
grammars and prefix blocks): one draft step per round, and the drafts of several sessions together.

Two paths share the session bookkeeping and the checks: the static one (default; static_drafter.py: cache slots
from a fixed pool, static buffers, CUDA graphs on a GPU, one host sync per round) and the eager one (`eager=True`:
a cache allocated per session, shapes that follow the context, nothing captured; the reference for the other).
A session with a grammar drafts its block on either path, and its tree within the grammar on the host
(grammar_tree.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from runtime.timing import TimerEvents
from draft_server.block_batch import BlockCall
from draft_server.dflash import DFlashDrafter
from draft_server.eager_drafter import EagerDrafter
from draft_server.grammar_tree import DraftGrammars, grammar_tree
from draft_server.prefix_cache import DraftPrefixCache
from draft_server.session import CapacityError, DraftCall, DraftResult, DraftSession, SessionError
from draft_server.session_table import SessionTable
from draft_server.static_drafter import StaticDrafter
from draft_server.target_head import TargetHead


class DraftEngine:
    """The drafter's sessions and the calls on them, over one of two paths: `static` (a StaticDrafter) or, with
    eager=True, `eager_drafter` (an EagerDrafter); the other is None."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: TargetHead,
        *,
        eager: bool = False,
        max_sessions: int = 16,
        max_context: int | None = None,
        compile: bool = False,
        max_batch: int = 1,
        target_path: str | Path | None = None,
        constrained: bool = True,
    ) -> None:
        """eager: the dynamic path (a cache per session, nothing captured). Otherwise the static path holds at most
        `max_sessions` sessions of at most `max_context` positions each (default: the drafter's
        max_position_embeddings); a slot's memory is allocated when first needed, and CUDA graphs run on a GPU.
        compile: torch.compile the static path's context append, block layers and tree build (fewer, fused
        kernels; a few compiles in warm-up, then one per new budget). max_batch: the most sessions' drafts
        draft_batch runs in one forward (the service's --max-batch). target_path, constrained: the sessions'
        grammars (DraftGrammars)."""
        cfg = drafter.config
        if head.embed.shape[1] != cfg.hidden_size:
            raise ValueError(f"target hidden size {head.embed.shape[1]} != drafter hidden size {cfg.hidden_size}")
        if cfg.mask_token_id >= head.embed.shape[0]:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary ({head.embed.shape[0]})")
        self.drafter = drafter
        self.head = head
        self.config = cfg
        self.device = head.embed.device
        self.dtype = head.embed.dtype
        self.timers = TimerEvents(self.device)
        max_context = max_context or cfg.max_position_embeddings
        if max_sessions < 1 or max_context < 2:
            raise ValueError(f"need max_sessions >= 1 and max_context >= 2, got {max_sessions} and {max_context}")
        self.max_batch = max_batch
        self.static = None if eager else StaticDrafter(drafter, head, max_sessions, max_context, compile=compile,
                                                       max_batch=max_batch)
        self.eager_drafter = EagerDrafter(drafter, head) if eager else None
        self.table = SessionTable(self.static, self.eager_drafter,
                                  DraftGrammars(target_path, head.vocab_size, constrained))

    def enable_prefix_cache(self, budget_bytes: int) -> None:
        """Keep prompt blocks' context past their sessions, within budget_bytes (draft_server/prefix_cache.py):
        sessions started from then on look their prompts up and offer their blocks."""
        self.table.enable_prefix_cache(budget_bytes)

    @property
    def sessions(self) -> dict[str, DraftSession]:
        return self.table.sessions

    @property
    def prefix(self) -> DraftPrefixCache | None:
        return self.table.prefix

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def feature_dim(self) -> int:
        return self.config.num_taps * self.config.hidden_size

    @property
    def eager(self) -> bool:
        return self.static is None

    def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        """grammar: the output's (SamplingParams.grammar's wire form; "" none), which the session's trees follow
        where grammars are `constrained`; SessionError for one that does not parse or compile. prompt: the
        request's prompt tokens, for the prefix cache (none: nothing looked up or offered) -> the positions whose
        context the prefix cache restored: the session's first features start there."""
        return self.table.start(session_id, capacity, grammar, prompt)

    def end_session(self, session_id: str) -> bool:
        return self.table.end(session_id)

    def session(self, session_id: str) -> DraftSession:
        return self.table.get(session_id)

    @torch.inference_mode()
    def draft(
        self,
        session_id: str,
        features: torch.Tensor | None,
        root_token: int,
        root_position: int,
        budget: int,
        top_k: int | None = None,
        committed: Sequence[int] = (),
        host_tree: bool = False,
        tree_buffer: int = 0,
    ) -> DraftResult:
        """features [m, taps*hidden]: target hidden states for positions [length, length+m), which must end right
        before `root_position` (None: m = 0). Appends them to the context, drafts the block [root, MASK * (B-1)] at
        positions root_position.., and builds a tree of `budget` nodes (top_k=1, budget=B-1 gives the DFlash chain).
        Nothing here waits for the device: the tree stays on it, so a co-located verifier takes it from there and
        the round's one host sync is the verifier's. host_tree: the static path on a GPU also queues the tree's
        copy to the host as the wire carries it (DraftResult.nodes), for a caller that sends it on (the service);
        tree_buffer: which pinned buffer that copy lands in (a batch's drafts each need their own until read).
        committed: a session with a grammar's output tokens since its previous draft, ending with the root
        (DraftGrammar.advance); its tree is built within the grammar on the host (one read of the candidates)."""
        sess, features = self._begin(session_id, features, root_token, root_position, budget, committed)
        timer = self.timers.timer()
        if self.static is not None:
            self.static.draft(sess.slot, sess.length, features, root_token, root_position)
            sess.length = root_position
            timer.mark()
            if sess.grammar is not None:
                tree, nodes = grammar_tree(self.static.logprobs, root_token, budget, top_k, sess.grammar), None
            else:
                tree, nodes = self.static.tree(budget, top_k, host_tree, tree_buffer)
            timer.end()
            return DraftResult(tree, timer, nodes)
        self.eager_drafter.append(sess, features)
        logprobs = self.eager_drafter.block_logprobs(sess, root_token, root_position)
        timer.mark()
        if sess.grammar is not None:
            tree = grammar_tree(logprobs, root_token, budget, top_k, sess.grammar)
        else:
            tree = self.eager_drafter.tree(logprobs, root_token, budget, top_k)
        timer.end()
        return DraftResult(tree, timer)

    def _begin(
        self, session_id: str, features: torch.Tensor | None, root_token: int, root_position: int, budget: int,
        committed: Sequence[int],
    ) -> tuple[DraftSession, torch.Tensor]:
        """A draft's checks (SessionError, the session untouched), then its session's grammar (if any) moved past
        the committed tokens -> (the session, the features, [0, taps*hidden] for none)."""
        sess = self.session(session_id)
        if features is None:
            features = torch.empty(0, self.feature_dim, dtype=self.dtype)
        m = features.shape[0]
        self._check_features(features)
        if sess.length + m != root_position:
            raise SessionError(
                f"context covers positions [0, {sess.length}) and {m} new features were sent, "
                f"so the root must be at position {sess.length + m}, not {root_position}"
            )
        self._check_room(sess, session_id, root_position)
        if not 0 <= root_token < self.head.vocab_size:
            raise SessionError(f"root token {root_token} outside vocabulary [0, {self.head.vocab_size})")
        self._check_budget(budget)
        self.table.offer(sess)  # the rows it covers are final: the prompt's, once the first draft has appended them
        if sess.grammar is not None:
            sess.grammar.advance(committed, root_token, root_position)
        sess.last_used = time.monotonic()
        return sess, features

    @torch.inference_mode()
    def draft_batch(self, calls: list[DraftCall], host_tree: bool = False) -> list[DraftResult | Exception]:
        """Several sessions' drafts, their blocks in one forward where the static path batches -> each call's
        DraftResult, or the exception draft() would raise for it: each outcome is what draft() would give the call
        alone (the same tree, up to the reduction order of the batched projections in bf16, or the same error).
        Only the blocks' forward is shared: each session's append and tree build run as alone. The calls that pass
        their checks, one per session, draft together; the others (and a session's second call, which comes after
        its first) draft alone, in order, after them."""
        if len(calls) == 1 or self.static is None or not self.static.batches:
            return [self._alone(call, host_tree, i) for i, call in enumerate(calls)]
        outcomes: list[DraftResult | Exception | None] = [None] * len(calls)
        together: list[tuple[int, BlockCall]] = []
        seen: set[str] = set()
        for i, call in enumerate(calls):
            if call.session_id in seen:
                continue
            try:
                sess, features = self._begin(call.session_id, call.features, call.root_token, call.root_position,
                                             call.budget, call.committed)
            except Exception as exc:  # noqa: BLE001 - this call's own error
                outcomes[i] = exc
                continue
            seen.add(call.session_id)
            together.append((i, BlockCall(sess.slot, sess.length, features, call.root_token, call.root_position)))
        if len(together) > 1:
            self._draft_together(calls, together, outcomes, host_tree)
        for i, call in enumerate(calls):
            if outcomes[i] is None:  # its host tree in a buffer after the one of the blocks drafted together
                outcomes[i] = self._alone(call, host_tree, 1 + i)
        return outcomes

    def _draft_together(
        self, calls: list[DraftCall], together: list[tuple[int, BlockCall]],
        outcomes: list[DraftResult | Exception | None], host_tree: bool,
    ) -> None:
        """The checked calls' blocks in one forward, then each one's tree; every result shares the batch's timer
        (forward: the appends and the blocks; rest: the trees). A session with a grammar takes its tree from its
        block's log-probs on the host; the batch's tree graph still builds one for it (dropped), so that the graph
        stays the one of the batch's shapes."""
        timer = self.timers.timer()
        batch = self.static.draft_batch([block for _, block in together])
        sessions = []
        for i, block in together:
            sess = self.session(calls[i].session_id)
            sess.length = block.position
            sessions.append(sess)
        timer.mark()
        trees = self.static.batch_trees(batch, [(calls[i].budget, calls[i].top_k) for i, _ in together], host_tree)
        for b, ((i, block), sess, (tree, nodes)) in enumerate(zip(together, sessions, trees)):
            if sess.grammar is not None:
                tree = grammar_tree(batch.logprobs[b], block.root, calls[i].budget, calls[i].top_k, sess.grammar)
                nodes = None
            outcomes[i] = DraftResult(tree, timer, nodes)
        timer.end()

    def _alone(self, call: DraftCall, host_tree: bool, tree_buffer: int) -> DraftResult | Exception:
        """draft() -> its result, or the exception it raised (the call's own outcome; the batch goes on).
        tree_buffer: its host tree's own buffer, as every result of the batch is read after the last is drafted."""
        try:
            return self.draft(*call, host_tree=host_tree, tree_buffer=tree_buffer)
        except Exception as exc:  # noqa: BLE001
            return exc

    @torch.inference_mode()
    def append(self, session_id: str, features: torch.Tensor) -> tuple[int, float]:
        """features [m, taps*hidden], m >= 1: target hidden states for positions [length, length+m) -> their
        context K/V, nothing drafted: a prompt's features, chunk by chunk, as the verifier sends them after each
        chunk of its prefill. -> (the context's length now, the append's device seconds: reading them waits
        for the append, which no round is waiting behind)."""
        sess = self.session(session_id)
        self._check_features(features)
        m = features.shape[0]
        if m == 0:
            raise SessionError("an append needs at least one feature row")
        self._check_room(sess, session_id, sess.length + m)
        self.table.offer(sess)
        sess.last_used = time.monotonic()
        timer = self.timers.timer()
        if self.static is not None:
            self.static.append(sess.slot, sess.length, features)
            sess.length += m
        else:
            self.eager_drafter.append(sess, features)
        timer.mark()
        return sess.length, timer.split()[0]

    def _check_features(self, features: torch.Tensor) -> None:
        if features.ndim != 2 or features.shape[1] != self.feature_dim:
            raise SessionError(f"features must be [m, {self.feature_dim}], got {list(features.shape)}")

    @staticmethod
    def _check_room(sess: DraftSession, session_id: str, root_position: int) -> None:
        if root_position + 1 > sess.capacity:
            raise CapacityError(f"session {session_id!r} context capacity {sess.capacity} exhausted")

    @staticmethod
    def _check_budget(budget: int) -> None:
        if budget < 1:
            raise SessionError(f"budget must be >= 1, got {budget}")

    def _block_logprobs(self, sess: DraftSession, root_token: int, root_position: int) -> torch.Tensor:
        """-> [B-1, vocab] fp32 log-probs of the block at root_position over the session's context, uncaptured;
        block position j predicts the token at root_position + j (no shift)."""
        if self.static is not None:
            return self.static.block_logprobs(sess.slot, root_token, root_position)
        return self.eager_drafter.block_logprobs(sess, root_token, root_position)
