"""SessionTable: the drafter's live sessions, from start to end: each one's context cache (a static slot, or
tensors of its own on the eager path), its grammar, and its prompt's blocks in the prefix cache
(draft_server/prefix_cache.py). DraftEngine runs the calls on them."""

from __future__ import annotations

import time
from collections.abc import Sequence

from draft_server.eager_drafter import EagerDrafter
from draft_server.grammar_tree import DraftGrammars
from draft_server.prefix_cache import DraftPrefixCache, PromptBlocks
from draft_server.session import CapacityError, DraftSession, SessionError, UnknownSessionError
from draft_server.static_drafter import StaticDrafter


class SessionTable:
    """Sessions by id over one of the engine's two paths: `static` (its slots) or `eager` (a cache per session)."""

    def __init__(self, static: StaticDrafter | None, eager: EagerDrafter | None, grammars: DraftGrammars) -> None:
        self.static, self.eager, self.grammars = static, eager, grammars
        self.sessions: dict[str, DraftSession] = {}
        self.prefix: DraftPrefixCache | None = None  # enable_prefix_cache

    def enable_prefix_cache(self, budget_bytes: int) -> None:
        """Keep prompt blocks' context past their sessions, within budget_bytes: sessions started from then on look
        their prompts up and offer their blocks (0: none kept)."""
        self.prefix = DraftPrefixCache(budget_bytes) if budget_bytes > 0 else None

    def start(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        """DraftEngine.start_session."""
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} already exists")
        if capacity < 1:
            raise SessionError(f"capacity must be >= 1, got {capacity}")
        if len(prompt) > capacity:
            raise SessionError(f"a prompt of {len(prompt)} tokens does not fit a capacity of {capacity}")
        state = self.grammars.start(grammar) if grammar else None
        if self.static is None:
            ctx_k, ctx_v = self.eager.caches(capacity)
            sess = self.sessions[session_id] = DraftSession(ctx_k, ctx_v, capacity, last_used=time.monotonic(),
                                                            grammar=state)
            return self._restore(sess, prompt)
        if capacity > self.static.max_context:
            raise CapacityError(f"capacity {capacity} exceeds the drafter's max_context {self.static.max_context}")
        slot = self.static.slots.acquire()
        if slot is None:
            raise CapacityError(
                f"all {self.static.slots.max_sessions} drafter session slots are in use "
                "(end a session, or raise --max-sessions)"
            )
        ctx_k, ctx_v = self.static.slots[slot]
        sess = self.sessions[session_id] = DraftSession(ctx_k, ctx_v, capacity, slot=slot, last_used=time.monotonic(),
                                                        grammar=state)
        return self._restore(sess, prompt)

    def end(self, session_id: str) -> bool:
        """Ends the session (its covered prompt blocks offered first) -> whether it existed."""
        sess = self.sessions.pop(session_id, None)
        if sess is None:
            return False
        if sess.blocks is not None and self.prefix is not None:
            self.offer(sess)
            self.prefix.release(sess.blocks)
        if sess.slot is not None:
            self.static.slots.release(sess.slot)
        return True

    def get(self, session_id: str) -> DraftSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown drafter session {session_id!r}") from None

    def offer(self, sess: DraftSession) -> None:
        """The session's prompt blocks its context covers (rows below its length are final), to the prefix cache
        (where it has a prompt there)."""
        if sess.blocks is not None and self.prefix is not None:
            self.prefix.offer(sess.blocks, sess.ctx_k, sess.ctx_v, sess.length)

    def _restore(self, sess: DraftSession, prompt: Sequence[int]) -> int:
        """A new session's prompt looked up in the prefix cache: its restored positions (0 without a cache)."""
        if self.prefix is None or not prompt:
            return 0
        sess.blocks = PromptBlocks(list(prompt))
        sess.length = self.prefix.restore(sess.blocks, sess.ctx_k, sess.ctx_v)
        return sess.length
