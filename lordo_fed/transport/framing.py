"""The data plane's chunk messages (`Chunk`, `UploadChunk` of proto/lordo_fed/v1/dataplane.proto),
serialized and parsed by hand around their `data` field so that the payload is copied once per
side, not four or five times.

Why: protobuf's Python runtime copies a bytes field into the message on construction, again on
serialization, again on parsing and once more on *every* read of `msg.data`; for a 200 MB payload
in 4 MiB chunks those copies cost more than the gRPC stream itself on these machines (measured:
the transport alone at 0.41 of a bare grpcio stream, raw bytes at 0.60). The bytes on the wire
are protobuf's wire format: a chunk is its small header fields (serialized by protobuf) followed
by the `data` field as key, length and bytes (fields may come in any order on the wire), so a
client built from the generated stubs talks to this server and the other way round
(tests/unit/test_transport.py).
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

from lordo_fed.wire.protowire import WT_LEN, Irregular, key, read_key, read_length, skip_value, varint

M = TypeVar("M", bound=Message)

CHUNK_DATA, UPLOAD_DATA = 1, 5
"""Field numbers of `data` in Chunk and UploadChunk (proto/lordo_fed/v1/dataplane.proto)."""


def frame(head: M, field: int, data) -> bytes:
    """The serialized message `head` with bytes field `field` set to `data` (any buffer): the
    header fields first, then the data field; one copy of `data` (into the returned bytes)."""
    return b"".join((head.SerializeToString(), key(field, WT_LEN), varint(len(data)), data))


def unframe(raw: bytes, cls: type[M], field: int) -> tuple[M, memoryview]:
    """(the message without its data field, a zero-copy view of the data field) from `raw`.

    A message that repeats the data field, or that the scanner does not handle, is parsed by
    protobuf instead (same result, one more copy): protobuf's own rules stay the reference."""
    view = memoryview(raw)
    end = len(view)
    try:
        pos, span, head = 0, None, []
        while pos < end:
            number, wire_type, after_key = read_key(view, pos, end)
            if number == field and wire_type == WT_LEN:
                if span is not None:
                    raise Irregular
                size, start = read_length(view, after_key, end)
                span, pos = (start, start + size), start + size
            else:
                after = skip_value(view, after_key, end, wire_type)
                head.append(view[pos:after])
                pos = after
        msg = cls.FromString(b"".join(head))
        return msg, (view[span[0]:span[1]] if span is not None else memoryview(b""))
    except Irregular:
        msg = cls.FromString(raw)
        data = memoryview(getattr(msg, cls.DESCRIPTOR.fields_by_number[field].name))
        msg.ClearField(cls.DESCRIPTOR.fields_by_number[field].name)
        return msg, data
