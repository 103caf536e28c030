"""The wire contract: committed stubs match the .proto, and every conversion round-trips through real bytes."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError

from protos.types import DrafterInfo, DraftTree, SamplingParams, StepResult, TokenLogprobs, VerifierInfo
from draft_server.tree import build_tree
from protos import generate, tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc


def _wire(msg):
    """Serialize and parse again, so a test sees exactly what the other side would."""
    return type(msg).FromString(msg.SerializeToString())


def test_committed_stubs_are_fresh(tmp_path):
    written = generate.generate(tmp_path)
    committed = generate.generated_paths(generate.PROTO_ROOT)
    assert [p.relative_to(tmp_path) for p in written] == [p.relative_to(generate.PROTO_ROOT) for p in committed]
    for fresh in written:
        committed = generate.PROTO_ROOT / fresh.relative_to(tmp_path)
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `python -m protos.generate`"


def test_stubs_import_from_protos_and_accept_the_grpcio_floor():
    grpc_stub = (generate.PROTO_ROOT / "ddtree/v1/ddtree_pb2_grpc.py").read_text()
    assert "from protos.ddtree.v1 import ddtree_pb2" in grpc_stub
    assert pb_grpc.GRPC_GENERATED_VERSION == generate.MIN_GRPCIO == "1.84.0"
    assert {s.full_name for s in pb.DESCRIPTOR.services_by_name.values()} == {"ddtree.v1.Drafter", "ddtree.v1.Verifier"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.int32])
def test_tensor_round_trip(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = tensors.tensor_from_pb(_wire(tensors.tensor_to_pb(t)))
    assert back.dtype == dtype and back.shape == (3, 5)
    assert torch.equal(back, t)


def test_bfloat16_travels_as_raw_two_byte_words():
    t = torch.randn(4, 3).to(torch.bfloat16)
    msg = _wire(tensors.tensor_to_pb(t.t()))  # a non-contiguous view, sent in logical (row-major) order
    assert msg.dtype == "bfloat16" and list(msg.shape) == [3, 4]
    assert msg.data == t.t().contiguous().view(torch.int16).numpy().tobytes()
    assert torch.equal(tensors.tensor_from_pb(msg), t.t())


@pytest.mark.parametrize("shape", [(0, 128), (), (2, 1, 3)])
def test_tensor_edge_shapes(shape):
    t = torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float32).reshape(shape)
    back = tensors.tensor_from_pb(_wire(tensors.tensor_to_pb(t)))
    assert back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize(
    "msg, complaint",
    [
        (pb.Tensor(data=b"\0" * 8, dtype="float64", shape=[1]), "dtype"),
        (pb.Tensor(data=b"\0" * 7, dtype="float32", shape=[2]), "needs 8 bytes"),
        (pb.Tensor(data=b"", dtype="float32", shape=[-1]), "shape"),
        (pb.Tensor(data=b"", dtype="float32", shape=[1] * 9), "shape"),
    ],
)
def test_malformed_tensors_are_value_errors(msg, complaint):
    with pytest.raises(ValueError, match=complaint):
        tensors.tensor_from_pb(msg)


def test_unsupported_dtype_is_refused_when_encoding():
    with pytest.raises(ValueError, match="no wire encoding"):
        tensors.tensor_to_pb(torch.zeros(2, dtype=torch.bool))


def test_tree_round_trip():
    torch.manual_seed(0)
    tree = build_tree(torch.log_softmax(torch.randn(7, 48), -1), root_token=5, budget=20)
    back = tensors.tree_from_pb(_wire(tensors.tree_to_pb(tree)))
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(back, name), getattr(tree, name))
    assert back.max_depth == tree.max_depth == 7 and back.num_nodes == 20


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(0.7, 20, 0.9, 2**64 - 1), SamplingParams(1.3, 0, 0.25, 0),
     SamplingParams(0.5, logprobs=0), SamplingParams(logprobs=20, logit_bias=((3, -100.0), (17, 0.25)), min_p=0.05,
                                                     min_tokens=7, stop_ids=(2, 9), presence_penalty=-1.5,
                                                     frequency_penalty=0.3, repetition_penalty=1.1)],
)
def test_sampling_params_round_trip(params):
    assert tensors.sampling_from_pb(_wire(tensors.sampling_to_pb(params))) == params


def test_unset_top_p_means_no_filter():
    assert tensors.sampling_from_pb(pb.SamplingParams(temperature=0.5)) == SamplingParams(0.5, 0, 1.0, None)


def test_step_round_trip_with_logprobs():
    lp = TokenLogprobs([-0.5, -2.25], [[4, 1, 0], [9, 4, 2]], [[-0.5, -1.0, -3.0], [-0.25, -2.25, -4.0]])
    back = tensors.step_from_pb(_wire(tensors.step_to_pb(StepResult([4, 9], None, logprobs=lp))))
    assert back.tokens == [4, 9] and back.logprobs == lp
    chosen_only = TokenLogprobs([-1.5], [[]], [[]])
    assert tensors.step_from_pb(_wire(tensors.step_to_pb(StepResult([3], None, logprobs=chosen_only)))).logprobs == chosen_only
    assert tensors.step_from_pb(_wire(tensors.step_to_pb(StepResult([3], None)))).logprobs is None


def test_step_answers_carry_no_features():
    """A step's features stay with the verifier (it sends them to its drafter itself): its answer holds the tokens
    and timings only."""
    assert "features" not in pb.StepResponse.DESCRIPTOR.fields_by_name
    features = torch.randn(3, 128).to(torch.bfloat16)
    step = StepResult([4, 9, 1], features, forward_s=0.25, timings={"walk_s": 0.01})
    msg = tensors.step_to_pb(step)
    msg.timings.total_s = 0.5  # what the server adds once it answers
    back = tensors.step_from_pb(_wire(msg))
    assert back.tokens == [4, 9, 1] and back.features is None
    assert back.forward_s == 0.25 and back.timings == {"walk_s": 0.01, "verify_server_s": 0.5}
    without = tensors.step_to_pb(StepResult([4, 9, 1], None, forward_s=0.25, timings={"walk_s": 0.01}))
    without.timings.total_s = 0.5
    assert msg.SerializeToString() == without.SerializeToString()  # the features wrote nothing
    bare = tensors.step_from_pb(_wire(tensors.step_to_pb(StepResult([7], None))))
    assert bare.tokens == [7] and bare.features is None


def test_draft_response_carries_the_round_loops_timing_keys():
    tree = build_tree(torch.log_softmax(torch.randn(3, 10), -1), root_token=2, budget=3, top_k=1)
    msg = tensors.draft_to_pb(tree, forward_s=0.125, tree_s=0.0625)
    msg.timings.total_s = 0.25
    back, timings = tensors.draft_from_pb(_wire(msg))
    assert torch.equal(back.tokens, tree.tokens)
    assert timings == {"draft_s": 0.125, "tree_s": 0.0625, "draft_server_s": 0.25}


def test_info_round_trips():
    drafter = DrafterInfo(16, [1, 9, 17, 25, 33], 5 * 4096, 151936, 1024, 40960, max_sessions=12)
    assert tensors.drafter_info_from_pb(_wire(tensors.drafter_info_to_pb(drafter))) == drafter
    verifier = VerifierInfo("Qwen3-8B", 151936, 40960, [151645, 151643], 36, 4096, 1024, 64, 42000, max_sessions=16)
    assert tensors.verifier_info_from_pb(_wire(tensors.verifier_info_to_pb(verifier))) == verifier


# ---- a drafted tree at the verifier (wire=True) ----------------------------------------------------------------


def test_a_drafted_tree_reaches_the_verifier_undecoded():
    """The verifier's drafter client keeps a DraftBatch answer's trees as they came: size and depth without decoding
    (the tree fit reads them so), the tensors decoded on first use, and the same message where one is written."""
    torch.manual_seed(0)
    tree = build_tree(torch.log_softmax(torch.randn(7, 48), -1), root_token=5, budget=20)
    received = _wire(tensors.draft_to_pb(tree, forward_s=0.125, tree_s=0.0625))
    wire_tree, timings = tensors.draft_from_pb(received, wire=True)
    assert isinstance(wire_tree, tensors.WireDraftTree) and isinstance(wire_tree, type(tree))
    assert wire_tree.num_nodes == 20 and wire_tree.max_depth == tree.max_depth and wire_tree._decoded is None
    assert tensors.tree_to_pb(wire_tree) is received.tree
    assert timings == {"draft_s": 0.125, "tree_s": 0.0625, "draft_server_s": 0.0}
    for name in ("tokens", "parents", "depths"):  # decoded on first use
        assert torch.equal(getattr(wire_tree, name), getattr(tree, name))
    answer = pb.DraftResponse()
    tensors.tree_to_pb(wire_tree, out=answer.tree)
    assert answer.tree == received.tree


def test_trees_that_are_no_int32_node_array_are_refused_both_ways():
    with pytest.raises(ValueError, match="12 bytes each"):
        tensors.tree_from_pb(pb.DraftTree(nodes=bytes(13), max_depth=1))
    ragged = DraftTree(torch.tensor([3, 4]), torch.tensor([-1]), torch.tensor([0, 1]), max_depth=1)
    with pytest.raises(ValueError, match="one entry per node"):
        tensors.tree_to_pb(ragged)
    huge = DraftTree(torch.tensor([3, 2**31]), torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)
    with pytest.raises(ValueError, match="fit int32"):
        tensors.tree_to_pb(huge)
    empty = tensors.tree_from_pb(pb.DraftTree())  # for the validator to refuse: no root
    assert empty.tokens.shape == empty.parents.shape == empty.depths.shape == (0,)


def test_append_features_are_written_in_place_and_decode_writable():
    features = torch.randn(5, 4)
    request = pb.AppendRequest(session_id="s")
    tensors.tensor_to_pb(features.t(), out=request.features)  # non-contiguous: sent in row-major order
    back = tensors.tensor_from_pb(_wire(request).features)
    assert torch.equal(back, features.t())
    back += 1  # owns writable memory


def _varint(n: int) -> bytes:
    """n as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _unpacked_tensor(features: torch.Tensor) -> bytes:
    """A Tensor message as another encoder may write it: shape before data, each dimension a field of its own."""
    words = features.view(torch.int16) if features.dtype == torch.bfloat16 else features
    data = words.numpy().tobytes()
    name = str(features.dtype).removeprefix("torch.").encode()
    dims = b"".join(b"\x18" + _varint(d) for d in features.shape)  # field 3, varint
    return dims + b"\x0a" + _varint(len(data)) + data + b"\x12" + _varint(len(name)) + name


def _appends(features: torch.Tensor) -> dict[str, bytes]:
    """One AppendRequest for `features` and session "s", in each encoding a drafter's lane can receive."""
    plain = pb.AppendRequest(session_id="s")
    tensors.tensor_to_pb(features, out=plain.features)
    tensor = _unpacked_tensor(features)
    # the features field twice, which protobuf merges: its description first, its data after
    described = pb.AppendRequest(features=pb.Tensor(dtype=plain.features.dtype, shape=plain.features.shape))
    data = pb.AppendRequest(session_id="s", features=pb.Tensor(data=plain.features.data))
    return {
        "protobuf's": plain.SerializeToString(),
        "fields reordered and unpacked": b"\x12" + _varint(len(tensor)) + tensor + b"\x0a\x01s",
        "features in two pieces": described.SerializeToString() + data.SerializeToString(),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_append_is_read_from_its_bytes_as_protobuf_reads_it(dtype):
    """AppendCall.FromString (a drafter's lane: the features copied once, from the frame's bytes) decodes every
    encoding of an AppendRequest as protobuf's parse does, and its features outlive the frame's buffer."""
    features = torch.randn(6, 10).to(dtype)
    for name, raw in _appends(features).items():
        want = relay.AppendCall.from_pb(pb.AppendRequest.FromString(raw))
        buffer = bytearray(raw)
        got = relay.AppendCall.FromString(memoryview(buffer))
        buffer[:] = bytes(len(buffer))  # the lane reuses its buffer: the call's features are its own
        assert got.session_id == want.session_id == "s", name
        assert got.features.dtype == want.features.dtype == dtype, name
        assert torch.equal(got.features, want.features) and torch.equal(got.features, features), name
    assert relay.AppendCall.FromString(pb.AppendRequest(session_id="s").SerializeToString()).features is None


@pytest.mark.parametrize("raw", [
    b"\x0a\x05ab",  # a string running past the message
    b"\x12\x03\x0a\x01",  # a tensor running past the message
    b"\x0a\x80",  # a truncated varint
    b"\x0b",  # a group (wire type 3)
    b"\x08\x01",  # session_id as a varint
])
def test_a_malformed_append_is_a_decode_error(raw):
    with pytest.raises(DecodeError):
        relay.AppendCall.FromString(raw)


@pytest.mark.parametrize("tensor, match", [
    (pb.Tensor(data=b"\x00" * 4, dtype="float64", shape=[1]), "dtype"),
    (pb.Tensor(data=b"\x00" * 3, dtype="float32", shape=[1]), "needs 4 bytes"),
    (pb.Tensor(data=b"", dtype="float32", shape=[-1]), "bad tensor shape"),
])
def test_bad_append_features_are_a_decode_error_naming_the_fault(tensor, match):
    raw = pb.AppendRequest(session_id="s", features=tensor).SerializeToString()
    with pytest.raises(DecodeError, match=match):
        relay.AppendCall.FromString(raw)
    with pytest.raises(ValueError, match=match):  # the gRPC form, the same check
        relay.AppendCall.from_pb(pb.AppendRequest.FromString(raw))
