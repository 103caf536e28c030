"""torch tensors <-> `Tensor` messages, and the one place where wire messages <-> internal dataclasses convert.

Servers and clients call only these functions, so a field added to the .proto is wired up here and nowhere else.
Decoding never trusts the sender: a wrong dtype or byte count is a ValueError, which servers answer with
INVALID_ARGUMENT. Decoding does not check trees against a session (verify_server/validate.py does).

The verifier reads a drafted tree's size and nodes without torch (its tree fit), and checks and verifies it once:
`draft_from_pb(wire=True)` keeps it a `WireDraftTree`, which holds the received message and decodes only when
something looks inside as tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from protos.types import (
    DrafterInfo, DraftTree, PromptChunk, SamplingParams, SessionStart, SessionStep, StepResult, TokenLogprobs,
    VerifierInfo,
)
from protos.ddtree.v1 import ddtree_pb2 as pb

# Wire dtype names are torch's without the prefix; bytes are little-endian (every supported host is).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}
WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_ITEMSIZES = {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()}
# numpy reads the bytes (far fewer instructions than a torch call); bfloat16, which numpy lacks, as int16 words.
_NUMPY_DTYPES = {
    "float32": np.float32, "bfloat16": np.int16, "float16": np.float16, "int64": np.int64, "int32": np.int32,
}
_MAX_DIMS = 8
NODE_BYTES = 12  # a DraftTree node on the wire: its token, parent and depth as int32


def tensor_to_pb(tensor: torch.Tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """Any-device tensor -> raw bytes (one device-to-host copy); bf16 goes as its raw 2-byte words.
    out: a (sub)message to fill in place (a submessage given to a constructor or CopyFrom is copied once more)."""
    name = WIRE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} has no wire encoding (supported: {', '.join(WIRE_DTYPES)})")
    host = tensor.detach() if tensor.requires_grad else tensor
    if host.device.type != "cpu":
        host = host.cpu()
    if name == "bfloat16":
        host = host.view(torch.int16)  # numpy has no bfloat16: the same 2-byte words under another name
    # numpy writes row-major order whatever the strides, so a non-contiguous view costs no extra copy.
    msg = pb.Tensor() if out is None else out
    msg.data = host.numpy().tobytes()
    msg.dtype = name
    msg.shape[:] = tensor.shape
    return msg


def tensor_from_pb(msg: pb.Tensor) -> torch.Tensor:
    """-> a CPU tensor that owns its memory. ValueError on an unknown dtype, a bad shape or a wrong byte count."""
    return tensor_from_parts(msg.dtype, tuple(msg.shape), msg.data)  # data read once: each read is a fresh copy


def tensor_from_parts(dtype_name: str, shape: tuple[int, ...], data: bytes | memoryview) -> torch.Tensor:
    """A Tensor message's fields -> a CPU tensor that owns its memory (one copy of `data`, which may be a view of
    a buffer about to be reused). ValueError as tensor_from_pb."""
    dtype = WIRE_DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"tensor dtype {dtype_name!r} is not one of {', '.join(WIRE_DTYPES)}")
    if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"bad tensor shape {list(shape)}")
    expected = math.prod(shape) * _ITEMSIZES[dtype_name]
    if len(data) != expected:
        raise ValueError(
            f"tensor of shape {list(shape)} and dtype {dtype_name} needs {expected} bytes, got {len(data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # a writable copy the tensor keeps alive (torch warns on read-only buffers)
    tensor = torch.from_numpy(np.frombuffer(data, dtype=_NUMPY_DTYPES[dtype_name]).reshape(shape).copy())
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def timings_to_pb(forward_s: float, detail: Mapping[str, float], out: pb.Timings | None = None) -> pb.Timings:
    """total_s is filled by the server once the answer is ready. out: a (sub)message to fill in place."""
    msg = pb.Timings() if out is None else out
    msg.forward_s = forward_s
    msg.detail.update(detail)
    return msg


# ---- draft trees and sampling -----------------------------------------------------------------------------------


class WireDraftTree(DraftTree):
    """A DraftTree still in its wire form: `message` as received; the tensors are decoded (once) on first use,
    `num_nodes` and `max_depth` need no decoding, and `tree_to_pb` returns `message` itself. Read-only by contract."""

    def __init__(self, message: pb.DraftTree) -> None:  # not the dataclass's __init__: nothing is decoded yet
        self.message = message
        self.max_depth = message.max_depth
        self._decoded: DraftTree | None = None

    def _tree(self) -> DraftTree:
        if self._decoded is None:
            self._decoded = tree_from_pb(self.message)
        return self._decoded

    tokens = property(lambda self: self._tree().tokens)  # type: ignore[assignment]
    parents = property(lambda self: self._tree().parents)  # type: ignore[assignment]
    depths = property(lambda self: self._tree().depths)  # type: ignore[assignment]

    @property
    def num_nodes(self) -> int:
        return len(self.message.nodes) // NODE_BYTES - 1


def tree_to_pb(tree: DraftTree, out: pb.DraftTree | None = None, nodes: torch.Tensor | None = None) -> pb.DraftTree:
    """out: a (sub)message to fill in place. nodes: the tree's [3, N+1] int32 host array where its producer already
    has it (the drafter's pinned copy: no stack, no copy, no range check here). A WireDraftTree is already a
    message: returned as it came (or copied into `out`). ValueError for a tree whose arrays differ in length or
    hold values beyond int32."""
    if isinstance(tree, WireDraftTree):
        if out is None:
            return tree.message
        out.CopyFrom(tree.message)
        return out
    if nodes is not None:
        data = nodes.numpy().tobytes()
    else:
        if not tree.tokens.shape == tree.parents.shape == tree.depths.shape:
            raise ValueError("a tree's tokens, parents and depths need one entry per node")
        wide = torch.stack((tree.tokens, tree.parents, tree.depths)).cpu().numpy()  # [3, N+1]; one host sync
        narrow = wide.astype(np.int32)
        if not (narrow == wide).all():
            raise ValueError("tree values must fit int32")
        data = narrow.tobytes()
    msg = pb.DraftTree() if out is None else out
    msg.nodes = data
    msg.max_depth = tree.max_depth
    return msg


def tree_from_pb(msg: pb.DraftTree) -> DraftTree:
    """-> a tree of int64 CPU tensors; ValueError on a byte count that is no [3, N+1] int32 array. Whether the
    arrays form a tree is verify_server/validate.py's question."""
    data = msg.nodes  # read once: every read of a bytes field is a fresh copy
    if len(data) % NODE_BYTES:
        raise ValueError(f"a tree's nodes are {NODE_BYTES} bytes each (3 int32), got {len(data)} bytes")
    tokens, parents, depths = torch.from_numpy(
        np.frombuffer(data, dtype=np.int32).reshape(3, -1).astype(np.int64)).unbind(0)  # [N+1] each
    return DraftTree(tokens=tokens, parents=parents, depths=depths, max_depth=msg.max_depth)


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        logprobs=params.logprobs, logit_bias=dict(params.logit_bias), min_p=params.min_p,
        min_tokens=params.min_tokens, stop_ids=params.stop_ids, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        grammar=params.grammar,
    )


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_p=msg.min_p,
        min_tokens=msg.min_tokens,
        stop_ids=tuple(msg.stop_ids),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        grammar=msg.grammar,
    )


# ---- drafter responses ------------------------------------------------------------------------------------------


def draft_to_pb(tree: DraftTree, forward_s: float, tree_s: float, nodes: torch.Tensor | None = None) -> pb.DraftResponse:
    """nodes: as tree_to_pb's."""
    msg = pb.DraftResponse()  # submessages filled in place rather than built and copied in
    tree_to_pb(tree, out=msg.tree, nodes=nodes)
    timings_to_pb(forward_s, {"tree_s": tree_s}, out=msg.timings)
    return msg


def draft_from_pb(msg: pb.DraftResponse, wire: bool = False) -> tuple[DraftTree, dict[str, float]]:
    """-> the tree and the round loop's timing keys (those of the in-process drafter, plus the server total).
    wire: the tree stays a WireDraftTree (decoded when first looked inside)."""
    timings = {"draft_s": msg.timings.forward_s, **msg.timings.detail, "draft_server_s": msg.timings.total_s}
    return WireDraftTree(msg.tree) if wire else tree_from_pb(msg.tree), timings


def drafter_info_to_pb(info: DrafterInfo) -> pb.DrafterInfoResponse:
    return pb.DrafterInfoResponse(
        block_size=info.block_size,
        target_layer_ids=info.target_layer_ids,
        feature_dim=info.feature_dim,
        vocab_size=info.vocab_size,
        max_budget=info.max_budget,
        max_session_tokens=info.max_session_tokens,
        max_sessions=info.max_sessions,
    )


def drafter_info_from_pb(msg: pb.DrafterInfoResponse) -> DrafterInfo:
    return DrafterInfo(
        block_size=msg.block_size,
        target_layer_ids=list(msg.target_layer_ids),
        feature_dim=msg.feature_dim,
        vocab_size=msg.vocab_size,
        max_budget=msg.max_budget,
        max_session_tokens=msg.max_session_tokens,
        max_sessions=msg.max_sessions,
    )


# ---- verifier responses -----------------------------------------------------------------------------------------


def session_step_to_pb(step: SessionStep, out: pb.SessionStep) -> None:
    """A session's part of a step, filled into `out` (a StepRequest's repeated field's new element)."""
    out.session_id, out.budget, out.top_k, out.untap = step.session_id, step.budget, step.top_k or 0, step.untap
    if (chunk := step.prompt) is not None:
        if not chunk.tokens:  # (on the wire an empty chunk would read as a decode)
            raise ValueError(f"session {step.session_id!r}: a prompt chunk holds at least one token")
        out.prompt.extend(chunk.tokens)
        out.more, out.skip_features = chunk.more, chunk.skip_features
        if chunk.start is not None:
            out.start.CopyFrom(start_to_pb(step.session_id, chunk.start))


def start_to_pb(session_id: str, start: SessionStart) -> pb.VerifierStartSessionRequest:
    return pb.VerifierStartSessionRequest(session_id=session_id, capacity=start.capacity,
                                          sampling=sampling_to_pb(start.params), tap_layers=start.taps)


def start_from_pb(msg: pb.VerifierStartSessionRequest) -> SessionStart:
    return SessionStart(msg.capacity, sampling_from_pb(msg.sampling), tuple(msg.tap_layers))


def chunk_from_pb(msg: pb.SessionStep) -> PromptChunk:
    """A part's prompt chunk (its other fields checked by the verifier)."""
    return PromptChunk(list(msg.prompt), msg.more, msg.skip_features,
                       start_from_pb(msg.start) if msg.HasField("start") else None)


def step_to_pb(result: StepResult, out: pb.StepResponse | None = None) -> pb.StepResponse:
    """The committed tokens, timings and logprobs (features stay with the verifier). out: a (sub)message to fill in
    place."""
    msg = pb.StepResponse() if out is None else out
    msg.tokens.extend(result.tokens)  # submessages filled in place rather than built and copied in
    timings_to_pb(result.forward_s, result.timings, out=msg.timings)
    if result.logprobs is not None:
        lp = result.logprobs
        msg.logprobs.SetInParent()  # present even for no tokens
        msg.logprobs.logprobs.extend(lp.logprobs)
        msg.logprobs.top_ids.extend(t for row in lp.top_ids for t in row)
        msg.logprobs.top_logprobs.extend(v for row in lp.top_logprobs for v in row)
    return msg


def step_from_pb(msg: pb.StepResponse) -> StepResult:
    timings = {**msg.timings.detail, "verify_server_s": msg.timings.total_s}
    logprobs = _logprobs_from_pb(msg.logprobs) if msg.HasField("logprobs") else None
    return StepResult(list(msg.tokens), None, forward_s=msg.timings.forward_s, timings=timings, logprobs=logprobs)


def _logprobs_from_pb(msg: pb.TokenLogprobs) -> TokenLogprobs:
    """The [n, k] rows back out of their flat, row-major fields."""
    chosen = list(msg.logprobs)
    ids, values = list(msg.top_ids), list(msg.top_logprobs)
    k = len(ids) // len(chosen) if chosen else 0
    return TokenLogprobs(chosen, [ids[i * k : (i + 1) * k] for i in range(len(chosen))],
                         [values[i * k : (i + 1) * k] for i in range(len(chosen))])


def verifier_info_to_pb(info: VerifierInfo) -> pb.VerifierInfoResponse:
    return pb.VerifierInfoResponse(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_context_length=info.max_context_length,
        eos_token_ids=info.eos_token_ids,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        max_tree_size=info.max_tree_size,
        max_tree_depth=info.max_tree_depth,
        max_session_tokens=info.max_session_tokens,
        max_sessions=info.max_sessions,
        drafts=info.drafts,
    )


def verifier_info_from_pb(msg: pb.VerifierInfoResponse) -> VerifierInfo:
    return VerifierInfo(
        model_name=msg.model_name,
        vocab_size=msg.vocab_size,
        max_context_length=msg.max_context_length,
        eos_token_ids=list(msg.eos_token_ids),
        num_layers=msg.num_layers,
        hidden_size=msg.hidden_size,
        max_tree_size=msg.max_tree_size,
        max_tree_depth=msg.max_tree_depth,
        max_session_tokens=msg.max_session_tokens,
        max_sessions=msg.max_sessions,
        drafts=msg.drafts,
    )
