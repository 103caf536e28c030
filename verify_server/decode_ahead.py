"""AR steps launched before the host has read the step before them: the verifier service's decode steps back to
back on the device.

A service that runs a batch of Decodes, reads its tokens, answers, and only then launches the next batch leaves the
device idle through all of its host work in between (reading back, committing, the answer's and the next batch's
messages: at 64 sessions of an 8B target, a third of a step). An AR step needs nothing from the host but "go on":
its root is the token of the step before, which lies on the device. So a batch of Decodes whose choices are made
in the graph (greedy, or sampled with temperature and min-p alone) is launched and read later (`launch`, `read`),
and the next batch, once it has come in, is launched behind it on the device, each root taken from the tokens of
the step still unread (BatchTree.root). The host reads a step while the device runs the next. A tapped session's
step keeps its features at launch, as a round does at its end (the graph's next replay rewrites them). A session
with a grammar joins a launch only with no step of its own unread: its mask, made on the host, follows from its
committed tokens (verify_server/grammar.py), and it is read before its next.

A session's steps launched and not read are its `ahead` (VerifySession.ahead): its next step starts that far past
its committed length, and its slot keeps that many rows more when it grows. Anything else the engine runs on a
session's rounds reads every launched step first (VerifyEngine.settle), so that only these steps see a session
whose committed state lags its device state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback
from protos.types import StepResult
from runtime.timing import TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.session import AheadStep, VerifySession
from verify_server.step_inputs import ROOT_ONLY
from verify_server.tree_batch import BatchTree
from verify_server.walk import session_draws, session_grammars, shared_taps, timed

log = logging.getLogger(__name__)

MAX_AHEAD = 2  # steps launched and not read at once: the one on the device and the one queued behind it


class DecodesAhead:
    """Launches batches of AR steps through the fused runner's batched graphs and reads them in launch order.
    sessions: the engine's table, not a copy (a session ended while its step ran is not committed to); committed:
    called with each live session's result as it is read (the engine's prefix cache takes its blocks)."""

    def __init__(
        self, fused: FusedRunner, timers: TimerEvents, sessions: dict[str, VerifySession],
        committed: Callable[[str, StepResult], StepResult],
    ) -> None:
        self.fused = fused
        self.timers = timers
        self.sessions = sessions
        self.committed = committed
        self.unread: list[AheadStep] = []  # launched and not read, oldest first
        # where each step's tokens land on the host: a ring longer than the steps unread at once
        self._readback = [PinnedReadback(fused.slots.max_sessions, torch.long, fused.device)
                          for _ in range(MAX_AHEAD + 1)]
        self._launched = 0

    def launchable(self, session_ids: list[str]) -> list[VerifySession] | None:
        """The sessions, where one launch can take a step of each: all known and prefilled, those with taps all
        tapping the same layers (one graph, whose features the untapped ones leave), with their choices made in the
        graph and all of one kind (greedy, or sampled), none twice, each with room for its step, those with a
        step unread all in the last step launched, and those with a grammar none unread; else None (the caller runs
        the calls the ordinary way)."""
        if not self.fused.batches_static or len(self.unread) >= MAX_AHEAD or not session_ids:
            return None
        if len(session_ids) > self.fused.slots.max_sessions or len(set(session_ids)) < len(session_ids):
            return None
        last = self.unread[-1] if self.unread else None
        found = []
        for session_id in session_ids:
            sess = self.sessions.get(session_id)
            if sess is None or sess.root is None or not sess.params.captured:
                return None
            if sess.ahead and (sess.ahead[-1][0] is not last or sess.grammar is not None):
                return None
            found.append(sess)
        if len({sess.params.greedy for sess in found}) > 1 or len({tuple(s.taps) for s in found if s.taps}) > 1:
            return None
        if not all(sess.has_room(sess.cache.length + len(sess.ahead) + 1) for sess in found):
            return None  # (the call that has no room gets its error the ordinary way)
        return found

    def launch(
        self, session_ids: list[str], sessions: list[VerifySession], host_features: bool
    ) -> AheadStep | None:
        """One AR step of each session (`launchable`'s answer) in one replay, queued behind the steps unread ->
        the step, unread; None where it cannot run (out of device memory: nothing is launched). Tapped sessions'
        root rows of features are kept at launch, in host memory where host_features, as a round's are
        (VerifySession.kept_rows)."""
        last = self.unread[-1] if self.unread else None
        items = []
        for sess in sessions:
            root = sess.root
            if sess.ahead:  # its root is the token of the step before, which only the device holds yet
                root = -(sess.ahead[-1][1] + 1)
            items.append(BatchTree(sess.cache, ROOT_ONLY, root, len(sess.ahead)))
        roots_from = None if last is None else last.tokens
        taps = shared_taps(sessions)
        timer = self.timers.timer()
        greedy = sessions[0].params.greedy
        grammars = session_grammars(sessions)
        try:
            draws = session_draws(sessions, items)
            captured = (self.fused.batch_round(items, taps, roots_from, grammars) if greedy
                        else self.fused.sampled_round(items, taps, draws, roots_from, grammars))
            if captured is None:
                raise RuntimeError("a batch of AR steps on the static path was not captured")
            timer.mark()
            packed, features = captured  # [trees, 2 + 1], [trees, 1, taps*hidden] or None: the graph's outputs
            tokens = packed[:, 1].clone()  # [trees] the bonus tokens: the graph's next replay rewrites its own
            ring = self._readback[self._launched % len(self._readback)]
            stored, host = ring.target(tokens[: len(sessions)])
            copies, kept = [(stored, tokens[: len(sessions)])], None
            if features is not None and not host_features:
                # [sessions, 1, taps*hidden] every session's root row kept in one allocation (each its row of it)
                block = torch.empty_like(features[: len(sessions), :1])
                copies.append((block, features[: len(sessions), :1]))
                kept = [block[b] if sess.taps else None for b, sess in enumerate(sessions)]
            elif features is not None:
                kept = []
                for b, sess in enumerate(sessions):
                    if not sess.taps:  # (an untapped session in a tapped graph: its features go nowhere)
                        kept.append(None)
                        continue
                    rows = features[b, :1]  # [1, taps*hidden] the root's row: the step's one committed position
                    dst, rows_kept = sess.kept_rows(sess.next_ring(), rows, host_features)
                    copies.append((dst, rows))
                    kept.append(rows_kept)
            copy_together(copies)
        except torch.OutOfMemoryError:
            log.warning("a batch of %d AR steps launched ahead ran out of memory; stepping them as they come",
                        len(sessions))
            return None
        timer.end()
        self._launched += 1
        now = time.monotonic()
        step = AheadStep(list(zip(session_ids, sessions)), tokens, host, timer, kept)
        for i, sess in enumerate(sessions):
            sess.last_used = now
            sess.ahead.append((step, i))
        self.unread.append(step)
        return step

    def read(self, step: AheadStep) -> list[StepResult]:
        """The step's results, read (waiting for it, and for the steps launched before it, in order) and committed
        once: each session's length and root move past its token. A session ended meanwhile is left as it is."""
        while step.results is None:
            oldest = self.unread[0]
            host = oldest.timer.sync(oldest.host.tolist)
            self.unread.pop(0)
            for session_id, sess in oldest.sessions:
                sess.ahead.popleft()
            results = timed([StepResult([token], None if oldest.features is None else oldest.features[i])
                             for i, token in enumerate(host)], oldest.timer)
            for (session_id, sess), result in zip(oldest.sessions, results):
                if self.sessions.get(session_id) is sess:
                    sess.cache.length += 1
                    sess.took(result.tokens)
                    self.committed(session_id, result)
            oldest.results = results
        return step.results

    def settle(self) -> None:
        """Reads every step launched (their results committed and kept for their callers)."""
        if self.unread:
            self.read(self.unread[-1])
