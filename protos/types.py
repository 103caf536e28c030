"""Plain data types shared by the drafter, the verifier and the round loop (never tied to a transport)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


MAX_LOGPROBS = 20  # most likely alternatives a committed token's log-probabilities may list (vLLM's default cap)


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks a token at each node. temperature == 0 means greedy (argmax).

    The target's logits go through the processors in vLLM's order: min_tokens' mask of `stop_ids`, logit_bias,
    then the repetition, frequency and presence penalties; then greedy takes the argmax, or sampling applies
    temperature, min_p, top_k and top_p (verify_server/processors.py, sampling.py). A `grammar` masks the tokens it
    forbids before all of them (verify_server/grammar.py)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    # the committed tokens' log-probabilities, each with this many most likely alternatives; None: none
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids ascending
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature)
    min_tokens: int = 0  # `stop_ids` are masked while fewer tokens than this have been generated
    stop_ids: tuple[int, ...] = ()  # the tokens that end the generation (EOS and stop tokens): what min_tokens masks
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token has been generated
    repetition_penalty: float = 1.0  # HF/vLLM's: divides (multiplies, if negative) the logits of prompt and generated tokens
    # structured output: a grammar every choice keeps to, as canonical JSON (runtime/grammar.py); "" = none
    grammar: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies: the choice at a node then depends on the tokens of its path."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether a processor that can change the argmax applies (min_p cannot: it only drops unlikely tokens)."""
        return bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.stop_ids)) or self.penalized

    @property
    def captured(self) -> bool:
        """Whether a captured round makes this request's choices inside its CUDA graph: the argmax of the logits
        (greedy), or a draw after temperature and min-p alone (no top-k or top-p), within the request's grammar's
        masks where it has one; no processor that reads the path, no logprobs."""
        return (not self.processed and self.logprobs is None
                and (self.greedy or (self.top_k == 0 and self.top_p == 1.0)))

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        bad_bias = next((b for _, b in self.logit_bias if not -100.0 <= b <= 100.0), None)  # False for NaN too
        if bad_bias is not None:
            raise ValueError(f"a logit_bias must be in [-100, 100], got {bad_bias}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias] + list(self.stop_ids)
        if any(t < 0 for t in ids):
            raise ValueError(f"token ids must be >= 0, got {min(ids)}")


@dataclass
class DraftTree:
    """A draft tree. Index 0 is the root (the last committed token); every parent index is smaller than its
    child's, so the arrays are a topological order.

    tokens:  [N+1] int64, node tokens, root first
    parents: [N+1] int64, parent index per node, -1 for the root
    depths:  [N+1] int64, 0 for the root; the position of a node is root position + depth
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    max_depth: int  # host-side bound on depths (block size - 1), so device code needs no sync to know it

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root (what `budget` counts)."""
        return self.tokens.shape[0] - 1

    def cpu(self) -> DraftTree:
        """The tree on the host, in one device-to-host copy (a sync) rather than one per array."""
        if self.tokens.device.type == "cpu":
            return self
        host = torch.stack((self.tokens, self.parents, self.depths)).cpu()  # [3, N+1]
        return DraftTree(tokens=host[0], parents=host[1], depths=host[2], max_depth=self.max_depth)


@dataclass
class TokenLogprobs:
    """The target's log-probabilities where each committed token was chosen: the log-softmax of its raw logits
    there, before any processor or temperature (vLLM's default logprobs_mode, raw_logprobs).

    logprobs:     [n] each committed token's
    top_ids:      [n][k] the k most likely tokens at each, most likely first (k: SamplingParams.logprobs)
    top_logprobs: [n][k] theirs
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' (a step's tokens cut at a stop or the limit)."""
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])


@dataclass
class StepResult:
    """What one verifier step (prefill, verify or AR decode) commits.

    tokens:   the tokens committed by this step, in order; the last one is the new root (bonus) token
    features: [len(tokens), taps * hidden] target hidden states at the tapped layers for the positions whose
              K/V this step kept (prompt positions for prefill; root + accepted nodes for verify/decode),
              or None when the session taps no layers
    logprobs: the tokens' log-probabilities, where the session asked for them (SamplingParams.logprobs)
    """

    tokens: list[int]
    features: torch.Tensor | None
    forward_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter reports about itself: the gateway taps the target and sizes trees and sessions from it."""

    block_size: int
    target_layer_ids: list[int]
    feature_dim: int  # len(target_layer_ids) * target hidden size
    vocab_size: int
    max_budget: int  # largest tree (nodes without the root) it drafts
    max_session_tokens: int  # largest session capacity it accepts
    max_sessions: int = 0  # sessions it holds at once (0: no fixed limit)


@dataclass(frozen=True)
class VerifierInfo:
    """What a verifier reports about its target and its limits."""

    model_name: str
    vocab_size: int
    max_context_length: int  # the target's max_position_embeddings
    eos_token_ids: list[int]
    num_layers: int
    hidden_size: int
    max_tree_size: int  # largest tree (nodes without the root) it verifies
    max_tree_depth: int
    max_session_tokens: int  # largest session capacity it accepts
    max_sessions: int = 0  # sessions it holds at once (0: no fixed limit)
    drafts: bool = False  # it has a drafter: its sessions may tap layers and speculate


class MemoryShort(RuntimeError):
    """A verifier call found no KV memory for its session now, and changed nothing (gRPC's ABORTED, or the
    in-process engine's own error): the gateway's engine preempts the sequence where it can go on from its output."""


class DraftAsk(NamedTuple):
    """One session's draft in a step (DraftRequest): the target's features of the positions since its last draft
    (in pieces, oldest first; none: empty), its root, and the tree's shape; committed: a session with a grammar's output since its last draft,
    ending with the root (() none)."""

    session_id: str
    features: Sequence[Any]  # each [m_i, taps * hidden] torch.Tensor
    root_token: int
    root_position: int
    budget: int
    top_k: int | None
    committed: Sequence[int] = ()


@dataclass(frozen=True)
class SessionStart:
    """A verifier session's start, carried by its prompt's first chunk: the KV slots it may take, how the target
    picks its tokens, the layers it taps for the drafter."""

    capacity: int
    params: SamplingParams
    taps: Sequence[int] = ()


@dataclass(frozen=True)
class PromptChunk:
    """A session's prompt, or a chunk of it, in a step: `more` says another chunk follows (no token is chosen then;
    the last one chooses the first). skip_features: the prompt positions below it send no features to the drafter
    (its prefix cache restored their context); start: the session starts with this chunk, its first (a request's
    first token waits for one call, not two)."""

    tokens: Sequence[int]
    more: bool = False
    skip_features: int = 0
    start: SessionStart | None = None


class SessionStep(NamedTuple):
    """A session's part in a step (SessionStep): a prompt chunk, or a decode: budget 0 an AR step, else the tree's
    nodes; untap: the session taps no features from this step on (its drafter has gone)."""

    session_id: str
    budget: int = 0
    top_k: int | None = None
    untap: bool = False
    prompt: PromptChunk | None = None


@dataclass
class StepOutcome:
    """A session's outcome of a step (StepOutcome): its commit, or the error it failed with; the tree it verified
    (0 nodes: an AR step); its drafter's failure, where it asked for a tree and took an AR step instead; the draft's
    timings (draft_s, tree_s, draft_rpc_s; over the wire they come in the commit's timings)."""

    step: StepResult | Exception
    tree_size: int = 0
    draft_error: Exception | None = None
    draft_timings: Mapping[str, float] = field(default_factory=dict)
