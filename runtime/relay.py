"""A prompt's features on their way verifier -> drafter in wire form: the drafter decodes a lane Append from the
frame's bytes with one copy of the features (`AppendCall`), where the protobuf parse, its bytes field and a writable
buffer would make three (a 2048-token chunk at Qwen3-8B shapes is 84 MB).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.tensors import tensor_from_parts, tensor_from_pb

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5  # protobuf wire types (groups, 3 and 4, are never ours)


@dataclass
class AppendCall:
    """An Append request decoded: its session and features [m, feature_dim] (None when the request has none), or
    the rows of the verifier's feature pool they lie in (None: none named)."""

    session_id: str
    features: torch.Tensor | None
    rows: pb.FeatureRows | None = None

    @classmethod
    def from_pb(cls, request: pb.AppendRequest) -> AppendCall:
        features = tensor_from_pb(request.features) if request.HasField("features") else None
        return cls(request.session_id, features,
                   request.feature_rows if request.HasField("feature_rows") else None)

    @classmethod
    def FromString(cls, payload: bytes | memoryview) -> AppendCall:  # noqa: N802 - a lane route's request parser
        """An AppendRequest's bytes -> the call, reading the features' bytes where they lie in `payload` (a lane
        frame, valid only during the call) and copying them once. Requests whose features come in more than one
        piece (protobuf merges those) take the generic parse. DecodeError for malformed bytes or features (the
        lane answers INVALID_ARGUMENT)."""
        try:
            session_id, tensors, rows = "", [], []
            for field, value in _fields(memoryview(payload)):
                if field == 1:
                    session_id = _text(value)
                elif field == 2:
                    tensors.append(value)
                elif field == 3:
                    rows.append(value)
            if len(tensors) > 1 or rows:  # (rows: a small message, parsed as it is)
                return cls.from_pb(pb.AppendRequest.FromString(payload))
            return cls(session_id, _tensor(tensors[0]) if tensors else None)
        except (ValueError, TypeError, IndexError) as exc:  # UnicodeDecodeError is a ValueError
            raise DecodeError(str(exc)) from None


def _tensor(message: memoryview) -> torch.Tensor:
    """A Tensor message's bytes -> the tensor (tensor_from_parts: one copy of its data)."""
    data, dtype, shape = memoryview(b""), "", []
    for field, value in _fields(message):
        if field == 1:
            data = value
        elif field == 2:
            dtype = _text(value)
        elif field == 3 and isinstance(value, int):
            shape.append(value)
        elif field == 3:  # packed
            shape.extend(value for _, value in _fields(value, packed_varints=True))
    # int64 dimensions come as unsigned 64-bit varints: a negative one is caught by tensor_from_parts
    return tensor_from_parts(dtype, tuple(d - (1 << 64) if d >= 1 << 63 else d for d in shape), data)


def _text(value: int | memoryview) -> str:
    if not isinstance(value, memoryview):
        raise ValueError("a string field that is not length-delimited")
    return bytes(value).decode()


def _fields(buf: memoryview, packed_varints: bool = False) -> Iterator[tuple[int, int | memoryview]]:
    """Protobuf wire bytes -> (field number, value) in order: an int for varints and fixed-width fields, a view of
    `buf` for length-delimited ones. packed_varints: `buf` is a packed repeated varint field's bytes (field 0)."""
    pos, end = 0, len(buf)
    while pos < end:
        if packed_varints:
            value, pos = _read_varint(buf, pos)
            yield 0, value
            continue
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type == _LENGTH:
            size, pos = _read_varint(buf, pos)
            if pos + size > end:
                raise ValueError("a length-delimited field runs past the message")
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (_FIXED64, _FIXED32):
            width = 8 if wire_type == _FIXED64 else 4
            if pos + width > end:
                raise ValueError("a fixed-width field runs past the message")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if field == 0:
            raise ValueError("field number 0")
        yield field, value


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos
