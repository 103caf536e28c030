"""The drafter engine: per-session context K/V caches and one draft step per round (transport-agnostic).

Two paths share the session bookkeeping and the checks: the static one (default; draft_graphs.py: cache slots from
a fixed pool, static buffers, CUDA graphs on a GPU, one host sync per round) and the eager one (`eager=True`:
a cache allocated per session, shapes that follow the context, nothing captured; the reference for the other).
"""

from __future__ import annotations

import time

import torch

from runtime.timing import TimerEvents
from draft_server.batched_drafts import BatchedDrafts
from draft_server.dflash import DFlashDrafter, sliding_window_mask
from draft_server.draft_graphs import StaticDrafter
from draft_server.session import CapacityError, DraftResult, DraftSession, SessionError, UnknownSessionError
from draft_server.target_head import TargetHead
from draft_server.tree import TreeLayouts, build_tree


class DraftEngine(BatchedDrafts):
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
    ) -> None:
        """eager: the dynamic path (a cache per session, nothing captured). Otherwise the static path holds at most
        `max_sessions` sessions of at most `max_context` positions each (default: the drafter's
        max_position_embeddings); a slot's memory is allocated when first needed, and CUDA graphs run on a GPU.
        compile: torch.compile the static path's context append, block layers and tree build (fewer, fused
        kernels; a few compiles in warm-up, then one per new budget). max_batch: the most sessions' drafts
        draft_batch runs in one forward."""
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
        self.sessions: dict[str, DraftSession] = {}
        self.timers = TimerEvents(self.device)
        max_context = max_context or cfg.max_position_embeddings
        if max_sessions < 1 or max_context < 2:
            raise ValueError(f"need max_sessions >= 1 and max_context >= 2, got {max_sessions} and {max_context}")
        self.max_batch = max_batch
        self.static = None if eager else StaticDrafter(drafter, head, max_sessions, max_context, compile=compile,
                                                       max_batch=max_batch)
        # the tree shapes' constants, kept per (budget, top_k); the static path's, when there is one
        self.layouts = (
            self.static.layouts if self.static else TreeLayouts(cfg.block_size - 1, head.vocab_size, self.device)
        )

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def feature_dim(self) -> int:
        return self.config.num_taps * self.config.hidden_size

    @property
    def eager(self) -> bool:
        return self.static is None

    def start_session(self, session_id: str, capacity: int) -> None:
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} already exists")
        if capacity < 1:
            raise SessionError(f"capacity must be >= 1, got {capacity}")
        if self.static is None:
            cfg = self.config
            shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
            ctx_k = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_hidden_layers)]
            ctx_v = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_hidden_layers)]
            self.sessions[session_id] = DraftSession(ctx_k, ctx_v, capacity, last_used=time.monotonic())
            return
        if capacity > self.static.max_context:
            raise CapacityError(f"capacity {capacity} exceeds the drafter's max_context {self.static.max_context}")
        slot = self.static.slots.acquire()
        if slot is None:
            raise CapacityError(
                f"all {self.static.slots.max_sessions} drafter session slots are in use "
                "(end a session, or raise --max-sessions)"
            )
        ctx_k, ctx_v = self.static.slots[slot]
        self.sessions[session_id] = DraftSession(ctx_k, ctx_v, capacity, slot=slot, last_used=time.monotonic())

    def end_session(self, session_id: str) -> bool:
        sess = self.sessions.pop(session_id, None)
        if sess is not None and sess.slot is not None:
            self.static.slots.release(sess.slot)
        return sess is not None

    def session(self, session_id: str) -> DraftSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown drafter session {session_id!r}") from None

    @torch.inference_mode()
    def draft(
        self,
        session_id: str,
        features: torch.Tensor | None,
        root_token: int,
        root_position: int,
        budget: int,
        top_k: int | None = None,
        host_tree: bool = False,
        tree_buffer: int = 0,
    ) -> DraftResult:
        """features [m, taps*hidden]: target hidden states for positions [length, length+m), which must end right
        before `root_position` (None: m = 0). Appends them to the context, drafts the block [root, MASK * (B-1)] at
        positions root_position.., and builds a tree of `budget` nodes (top_k=1, budget=B-1 gives the DFlash chain).
        Nothing here waits for the device: the tree stays on it, so a co-located verifier takes it from there and
        the round's one host sync is the verifier's. host_tree: the static path on a GPU also queues the tree's
        copy to the host as the wire carries it (DraftResult.nodes), for a caller that sends it on (the service);
        tree_buffer: which pinned buffer that copy lands in (a batch's drafts each need their own until read)."""
        sess, features = self._begin(session_id, features, root_token, root_position, budget)
        timer = self.timers.timer()
        if self.static is not None:
            self.static.draft(sess.slot, sess.length, features, root_token, root_position)
            sess.length = sess.length_max = root_position
            timer.mark()
            tree, nodes = self.static.tree(budget, top_k, host_tree, tree_buffer)
            timer.end()
            return DraftResult(tree, timer, nodes)
        self._append_eager(sess, features)
        logprobs = self._block_logprobs(sess, root_token, root_position)
        timer.mark()
        tree = build_tree(logprobs, root_token, budget, top_k, self.layouts.get(budget, top_k)[1])
        timer.end()
        return DraftResult(tree, timer)

    def _begin(
        self, session_id: str, features: torch.Tensor | None, root_token: int, root_position: int, budget: int
    ) -> tuple[DraftSession, torch.Tensor]:
        """A draft's checks (SessionError, the session untouched), then its session's context settled where the
        features begin -> (the session, the features, [0, taps*hidden] for none)."""
        sess = self.session(session_id)
        if features is None:
            features = torch.empty(0, self.feature_dim, dtype=self.dtype)
        m = features.shape[0]
        self._check_features(features)
        if sess.length == sess.length_max and sess.length + m != root_position:
            raise SessionError(
                f"context covers positions [0, {sess.length}) and {m} new features were sent, "
                f"so the root must be at position {sess.length + m}, not {root_position}"
            )
        self._check_room(sess, session_id, root_position)
        if not 0 <= root_token < self.head.vocab_size:
            raise SessionError(f"root token {root_token} outside vocabulary [0, {self.head.vocab_size})")
        self._check_budget(budget)
        sess.settle(root_position - m)
        sess.last_used = time.monotonic()
        return sess, features

    @torch.inference_mode()
    def append(self, session_id: str, features: torch.Tensor) -> tuple[int, float]:
        """features [m, taps*hidden], m >= 1: target hidden states for positions [length, length+m) -> their
        context K/V, nothing drafted: a prompt's features, chunk by chunk, as the verifier hands them out after
        its prefill (TakeFeatures). -> (the context's length now, the append's
        device seconds: reading it waits for the append, which no round is waiting behind)."""
        sess = self.session(session_id)
        self._check_features(features)
        m = features.shape[0]
        if m == 0:
            raise SessionError("an append needs at least one feature row")
        if sess.length != sess.length_max:
            raise SessionError("a session with a draft after a round in flight cannot take an append")
        self._check_room(sess, session_id, sess.length + m)
        sess.last_used = time.monotonic()
        timer = self.timers.timer()
        if self.static is not None:
            self.static.append(sess.slot, sess.length, features)
            sess.length = sess.length_max = sess.length + m
        else:
            self._append_eager(sess, features)
        timer.mark()
        return sess.length, timer.split()[0]

    def _append_eager(self, sess: DraftSession, features: torch.Tensor) -> None:
        """The eager path's context append: features [m, taps*hidden] at positions [length, length+m)."""
        end = sess.length + features.shape[0]
        if end == sess.length:
            return
        positions = torch.arange(sess.length, end, device=self.device)[None]
        new_kv = self.drafter.context_kv(features.to(self.device, self.dtype)[None], positions)
        for layer, (k, v) in enumerate(new_kv):
            sess.ctx_k[layer][:, :, sess.length : end] = k
            sess.ctx_v[layer][:, :, sess.length : end] = v
        sess.length = sess.length_max = end

    @torch.inference_mode()
    def draft_after(
        self,
        session_id: str,
        features: torch.Tensor,
        start: int,
        cursor: torch.Tensor,
        budget: int,
        top_k: int | None = None,
    ) -> DraftResult:
        """The draft of the round after a verify round still in flight on this device (static path only): features
        [n, taps*hidden] on the device are that round's path features for positions [start, start+n), of which
        only its accepted k+1 are real; cursor [2] = (start + k + 1, the bonus token) is its outcome there. All n
        rows are appended (those past k+1 land where the block's own rows, then later appends, overwrite them) and
        the block is drafted at the cursor's position, so nothing here waits for the round. The host learns k at
        the next draft, which starts its features at start + k + 1. The tree is the graph's own output (no copy a
        round): the caller queues the verify round that reads it before this engine drafts again."""
        sess = self.session(session_id)
        if self.static is None:
            raise SessionError("only the static path drafts after a round in flight")
        n = features.shape[0]
        self._check_features(features)
        if not 0 < n <= self.block_size or features.device != self.device:
            raise SessionError(f"a draft after a round takes 1 to {self.block_size} feature rows on {self.device}")
        self._check_room(sess, session_id, start + n)
        self._check_budget(budget)
        sess.settle(start)
        sess.last_used = time.monotonic()
        timer = self.timers.timer()
        self.static.draft_after(sess.slot, start, features, cursor, start + n)
        sess.length, sess.length_max = start + 1, start + n
        timer.mark()
        tree, _ = self.static.tree(budget, top_k, keep=False)
        timer.end()
        return DraftResult(tree, timer)

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
        """-> [B-1, vocab] fp32 log-probs; block position j predicts the token at root_position + j (no shift)."""
        if self.static is not None:
            return self.static.block_logprobs(sess.slot, root_token, root_position)
        b = self.block_size
        ids = torch.full((1, b), self.config.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = root_token
        positions = torch.arange(root_position, root_position + b, device=self.device)[None]
        cfg, sliding = self.config, None
        # Through a sliding layer no block query reaches context before `lo` (the root's window reaches furthest
        # back), so those layers attend over [lo, length) only; the mask trims the later queries' windows.
        lo = max(0, root_position - cfg.sliding_window + 1) if cfg.has_sliding_layers else 0
        starts = [lo if kind == "sliding_attention" else 0 for kind in cfg.layer_types]
        ctx = [(k[:, :, s : sess.length], v[:, :, s : sess.length]) for s, k, v in zip(starts, sess.ctx_k, sess.ctx_v)]
        if cfg.has_sliding_layers:
            ctx_pos = torch.arange(lo, sess.length, device=self.device)[None]
            sliding = sliding_window_mask(positions, ctx_pos, cfg.sliding_window)  # [1, 1, B, length-lo+B]
        hidden = self.drafter(self.head.embed_tokens(ids), positions, ctx, sliding_mask=sliding)  # [1, B, hidden]
        return torch.log_softmax(self.head.logits(hidden[0, 1:]).float(), dim=-1)
