"""Decoding a round's payload: `lordo_fed.v1` protobuf bytes -> `GlobalState` / `WorkerUpdate`,
every payload validated as hostile input before any tensor is built.

`decode_global_state` and `decode_update` take bytes, bytearray, memoryview or an mmap of a
spooled file (`with mapped_payload(path) as data: decode_update(data, ...)`), and read it in
place: a scanner cuts the tensors' `data` fields out of the wire format, protobuf parses the small
rest (names, shapes, dtypes, sizes, counters, metrics), and each tensor is copied once from a
zero-copy view of its span into memory it owns (the bf16 -> fp32 widening being that copy): N
bytes of fp32 tensors for an N-byte payload instead of ~2-3N. Wire forms the scanner does not
delimit itself (groups, non-minimal varints, ...) go to the protobuf path
(`decode_*_reference`), which decides as it always did; the same functions are the oracle of
tests/unit/test_codec.py.

Why validate this much: a payload comes from another machine. Decoding checks everything before
building a tensor and raises `PayloadError` (a `ValueError`) naming the tensor and the problem.
Size checks use the message fields only (shape, dtype, codec, nbytes, then the length of the data
span), so a hostile payload cannot make the receiver allocate more than about twice its own size
(on the fast path: the decoded tensors, at most twice the payload for bf16 words widened to fp32,
plus the skeleton). Floating data comes back as fp32 (BF16_BITS upcast exactly), integers in
their declared dtype, all CPU tensors that own writable memory (or, with `adopt`, views of a
buffer the caller hands over).

Measured (benchmarks/codec_memory.py, a 200 MB fp32 update, one thread; docs/results.md section
3): peak extra memory of decoding from bytes 425 MB -> 200 MB; time 0.22 s -> 0.02 s.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import traceback
from pathlib import Path
from typing import Iterable, Iterator, Union

import numpy as np
import torch
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError
from torch import Tensor

from lordo_fed.v1 import wire_pb2 as pb
from lordo_fed.wire.codec import GLOBAL_STATE_SCHEMA, SCHEMA, SCHEMA_V2, UPDATE_SCHEMA, WIRE_WORDS, PayloadError
from lordo_fed.wire.compress import (CodecSpec, CompressionError, Encoded, SparseValues, decode as decode_compressed,
                                      decode_sparse, describe, payload_bounds, split_payload)
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.relayed import relay_own_problem, relayed_reply_problem
from lordo_fed.wire.protowire import MAX_MESSAGE, WT_LEN, Irregular, key, read_key, read_length, skip_value, varint

Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]
"""What the decoders read: a payload in memory, or mapped from its file (`mapped_payload`)."""
_PAYLOAD_TYPES = (bytes, bytearray, memoryview, mmap.mmap)
_COMPRESSED_CODECS = frozenset({pb.QUANT, pb.TOPK, pb.TOPK_QUANT, pb.ROWS})

# dtype -> (codecs that fit it, torch dtype reconstructed)
_DTYPE_INFO: dict[int, tuple[frozenset[int], torch.dtype]] = {
    pb.FLOAT32: (frozenset({pb.RAW, pb.BF16_BITS}), torch.float32),
    pb.BFLOAT16: (frozenset({pb.BF16_BITS}), torch.bfloat16),
    pb.INT64: (frozenset({pb.RAW}), torch.int64),
    pb.INT32: (frozenset({pb.RAW}), torch.int32),
}


def _enum_name(enum, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        return str(value)


# ---------------------------------------------------------------------------------------------
# validation, and the protobuf-message decoders (the fallback of the scanner, the tests' oracle)


def _byte_view(data, kind: str) -> memoryview:
    """A flat memoryview of the payload, without copying it (mmap included)."""
    if not isinstance(data, _PAYLOAD_TYPES):
        raise TypeError(f"{kind}: expected the payload as bytes, got {type(data).__name__}")
    view = memoryview(data)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def _parse(cls, data, kind: str, payload_size: int | None = None):
    """Parse with protobuf; `payload_size` is the size to report (the skeleton of the fast path
    is shorter than the payload it stands for)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{kind}: expected the payload as bytes, got {type(data).__name__}")
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        size = len(data) if payload_size is None else payload_size
        raise PayloadError(f"{kind}: payload of {size} bytes is not a {SCHEMA} message "
                           f"({exc})") from exc
    return msg


def _check_header(msg, kind: str, expected_schema: str, expected_model_id: str | None) -> bool:
    """Schema, wire types and model identity; returns whether the payload is v2 (compressed
    codecs allowed)."""
    if msg.schema == f"{SCHEMA_V2}.{kind}":
        expected_schema = msg.schema
    if msg.schema != expected_schema:
        if not msg.schema:
            raise PayloadError(f"{kind}: the payload carries no schema version (received '', "
                               f"expected {expected_schema!r}): not a {SCHEMA} message")
        hint = ""
        other = UPDATE_SCHEMA if expected_schema == GLOBAL_STATE_SCHEMA else GLOBAL_STATE_SCHEMA
        if msg.schema == other:
            hint = f" (a {other.rsplit('.', 1)[1]} where a {kind} was expected)"
        raise PayloadError(f"{kind}: schema {msg.schema!r} received, expected {expected_schema!r} "
                           f"(or '{SCHEMA_V2}.{kind}' with compressed tensors){hint}")
    _check_wire_types(msg, kind)
    if expected_model_id is not None and msg.model_id != expected_model_id:
        raise PayloadError(f"{kind}: model_id {msg.model_id!r} received, expected "
                           f"{expected_model_id!r}: the payload is for another model "
                           f"(parameter names or shapes differ)")
    return msg.schema.startswith(SCHEMA_V2 + ".")


def _check_counts(kind: str, **fields: int) -> None:
    for name, value in fields.items():
        if value < 0:
            raise PayloadError(f"{kind}.{name}={value}: expected an integer >= 0")


_WIRE_TYPES = {0: "varint", 1: "fixed64", 2: "length-delimited", 3: "start-group", 4: "end-group",
               5: "fixed32"}


def _check_wire_types(msg, label: str) -> None:
    """Refuse a known field sent with another wire type (protobuf parks it among the unknown
    fields and leaves the field empty, e.g. shape dims sent as doubles would read as shape [])."""
    fields = msg.DESCRIPTOR.fields_by_number
    for f in unknown_fields.UnknownFieldSet(msg):
        if f.field_number in fields:
            name = fields[f.field_number].name
            wire = _WIRE_TYPES.get(f.wire_type, str(f.wire_type))
            what = " (non-integer shape dimensions?)" if name == "shape" else ""
            raise PayloadError(f"{label}: field {name!r} sent as {wire}, which does not fit its "
                               f"declared type{what}")


def _spec_of(t: pb.Tensor, label: str = "") -> CodecSpec:
    """The compression spec a v2 tensor declares (its codec fields, as sent); PayloadError, naming
    `label`, for `levels` that no codec has."""
    label = label or repr(t.name)
    if t.codec in (pb.QUANT, pb.ROWS) and t.levels:
        raise PayloadError(f"{label}: levels {_enum_name(pb.Levels, t.levels)} with codec {pb.Codec.Name(t.codec)} "
                           "(only TOPK_QUANT has levels)")
    if t.codec in (pb.QUANT, pb.ROWS) and (t.index_coding or t.tile):
        raise PayloadError(f"{label}: index_coding {_enum_name(pb.IndexCoding, t.index_coding)} / tile {t.tile} with "
                           f"codec {pb.Codec.Name(t.codec)} (only TOPK and TOPK_QUANT have them)")
    if t.codec == pb.QUANT:
        return CodecSpec("quant", bits=t.bits, block=t.block, sqrt=bool(t.sqrt))
    if t.codec == pb.ROWS:
        return CodecSpec("rows", bits=t.bits, topk=t.topk)
    levels = {pb.GRID: "grid", pb.LUT: "lut", pb.SIGN: "sign"}.get(t.levels)
    if levels is None:
        raise PayloadError(f"{label}: unknown levels enum value {_enum_name(pb.Levels, t.levels)} "
                           f"(known: {', '.join(pb.Levels.keys())})")
    if levels != "grid" and t.codec != pb.TOPK_QUANT:
        raise PayloadError(f"{label}: levels {pb.Levels.Name(t.levels)} with codec {pb.Codec.Name(t.codec)} "
                           "(only TOPK_QUANT has levels)")
    coding = {pb.FIXED: "fixed", pb.RICE: "rice"}.get(t.index_coding)
    if coding is None:
        raise PayloadError(f"{label}: unknown index_coding enum value {_enum_name(pb.IndexCoding, t.index_coding)} "
                           f"(known: {', '.join(pb.IndexCoding.keys())})")
    return CodecSpec("topk", bits=t.bits if t.codec == pb.TOPK_QUANT else 0, chunk=t.chunk, density=1.0, topk=t.topk,
                     levels=levels, index_coding=coding, tile=t.tile)


def _check_tensor_meta(t: pb.Tensor, where: str, v2: bool = False,
                       codecs: frozenset[CodecSpec] | None = None) -> tuple[int, ...]:
    """Everything but len(data), from the message fields alone: returns the shape. Compressed
    codecs only in a v2 payload, and only those in `codecs` (what this receiver configured)."""
    label = f"{where}[{t.name!r}]"
    _check_wire_types(t, label)
    if t.dtype not in _DTYPE_INFO:
        raise PayloadError(f"{label}: unknown dtype enum value {_enum_name(pb.DType, t.dtype)} "
                           f"(known: {', '.join(pb.DType.Name(d) for d in _DTYPE_INFO)})")
    known = (pb.RAW, pb.BF16_BITS, *sorted(_COMPRESSED_CODECS)) if v2 else (pb.RAW, pb.BF16_BITS)
    if t.codec not in known:
        raise PayloadError(f"{label}: unknown codec enum value {_enum_name(pb.Codec, t.codec)} "
                           f"(known: {', '.join(pb.Codec.Name(c) for c in known)})"
                           + ("" if v2 or t.codec not in _COMPRESSED_CODECS else
                              f"; compressed codecs come in {SCHEMA_V2} payloads only"))
    compressed = t.codec in _COMPRESSED_CODECS
    codecs_of_dtype = _DTYPE_INFO[t.dtype][0] | (_COMPRESSED_CODECS if t.dtype == pb.FLOAT32 else frozenset())
    if t.codec not in codecs_of_dtype:
        raise PayloadError(f"{label}: codec {pb.Codec.Name(t.codec)} does not fit dtype "
                           f"{pb.DType.Name(t.dtype)} (allowed: "
                           f"{', '.join(sorted(pb.Codec.Name(c) for c in codecs_of_dtype))})")
    if not compressed and (t.bits or t.block or t.chunk or t.topk or t.sqrt or t.levels or t.index_coding or t.tile):
        raise PayloadError(f"{label}: codec {pb.Codec.Name(t.codec)} with compression fields set (bits={t.bits}, "
                           f"block={t.block}, chunk={t.chunk}, topk={t.topk}, sqrt={t.sqrt}, levels={t.levels}, "
                           f"index_coding={t.index_coding}, tile={t.tile})")
    shape = tuple(t.shape)
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool):
            raise PayloadError(f"{label}: shape {list(shape)} has a non-integer dimension {d!r}")
        if d < 0:
            raise PayloadError(f"{label}: shape {list(shape)} has a negative dimension {d}")
    if t.nbytes < 0:
        raise PayloadError(f"{label}: negative declared size nbytes={t.nbytes}")
    if compressed:
        spec = _spec_of(t, label)
        try:
            spec.validate()
        except ValueError as err:
            raise PayloadError(f"{label}: {err}") from None
        if codecs is None or spec.canonical() not in codecs:
            configured = ", ".join(sorted(describe(c) for c in codecs or ())) or "none"
            raise PayloadError(f"{label}: codec {describe(spec)} is not one this receiver configured "
                               f"(configured: {configured})")
        try:
            lo, hi = payload_bounds(spec, math.prod(shape), shape)
        except CompressionError as err:
            raise PayloadError(f"{label}: {err}") from None
        if not lo <= t.nbytes <= hi:
            raise PayloadError(f"{label}: declared size nbytes={t.nbytes} does not match shape {list(shape)} "
                               f"with codec {describe(spec)} = {lo if lo == hi else f'{lo} to {hi}'}")
        return shape
    itemsize = WIRE_WORDS[(t.dtype, t.codec)].itemsize
    expected = math.prod(shape) * itemsize
    if t.nbytes != expected:
        raise PayloadError(f"{label}: declared size nbytes={t.nbytes} does not match shape "
                           f"{list(shape)} x {itemsize} bytes ({pb.DType.Name(t.dtype)}/"
                           f"{pb.Codec.Name(t.codec)}) = {expected}")
    return shape


def _check_group(group: Iterable[pb.Tensor], where: str, v2: bool = False,
                 codecs: frozenset[CodecSpec] | None = None) -> list[tuple[int, ...]]:
    seen: set[str] = set()
    shapes = []
    for t in group:
        if not t.name:
            raise PayloadError(f"{where}: a tensor without a name")
        if t.name in seen:
            raise PayloadError(f"{where}[{t.name!r}]: duplicate tensor name")
        seen.add(t.name)
        shapes.append(_check_tensor_meta(t, where, v2, codecs))
    return shapes


def _build_tensor(t: pb.Tensor, shape: tuple[int, ...], where: str, data=None, adopt: bool = False,
                  compressed: str = "dense") -> Tensor | Encoded | SparseValues:
    """The tensor of `t`, from `data` (a zero-copy view of its span in the payload) or, on the
    protobuf path, from `t.data`; one copy (or the bf16 widening) into memory it owns, or with
    `adopt` no copy at all when the span already is what the tensor needs (fp32 or another
    native dtype, in a writable buffer): the tensor is then a view of the payload. Such a view is
    usually not 4-byte aligned (protobuf's length prefixes put the data anywhere); torch's CPU
    kernels read it with unaligned loads (measured: copying 200 MB out of it takes as long as
    from an aligned one), and a copy to a GPU takes it as any host memory. `compressed='encoded'`: a
    compressed tensor comes back as its `Encoded` (checked, not densified: what a relay sends on);
    `compressed='sparse'`: a top-k one as `SparseValues` (decoded, not densified; `decode_sparse`)."""
    if data is None:
        data = t.data  # the protobuf path: one copy out of the message
    if len(data) != t.nbytes:
        relation = "larger than" if len(data) > t.nbytes else "smaller than"
        raise PayloadError(f"{where}[{t.name!r}]: payload {relation} its declared size "
                           f"({len(data)} bytes of data, nbytes={t.nbytes})")
    if t.codec in _COMPRESSED_CODECS:  # checked against this receiver's codecs and the sizes already
        label = f"{where}[{t.name!r}]"
        try:
            enc = split_payload(_spec_of(t), math.prod(shape), data, shape)
            if compressed == "dense":
                return decode_compressed(enc, label).view(shape)
            decoded = decode_sparse(enc, label)  # validates the positions and values
            return enc if compressed == "encoded" else decoded
        except CompressionError as err:
            raise PayloadError(str(err) if str(err).startswith(label) else f"{label}: {err}") from None
    wire = np.frombuffer(data, dtype=WIRE_WORDS[(t.dtype, t.codec)])
    if t.codec == pb.BF16_BITS:
        # bf16 -> fp32 is exact: the 16 bits are the top half of the fp32 word.
        words = wire.astype(np.uint32)
        words <<= 16
        out = torch.from_numpy(words.view(np.float32)).reshape(shape)
        return out.to(torch.bfloat16) if t.dtype == pb.BFLOAT16 else out
    if adopt and wire.dtype.isnative and wire.flags.writeable:
        return torch.from_numpy(wire).reshape(shape)  # a view: keeps the caller's buffer alive
    native = wire.astype(wire.dtype.newbyteorder("="), copy=True)  # owned, writable
    return torch.from_numpy(native).reshape(shape)


def _decode_group(group, shapes: list[tuple[int, ...]], where: str, spans: list[tuple[int, int]] | None = None,
                  view: memoryview | None = None, adopt: bool = False,
                  compressed: str = "dense") -> dict[str, Tensor]:
    if spans is None:
        return {t.name: _build_tensor(t, shape, where, compressed=compressed) for t, shape in zip(group, shapes)}
    return {t.name: _build_tensor(t, shape, where, view[start:start + size], adopt, compressed)
            for t, shape, (start, size) in zip(group, shapes, spans)}


def _finish_global_state(msg: pb.GlobalState, expected_model_id: str | None,
                         spans: dict[int, list[tuple[int, int]]] | None = None,
                         view: memoryview | None = None, adopt: bool = False,
                         codecs: frozenset[CodecSpec] | None = None, compressed: str = "dense") -> GlobalState:
    """Validate a parsed GlobalState and build its tensors: from each `data` field (protobuf
    path) or from the data spans the scanner found in `view` (fast path, keyed by field number).
    Each relayed reply is a WorkerUpdate payload of its own, decoded (and refused) as one."""
    kind = "GlobalState"
    v2 = _check_header(msg, kind, GLOBAL_STATE_SCHEMA, expected_model_id)
    _check_counts(kind, round=msg.round, opt_step=msg.opt_step, local_steps=msg.local_steps, relay_own=msg.relay_own)
    groups = [(msg.params, f"{kind}.params", 5), (msg.projections, f"{kind}.projections", 6),
              (msg.moments, f"{kind}.moments", 7)]
    shapes = [_check_group(g, where, v2 and field != 6, codecs) for g, where, field in groups]
    params, projections, moments = (
        _decode_group(g, s, where, None if spans is None else spans[field], view, adopt)
        for (g, where, field), s in zip(groups, shapes))
    if msg.params_from_seed and params:
        raise PayloadError(f"{kind}: params_from_seed is set but {len(params)} parameter tensors came too")
    if msg.params_delta and (msg.params_from_seed or not v2):
        raise PayloadError(f"{kind}: params_delta is set " + ("with params_from_seed" if msg.params_from_seed else
                                                              f"in a {SCHEMA} payload (a {SCHEMA_V2} field)"))
    relay = _relayed(msg, expected_model_id, list(msg.relay) if spans is None else
                     [view[start:start + size] for start, size in spans[_RELAY]], codecs, bool(params))
    own = _relay_own(msg, relay, bool(params))
    return GlobalState(round=int(msg.round), params=params, projections=projections,
                       moments=moments, opt_step=int(msg.opt_step), params_from_seed=bool(msg.params_from_seed),
                       params_delta=bool(msg.params_delta), local_steps=int(msg.local_steps), relay=relay,
                       outer_lr=float(msg.outer_lr), relay_own=own,
                       relay_own_digest=msg.relay_own_digest if own is not None else "")


def _relayed(msg: pb.GlobalState, expected_model_id: str | None, payloads: list, codecs: frozenset[CodecSpec] | None,
             has_params: bool) -> list[WorkerUpdate]:
    """The replies a relaying state carries (lordo_fed.rounds.relay), each decoded as a WorkerUpdate payload:
    only with `params_delta` and no θ, of the previous round, Δ only, one per worker; `outer_lr` finite, > 0
    with replies."""
    kind = "GlobalState"
    if not math.isfinite(msg.outer_lr) or msg.outer_lr < 0 or (payloads and not msg.outer_lr > 0):
        raise PayloadError(f"{kind}: outer_lr={msg.outer_lr!r}: expected a finite number > 0 with relayed replies "
                           "(0 without)")
    if not payloads:
        return []
    if not msg.params_delta or has_params:
        raise PayloadError(f"{kind}: {len(payloads)} relayed replies " + ("with θ's tensors too" if has_params else
                                                                           "without params_delta"))
    out: list[WorkerUpdate] = []
    for i, payload in enumerate(payloads):
        where = f"{kind}.relay[{i}]"
        try:
            # each top-k Δ kept sparse, as the server kept it: the replay sums it (and reads its norm) as the server did
            reply = decode_update(payload, expected_model_id, codecs=codecs, sparse=True)
        except PayloadError as err:
            raise PayloadError(f"{where}: {err}") from None
        problem = relayed_reply_problem(reply, msg.round, out[-1] if out else None)
        if problem:
            raise PayloadError(f"{where}: {problem}")
        out.append(reply)
    return out


def _relay_own(msg: pb.GlobalState, relay: list[WorkerUpdate], has_params: bool) -> int | None:
    """The worker whose reply the state leaves out for its node (`relay_own`: worker id + 1 on the wire,
    0: none), screened by `relay_own_problem`."""
    problem = relay_own_problem(int(msg.relay_own) - 1, msg.relay_own_digest, bool(msg.params_delta), has_params,
                                msg.outer_lr, [u.worker_id for u in relay])
    if problem:
        raise PayloadError(f"GlobalState: {problem}")
    return int(msg.relay_own) - 1 if msg.relay_own else None


def _finish_update(msg: pb.WorkerUpdate, expected_model_id: str | None,
                   spans: dict[int, list[tuple[int, int]]] | None = None,
                   view: memoryview | None = None, adopt: bool = False,
                   codecs: frozenset[CodecSpec] | None = None, compressed: str = "dense") -> WorkerUpdate:
    """Validate a parsed WorkerUpdate and build its tensors (see `_finish_global_state`)."""
    kind = "WorkerUpdate"
    v2 = _check_header(msg, kind, UPDATE_SCHEMA, expected_model_id)
    _check_counts(kind, round=msg.round, worker_id=msg.worker_id, tokens=msg.tokens,
                  opt_step=msg.opt_step)
    if len(msg.delta_coords) and not v2:
        raise PayloadError(f"{kind}: delta_coords in a {SCHEMA} payload (a {SCHEMA_V2} field)")
    groups = [(msg.delta, f"{kind}.delta", 7), (msg.moments, f"{kind}.moments", 8),
              (msg.delta_coords, f"{kind}.delta_coords", 10)]
    shapes = [_check_group(g, where, v2, codecs) for g, where, _ in groups]
    # 'sparse' keeps Δ's top-k tensors sparse; moments and coordinates are dense whatever their codec
    modes = [compressed] + [("dense" if compressed == "sparse" else compressed)] * 2
    delta, moments, coords = (_decode_group(g, s, where, None if spans is None else spans[field], view, adopt, mode)
                              for (g, where, field), s, mode in zip(groups, shapes, modes))
    return WorkerUpdate(worker_id=int(msg.worker_id), round=int(msg.round), delta=delta,
                        moments=moments, tokens=int(msg.tokens), opt_step=int(msg.opt_step),
                        metrics={str(k): float(v) for k, v in msg.metrics.items()}, coords=coords)


def decode_global_state_reference(data, expected_model_id: str | None = None,
                                   codecs: frozenset[CodecSpec] | None = None, compressed: str = "dense") -> GlobalState:
    """The protobuf path: parse the whole payload into a message (a copy of it), then copy each
    tensor out of its `data` field. The oracle of the tests, and the fallback of
    `decode_global_state` for wire forms its scanner leaves to protobuf."""
    return _finish_global_state(_parse(pb.GlobalState, data, "GlobalState"), expected_model_id, codecs=codecs,
                                compressed=compressed)


def decode_update_reference(data, expected_model_id: str | None = None,
                             codecs: frozenset[CodecSpec] | None = None, compressed: str = "dense") -> WorkerUpdate:
    """The protobuf path of `decode_update` (see `decode_global_state_reference`)."""
    return _finish_update(_parse(pb.WorkerUpdate, data, "WorkerUpdate"), expected_model_id, codecs=codecs,
                          compressed=compressed)


# ---------------------------------------------------------------------------------------------
# decoding without the protobuf copy
#
# A scanner walks the wire format of the payload (top level, and the body of every Tensor of a
# tensor field) and builds a *skeleton*: the same message with every Tensor's `data` field cut out
# (the enclosing Tensor's length rewritten) and the fields this schema does not know dropped. The
# skeleton is a few bytes per tensor; protobuf parses it, and the usual checks run on the parsed
# message, so every field is read, defaulted, UTF-8-checked and refused exactly as on the protobuf
# path. The data spans, remembered by offset (the last `data` of a Tensor wins, as in protobuf),
# are read through zero-copy views of the payload and copied once into the decoded tensors.
#
# Equivalence rests on one rule: the scanner only cuts what it has delimited exactly as upb does.
# Anything it does not handle itself (groups, wire types 3/4/6/7, non-minimal tag or length
# varints, a varint over 10 bytes, a length past the end, lengths over 2 GiB, unusually many
# fields) raises `Irregular` (lordo_fed.wire.protowire), and the whole payload goes to the
# protobuf path instead, which decides (and costs what it always did). Bytes that protobuf
# validates (strings, varints, enum values, packed shapes, map entries) are copied into the
# skeleton unchanged, so protobuf validates them there. Unknown fields are ignored on both paths.

_TENSOR_FIELDS = {"GlobalState": frozenset({5, 6, 7}), "WorkerUpdate": frozenset({7, 8, 10})}
_RELAY = 11
_SPAN_FIELDS = {"GlobalState": frozenset({_RELAY}), "WorkerUpdate": frozenset()}
"""Bytes fields whose content is itself a payload (a relayed WorkerUpdate): the scanner keeps their spans
and leaves them out of the skeleton, and each is decoded in place as a payload of its own."""
_KNOWN_FIELDS = {"GlobalState": frozenset(pb.GlobalState.DESCRIPTOR.fields_by_number),
                 "WorkerUpdate": frozenset(pb.WorkerUpdate.DESCRIPTOR.fields_by_number)}
_KNOWN_TENSOR_FIELDS = frozenset(pb.Tensor.DESCRIPTOR.fields_by_number)
_TENSOR_DATA = 6
_MAX_HEADER_FIELDS = 4096
"""Top-level fields besides tensors (scalars, metrics entries) the scanner walks in Python
before it leaves the payload to protobuf's C parser (a flood of tiny fields costs the same)."""
_MAX_TENSOR_FIELDS = 64
"""Fields in one Tensor body (we send at most 6) beyond which the same happens."""


def _scan_tensor(view: memoryview, pos: int, end: int) -> tuple[bytes, tuple[int, int]]:
    """One Tensor body: (its bytes without `data` and unknown fields, the span of its data)."""
    kept = []
    span = (pos, 0)  # no data field: empty data, as protobuf reads it
    for _ in range(_MAX_TENSOR_FIELDS):
        if pos >= end:
            return b"".join(kept), span
        start = pos
        field, wire_type, pos = read_key(view, pos, end)
        if field == _TENSOR_DATA and wire_type == WT_LEN:
            size, pos = read_length(view, pos, end)
            span = (pos, size)
            pos += size
            continue
        pos = skip_value(view, pos, end, wire_type)
        if field in _KNOWN_TENSOR_FIELDS:  # a known field sent with another wire type stays:
            kept.append(bytes(view[start:pos]))  # the checks refuse it
    raise Irregular


def _scan(view: memoryview, kind: str) -> tuple[bytes, dict[int, list[tuple[int, int]]]]:
    """The skeleton of a payload and, per tensor field, the data span of each Tensor in order."""
    tensor_fields, known, span_fields = _TENSOR_FIELDS[kind], _KNOWN_FIELDS[kind], _SPAN_FIELDS[kind]
    pieces: list[bytes] = []
    spans: dict[int, list[tuple[int, int]]] = {field: [] for field in tensor_fields | span_fields}
    header_fields = 0
    pos, end = 0, view.nbytes
    if end > MAX_MESSAGE:
        raise Irregular
    while pos < end:
        start = pos
        field, wire_type, pos = read_key(view, pos, end)
        if field in tensor_fields and wire_type == WT_LEN:
            size, pos = read_length(view, pos, end)
            body, span = _scan_tensor(view, pos, pos + size)
            pieces += (key(field, WT_LEN), varint(len(body)), body)
            spans[field].append(span)
            pos += size
            continue
        if field in span_fields and wire_type == WT_LEN:
            size, pos = read_length(view, pos, end)
            if pos + size > end:
                raise Irregular
            spans[field].append((pos, size))
            pos += size
            continue
        header_fields += 1
        if header_fields > _MAX_HEADER_FIELDS:
            raise Irregular
        pos = skip_value(view, pos, end, wire_type)
        if field in known:
            pieces.append(bytes(view[start:pos]))
    return b"".join(pieces), spans


def _decode(data, kind: str, cls, finish, reference, expected_model_id: str | None, adopt: bool = False,
            codecs: Iterable[CodecSpec] | None = None, compressed: str = "dense"):
    view = _byte_view(data, kind)
    codecs = None if codecs is None else frozenset(c.canonical() for c in codecs)
    try:
        skeleton, spans = _scan(view, kind)
    except Irregular:
        return reference(view, expected_model_id, codecs, compressed)
    msg = _parse(cls, skeleton, kind, payload_size=view.nbytes)
    groups = {f.number: getattr(msg, f.name) for f in cls.DESCRIPTOR.fields if f.number in _TENSOR_FIELDS[kind]}
    if any(len(groups[field]) != len(spans[field]) for field in groups):  # pragma: no cover
        return reference(view, expected_model_id, codecs, compressed)  # cannot happen: one element per occurrence
    return finish(msg, expected_model_id, spans, view, adopt, codecs, compressed)


def _release_views_on_error(decode):
    """Decoders raise with their zero-copy views of the payload cleared from the traceback's
    frames: a caller that keeps the exception (pytest.raises, a log record) can still close or
    resize the buffer it decoded from (an mmap refuses to close while a view of it is alive)."""

    @functools.wraps(decode)
    def wrapper(data, expected_model_id: str | None = None, **options):
        try:
            return decode(data, expected_model_id, **options)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    return wrapper


def adoptable(data: Buffer) -> bool:
    """Whether `data` is a writable buffer the receiver may hand to `decode_*(adopt=True)`: a
    bytearray, or a writable memoryview such as a node's download (lordo_fed.transport.client
    `download`). Bytes, read-only views and mmaps are copied from instead."""
    return isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)


@_release_views_on_error
def decode_global_state(data: Buffer, expected_model_id: str | None = None, adopt: bool = False,
                        codecs: Iterable[CodecSpec] | None = None) -> GlobalState:
    """Parse and validate a GlobalState payload; floating tensors come back fp32 on the CPU.

    `data` is bytes, a bytearray, a memoryview or an mmap (a spooled file): it is read in place,
    never copied whole; each tensor is copied once out of it into memory the tensor owns.
    `adopt=True`, for a writable buffer the caller hands over (a node's download): fp32 tensors
    are views of it instead, no copy (and, in a fresh process, no second 4 KiB page fault per
    page: 0.5 s per 200 MB on these VMs); the buffer lives as long as any of them.
    `codecs`: the compression specs this receiver configured (lordo_fed.wire.compress); a
    compressed tensor of any other spec is refused (None: none, v1 codecs only). A compressed
    tensor decodes to fp32 in memory of its own, at most as many bytes as the configured codecs
    expand the payload to."""
    return _decode(data, "GlobalState", pb.GlobalState, _finish_global_state,
                   decode_global_state_reference, expected_model_id, adopt, codecs)


@_release_views_on_error
def decode_update(data: Buffer, expected_model_id: str | None = None, adopt: bool = False,
                  codecs: Iterable[CodecSpec] | None = None, keep_compressed: bool = False,
                  sparse: bool = False) -> WorkerUpdate:
    """Parse and validate a WorkerUpdate payload; floating tensors come back fp32 on the CPU.

    Accepts bytes, bytearray, memoryview or mmap, read in place; `adopt` and `codecs` as in
    `decode_global_state`. `keep_compressed`: compressed tensors come back as their `Encoded`
    (their positions and values decoded to check them, not densified, and kept as sent: what a
    relaying server sends on). `sparse`: a top-k tensor comes back as `SparseValues` (what the server
    keeps of a reply between screening and aggregating it), any other compressed one decoded."""
    if keep_compressed and sparse:
        raise ValueError("decode_update: keep_compressed and sparse exclude each other")
    return _decode(data, "WorkerUpdate", pb.WorkerUpdate, _finish_update, decode_update_reference, expected_model_id,
                   adopt, codecs, "encoded" if keep_compressed else "sparse" if sparse else "dense")


@contextlib.contextmanager
def mapped_payload(path: str | Path) -> Iterator[Buffer]:
    """The payload spooled in file `path`, mapped read-only for `decode_*` to read in place (an
    empty file, which cannot be mapped, as b""). The mapping closes when the block ends, so use
    the decoded message, which owns its tensors, after it:

        with mapped_payload(path) as data:
            update = decode_update(data, expected_model_id=model_id)
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            yield mapped
