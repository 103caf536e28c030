"""The verifier engine: prefill, tree verification in one forward, the acceptance walk, KV compaction, AR decode.

Its parts: the fused path's runner (verify_server/fused_runner.py) where the target has one, else the HF modules
with the tree attention of tree_attention.py and linear_attention.py; several sessions' rounds in one forward
(batched_rounds.py, BatchedRounds); AR steps launched before the host reads the step before (decode_ahead.py,
DecodesAhead); a prompt's prefill, whole or in chunks (prefill.py, PromptPrefill), and several sessions' prompts in
one forward (prompt_batch.py, PromptBatch); the walk and commit of a round (walk.py); a session's state
(session.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback
from protos.types import DraftTree, SamplingParams, StepResult
from runtime.grammar import Grammars
from runtime.models import read_eos_ids
from runtime.timing import StepTimer, TimerEvents
from verify_server.batched_rounds import BatchedRounds
from verify_server.decode_ahead import AheadStep, DecodesAhead
from verify_server.fused import fused_unsupported
from verify_server.fused_runner import FusedRunner
from verify_server.grammar import TreeGrammar
from verify_server.hf_forward import HFForward
from verify_server.cache_slots import MIN_SLOT_TOKENS, CacheSlots, NoMemory, OwnCaches
from verify_server.kv_cache import KVCache
from verify_server.prefill import PrefillCall, PromptPrefill
from verify_server.prefix_cache import PrefixCache, SessionBlocks
from verify_server.processors import TokenHistory
from verify_server.prompt_batch import PromptBatch, end_failed_starts
from verify_server.sampling import Draws
from verify_server.session import CapacityError, MemoryShortError, SessionError, UnknownSessionError, VerifySession
from verify_server.state_cache import LinearLayout, StateCache, TreeScratch
from verify_server.step_attention import INVARIANT
from verify_server.step_inputs import MAX_GRAPH_NODES, ROOT_ONLY
from verify_server.tree_attention import ATTENTION_NAME, ancestor_matrix
from verify_server.tree_batch import BatchTree
from verify_server.walk import TreeRows, commit_captured, session_draws, session_grammars, timed, walk_and_commit

log = logging.getLogger(__name__)


def load_target(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Any HF causal LM from a local directory, wired to the tree attention of verify_server/tree_attention.py.
    Never downloads."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in target directory {path}")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
    )
    return model.to(device).eval()


class VerifyEngine:
    """One target's verification for many sessions: the steps a service or an in-process step engine calls
    (start_session, prefill, prefill_batch, verify, decode, verify_batch, launch_decodes /
    read_decodes, end_session)."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_tree_size: int = 1024,
        max_sessions: int = 16,
        fused: bool = True,
        graphs: bool = True,
        compile: bool = False,
        fused_rows: int | None = None,
        attention: str | None = None,
        max_batch: int = 8,
        target_path: str | Path | None = None,
    ) -> None:
        """max_tree_size: largest tree (nodes without the root) verify accepts; sizes a hybrid target's scratch.
        fused: run Qwen3 / Llama / Qwen2 targets through the fused forward (verify_server/fused.py) with static
        buffers, CUDA graphs when `graphs` and on a GPU, and at most max_sessions cache slots; other targets, or
        fused=False, take the generic path through the HF modules. compile: torch.compile the fused layer step
        (fewer, fused kernels per layer; each new step shape compiles once, in warm-up or on first use). fused_rows:
        the fused path's steps of up to this many rows run the Triton projections of kernels/gemv.py where they can
        (a GPU with Triton); None: FusedRunner's default. attention: the fused path's attention kernel
        (step_attention.ATTENTION_CHOICES; INVARIANT, the deterministic mode, needs the fused path: a ValueError
        where it has none); None: FusedRunner's default. max_batch: the most sessions' rounds
        verify_batch runs in one forward (bounds what the fused path compiles at start-up). target_path: the
        target's directory, whose tokenizer compiles the verifier sessions' grammars (None: a session that brings
        one is refused)."""
        cfg = model.config
        self.model = model
        self.lm_head = model.get_output_embeddings()
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = self.lm_head.weight.device
        self.dtype = self.lm_head.weight.dtype
        self.sessions: dict[str, VerifySession] = {}
        self.target_path = target_path
        self.grammars: Grammars | None = None  # built from target_path when a verifier session first brings a grammar
        self.timers = TimerEvents(self.device)
        self.fused: FusedRunner | None = None
        self.ahead: DecodesAhead | None = None  # the fused path's AR steps launched before the last one is read
        no_fused = "the generic HF path was asked for" if not fused else fused_unsupported(cfg)
        if attention == INVARIANT and no_fused is not None:
            raise ValueError(f"the deterministic mode needs the fused path (Qwen3 / Llama / Qwen2 targets): {no_fused}")
        if no_fused is None:
            self.fused = FusedRunner(model, self.num_layers, max_sessions, graphs, compile, attention, fused_rows,
                                     max_batch)
            self.ahead = DecodesAhead(self.fused, self.timers, self.sessions, self._cached)
        # a call that cannot join a batch runs alone through _verify; verify_batch then commits it with the rest
        self.batched = BatchedRounds(self.fused, self.timers, self.sessions, self._verify)
        # a prompt chunk that no captured prompt step runs goes through _forward
        self.prompts = PromptPrefill(self.fused, self.timers, self.device, self._forward)
        self.prompt_batch = PromptBatch(self.prompts, self.fused)
        self.hf: HFForward | None = None  # the generic path, for targets without a fused one
        # a hybrid target's gated-delta layout (None: every layer has K/V), and its tree's per-node factors
        self.linear: LinearLayout | None = None
        self.scratch: TreeScratch | None = None
        if self.fused is None:
            self.hf = HFForward(model, max_tree_size + 1)
            self.linear, self.scratch = self.hf.linear, self.hf.scratch
        self.kv_layers = [i for i in range(self.num_layers) if self.linear is None or i not in self.linear.layer_ids]
        # where sessions' caches come from, and larger ones as they grow
        row_bytes = 2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        self.caches: CacheSlots = self.fused.slots if self.fused is not None else OwnCaches(
            lambda rows: KVCache(self.kv_layers, self.num_kv_heads, self.head_dim, rows, self.device, self.dtype),
            row_bytes)
        # Whether a prompt's prefix can be restored from cached K/V: not on hybrids, whose linear-attention state
        # after a prefix is no slice of anything kept (verify_server/state_cache.py)
        self.caches_prefixes = self.linear is None
        self.prefix: PrefixCache | None = None  # enable_prefix_cache

    @property
    def path(self) -> str:
        """Which forward runs: 'fused+graphs', 'fused' or 'hf'."""
        if self.fused is None:
            return "hf"
        return "fused+graphs" if self.fused.graphs.enabled else "fused"

    def limit_kv_caches(self, nbytes: int) -> None:
        """From now on the sessions' KV caches hold at most nbytes (--kv-cache-gib): a step past it fails
        MemoryShortError with nothing changed."""
        self.caches.limit_to(nbytes)

    def enable_prefix_cache(self, budget_bytes: int) -> None:
        """Keeps committed tokens' K/V and features past their sessions, up to budget_bytes of device memory
        (verify_server/prefix_cache.py), where this engine caches prefixes (caches_prefixes); said once in the log
        where it does not."""
        if not self.caches_prefixes:
            log.info("prefix caching is off: this target's linear-attention state cannot be restored at a prefix")
            return
        self.prefix = PrefixCache(budget_bytes, self.device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_tree_size: int = 1024,
        max_sessions: int = 16,
        eager: bool = False,
        compile: bool = False,
        fused_rows: int | None = None,
        attention: str | None = None,
        max_batch: int = 8,
    ) -> "VerifyEngine":
        """eager: the generic HF path, no static buffers or graphs (the fused path is the default)."""
        model = load_target(path, device, dtype)
        return cls(model, max_tree_size, max_sessions, not eager, not eager, compile, fused_rows, attention, max_batch,
                   path)

    @staticmethod
    def read_eos_ids(path: str | Path) -> list[int]:
        return read_eos_ids(path)

    # ---- sessions -------------------------------------------------------------------------------------------

    def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        if session_id in self.sessions:
            raise SessionError(f"session {session_id!r} already exists")
        params.validate()
        bad = [t for t in taps if not 0 <= t < self.num_layers]
        if bad:
            raise SessionError(f"tap layer {bad[0]} outside the target's {self.num_layers} layers")
        grammar = self._grammar(params.grammar) if params.grammar else None
        draws = None
        if not params.greedy:
            draws = Draws(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        try:  # small: it grows with what the session commits (VerifySession.check_room)
            cache = self.caches.acquire(min(capacity, MIN_SLOT_TOKENS))
        except NoMemory as exc:
            raise MemoryShortError(str(exc)) from None
        except MemoryError as exc:
            raise CapacityError(str(exc)) from None
        states = StateCache(self.linear, self.device, self.dtype) if self.linear else None
        history = TokenHistory(self.vocab_size, self.device) if params.processed else None
        blocks = SessionBlocks(tuple(taps)) if self.prefix is not None else None
        self.sessions[session_id] = VerifySession(cache, capacity, params, draws, list(taps), self.caches, states=states,
                                                  history=history, grammar=grammar, blocks=blocks)

    def _grammar(self, description: str) -> TreeGrammar:
        """A new session's grammar state; SessionError where it cannot have one."""
        if self.target_path is None:
            raise SessionError("this verifier has no tokenizer to compile grammars with")
        if self.grammars is None:
            self.grammars = Grammars.from_target(self.target_path, self.vocab_size, read_eos_ids(self.target_path))
        try:
            return TreeGrammar(self.grammars.start(description))
        except ValueError as exc:
            raise SessionError(str(exc)) from None

    def end_session(self, session_id: str) -> bool:
        sess = self.sessions.pop(session_id, None)
        if sess is not None and sess.blocks is not None:
            self.prefix.release(sess.blocks)
        if sess is not None:
            self.caches.release(sess.cache)
        return sess is not None

    def untap(self, session_id: str) -> None:
        """The session taps no features from now on: its drafter has gone (a speculating request gone on with AR
        steps), so its steps batch with untapped sessions'. The prefix blocks it commits from now on are cached
        without features."""
        sess = self.session(session_id)
        sess.taps = []
        if sess.blocks is not None:
            sess.blocks.taps, sess.blocks.rows = (), []

    def session(self, session_id: str) -> VerifySession:
        try:
            sess = self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown verifier session {session_id!r}") from None
        sess.last_used = time.monotonic()
        return sess

    # ---- steps ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, host_features: bool = False,
        skip_features: int = 0,
    ) -> StepResult:
        """Runs the prompt, whole or one chunk of it: each call continues the context where the last one left it
        (slot cache.length), and every call but the last sets `more`. -> the chunk's features [len(prompt),
        taps*hidden] (None without taps; in host memory with `host_features`) and, from
        the last call only, the first token (the new root). A `more` chunk picks no token: no host sync for one,
        and a sampled session draws nothing, so a chunked prompt samples what it would have in one
        call. A completed prompt takes no more chunks. skip_features: the features of the prompt's positions below
        it are left out (the drafter restored their context); a chunk wholly below it has none."""
        call = PrefillCall(session_id, prompt, more, host_features, skip_features)
        return self.prompts.prefill(call, self.session(session_id), self.prefix)

    @torch.inference_mode()
    def prefill_batch(self, calls: list[PrefillCall]) -> list[StepResult | Exception]:
        """Several sessions' prefill calls, their chunks in one forward where they can share it (a burst of
        requests' prompts: PromptBatch.run) -> each call's StepResult, or the exception prefill would
        raise for it. A session's later call in the batch runs after its earlier one. A failed call that started its
        session (PrefillCall.starts) ends it: a session holds nothing of a chunk that failed."""
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        found: list[tuple[int, tuple[PrefillCall, VerifySession]]] = []
        for i, call in enumerate(calls):
            try:
                found.append((i, (call, self.session(call.session_id))))
            except UnknownSessionError as exc:
                outcomes[i] = exc
        for (i, _), outcome in zip(found, self.prompt_batch.run([pair for _, pair in found], self.prefix)):
            outcomes[i] = outcome
        return end_failed_starts(self.end_session, calls, outcomes)

    @torch.inference_mode()
    def decode(self, session_id: str, host_features: bool = False) -> StepResult:
        """A plain autoregressive step: a tree holding only the root."""
        return self.verify(session_id, ROOT_ONLY, host_features)

    @torch.inference_mode()
    def verify(self, session_id: str, tree: DraftTree, host_features: bool = False) -> StepResult:
        """_verify, its committed tokens offered to the prefix cache."""
        self.settle()
        return self._cached(session_id, self._verify(session_id, tree, host_features))

    # ---- AR steps launched ahead ----------------------------------------------------------------------------

    @torch.inference_mode()
    def launch_decodes(self, session_ids: list[str], host_features: bool = False) -> AheadStep | None:
        """One AR step of each session in one replay, launched behind the steps launched before and not read, its
        roots taken from theirs on the device (verify_server/decode_ahead.py); read_decodes reads it. None where
        one launch cannot take them all (DecodesAhead.launchable): nothing is launched, and verify_batch runs
        them. host_features: tapped sessions' features come back in host memory, as decode's."""
        if self.ahead is None:
            return None
        sessions = self.ahead.launchable(session_ids)
        return None if sessions is None else self.ahead.launch(session_ids, sessions, host_features)

    @torch.inference_mode()
    def read_decodes(self, step: AheadStep) -> list[StepResult]:
        """A launched step's results, one per session in its order (a tapped session's with its step's features [1,
        taps*hidden]): waits for it, and commits it and the steps launched before it (once: a step read already
        answers from its results)."""
        return self.ahead.read(step)

    def settle(self) -> None:
        """Reads every AR step launched ahead, their results kept for their callers: what runs any other round,
        or checks a tree against a session's root, must find each session's committed state as its device's."""
        if self.ahead is not None and self.ahead.unread:
            with torch.inference_mode():
                self.ahead.settle()

    def _cached(self, session_id: str, step: StepResult) -> StepResult:
        """A round's commit as the prefix cache sees it: the blocks it fills are offered (where prefixes are
        cached). In inference mode, as its callers are (entering it here would cost each round of a batch)."""
        sess = self.sessions[session_id]
        if sess.blocks is not None:
            # a round's features on the device are memory of their own (VerifySession.kept_rows): kept, not copied
            self.prefix.commit(sess.blocks, sess.cache, step.tokens, step.features,
                               owned=step.features is not None and step.features.device.type != "cpu")
        return step

    def _verify(self, session_id: str, tree: DraftTree, host_features: bool = False) -> StepResult:
        """Scores every node in ONE forward, keeps the longest path whose every token is the target's own choice,
        appends the target's choice after it (the bonus), and compacts the cache to that path. The tree may be on
        the host or on any device (a co-located drafter's stays on the GPU); its root token is replaced by the
        session's. host_features: the round queues the path's features' copy to host memory before its sync, so a
        caller that sends them on (the service) waits for no copy after the round's one sync, into a buffer of the
        session's that a later round reuses (FEATURE_RING); otherwise they stay on the device, where an in-process
        drafter reads them."""
        sess = self.session(session_id)
        if sess.root is None:
            raise SessionError(f"session {session_id!r} must be prefilled before verify/decode")
        q = tree.tokens.shape[0]
        if self.scratch is not None and q > self.scratch.max_nodes:
            limit = self.scratch.max_nodes - 1
            raise CapacityError(f"a tree of {q - 1} nodes exceeds the verifier's max_tree_size {limit}")
        sess.check_room(sess.cache.length, q)
        timer = self.timers.timer()
        start, taps = sess.cache.length, tuple(sess.taps)
        captures = sess.params.captured and self.fused is not None  # forward, choices (within the grammar), walk
        # and compaction in one replay
        if captures and sess.params.greedy:
            captured = self.fused.greedy_round(sess.cache, taps, tree, sess.root, sess.grammar)
            if captured is not None:
                return self._commit_greedy(sess, tree, captured, timer, host_features)
        if captures and not sess.params.greedy:
            items = [BatchTree(sess.cache, tree, sess.root)]
            captured = self.fused.sampled_round(items, taps, session_draws([sess], items),
                                                grammars=session_grammars([sess]))
            if captured is not None:
                return commit_captured([sess], items, captured, timer, host_features)[0]
        scored = self.fused.tree_forward(sess.cache, taps, tree, sess.root) if self.fused is not None else None
        if scored is not None:  # the tree as the graph read it: no second upload
            logits, features, x = scored
            ids, parents, depths, anc = x.ids, x.parents, x.depths, x.anc
        else:
            parents = tree.parents.to(self.device)
            depths = tree.depths.to(self.device)
            ids = tree.tokens.to(self.device).clone()
            ids[0] = sess.root
            anc = ancestor_matrix(parents)  # [q, q]
            logits, features = self._forward(sess, ids, start + depths, anc, last_only=False)
        rows = TreeRows(ids, parents, depths, anc, logits, features, tree.max_depth)
        return walk_and_commit([sess], [rows], timer, host_features, self.scratch)[0]

    def _commit_greedy(
        self, sess: VerifySession, tree: DraftTree, captured: tuple[torch.Tensor, torch.Tensor | None],
        timer: StepTimer, host_features: bool,
    ) -> StepResult:
        """A captured greedy round's end (FusedRunner.greedy_round: its walk and compaction ran in the graph): its
        outcome stored into the session's readback buffer (kernels/readback.py) and its path's features into memory
        of their own (VerifySession.kept_rows: as many rows as its path can have) in one launch, before the round's
        one host sync; then the session's length and root move past its accepted path."""
        packed, path_features = captured  # [2 + qb], [qb, taps*hidden] or None: the graph's outputs
        timer.mark()
        if sess.readback is None:  # a captured greedy round's outcome only: the others are read after their walk
            sess.readback = PinnedReadback(2 + MAX_GRAPH_NODES, torch.long, self.device)
        stored, host = sess.readback.target(packed)
        copies, features = [(stored, packed)], None
        if path_features is not None:
            rows = path_features[: min(tree.max_depth + 1, packed.shape[0] - 2)]
            kept, features = sess.kept_rows(sess.next_ring(), rows, host_features)
            copies.append((kept, rows))
        copy_together(copies)
        read = timer.sync(host.tolist)  # the round's single host sync
        k, bonus = read[0], read[1]
        sess.cache.length += k + 1
        tokens = read[3 : 3 + k] + [bonus]
        sess.took(tokens)
        return timed([StepResult(tokens, None if features is None else features[: k + 1])], timer)[0]

    # ---- batched rounds -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def verify_batch(
        self, calls: list[tuple[str, DraftTree]], host_features: bool = False
    ) -> list[StepResult | Exception]:
        """Several sessions' Verify and Decode calls, their forward shared where it can be -> each call's
        StepResult, or the exception verify() would raise for it (BatchedRounds.verify_batch)."""
        self.settle()
        outcomes = self.batched.verify_batch(calls, host_features)
        for (session_id, _), outcome in zip(calls, outcomes):  # in call order: a session's second call came after
            if isinstance(outcome, StepResult):
                self._cached(session_id, outcome)
        return outcomes

    def _forward(
        self, sess: VerifySession, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [q] -> logits [q or 1, V] fp32, features [q, taps*hidden] (None without taps)."""
        if self.fused is not None:
            return self.fused.forward(sess.cache, tuple(sess.taps), ids, positions, tree, last_only)
        return self.hf.forward(sess, ids, positions, tree, last_only)
