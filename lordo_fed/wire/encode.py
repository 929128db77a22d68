"""Encoding a round's payload: `GlobalState` / `WorkerUpdate` -> `lordo_fed.v1` protobuf bytes.

`encode_global_state` and `encode_update` return the payload as one writable buffer; `encode_into` /
`encode_*_into` write it into a given buffer or file; `encoded_size` gives its length upfront;
`StreamingEncode` encodes on a thread into a buffer that is readable as it fills. How tensors
travel (fp32 or bf16, integers as they are) is described in lordo_fed.wire.codec.

Why the wire format is written directly, without a protobuf message: the exact size is computed
from names and shapes, one buffer of that size is allocated (`new_buffer`: not zero-filled first;
or the caller's buffer is used), the few header bytes of each tensor are written, and the tensor is
copied in once by torch through a view of the output, the fp32 cast or bf16 rounding happening in
that copy. Encoding a payload of N bytes thus needs N bytes (the output) instead of ~4N (tensor ->
`tobytes` -> message field -> `SerializeToString`, plus the cast); into a file, it needs a 4 MiB staging buffer at
most. The bytes are those `SerializeToString` writes for the same message (tests/unit/test_codec.py
compares them with the protobuf-message encoders kept here as `encode_*_reference`), except for
the order of the metrics map entries, written sorted by key where `SerializeToString` follows
upb's hash table (a map has no order for a reader). Messages over protobuf's 2 GiB limit are
refused.

Measured (benchmarks/codec_memory.py, a 200 MB fp32 update, one thread; docs/results.md section
3): peak extra memory of encoding 895 MB -> 202 MB (into a file: 0.4 MB); time 0.52 s -> 0.10 s.
"""

from __future__ import annotations

import mmap
import struct
import sys
import threading
import time
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping, Union

import numpy as np
import torch
from torch import Tensor

from lordo_fed.v1 import wire_pb2 as pb
from lordo_fed.wire.codec import SCHEMA, SCHEMA_V2, WIRE_WORDS, check_payload_dtype, wire_form
from lordo_fed.wire.compress import Encoded
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.protowire import (MAX_MESSAGE, WT_FIXED64, WT_LEN, WT_VARINT, int64_field, key, new_buffer,
                                      string_field, varint)

Sink = Union[bytearray, memoryview, mmap.mmap, np.ndarray, BinaryIO]
"""Where `encode_into` writes: a writable buffer (from its offset 0) or a binary file."""
_CHUNK_BYTES = 4 << 20
"""Staging buffer of `encode_*_into(file)` for tensors that need a cast (bounded extra memory)."""
_LITTLE_ENDIAN = sys.byteorder == "little"


# ---------------------------------------------------------------------------------------------
# what both encoders (direct and protobuf-message) derive alike: codec fields, schema string


def _codec_fields(enc: Encoded) -> tuple[int, dict[int, int]]:
    """(Codec enum value, {Tensor field number: value} of bits/block/chunk/topk/sqrt/levels/index_coding/tile)
    of an Encoded."""
    spec = enc.spec
    if spec.kind == "raw":
        return pb.RAW, {}
    if spec.kind == "quant":
        return pb.QUANT, {7: spec.bits, 8: spec.block, **({11: 1} if spec.sqrt else {})}
    if spec.kind == "rows":
        return pb.ROWS, {**({7: spec.bits} if spec.bits else {}), 10: spec.topk}
    levels = {"grid": pb.GRID, "lut": pb.LUT, "sign": pb.SIGN}[spec.levels]
    coding = {"fixed": pb.FIXED, "rice": pb.RICE}[spec.index_coding]
    return (pb.TOPK_QUANT if spec.bits else pb.TOPK), {**({7: spec.bits} if spec.bits else {}), 9: spec.chunk,
                                                        10: spec.k, **({12: levels} if levels else {}),
                                                        **({13: coding} if coding else {}),
                                                        **({14: spec.tile} if spec.tile else {})}


def _relay_own_field(state: GlobalState) -> int:
    """`GlobalState.relay_own` as the wire carries it: the worker id + 1, 0 for none (ids start at 0)."""
    if state.relay_own is None:
        return 0
    if int(state.relay_own) < 0:
        raise ValueError(f"GlobalState.relay_own={state.relay_own!r}: expected a worker id >= 0 or None")
    return int(state.relay_own) + 1


def _schema_of(groups: Iterable[Mapping[str, object]], kind: str, v2_fields: bool = False) -> str:
    """v2 when any tensor travels compressed or a v2 field is set, else v1 (what every v1 receiver reads)."""
    compressed = v2_fields or any(isinstance(t, Encoded) and t.spec.kind != "raw" for g in groups for t in g.values())
    return f"{SCHEMA_V2 if compressed else SCHEMA}.{kind}"


# ---------------------------------------------------------------------------------------------
# the wire format written directly (protobuf encoding rules, proto3)
#
# SerializeToString writes the fields of these messages in field-number order, leaves out scalar
# fields at their default (0, ""), packs `repeated int64 shape`, writes every element of a
# repeated message field (even an empty one) and every map entry with both key and value. The
# plan below reproduces that layout: the headers are a few bytes per tensor, built in Python; the
# tensor data is copied once, straight from the tensor into the output (a cast or the bf16
# rounding happening in that same copy).


class _TensorPiece:
    """One Tensor element of a repeated field: its protobuf bytes up to the data, then the data
    (`nbytes` bytes: the tensor's elements as `wire` words, C order, little-endian)."""

    __slots__ = ("head", "tensor", "wire", "nbytes")

    def __init__(self, head: bytes, tensor: Tensor, wire: torch.dtype, nbytes: int) -> None:
        self.head, self.tensor, self.wire, self.nbytes = head, tensor, wire, nbytes


class _BytesPiece:
    """One compressed tensor's element: its protobuf bytes up to the data, then the data as the codec made
    it, in parts (data, scales, indices) that the writer copies once each, straight into the output."""

    __slots__ = ("head", "parts", "nbytes")

    def __init__(self, head: bytes, parts: tuple[bytes, ...]) -> None:
        self.head, self.parts, self.nbytes = head, parts, sum(len(p) for p in parts)


class _Plan:
    """What an encoder writes, in order: small `bytes`, `_TensorPiece`s and `_BytesPiece`s; `size` in total."""

    def __init__(self) -> None:
        self.pieces: list[bytes | _TensorPiece | _BytesPiece] = []
        self.size = 0

    def add(self, piece: bytes | _TensorPiece | _BytesPiece) -> None:
        self.pieces.append(piece)
        self.size += len(piece) if isinstance(piece, bytes) else len(piece.head) + piece.nbytes


def _plan_encoded(plan: _Plan, field: int, name: str, enc: Encoded, where: str) -> None:
    """A compressed tensor: its header, its bytes as they are, then its codec fields (7-10 come
    after `data` in field order, as SerializeToString writes them)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tensor name {name!r} must be a non-empty string")
    codec, fields = _codec_fields(enc)
    parts = tuple(p for p in (enc.data, enc.scales, enc.indices) if len(p))  # `enc.payload()`, not joined
    nbytes = sum(len(p) for p in parts)
    body = bytearray(string_field(1, name))
    if enc.shape:
        dims = b"".join(varint(int(d)) for d in enc.shape)
        body += key(2, WT_LEN) + varint(len(dims)) + dims
    body += key(3, WT_VARINT) + varint(pb.FLOAT32) + key(4, WT_VARINT) + varint(codec)
    if nbytes:
        body += key(5, WT_VARINT) + varint(nbytes) + key(6, WT_LEN) + varint(nbytes)
    trailer = b"".join(key(number, WT_VARINT) + varint(value) for number, value in sorted(fields.items()) if value)
    head = key(field, WT_LEN) + varint(len(body) + nbytes + len(trailer)) + bytes(body)
    plan.add(_BytesPiece(head, parts))
    if trailer:
        plan.add(trailer)


def _plan_group(plan: _Plan, field: int, tensors: Mapping[str, Tensor], payload_dtype: str, where: str) -> None:
    for name, t in tensors.items():
        if isinstance(t, Encoded):
            _plan_encoded(plan, field, name, t, where)
            continue
        t, dtype, codec, wire = wire_form(name, t, payload_dtype, where)
        nbytes = t.numel() * WIRE_WORDS[(dtype, codec)].itemsize
        body = bytearray(string_field(1, name))
        if t.dim():
            dims = b"".join(varint(int(d)) for d in t.shape)
            body += key(2, WT_LEN) + varint(len(dims)) + dims
        body += key(3, WT_VARINT) + varint(dtype) + key(4, WT_VARINT) + varint(codec)
        if nbytes:
            body += key(5, WT_VARINT) + varint(nbytes) + key(6, WT_LEN) + varint(nbytes)
        head = key(field, WT_LEN) + varint(len(body) + nbytes) + bytes(body)
        plan.add(_TensorPiece(head, t, wire, nbytes))


def _finish_plan(plan: _Plan, kind: str) -> _Plan:
    if plan.size > MAX_MESSAGE:
        raise ValueError(f"{kind}: {plan.size} bytes encoded would exceed protobuf's 2 GiB message limit "
                         f"(send fewer tensors per message, or bf16)")
    return plan


def _global_state_plan(state: GlobalState, model_id: str, payload_dtype: str) -> _Plan:
    check_payload_dtype(payload_dtype)
    if not isinstance(model_id, str):
        raise TypeError(f"model_id: expected a str, got {type(model_id).__name__}")
    plan = _Plan()
    plan.add(string_field(1, _schema_of((state.params, state.moments), "GlobalState", state.params_delta)) + string_field(2, model_id)
             + int64_field(3, int(state.round), "GlobalState.round")
             + int64_field(4, int(state.opt_step), "GlobalState.opt_step"))
    _plan_group(plan, 5, state.params, payload_dtype, "GlobalState.params")
    # Projection bases always travel in fp32: rounded to bf16 they are no longer orthonormal
    # (‖PPᵀ − I‖ ~ 5e-4), and they are small (r x n per matrix, against Δ's m x n).
    _plan_group(plan, 6, state.projections, "fp32", "GlobalState.projections")
    _plan_group(plan, 7, state.moments, payload_dtype, "GlobalState.moments")
    if state.params_from_seed:
        plan.add(key(8, WT_VARINT) + varint(1))
    if state.params_delta:
        plan.add(key(9, WT_VARINT) + varint(1))
    if state.local_steps:
        plan.add(int64_field(10, int(state.local_steps), "GlobalState.local_steps"))
    for reply in state.relay:  # each a WorkerUpdate message inside a bytes field: its length, then its plan
        sub = _update_plan(reply, model_id, payload_dtype)
        plan.add(key(11, WT_LEN) + varint(sub.size))
        for piece in sub.pieces:
            plan.add(piece)
    if state.outer_lr:
        plan.add(key(12, WT_FIXED64) + struct.pack("<d", float(state.outer_lr)))
    own = int64_field(13, _relay_own_field(state), "GlobalState.relay_own") + string_field(14, state.relay_own_digest)
    if own:
        plan.add(own)
    return _finish_plan(plan, "GlobalState")


def _update_plan(update: WorkerUpdate, model_id: str, payload_dtype: str) -> _Plan:
    check_payload_dtype(payload_dtype)
    if not isinstance(model_id, str):
        raise TypeError(f"model_id: expected a str, got {type(model_id).__name__}")
    plan = _Plan()
    plan.add(string_field(1, _schema_of((update.delta, update.moments), "WorkerUpdate", bool(update.coords)))
             + string_field(2, model_id)
             + int64_field(3, int(update.round), "WorkerUpdate.round")
             + int64_field(4, int(update.worker_id), "WorkerUpdate.worker_id")
             + int64_field(5, int(update.tokens), "WorkerUpdate.tokens")
             + int64_field(6, int(update.opt_step), "WorkerUpdate.opt_step"))
    _plan_group(plan, 7, update.delta, payload_dtype, "WorkerUpdate.delta")
    _plan_group(plan, 8, update.moments, payload_dtype, "WorkerUpdate.moments")
    metrics: dict[str, float] = {}
    for name, value in update.metrics.items():  # str() may merge keys: the last value wins, as in a map
        metrics[str(name)] = float(value)
    # Sorted by key (UTF-8 byte order): a fixed order. SerializeToString writes map entries in
    # upb's hash order, and upb's deterministic mode sorts a key after the keys it is a prefix of;
    # a map has no order on the reader's side, so only each entry's bytes have to match.
    for name in sorted(metrics, key=lambda k: k.encode("utf-8")):
        raw = name.encode("utf-8")
        entry = (key(1, WT_LEN) + varint(len(raw)) + raw + key(2, WT_FIXED64)
                 + struct.pack("<d", metrics[name]))
        plan.add(key(9, WT_LEN) + varint(len(entry)) + entry)
    _plan_group(plan, 10, update.coords, payload_dtype, "WorkerUpdate.delta_coords")
    return _finish_plan(plan, "WorkerUpdate")


def _plan_of(msg: GlobalState | WorkerUpdate, model_id: str, payload_dtype: str) -> _Plan:
    if isinstance(msg, GlobalState):
        return _global_state_plan(msg, model_id, payload_dtype)
    if isinstance(msg, WorkerUpdate):
        return _update_plan(msg, model_id, payload_dtype)
    raise TypeError(f"expected a GlobalState or WorkerUpdate, got {type(msg).__name__}")


def _swap_to_little_endian(words: Tensor) -> None:
    """In place: native-endian words -> little-endian (a no-op on little-endian hosts)."""
    if not _LITTLE_ENDIAN and words.element_size() > 1:
        as_int = words.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[words.element_size()])
        as_int.numpy().byteswap(inplace=True)


def _write_plan_into(plan: _Plan, out, progress: Callable[[int], None] | None = None) -> int:
    """Write `plan` into the writable buffer `out` from offset 0: each tensor is copied once,
    by torch, into a view of `out` (casting or rounding to bf16 on the way). `progress(pos)`, when
    given, is called after each piece with the number of bytes of `out` that are final."""
    view = memoryview(out)
    if view.readonly:
        raise TypeError(f"output buffer ({type(out).__name__}) is read-only")
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    if view.nbytes < plan.size:
        raise ValueError(f"output buffer of {view.nbytes} bytes is smaller than the {plan.size}-byte payload")
    pos = 0
    dst: Tensor | None = None
    try:
        with torch.no_grad():
            for piece in plan.pieces:
                head = piece if isinstance(piece, bytes) else piece.head
                view[pos:pos + len(head)] = head
                pos += len(head)
                if isinstance(piece, bytes) or not piece.nbytes:
                    continue
                if isinstance(piece, _BytesPiece):
                    for part in piece.parts:
                        view[pos:pos + len(part)] = part
                        pos += len(part)
                    if progress is not None:
                        progress(pos)
                    continue
                dst = torch.frombuffer(view, dtype=piece.wire, count=piece.tensor.numel(), offset=pos)
                dst.view(piece.tensor.shape).copy_(piece.tensor)
                _swap_to_little_endian(dst)
                pos += piece.nbytes
                if progress is not None:
                    progress(pos)
    finally:
        dst = None  # drop the export of `view` first: a caller's mmap must stay closable
        view.release()
    return pos


def _c_order_chunks(t: Tensor, limit: int) -> Iterator[Tensor]:
    """Views of `t` that cover it in C order, each of at most `limit` elements (a 0-d tensor
    is one piece), without copying `t`: blocks of rows, or single rows split further."""
    if t.numel() <= limit or t.dim() == 0:
        yield t
    elif t.is_contiguous():
        flat = t.view(-1)
        for i in range(0, flat.numel(), limit):
            yield flat[i:i + limit]
    elif (row := t[0].numel()) <= limit:
        step = limit // row
        for i in range(0, t.shape[0], step):
            yield t[i:i + step]
    else:
        for i in range(t.shape[0]):
            yield from _c_order_chunks(t[i], limit)


def _write_all(f: BinaryIO, data) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = f.write(view[done:])
        if n is None:
            raise OSError("the output file is non-blocking and would block")
        done += n


def _write_plan_to_file(plan: _Plan, f: BinaryIO) -> int:
    """Write `plan` sequentially with `f.write`: headers as they are, tensor data straight from
    CPU tensors already in wire form, anything else through a bounded staging buffer."""
    staging: Tensor | None = None
    with torch.no_grad():
        for piece in plan.pieces:
            if isinstance(piece, bytes):
                _write_all(f, piece)
                continue
            _write_all(f, piece.head)
            if isinstance(piece, _BytesPiece):
                for part in piece.parts:
                    _write_all(f, part)
                continue
            t = piece.tensor
            if not piece.nbytes:
                continue
            if _LITTLE_ENDIAN and t.device.type == "cpu" and t.dtype == piece.wire and t.is_contiguous():
                _write_all(f, t.reshape(-1).view(torch.uint8).numpy())
                continue
            if staging is None:
                staging = torch.empty(_CHUNK_BYTES, dtype=torch.uint8)
            itemsize = piece.wire.itemsize
            limit = _CHUNK_BYTES // itemsize
            words = staging.view(piece.wire)
            for chunk in _c_order_chunks(t, limit):
                n = chunk.numel()
                words[:n].view(chunk.shape).copy_(chunk)
                _swap_to_little_endian(words[:n])
                _write_all(f, staging[:n * itemsize].numpy())
    return plan.size


def encoded_size(msg: GlobalState | WorkerUpdate, model_id: str, payload_dtype: str = "fp32") -> int:
    """Exact byte length of `encode_global_state(msg, ...)` / `encode_update(msg, ...)`, computed
    from names and shapes alone (nothing is encoded): what to preallocate or announce upfront."""
    return _plan_of(msg, model_id, payload_dtype).size


def encode_into(msg: GlobalState | WorkerUpdate, model_id: str, out: Sink, payload_dtype: str = "fp32") -> int:
    """Encode a GlobalState or WorkerUpdate into `out`; returns the bytes written.

    `out` is either a writable buffer (bytearray, memoryview, writable mmap, numpy array) at
    least `encoded_size(...)` bytes long, written from its offset 0, or a binary file object
    (anything with `write`, e.g. `open(path, "wb")` or a socket file): written sequentially, with
    at most a 4 MiB staging buffer besides the tensors themselves, so a payload can be spooled to
    disk without ever being held whole in memory. The bytes are those of `encode_global_state` /
    `encode_update`. Validation happens before anything is written."""
    plan = _plan_of(msg, model_id, payload_dtype)
    try:
        memoryview(out).release()
    except TypeError:
        if not callable(getattr(out, "write", None)):
            raise TypeError(f"out: expected a writable buffer or a binary file, got {type(out).__name__}") from None
        return _write_plan_to_file(plan, out)
    return _write_plan_into(plan, out)


def encode_global_state(state: GlobalState, model_id: str, payload_dtype: str = "fp32") -> memoryview:
    """Serialize the aggregator's round state (fp32 exact, or floats rounded to bf16).

    One allocation of the exact encoded size (`new_buffer`: a `bytearray` of it would zero-fill it
    first, 0.157 s of a 200 MB encoding's 0.181 s in a fresh process, cProfile); each tensor is copied into it
    once. The result is a writable, byte-format memoryview (bytes-like: `len`, slicing, `bytes(...)`,
    `write`, protobuf parsing and `decode_*(adopt=True)` all accept it) holding exactly what
    `SerializeToString` of the equivalent protobuf message would."""
    plan = _global_state_plan(state, model_id, payload_dtype)
    out = new_buffer(plan.size)
    _write_plan_into(plan, out)
    return out


def encode_update(update: WorkerUpdate, model_id: str, payload_dtype: str = "fp32") -> memoryview:
    """Serialize a worker's reply (fp32 exact, or floats rounded to bf16).

    One allocation of the exact encoded size, each tensor copied into it once (see
    `encode_global_state`); metrics entries are written sorted by key."""
    plan = _update_plan(update, model_id, payload_dtype)
    out = new_buffer(plan.size)
    _write_plan_into(plan, out)
    return out


class StreamingEncode:
    """`encode_update` (or `encode_global_state`, given a GlobalState) on a thread, into a buffer of
    the exact encoded size that is readable as it fills: a node starts uploading the first bytes
    while the rest is still being encoded, and the server starts serving an announced round's state
    the same way, so the encoding hides behind the link (benchmarks/wan_rounds.py,
    benchmarks/dataplane_throughput.py). `wait_for(n)` blocks until the first `n` bytes are final,
    `written` says how many are without blocking; `result()` returns the whole buffer. The bytes are
    exactly `encode_update`'s / `encode_global_state`'s (their test oracles, tests/unit/test_codec.py)."""

    def __init__(self, message: WorkerUpdate | GlobalState, model_id: str, payload_dtype: str = "fp32"):
        # errors in the inputs raise here, in the caller's thread
        plan = (_global_state_plan(message, model_id, payload_dtype) if isinstance(message, GlobalState)
                else _update_plan(message, model_id, payload_dtype))
        self.buffer = new_buffer(plan.size)
        self.seconds = 0.0
        """How long the encoding took (from its start to its last byte)."""
        self._done, self._error = 0, None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(plan,), name="lordo-encode", daemon=True)
        self._thread.start()

    def _run(self, plan: _Plan) -> None:
        started = time.perf_counter()
        try:
            _write_plan_into(plan, self.buffer, self._advance)
        except BaseException as err:  # noqa: BLE001 (re-raised in the waiting thread)
            with self._cond:
                self._error = err
                self._cond.notify_all()
            return
        self.seconds = time.perf_counter() - started
        self._advance(len(self.buffer))

    def _advance(self, pos: int) -> None:
        with self._cond:
            self._done = pos
            self._cond.notify_all()

    @property
    def written(self) -> int:
        """How many bytes of `buffer`, from its start, are final now (never blocks)."""
        return self._done

    def wait_for(self, nbytes: int) -> None:
        """Block until the first `nbytes` bytes of `buffer` are written; re-raises an encoding error."""
        nbytes = min(nbytes, len(self.buffer))
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._done >= nbytes)
            if self._done < nbytes:
                raise self._error

    def result(self) -> memoryview:
        """The whole encoded payload (waits for it)."""
        self.wait_for(len(self.buffer))
        self._thread.join()
        return self.buffer


def encode_global_state_into(state: GlobalState, model_id: str, out: Sink, payload_dtype: str = "fp32") -> int:
    """`encode_global_state` into a writable buffer or a binary file (see `encode_into`)."""
    if not isinstance(state, GlobalState):
        raise TypeError(f"expected a GlobalState, got {type(state).__name__}")
    return encode_into(state, model_id, out, payload_dtype)


def encode_update_into(update: WorkerUpdate, model_id: str, out: Sink, payload_dtype: str = "fp32") -> int:
    """`encode_update` into a writable buffer or a binary file (see `encode_into`)."""
    if not isinstance(update, WorkerUpdate):
        raise TypeError(f"expected a WorkerUpdate, got {type(update).__name__}")
    return encode_into(update, model_id, out, payload_dtype)


# ---------------------------------------------------------------------------------------------
# the protobuf-message encoders (the oracle of the tests; not used on the hot path)


def _le_bytes(arr: np.ndarray) -> bytes:
    """C-order little-endian bytes of an array (no copy beyond tobytes on little-endian hosts)."""
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _fill_tensor(out: pb.Tensor, name: str, t: Tensor, payload_dtype: str, where: str) -> None:
    if isinstance(t, Encoded):
        codec, fields = _codec_fields(t)
        out.name = name
        out.shape.extend(int(d) for d in t.shape)
        out.dtype, out.codec = pb.FLOAT32, codec
        data = t.payload()
        out.nbytes = len(data)
        out.data = data
        for number, value in fields.items():
            name = pb.Tensor.DESCRIPTOR.fields_by_number[number].name
            setattr(out, name, bool(value) if name == "sqrt" else value)
        return
    t, dtype, codec, _ = wire_form(name, t, payload_dtype, where)
    if t.device.type != "cpu":
        t = t.cpu()
    if codec == pb.BF16_BITS:
        data = _le_bytes(t.to(torch.bfloat16).contiguous().view(torch.int16).numpy())
    elif dtype == pb.FLOAT32:
        data = _le_bytes(t.to(torch.float32).contiguous().numpy())
    else:
        data = _le_bytes(t.contiguous().numpy())
    out.name = name
    out.shape.extend(int(d) for d in t.shape)
    out.dtype = dtype
    out.codec = codec
    out.nbytes = len(data)
    out.data = data


def _fill_group(group, tensors: Mapping[str, Tensor], payload_dtype: str, where: str) -> None:
    for name, t in tensors.items():
        _fill_tensor(group.add(), name, t, payload_dtype, where)


def encode_global_state_reference(state: GlobalState, model_id: str, payload_dtype: str = "fp32",
                                   deterministic: bool = False) -> bytes:
    """The protobuf-message encoder (tensor -> bytes -> message field -> SerializeToString: ~4
    payload-sized copies). Kept as the oracle that `encode_global_state` must match byte for byte."""
    check_payload_dtype(payload_dtype)
    msg = pb.GlobalState(schema=_schema_of((state.params, state.moments), "GlobalState", state.params_delta), model_id=model_id,
                         round=int(state.round), opt_step=int(state.opt_step))
    _fill_group(msg.params, state.params, payload_dtype, "GlobalState.params")
    _fill_group(msg.projections, state.projections, "fp32", "GlobalState.projections")
    _fill_group(msg.moments, state.moments, payload_dtype, "GlobalState.moments")
    msg.params_from_seed = bool(state.params_from_seed)
    msg.params_delta = bool(state.params_delta)
    msg.local_steps = int(state.local_steps)
    msg.relay.extend(encode_update_reference(r, model_id, payload_dtype, deterministic) for r in state.relay)
    msg.outer_lr = float(state.outer_lr)
    msg.relay_own = _relay_own_field(state)
    msg.relay_own_digest = state.relay_own_digest
    return msg.SerializeToString(deterministic=deterministic)


def encode_update_reference(update: WorkerUpdate, model_id: str, payload_dtype: str = "fp32",
                             deterministic: bool = False) -> bytes:
    """The protobuf-message encoder of a WorkerUpdate (the oracle of `encode_update`). Map entries
    (metrics) come out in upb's hash order, or in upb's sort order with `deterministic`."""
    check_payload_dtype(payload_dtype)
    msg = pb.WorkerUpdate(schema=_schema_of((update.delta, update.moments), "WorkerUpdate", bool(update.coords)),
                          model_id=model_id,
                          round=int(update.round),
                          worker_id=int(update.worker_id), tokens=int(update.tokens),
                          opt_step=int(update.opt_step))
    _fill_group(msg.delta, update.delta, payload_dtype, "WorkerUpdate.delta")
    _fill_group(msg.moments, update.moments, payload_dtype, "WorkerUpdate.moments")
    for name, value in update.metrics.items():
        msg.metrics[str(name)] = float(value)
    _fill_group(msg.delta_coords, update.coords, payload_dtype, "WorkerUpdate.delta_coords")
    return msg.SerializeToString(deterministic=deterministic)
