"""torch tensors <-> `Tensor` messages, and the one place where wire messages <-> internal dataclasses convert.

Servers and clients call only these functions, so a field added to the .proto is wired up here and nowhere else.
Decoding never trusts the sender: a wrong dtype or byte count is a ValueError, which servers answer with
INVALID_ARGUMENT. Decoding does not check trees against a session (verify_server/validate.py does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ddtree.types import DrafterInfo, DraftTree, SamplingParams, StepResult, VerifierInfo
from protos.ddtree.v1 import ddtree_pb2 as pb

# Wire dtype names are torch's without the prefix; bytes are little-endian (every supported host is).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_MAX_DIMS = 8


def tensor_to_pb(tensor: torch.Tensor) -> pb.Tensor:
    """Any-device tensor -> raw bytes (one device-to-host copy); bf16 goes as its raw 2-byte words."""
    name = _WIRE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} has no wire encoding (supported: {', '.join(WIRE_DTYPES)})")
    # Viewed as bytes so dtypes numpy lacks (bfloat16) need no conversion.
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=name, shape=list(tensor.shape))


def tensor_from_pb(msg: pb.Tensor) -> torch.Tensor:
    """-> a CPU tensor that owns its memory. ValueError on an unknown dtype, a bad shape or a wrong byte count."""
    dtype = WIRE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"tensor dtype {msg.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    shape = list(msg.shape)
    if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"bad tensor shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise ValueError(f"tensor of shape {shape} and dtype {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy the tensor keeps alive (torch warns on read-only buffers).
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def timings_to_pb(forward_s: float, detail: Mapping[str, float]) -> pb.Timings:
    """total_s is filled by the server once the answer is ready."""
    return pb.Timings(forward_s=forward_s, detail=dict(detail))


# ---- draft trees and sampling -----------------------------------------------------------------------------------


def tree_to_pb(tree: DraftTree) -> pb.DraftTree:
    tokens, parents, depths = torch.stack((tree.tokens, tree.parents, tree.depths)).tolist()  # one host sync
    return pb.DraftTree(tokens=tokens, parents=parents, depths=depths, max_depth=tree.max_depth)


def tree_from_pb(msg: pb.DraftTree) -> DraftTree:
    """Shape only; whether the arrays form a tree is verify_server/validate.py's question."""
    return DraftTree(
        tokens=torch.tensor(list(msg.tokens), dtype=torch.long),
        parents=torch.tensor(list(msg.parents), dtype=torch.long),
        depths=torch.tensor(list(msg.depths), dtype=torch.long),
        max_depth=msg.max_depth,
    )


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
    )


# ---- drafter responses ------------------------------------------------------------------------------------------


def draft_to_pb(tree: DraftTree, forward_s: float, tree_s: float) -> pb.DraftResponse:
    return pb.DraftResponse(tree=tree_to_pb(tree), timings=timings_to_pb(forward_s, {"tree_s": tree_s}))


def draft_from_pb(msg: pb.DraftResponse) -> tuple[DraftTree, dict[str, float]]:
    """-> the tree and the round loop's timing keys (those of the in-process drafter, plus the server total)."""
    timings = {"draft_s": msg.timings.forward_s, **msg.timings.detail, "draft_server_s": msg.timings.total_s}
    return tree_from_pb(msg.tree), timings


def drafter_info_to_pb(info: DrafterInfo) -> pb.DrafterInfoResponse:
    return pb.DrafterInfoResponse(
        block_size=info.block_size,
        target_layer_ids=info.target_layer_ids,
        feature_dim=info.feature_dim,
        vocab_size=info.vocab_size,
        max_budget=info.max_budget,
        max_session_tokens=info.max_session_tokens,
    )


def drafter_info_from_pb(msg: pb.DrafterInfoResponse) -> DrafterInfo:
    return DrafterInfo(
        block_size=msg.block_size,
        target_layer_ids=list(msg.target_layer_ids),
        feature_dim=msg.feature_dim,
        vocab_size=msg.vocab_size,
        max_budget=msg.max_budget,
        max_session_tokens=msg.max_session_tokens,
    )


# ---- verifier responses -----------------------------------------------------------------------------------------


def step_to_pb(result: StepResult) -> pb.StepResponse:
    msg = pb.StepResponse(tokens=result.tokens, timings=timings_to_pb(result.forward_s, result.timings))
    if result.features is not None:
        msg.features.CopyFrom(tensor_to_pb(result.features))
    return msg


def step_from_pb(msg: pb.StepResponse) -> StepResult:
    features = tensor_from_pb(msg.features) if msg.HasField("features") else None
    timings = {**msg.timings.detail, "verify_server_s": msg.timings.total_s}
    return StepResult(list(msg.tokens), features, forward_s=msg.timings.forward_s, timings=timings)


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
    )
