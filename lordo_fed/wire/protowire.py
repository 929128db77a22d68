"""Protobuf wire-format primitives, written and read by hand: varints, keys, scalar fields, and
a reader that delimits fields exactly as upb (protobuf's C parser) does, or says it cannot.

Why by hand: the payload codec (lordo_fed.wire.encode, lordo_fed.wire.decode) and the data
plane's chunk framing (lordo_fed.transport.framing) write and cut protobuf messages around their
large bytes fields, so that those bytes are copied once instead of the four or five times
protobuf's Python runtime copies them. Both sides share these primitives: one implementation of
the encoding rules, and one notion of which wire forms a hand-written reader may handle.

The readers take a memoryview, a position and an end, and return the value with the position
after it. Anything they do not delimit exactly as upb does (groups, wire types 3/4/6/7,
non-minimal key or length varints, a varint over 10 bytes, a length past the end or over
protobuf's 2 GiB limit) raises `Irregular`: the caller then hands the whole message to protobuf,
whose own rules stay the reference.
"""

from __future__ import annotations

import mmap

WT_VARINT, WT_FIXED64, WT_LEN, WT_FIXED32 = 0, 1, 2, 5
"""The wire types the writers use and the readers handle (3 and 4, groups, are `Irregular`)."""
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_MESSAGE = 2 ** 31 - 1
"""Protobuf's message size limit (2 GiB - 1): larger payloads would not parse anywhere."""


# ---------------------------------------------------------------------------------------------
# writing (proto3 rules: a scalar at its default value is left out)


def varint(value: int) -> bytes:
    """Base-128 varint; negative int64 values as their 64-bit two's complement (10 bytes)."""
    value &= 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    """The key that precedes a field's value: varint of (field number << 3) | wire type."""
    return varint((field << 3) | wire_type)


def int64_field(field: int, value: int, label: str) -> bytes:
    """An int64 field (nothing at 0, as proto3 writes it); `label` names it in the error that
    refuses a value out of the int64 range."""
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{label}={value}: out of the int64 range of the wire")
    return key(field, WT_VARINT) + varint(value) if value else b""


def string_field(field: int, value: str) -> bytes:
    """A string field, UTF-8 (nothing for "", as proto3 writes it)."""
    raw = value.encode("utf-8")
    return key(field, WT_LEN) + varint(len(raw)) + raw if raw else b""


# ---------------------------------------------------------------------------------------------
# reading (in place, from a memoryview; `Irregular` where protobuf must decide)


class Irregular(Exception):
    """Wire format the hand-written readers leave to protobuf (see the module docstring)."""


def read_varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`; at most 10 bytes, none past `end`."""
    result = shift = 0
    while shift < 70:
        if pos >= end:
            raise Irregular
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise Irregular  # more than 10 bytes


def read_minimal_varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """`read_varint` for keys and lengths, with a non-minimal encoding (a trailing 0x80 0x00)
    left to protobuf: only their usual form is delimited by hand."""
    value, after = read_varint(view, pos, end)
    if after - pos > 1 and view[after - 1] == 0:  # trailing 0x80 0x00: a non-minimal encoding
        raise Irregular
    return value, after


def read_key(view: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """(field number, wire type, position after the key) of a key the readers handle."""
    tag, pos = read_minimal_varint(view, pos, end)
    field, wire_type = tag >> 3, tag & 7
    if tag >= 2 ** 32 or field == 0 or wire_type not in (WT_VARINT, WT_FIXED64, WT_LEN, WT_FIXED32):
        raise Irregular
    return field, wire_type, pos


def read_length(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(length, position after it) of a length-delimited field whose bytes all lie before `end`."""
    size, pos = read_minimal_varint(view, pos, end)
    if size > end - pos or size > MAX_MESSAGE:
        raise Irregular
    return size, pos


def skip_value(view: memoryview, pos: int, end: int, wire_type: int) -> int:
    """The position after the value of wire type `wire_type` that starts at `pos`."""
    if wire_type == WT_VARINT:
        return read_varint(view, pos, end)[1]
    if wire_type == WT_LEN:
        size, pos = read_length(view, pos, end)
        return pos + size
    pos += 8 if wire_type == WT_FIXED64 else 4
    if pos > end:
        raise Irregular
    return pos


def new_buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` whose memory is not zero-filled up front (`bytearray(n)`
    memsets all of it: 0.14 s per 341 MB, ~0.9 s on a node whose cores are busy): pages come from
    the kernel as they are first written, i.e. while a download or an encoding fills them. Here,
    beside the wire primitives, so that the data plane's client allocates it without importing the
    payload codec (and torch).

    An anonymous private mapping, not `np.empty`: numpy asks for transparent huge pages on large
    arrays (madvise), and where the kernel defragments on such a fault (THP `defrag=madvise`, a
    common default) a fault waits for memory compaction once free huge pages run out. Measured
    (docs/results.md section 18): a 200 MB encode up to 0.23 s (server) and 0.41-0.45 s (node) with
    numpy's huge pages against 0.05 s and 0.10-0.11 s with 4 KiB pages, and a round's whole payload
    path 1.62-1.96 s against 1.08-1.58 s (three pairs).
    Buffers under a MiB are bytearrays (the memset is negligible; a mapping costs a syscall)."""
    n = int(nbytes)
    if n < _MAPPED_MIN:
        return memoryview(bytearray(n))
    return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)).cast("B")


_MAPPED_MIN = 1 << 20
"""Bytes from which `new_buffer` maps its own memory."""
