"""Compression codecs for tensors on the wire: blockwise quantisation, chunked top-k, their
composition, and the error feedback that carries each compression's residual into the next round.

- **Blockwise quantisation** (`quantize` / `dequantize`): the flattened tensor is cut into blocks of
  `block` values, each with one positive scale s = absmax / L, and every value is rounded to the
  nearest level: int8 q ∈ [−127, 127] and int4 q ∈ [−7, 7]; every code decodes to q·s. Codes are
  packed 8 / bits per byte. An all-zero block gets the smallest normal fp32 as its scale, so every
  scale on the wire is finite and > 0 (a receiver refuses the rest).
- **Chunked top-k** (`topk` / `densify`): the flattened tensor is cut into chunks of `chunk`
  values and each keeps its k largest magnitudes (the tail chunk of n mod chunk values keeps
  ceil(k · tail / chunk)), indices sorted within the chunk and packed in 12 bits when chunk ≤ 4096
  (16 when ≤ 65536): SparseLoCo's layout (Sarfi et al. 2025, "Communication-Efficient Language
  Model Training Scales Reliably and Robustly"), where top-k of 1–3% per chunk with 2-bit values
  and error feedback loses nothing against DiLoCo. `index_coding='rice'` sends the gaps between a
  chunk's sorted positions as Rice codes instead (lossless; ~6.5 bits a position at 1/32, 7.5 at
  1/64, against 12). `tile=64` cuts a 2-D tensor into 64×64 tiles, each a chunk (SparseLoCo's cut).
  Selection, layout and position codings live in lordo_fed/wire/positions.py.
- **2-bit top-k values** decode to bin means, never to a grid: a 2-bit grid has no level near the
  typical kept value and inflates heavy-tailed ones (gain ⟨x̂, x⟩/⟨x, x⟩ 1.23–1.62 on Student-t(3),
  docs/results.md section 12). `levels='lut'` is SparseLoCo's lookup table (Sarfi et al. 2025, its
  code): over the tensor's kept values, shift μ and σ, four bins of width 1.5σ around μ, and each
  code decodes to the mean of the values in its bin (4 fp32 per tensor). `levels='sign'`: the sign
  and one of two magnitudes per chunk, each the mean of its side of a split fitted to the chunk's
  kept magnitudes (8 bytes per chunk). A bin mean never
  overshoots: the decoded value is the mean of the originals that share its code.
- **1-bit top-k values** (`bits=1`, `levels='sign'`): the sign and the chunk's mean kept magnitude
  (4 bytes per chunk), the least-squares scale of the signs: a 3% top-k keeps the chunk's largest
  values, whose magnitudes differ little, and a kept value's bytes are mostly its position (about
  6.6 of 9 bits at 3% with 2-bit values; docs/results.md section 12, part seven).
- **Row-sparse** (`kind='rows'`, for an embedding): of a 2-D tensor, only the rows whose L2 norm
  is at least `threshold` x the largest row's, their values fp32 or int8 / int4 with one scale
  per row, their row indices packed in 16 bits (32 past 65536 rows). With error feedback the rows
  left out accumulate until they qualify.
- **Composition**: a `CodecSpec` names a raw, a quantised, a top-k, a top-k-with-quantised-
  values or a row-sparse encoding; `encode` returns an `Encoded` whose byte fields are what a wire tensor
  carries, `decode` rebuilds the fp32 tensor and refuses what cannot have come from `encode`
  (`CompressionError`, naming the tensor and the problem); `decode_sparse` gives a top-k as its values at
  their positions (`SparseValues`), which the server adds into its sums without the dense tensor.
- **Error feedback** (`ErrorFeedback`): e ← β·e + x; c = C(e); e ← e − D(c): what a compression
  leaves out of one round is sent in a later one (Seide et al. 2014; Karimireddy et al. 2019);
  β < 1 lets old residue fade (SparseLoCo's 0.95).

Everything is plain torch on whatever device the tensor lives on, one pass per tensor; the
simple reference of each codec (a loop per block or chunk) lives in tests/unit/test_compress.py as
its oracle.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

from lordo_fed.wire.positions import (chunk_layout, chunk_offsets, densify, pack_positions, position_bytes, tile_order,
                                      tiled, topk, unpack_positions, untile)
from lordo_fed.wire.values import (LUT_BINS, CompressionError, all_finite, dequantize, lut_quantize, pack, packed_size,
                                   quantize, row_index_bits, sign_dequantize, sign_quantize, unpack)

QUANT_BITS = (8, 4)
"""Dense blockwise quantisation."""
TOPK_BITS = (0, 8, 4, 2, 1)
"""Top-k values: fp32 (0), 8 or 4 bits on a grid, 2 bits as bin means, 1 bit as the sign."""
LEVELS = ("grid", "lut", "sign")
"""How quantised top-k values decode: 'grid' (8, 4 bits), 'lut' (2 bits) or 'sign' (2 bits, or 1: the
sign and the chunk's mean magnitude)."""
ROW_BITS = (0, 8, 4)
"""Values of a row-sparse tensor: fp32 (0), int8 or int4, one scale per row."""
INDEX_CODINGS = ("fixed", "rice")
"""How top-k positions travel: 'fixed' (12 or 16 bits each), 'rice' (the gaps, Rice-coded)."""


@dataclass(frozen=True)
class CodecSpec:
    """How one tensor is compressed: 'raw' (fp32), 'quant' (blockwise, `bits`, `block`), 'topk'
    (`density` of each `chunk`, values fp32 or, with `bits`, quantised per `levels`),
    'rows' (the rows of a 2-D tensor at least `threshold` x the largest row's norm)."""

    kind: str = "raw"
    """'raw', 'quant', 'topk' or 'rows'."""
    bits: int = 0
    """Quantised values: 8 or 4 ('quant' needs one), 2 for top-k values (0 = fp32 values)."""
    block: int = 64
    """'quant': values per scale."""
    chunk: int = 4096
    """'topk': values per chunk."""
    density: float = 0.03
    """'topk': the share of each chunk kept (k = max(1, round(density · chunk)))."""
    topk: int = 0
    """'topk': entries kept per chunk, when given (0 = from `density`; what a receiver reads off the wire).
    'rows': the rows one encoding kept (set by `encode`, read off the wire)."""
    threshold: float = 0.1
    """'rows': keep the rows whose L2 norm is at least this share of the largest row's (0 < t <= 1)."""
    sqrt: bool = False
    """'quant' of a second moment v ≥ 0: √v is quantised, rounded up, and squared back, so v̂ ≥ v
    and a positive v never becomes 0 (Adam divides by √v̂: a zeroed v makes its step explode)."""
    levels: str = "grid"
    """'topk' with `bits`: 'grid' (8, 4 bits: q·s, one scale per chunk), 'lut' or 'sign' (2 bits: bin means)."""
    index_coding: str = "fixed"
    """'topk': positions 'fixed' (12 bits each for chunks of 4096) or 'rice' (the gaps between a chunk's
    sorted positions, Rice-coded: ~6.5 bits at 1/32, `rice_parameter`)."""
    tile: int = 0
    """'topk': the side of the square tiles a 2-D tensor whose sides it divides is cut into, each a chunk
    (`chunk` = tile², SparseLoCo's 64×64); 0, and every other tensor: flat chunks of the C-order values."""

    def validate(self) -> "CodecSpec":
        if self.kind not in ("raw", "quant", "topk", "rows"):
            raise ValueError(f"codec kind={self.kind!r}: expected 'raw', 'quant', 'topk' or 'rows'")
        if self.kind == "rows":
            if self.bits not in ROW_BITS:
                raise ValueError(f"codec 'rows' bits={self.bits!r}: expected one of {ROW_BITS} (0 = fp32 values)")
            if not (0.0 < self.threshold <= 1.0):
                raise ValueError(f"codec 'rows' threshold={self.threshold!r}: expected a share in (0, 1]")
            if not (isinstance(self.topk, int) and self.topk >= 0):
                raise ValueError(f"codec 'rows' topk={self.topk!r}: expected the number of rows kept, >= 0")
            return self
        if self.kind == "quant" and self.bits not in QUANT_BITS:
            raise ValueError(f"codec 'quant' bits={self.bits!r}: expected one of {QUANT_BITS}")
        if self.kind == "topk" and self.bits not in TOPK_BITS:
            raise ValueError(f"codec 'topk' bits={self.bits!r}: expected 0 (fp32 values) or one of {TOPK_BITS[1:]}")
        if self.levels not in LEVELS:
            raise ValueError(f"codec levels={self.levels!r}: expected one of {LEVELS}")
        if self.kind == "topk" and self.bits == 2 and self.levels == "grid":
            raise ValueError("codec 'topk' bits=2 levels='grid': 2-bit values decode to bin means, expected "
                             "levels 'lut' or 'sign' (a 2-bit grid inflates heavy-tailed values)")
        if self.levels != "grid" and (self.kind != "topk" or self.bits not in ((2, 1) if self.levels == "sign" else (2,))):
            raise ValueError(f"codec levels={self.levels!r} with kind={self.kind!r} bits={self.bits}: "
                             "'lut' is for 2-bit top-k values, 'sign' for 2- and 1-bit ones")
        if self.kind == "topk" and self.bits == 1 and self.levels != "sign":
            raise ValueError(f"codec 'topk' bits=1 levels={self.levels!r}: 1-bit values are signs, expected "
                             "levels 'sign'")
        if not (isinstance(self.block, int) and self.block >= 1):
            raise ValueError(f"codec block={self.block!r}: expected an integer >= 1")
        if not (isinstance(self.chunk, int) and 1 <= self.chunk <= 65536):
            raise ValueError(f"codec chunk={self.chunk!r}: expected an integer in [1, 65536]")
        if not (0.0 < self.density <= 1.0):
            raise ValueError(f"codec density={self.density!r}: expected a share in (0, 1]")
        if not (isinstance(self.topk, int) and 0 <= self.topk <= self.chunk):
            raise ValueError(f"codec topk={self.topk!r}: expected 0 (from density) or 1..chunk={self.chunk}")
        if self.sqrt and self.kind != "quant":
            raise ValueError(f"codec sqrt=True with kind={self.kind!r}: only 'quant' quantises square roots")
        if self.index_coding not in INDEX_CODINGS:
            raise ValueError(f"codec index_coding={self.index_coding!r}: expected one of {INDEX_CODINGS}")
        if self.kind != "topk" and (self.index_coding != "fixed" or self.tile):
            raise ValueError(f"codec index_coding={self.index_coding!r} tile={self.tile!r} with kind={self.kind!r}: "
                             "they are for top-k positions")
        if not (isinstance(self.tile, int) and 0 <= self.tile and (not self.tile or self.tile ** 2 == self.chunk)):
            raise ValueError(f"codec tile={self.tile!r}: expected 0 (flat chunks) or the side of a square chunk, "
                             f"tile² = chunk={self.chunk}")
        return self

    @property
    def k(self) -> int:
        """Entries kept per full chunk."""
        return self.topk if self.topk else max(1, min(self.chunk, round(self.density * self.chunk)))

    def canonical(self) -> "CodecSpec":
        """The spec as a receiver reads it off the wire (only the fields the kind uses; k explicit):
        what a receiver's set of configured codecs holds."""
        if self.kind == "raw":
            return CodecSpec("raw")
        if self.kind == "quant":
            return CodecSpec("quant", bits=self.bits, block=self.block, sqrt=self.sqrt)
        if self.kind == "rows":  # the rows kept and the threshold are the sender's choice, per tensor
            return CodecSpec("rows", bits=self.bits)
        return CodecSpec("topk", bits=self.bits, chunk=self.chunk, density=1.0, topk=self.k, levels=self.levels,
                         index_coding=self.index_coding, tile=self.tile)


@dataclass
class Encoded:
    """A compressed tensor as it crosses the wire: `data` holds the (packed) values, `scales` the
    fp32 block scales, `indices` the packed top-k positions; `shape` the tensor's."""

    spec: CodecSpec
    numel: int
    data: bytes
    scales: bytes = b""
    indices: bytes = b""
    shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.scales) + len(self.indices)

    def payload(self) -> bytes:
        """The bytes of a wire tensor's `data` field: data, scales, indices, in that order."""
        return self.data + self.scales + self.indices


def part_sizes(spec: CodecSpec, numel: int, shape: tuple[int, ...] = ()) -> tuple[int, int, int]:
    """(data, scales, indices) bytes of `numel` values (of `shape`, which 'rows' needs) encoded
    per `spec`: what a receiver expects before it reads anything. Rice-coded indices vary with the
    positions: their largest size here (`lordo_fed.wire.positions.position_bytes`)."""
    if spec.kind == "raw":
        return 4 * numel, 0, 0
    if spec.kind == "rows":
        nrows, row_len = _row_shape(shape, numel)
        values = spec.topk * row_len
        data = packed_size(values, spec.bits) if spec.bits else 4 * values
        return data, 4 * spec.topk if spec.bits else 0, packed_size(spec.topk, row_index_bits(nrows))
    if spec.kind == "quant":
        return packed_size(numel, spec.bits), 4 * math.ceil(numel / spec.block), 0
    full, k, _, k_tail = chunk_layout(numel, spec.chunk, spec.k)
    count = full * k + k_tail
    indices = position_bytes(numel, spec.chunk, spec.k, spec.index_coding)[1]
    if not spec.bits:
        return 4 * count, 0, indices
    groups = full + (1 if k_tail else 0)
    per = {"grid": 4 * groups, "lut": 4 * LUT_BINS, "sign": 4 * _sign_magnitudes(spec) * groups}[spec.levels]
    return packed_size(count, spec.bits), per, indices


def payload_bounds(spec: CodecSpec, numel: int, shape: tuple[int, ...] = ()) -> tuple[int, int]:
    """(fewest, most) bytes of a whole encoding: one size unless its positions are Rice-coded."""
    data, scales, indices = part_sizes(spec, numel, shape)
    if spec.kind != "topk":
        return data + scales + indices, data + scales + indices
    lo, hi = position_bytes(numel, spec.chunk, spec.k, spec.index_coding)
    return data + scales + lo, data + scales + hi


def split_payload(spec: CodecSpec, numel: int, payload, shape: tuple[int, ...] = ()) -> Encoded:
    """The `Encoded` whose `payload()` is `payload` (sizes from `part_sizes`, the positions the rest;
    CompressionError when the length is outside `payload_bounds`)."""
    sizes = part_sizes(spec, numel, shape)
    lo, hi = payload_bounds(spec, numel, shape)
    if not lo <= len(payload) <= hi:
        expected = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise CompressionError(f"{len(payload)} bytes, expected {expected} for {numel} values of codec "
                               f"{describe(spec)}")
    a, b = sizes[0], sizes[0] + sizes[1]
    view = memoryview(payload)
    return Encoded(spec, numel, bytes(view[:a]), bytes(view[a:b]), bytes(view[b:]), shape)


def support(enc: Encoded) -> Tensor:
    """The flat positions a top-k `Encoded` carries, increasing within each chunk (int64), in the
    order its chunks are cut (tiles, for a tiled tensor)."""
    spec = enc.spec
    return (unpack_positions(enc.indices, enc.numel, spec.chunk, spec.k, spec.index_coding, "tensor")
            + chunk_offsets(enc.numel, spec.chunk, spec.k))


def describe(spec: CodecSpec) -> str:
    """A short name of a spec for messages: raw, int8/64, top-k 123/4096, top-k 123/4096 2-bit."""
    if spec.kind == "raw":
        return "raw"
    if spec.kind == "quant":
        return f"{'sqrt-' if spec.sqrt else ''}int{spec.bits}/{spec.block}"
    if spec.kind == "rows":
        return "rows" + (f" {spec.topk}" if spec.topk else "") + (f" int{spec.bits}" if spec.bits else " fp32")
    return (f"top-k {spec.k}/{spec.chunk}" + (f" {spec.tile}x{spec.tile} tiles" if spec.tile else "")
            + (f" {spec.bits}-bit" if spec.bits else "") + (f" {spec.levels}" if spec.levels != "grid" else "")
            + (" rice" if spec.index_coding == "rice" else ""))


def _row_shape(shape: tuple[int, ...], numel: int) -> tuple[int, int]:
    """(rows, values per row) of a row-sparse tensor; CompressionError unless it is 2-D."""
    if len(shape) != 2 or math.prod(shape) != numel:
        raise CompressionError(f"the row-sparse codec needs a 2-D shape, got {list(shape)} for {numel} values")
    return int(shape[0]), int(shape[1])


# ----------------------------------------------------------------------------- encode / decode
def encode(x: Tensor, spec: CodecSpec) -> Encoded:
    """`x` compressed per `spec` (`decode(encode(x, s), ...)` is what the receiver gets)."""
    n, shape = x.numel(), tuple(x.shape)
    if spec.kind == "raw":
        return Encoded(spec, n, _f32(x), shape=shape)
    if spec.kind == "rows":
        return _encode_rows(x, spec)
    if spec.kind == "quant":
        values = x.detach().float().clamp_min(0).sqrt() if spec.sqrt else x
        codes, scales = quantize(values, spec.bits, spec.block, up=spec.sqrt)
        return Encoded(spec, n, pack(codes, spec.bits), _f32(scales), shape=shape)
    positions, values = topk(tile_order(x.detach(), spec.tile) if tiled(spec.tile, shape) else x, spec.chunk, spec.k)
    indices = pack_positions(positions, n, spec.chunk, spec.k, spec.index_coding)
    if not spec.bits:
        return Encoded(spec, n, _f32(values), indices=indices, shape=shape)
    codes, scales = _quantize_groups(values, spec, _value_groups(n, spec))
    return Encoded(spec, n, pack(codes, spec.bits), _f32(scales), indices, shape)


def decode(enc: Encoded, label: str = "tensor") -> Tensor:
    """The flat fp32 tensor an `Encoded` stands for; CompressionError (naming `label`) for byte
    counts that do not match the spec and numel, non-finite or non-positive scales, top-k
    indices out of range or repeated, non-finite values."""
    spec, n = enc.spec, enc.numel
    if n < 0:
        raise CompressionError(f"{label}: numel={n}")
    try:
        if spec.kind == "raw":
            if len(enc.data) != 4 * n:
                raise CompressionError(f"{len(enc.data)} bytes of fp32 values, expected {4 * n}")
            out = torch.frombuffer(bytearray(enc.data), dtype=torch.float32) if n else torch.zeros(0)
            return _finite(out, label)
        if spec.kind == "rows":
            return _decode_rows(enc, label)
        if spec.kind == "quant":
            nblocks = math.ceil(n / spec.block)
            scales = _scales(enc.scales, nblocks)
            codes = unpack(enc.data, spec.bits, n)
            values = dequantize(codes, scales, spec.bits, spec.block, n)
            if spec.sqrt:
                if bool((values < 0).any()):
                    raise CompressionError("a negative square root of a second moment")
                return values.square()
            return values
        positions, values = _topk_parts(enc, label)
        out = densify(positions, values, n, spec.chunk, spec.k)
        return untile(out, enc.shape, spec.tile) if tiled(spec.tile, tuple(enc.shape)) else out
    except CompressionError as err:
        raise _named(err, label) from None


def _named(err: CompressionError, label: str) -> CompressionError:
    return err if str(err).startswith(label) else CompressionError(f"{label}: {err}")


def _topk_parts(enc: Encoded, label: str) -> tuple[Tensor, Tensor]:
    """(positions within their chunks, fp32 values) of a top-k `Encoded`, checked as `decode` checks them."""
    spec, n = enc.spec, enc.numel
    full, k, tail, k_tail = chunk_layout(n, spec.chunk, spec.k)
    count = full * k + k_tail
    positions = unpack_positions(enc.indices, n, spec.chunk, spec.k, spec.index_coding, label)
    if not spec.bits:
        if len(enc.data) != 4 * count:
            raise CompressionError(f"{len(enc.data)} bytes of top-k values, expected {4 * count}")
        return positions, _finite(torch.frombuffer(bytearray(enc.data), dtype=torch.float32) if count else torch.zeros(0),
                                  label)
    codes = unpack(enc.data, spec.bits, count)
    return positions, _dequantize_groups(codes, enc.scales, spec, _value_groups(n, spec))


@dataclass(frozen=True)
class SparseValues:
    """A decoded top-k tensor kept sparse: its fp32 `values` at the flat `positions` (int64, each once)
    of a tensor of `shape`, zeros elsewhere. What the server keeps of a top-k reply between screening
    it and adding it into the round's sums: 12 bytes a sent value, where the dense decode is 4 bytes
    a parameter (33x more at 3% density), so a reply is decoded once (server/courier.py)."""

    positions: Tensor
    values: Tensor
    shape: tuple[int, ...]
    encoded: Encoded | None = field(default=None, compare=False, repr=False)
    """The bytes it was decoded from (`decode_sparse`), checked: what a relaying server sends on
    (lordo_fed.rounds.relay.relayed_of), so that a reply it keeps sparse is not decoded twice."""

    @property
    def nbytes(self) -> int:
        return (self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()
                + (self.encoded.nbytes if self.encoded is not None else 0))

    def dense(self) -> Tensor:
        """The tensor as `decode` gives it."""
        out = torch.zeros(math.prod(self.shape), dtype=torch.float32, device=self.values.device)
        out[self.positions] = self.values
        return out.view(self.shape)

    def add_to(self, acc: Tensor, alpha: float) -> None:
        """acc += alpha · self, bit for bit what `acc.add_(self.dense(), alpha=alpha)` gives: the same
        add_ on the sent positions (gathered, added, scattered back), and x + alpha·0 = x elsewhere
        (where x is −0.0 the dense add gives +0.0: equal, as torch.equal and every later sum see it)."""
        flat, positions = acc.view(-1), self.positions.to(acc.device)
        # index_select / index_copy_ rather than flat[positions]: the same add_, 1.7x faster on a CPU
        flat.index_copy_(0, positions, flat.index_select(0, positions).add_(self.values.to(acc.device), alpha=alpha))


def decode_sparse(enc: Encoded, label: str = "tensor") -> Tensor | SparseValues:
    """What `decode` gives, as `SparseValues` for an untiled top-k (the dense tensor, shaped, otherwise);
    the same checks and CompressionErrors as `decode`."""
    spec = enc.spec
    if spec.kind != "topk" or tiled(spec.tile, tuple(enc.shape)) or math.prod(enc.shape) != enc.numel:
        return decode(enc, label).view(enc.shape)
    try:
        positions, values = _topk_parts(enc, label)
    except CompressionError as err:
        raise _named(err, label) from None
    return SparseValues(positions + chunk_offsets(enc.numel, spec.chunk, spec.k), values.float(), tuple(enc.shape), enc)


def plus_decoded(x: Tensor, enc: Encoded, label: str = "tensor") -> Tensor:
    """x + decode(enc) as a new tensor, bit for bit; an untiled top-k adds on its positions only
    (`SparseValues.add_to`), without building its dense decode."""
    return add_decoded(x.clone(memory_format=torch.contiguous_format), enc, label)


def add_decoded(x: Tensor, enc: Encoded, label: str = "tensor") -> Tensor:
    """x += decode(enc) in place (`x` contiguous), bit for bit `plus_decoded`'s sum; returns `x`."""
    change = decode_sparse(enc, label)
    if isinstance(change, SparseValues):
        change.add_to(x, 1.0)
    else:
        x.add_(change.view(x.shape))
    return x


def decoded(tensors: Mapping[str, Tensor | Encoded], sparse: bool = False) -> dict[str, Tensor | SparseValues]:
    """`tensors` with every `Encoded` replaced by what its receiver decodes (shaped as sent):
    what the reference trainer aggregates, the same values a Flower server decodes. With `sparse`, an
    untiled top-k comes back as `SparseValues` (`decode_sparse`), which every sum adds bit for bit as its
    dense decode."""
    if sparse:
        return {k: decode_sparse(v, k) if isinstance(v, Encoded) else v for k, v in tensors.items()}
    return {k: decode(v, k).view(v.shape) if isinstance(v, Encoded) else v for k, v in tensors.items()}


def roundtrip(x: Tensor, spec: CodecSpec) -> Tensor:
    """What the receiver of `encode(x, spec)` reconstructs, shaped like `x`."""
    return decode(encode(x, spec)).view_as(x).to(x.device)


def _encode_rows(x: Tensor, spec: CodecSpec) -> Encoded:
    """The rows of 2-D `x` whose L2 norm is >= threshold x the largest (none when x is 0)."""
    if x.dim() != 2:
        raise ValueError(f"the row-sparse codec needs a 2-D tensor, got shape {list(x.shape)}")
    rows = x.detach().float()
    norms = rows.norm(dim=1)
    top = float(norms.max()) if rows.shape[0] else 0.0
    kept = ((norms >= spec.threshold * top) & (norms > 0)).nonzero().squeeze(1)  # increasing
    values = rows[kept]
    sent = dataclasses.replace(spec, topk=int(kept.numel()))
    indices = pack(kept, row_index_bits(rows.shape[0]))
    if not spec.bits:
        return Encoded(sent, x.numel(), _f32(values), indices=indices, shape=tuple(x.shape))
    codes, scales = quantize(values, spec.bits, max(1, rows.shape[1]))  # one scale per row
    return Encoded(sent, x.numel(), pack(codes, spec.bits), _f32(scales), indices, tuple(x.shape))


def _decode_rows(enc: Encoded, label: str) -> Tensor:
    spec = enc.spec
    nrows, row_len = _row_shape(tuple(enc.shape), enc.numel)
    count = spec.topk
    if count > nrows:
        raise CompressionError(f"{count} rows declared, the tensor has {nrows}")
    kept = unpack(enc.indices, row_index_bits(nrows), count)
    if count and int(kept.max()) >= nrows:
        raise CompressionError(f"a row index >= the tensor's {nrows} rows")
    if count > 1 and not bool((kept[1:] > kept[:-1]).all()):
        raise CompressionError("row indices repeated or out of order")
    if spec.bits:
        scales = _scales(enc.scales, count)
        values = dequantize(unpack(enc.data, spec.bits, count * row_len), scales, spec.bits, max(1, row_len),
                            count * row_len)
    else:
        if len(enc.data) != 4 * count * row_len:
            raise CompressionError(f"{len(enc.data)} bytes of row values, expected {4 * count * row_len}")
        values = _finite(torch.frombuffer(bytearray(enc.data), dtype=torch.float32) if count * row_len
                         else torch.zeros(0), label)
    out = torch.zeros(nrows, row_len)
    out[kept.long()] = values.view(count, row_len)
    return out.reshape(-1)


def _f32(t: Tensor) -> bytes:
    return t.detach().float().cpu().numpy().astype("<f4").tobytes()


def _floats(data: bytes, count: int, what: str) -> Tensor:
    """The `count` fp32 values `what` (scales, a 2-bit table or magnitudes) off the wire;
    CompressionError when the byte count differs."""
    if len(data) != 4 * count:
        raise CompressionError(f"{len(data)} bytes of {what}, expected {4 * count}")
    return torch.frombuffer(bytearray(data), dtype=torch.float32) if count else torch.zeros(0)


def _scales(data: bytes, count: int) -> Tensor:
    scales = _floats(data, count, "scales")
    if not all_finite(scales) or bool((scales <= 0).any()):
        raise CompressionError("a block scale is NaN, infinite, zero or negative")
    return scales


def _finite(t: Tensor, label: str) -> Tensor:
    if not all_finite(t):
        raise CompressionError(f"{label}: contains NaN or Inf")
    return t


def _sign_magnitudes(spec: CodecSpec) -> int:
    """Magnitudes per chunk of 'sign' levels: two with 2-bit codes, one (the mean) with 1-bit codes."""
    return 2 if spec.bits == 2 else 1


def _value_groups(numel: int, spec: CodecSpec) -> tuple[int, int, int]:
    """Top-k values share one scale per chunk: (full chunks, k of each, k of the tail)."""
    full, k, _, k_tail = chunk_layout(numel, spec.chunk, spec.k)
    return full, k, k_tail


def _groups_of(values: Tensor, groups: tuple[int, int, int]) -> list[Tensor]:
    """The kept values as 2-D (chunks, k) blocks: the full chunks', then the tail's (1, k_tail)."""
    full, k, k_tail = groups
    parts = [values[:full * k].view(full, k)] if full else []
    if k_tail:
        parts.append(values[full * k:].view(1, k_tail))
    return parts


def _quantize_groups(values: Tensor, spec: CodecSpec, groups: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """(codes, what they decode with) of a chunked top-k's values: per `spec.levels`, one grid scale
    per chunk, SparseLoCo's 4-entry table for the tensor, or two magnitudes per chunk."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(LUT_BINS if spec.levels == "lut" else 0)
    if spec.levels == "lut":
        return lut_quantize(values)
    parts = [quantize(p, spec.bits, p.shape[1]) if spec.levels == "grid" else sign_quantize(p, _sign_magnitudes(spec))
             for p in _groups_of(values, groups)]
    return torch.cat([c for c, _ in parts]), torch.cat([s.reshape(-1) for _, s in parts])


def _dequantize_groups(codes: Tensor, data: bytes, spec: CodecSpec, groups: tuple[int, int, int]) -> Tensor:
    """The values `_quantize_groups` encoded, from the codes and the bytes after them;
    CompressionError for a table or magnitudes that cannot have come from it."""
    full, k, k_tail = groups
    nchunks = full + (1 if k_tail else 0)
    if spec.levels == "lut":
        table = _floats(data, LUT_BINS, "a 2-bit lookup table")
        if not all_finite(table):
            raise CompressionError("a 2-bit lookup table holds NaN or Inf")
        return table[codes.long()]
    if spec.levels == "sign":
        per = _sign_magnitudes(spec)
        mags = _floats(data, per * nchunks, f"{spec.bits}-bit magnitudes")
        if not all_finite(mags) or bool((mags < 0).any()):
            raise CompressionError(f"a NaN, infinite or negative magnitude of {spec.bits}-bit sign codes")
        if not nchunks:
            return torch.zeros(0)
        mags = mags.view(-1, per)
        return torch.cat([sign_dequantize(c, m).reshape(-1)
                          for c, m in zip(_groups_of(codes, groups), (mags[:full], mags[full:]) if full else (mags,))])
    scales = _scales(data, nchunks)
    parts = [dequantize(codes[:full * k], scales[:full], spec.bits, k, full * k)] if full else []
    if k_tail:
        parts.append(dequantize(codes[full * k:], scales[full:], spec.bits, k_tail, k_tail))
    return torch.cat(parts) if parts else torch.zeros(0)


# ----------------------------------------------------------------------------- error feedback
class ErrorFeedback:
    """Per-name residual buffers of a lossy codec: `compress(name, x)` encodes x + e and keeps
    e ← x + e − decode(...), so that nothing a round leaves out is lost (it travels later).

    The buffers are fp32 on x's device, created at first use; `state_dict` / `load_state_dict`
    carry them with the client's state between rounds (their bytes count in the memory table)."""

    def __init__(self, decay: float = 1.0) -> None:
        self.residual: dict[str, Tensor] = {}
        self.decay = decay
        """β: the residual is decayed before each new x is added, e ← β·e + x (SparseLoCo's 0.95,
        Sarfi et al. 2025, where the decaying buffer replaces outer momentum; 1 = classic error feedback)."""

    def compress(self, name: str, x: Tensor, spec: CodecSpec, scale: float = 1.0) -> tuple[Encoded, Tensor]:
        """(the encoding of x + β·scale·e, what the receiver decodes from it, shaped like x); `scale`: this
        round's factor on top of β (the lr's fall since the last round, `RoundConfig.wire_ef_lr_scale`)."""
        target, owned = self._plus_residual(name, x, scale)
        return self._send(name, target, spec, owned)

    def compress_split(self, name: str, x: Tensor, spec: CodecSpec,
                       split: Callable[[Tensor], tuple[Encoded, Tensor]],
                       scale: float = 1.0) -> tuple[Encoded, Encoded]:
        """(the residual's encoding, the coordinates' encoding) of x + β·scale·e cut by `split` into
        coordinates and a residual R (`lordo_fed.wire.lowrank.split`, which already folds the
        coordinates' rounding into R); R is encoded per `spec` and e ← R − decode(...)."""
        target, _ = self._plus_residual(name, x, scale)
        coords, residual = split(target)  # a new tensor: kept as the next residual
        return self._send(name, residual, spec, owned=True)[0], coords

    def _plus_residual(self, name: str, x: Tensor, scale: float) -> tuple[Tensor, bool]:
        """(x + β·scale·e in e's own buffer, True), or at first use (x as fp32, False: it may be x itself)."""
        e = self.residual.get(name)
        if e is None:
            return x.detach().float(), False
        factor = self.decay * scale
        return (e.mul_(factor) if factor != 1.0 else e).add_(x.detach().float()), True

    def _send(self, name: str, target: Tensor, spec: CodecSpec, owned: bool) -> tuple[Encoded, Tensor]:
        """Encode `target`, keep target − decoded as the residual (in place when `owned`)."""
        enc = encode(target, spec)
        sent = decode(enc, name).view_as(target).to(target.device)
        self.residual[name] = target.sub_(sent) if owned else target - sent
        return enc, sent

    def state_dict(self) -> dict[str, Tensor]:
        return {f"wire_ef/{k}": v for k, v in self.residual.items()}

    def load_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        self.residual = {k.removeprefix("wire_ef/"): v.float().clone() for k, v in sd.items()
                         if k.startswith("wire_ef/")}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.residual.values())
