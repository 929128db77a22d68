"""Value codes of the compressed wire tensors (lordo_fed.wire.compress): bit packing, blockwise
quantisation on a grid, and the bin-mean quantisers of top-k values (2-bit, and the 1-bit sign).

- `quantize` / `dequantize`: blocks of `block` values, one scale s = absmax / L each, codes
  q ∈ [−L, L] (int8 L = 127, int4 L = 7) decoding to q·s.
- `lut_quantize`: SparseLoCo's 4-entry table per tensor (Sarfi et al. 2025, "Communication-Efficient
  Language Model Training Scales Reliably and Robustly", its code).
- `sign_quantize` / `sign_dequantize`: the sign and one of two magnitudes per chunk, or the sign and
  the chunk's mean magnitude.
- `pack` / `unpack`: codes of any width up to 32 bits, little-endian.
- `rice_encode` / `rice_decode`: the gaps between sorted top-k positions as Rice codes.

Plain torch on the values' device; the oracles are in tests/unit/test_compress.py and
tests/unit/test_codec_roundtrip.py (decode(encode(x)) against x).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor


class CompressionError(ValueError):
    """A compressed tensor that cannot have come from `encode`: what and why."""


_LEVELS = {8: 127, 4: 7}
"""Largest integer level per bit width."""

_TINY = torch.finfo(torch.float32).tiny
"""Scale of an all-zero block: every scale on the wire is finite and > 0."""

_UP = 1e-6
"""Relative margin of rounding up (`quantize(up=True)`): well above fp32's rounding of a division
and a product (6e-8 each), so that the decoded value is never below the original."""

LUT_BINS, LUT_SIGMAS = 4, 6.0
"""SparseLoCo's 2-bit table: 4 bins over 6σ (each 1.5σ wide, the outer two open-ended)."""

_SIGN_REFINE = 2
"""Lloyd steps of the 'sign' levels' split after its geometric-mean start."""


def all_finite(t: Tensor) -> bool:
    """Whether every value of `t` is finite. One reduction decides in the common case: a norm of
    finite values is finite unless its squares overflow, and a NaN or an Inf makes it non-finite;
    only then is each value tested (`torch.isfinite` writes a bool per value: 37x slower than the
    norm on 40 M fp32 values on one CPU thread, and it ran for every reply on arrival). The server's
    screening and the codecs' value checks both use it."""
    return math.isfinite(float(torch.linalg.vector_norm(t))) or bool(torch.isfinite(t).all())


# ----------------------------------------------------------------------------- bit packing
def pack(codes: Tensor, bits: int) -> bytes:
    """Non-negative integer codes (< 2**bits) packed little-endian, 8 / bits per byte for 1, 2, 4 and
    8 bits, two per three bytes for 12, two bytes each for 16. Every width is the same bit stream
    (code i's bit j at bit i·bits + j, least significant first); widths 0-31 other than those go
    through the bit-serial path (a Rice code's remainders, `rice_encode`), 0 bits in no bytes."""
    if bits not in (1, 2, 4, 8, 12, 16, 32):
        return _pack_serial(codes, bits)
    if bits == 8:  # one code per byte: no shifts
        return codes.reshape(-1).to("cpu", torch.uint8).numpy().tobytes()
    c = codes.reshape(-1).to("cpu", torch.int32)
    if bits in (1, 2, 4):
        per = 8 // bits
        pad = (-c.numel()) % per
        if pad:
            c = torch.cat([c, c.new_zeros(pad)])
        c = c.view(-1, per)
        shifts = torch.arange(per, dtype=torch.int32) * bits
        return (c << shifts).sum(dim=1).to(torch.uint8).numpy().tobytes()
    if bits == 12:
        if c.numel() % 2:
            c = torch.cat([c, c.new_zeros(1)])
        a, b = c[0::2], c[1::2]
        out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1)
        return out.to(torch.uint8).numpy().tobytes()
    if bits == 16:
        return c.to(torch.int32).numpy().astype("<u2").tobytes()
    if bits == 32:
        return codes.reshape(-1).to("cpu", torch.int64).numpy().astype("<u4").tobytes()
    raise ValueError(f"pack: bits={bits}: expected 2, 4, 8, 12, 16 or 32")


def unpack(data: bytes, bits: int, count: int) -> Tensor:
    """The first `count` codes of `pack(codes, bits)` (uint8 for 8 bits, else int64);
    CompressionError if the bytes are not exactly what `count` codes take."""
    expected = packed_size(count, bits)
    if len(data) != expected:
        raise CompressionError(f"{len(data)} bytes of {bits}-bit codes, expected {expected} for {count} codes")
    if bits not in (1, 2, 4, 8, 12, 16, 32):
        return _unpack_serial(data, bits, count)
    if bits == 8:  # the bytes are the codes
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    if bits in (1, 2, 4):  # each byte's codes looked up in one row of a 256-row table: no shifts over int64
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        return _byte_codes(bits).index_select(0, raw.to(torch.int32)).reshape(-1)[:count]
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else torch.zeros(0, dtype=torch.int64)
    if bits == 12:
        t = raw.view(-1, 3)
        a = t[:, 0] | ((t[:, 1] & 0xF) << 8)
        b = (t[:, 1] >> 4) | (t[:, 2] << 4)
        return torch.stack([a, b], dim=1).reshape(-1)[:count]
    if bits == 16:
        t = raw.view(-1, 2)
        return (t[:, 0] | (t[:, 1] << 8))[:count]
    if bits == 32:
        t = raw.view(-1, 4)
        return (t[:, 0] | (t[:, 1] << 8) | (t[:, 2] << 16) | (t[:, 3] << 24))[:count]
    raise ValueError(f"unpack: bits={bits}: expected 2, 4, 8, 12, 16 or 32")


@functools.cache
def _byte_codes(bits: int) -> Tensor:
    """(256, 8 // bits) int64: the `bits`-bit codes `pack` puts in each byte value, lowest bits first."""
    shifts = torch.arange(8 // bits, dtype=torch.int64) * bits
    return (torch.arange(256, dtype=torch.int64).view(-1, 1) >> shifts) & ((1 << bits) - 1)


def _word(bits: int) -> np.dtype:
    """The narrowest little-endian unsigned word that holds `bits`-bit codes."""
    return np.dtype("<u1" if bits <= 8 else "<u2" if bits <= 16 else "<u4")


def _pack_serial(codes: Tensor, bits: int) -> bytes:
    """`pack` of any width in 0..31: each code's bits, least significant first, in one stream (the
    codes' bytes unpacked to bits, their low `bits` kept, repacked: one byte of scratch a bit)."""
    if not (isinstance(bits, int) and 0 <= bits < 32):
        raise ValueError(f"pack: bits={bits!r}: expected 0..32")
    c = codes.reshape(-1).to("cpu", torch.int64).numpy()
    if not bits or not c.size:
        return b""
    word = _word(bits)
    stream = np.unpackbits(c.astype(word).view(np.uint8).reshape(c.size, word.itemsize), axis=1, bitorder="little")
    return np.packbits(stream[:, :bits].reshape(-1), bitorder="little").tobytes()


def _unpack_serial(data: bytes, bits: int, count: int) -> Tensor:
    """The codes of `_pack_serial` (int64); the caller has checked the byte count."""
    if not (isinstance(bits, int) and 0 <= bits < 32):
        raise ValueError(f"unpack: bits={bits!r}: expected 0..32")
    if not bits or not count:
        return torch.zeros(count, dtype=torch.int64)
    word = _word(bits)
    stream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * bits, bitorder="little")
    wide = np.zeros((count, 8 * word.itemsize), dtype=np.uint8)
    wide[:, :bits] = stream.reshape(count, bits)
    codes = np.packbits(wide, axis=1, bitorder="little").reshape(-1).view(word)
    return torch.from_numpy(codes.astype(np.int64))


def packed_size(count: int, bits: int) -> int:
    """Bytes `pack` writes for `count` codes of `bits` bits."""
    if bits == 12:
        return 3 * math.ceil(count / 2)
    if bits in (16, 32):
        return bits // 8 * count
    return math.ceil(count * bits / 8)


def index_bits(chunk: int) -> int:
    """Bits per packed top-k index for chunks of `chunk` values."""
    return 12 if chunk <= 4096 else 16


# ----------------------------------------------------------------------------- Rice-coded gaps
RICE_MAX_PARAMETER = 16
"""Largest Rice parameter `rice_parameter` picks (chunks are at most 65536 values)."""


@functools.cache  # a pure function of two ints, asked once per top-k tensor of every reply
def rice_parameter(chunk: int, k: int) -> int:
    """The Rice parameter b for the gaps between k sorted positions of `chunk`: the b in
    0..`RICE_MAX_PARAMETER` with the fewest expected bits per gap, b + 1 + E[g >> b], the gaps taken
    as geometric with p = k / chunk (uniformly spread positions), so E[g >> b] = t / (1 − t) with
    t = (1 − p)^(2^b) (Golomb 1966; Rice's power-of-two case). At k / chunk = 1/32 that is b = 4 and
    6.5 expected bits a position against 12 fixed; the entropy of a uniform choice is 6.4."""
    p = min(1.0, max(k, 1) / chunk)
    return min(range(RICE_MAX_PARAMETER + 1), key=lambda b: b + rice_expected_quotient(p, b))


def rice_expected_quotient(p: float, b: int) -> float:
    """E[g >> b] of a geometric gap g with P(g ≥ m) = (1 − p)^m."""
    t = (1.0 - p) ** (1 << b)
    return t / (1.0 - t) if t < 1.0 else math.inf


def rice_encode(gaps: Tensor, b: int) -> bytes:
    """Non-negative `gaps` as Rice codes with parameter `b`: the remainders g mod 2^b, `pack`ed in b
    bits each, then the quotients g >> b in unary (q ones and a zero each, one bit stream, least
    significant bit first, the last byte padded with zeros). The remainders come first, so a
    receiver knows where the quotients start."""
    g = gaps.reshape(-1).to("cpu", torch.int64)
    head = pack(g & ((1 << b) - 1), b)
    if not g.numel():
        return head
    ends = torch.cumsum((g >> b) + 1, 0) - 1  # where each code's terminating zero sits
    stream = np.ones(int(ends[-1]) + 1, dtype=np.uint8)
    stream[ends.numpy()] = 0
    return head + np.packbits(stream, bitorder="little").tobytes()


def rice_decode(data: bytes, b: int, count: int) -> Tensor:
    """The `count` gaps of `rice_encode(gaps, b)` (int64); CompressionError for bytes that cannot
    have come from it: too short for the remainders, fewer than `count` codes, bytes after the last
    code or padding bits that are not zero."""
    head = packed_size(count, b)
    if len(data) < head:
        raise CompressionError(f"{len(data)} bytes of Rice-coded indices, fewer than the {head} of "
                               f"{count} {b}-bit remainders")
    remainders = unpack(bytes(data[:head]), b, count)
    tail = np.frombuffer(data, dtype=np.uint8, offset=head)
    if not count:
        if tail.size:
            raise CompressionError(f"{tail.size} bytes of unary codes after 0 indices")
        return torch.zeros(0, dtype=torch.int64)
    # The unary stream's zero bits end the codes: unpacking the inverted bytes marks them with ones, read as
    # bools (numpy's nonzero is several times faster on bools than on bytes) with no comparison pass.
    ends = np.unpackbits(np.invert(tail), bitorder="little").view(np.bool_)
    zeros = np.flatnonzero(ends)
    if zeros.size < count:
        raise CompressionError(f"the unary codes of Rice-coded indices end after {zeros.size} of {count}")
    last = int(zeros[count - 1])
    # every bit after the last code's terminator is padding, so zero: each one of them is in `zeros`
    if tail.size != last // 8 + 1 or zeros.size - count != ends.size - last - 1:
        raise CompressionError(f"{tail.size} bytes of unary codes, expected {last // 8 + 1} ending in zero bits")
    quotients = np.empty(count, dtype=np.int64)  # the ones before each terminator, since the one before it
    quotients[0] = zeros[0]
    np.subtract(zeros[1:count], zeros[:count - 1], out=quotients[1:])
    quotients[1:] -= 1
    return torch.from_numpy(quotients).bitwise_left_shift_(b).bitwise_or_(remainders)


def row_index_bits(nrows: int) -> int:
    """Bits per packed row index of a row-sparse tensor of `nrows` rows."""
    return 16 if nrows <= 65536 else 32


# ----------------------------------------------------------------------------- quantisation
def quantize(x: Tensor, bits: int, block: int, up: bool = False) -> tuple[Tensor, Tensor]:
    """(codes, scales): the flattened `x` in blocks of `block`, one fp32 scale each, codes as
    uint8 (q + L) ready to `pack`; with `up` (values ≥ 0) rounded up instead of to the nearest level."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nblocks = math.ceil(n / block)
    padded = torch.nn.functional.pad(flat, (0, nblocks * block - n)).view(nblocks, block)
    level = _LEVELS[bits]
    scales = (padded.abs().amax(dim=1) / level).clamp_min(_TINY)
    if up:  # room above the largest value, so that rounding up never needs a level past L
        scales = scales * (1 + _UP)
    q = padded / scales[:, None]
    # up: a relative nudge before ceil, so that fp32 rounding of x / s never lands one level low
    codes = (q.mul_(1 + _UP).ceil_() if up else q.round_()).clamp_(-level, level).add_(level)
    return codes.reshape(-1)[:n].to(torch.uint8), scales


def dequantize(codes: Tensor, scales: Tensor, bits: int, block: int, numel: int) -> Tensor:
    """The fp32 values of `quantize`'s output (flat, `numel` long)."""
    q = codes.to(torch.float32) - _LEVELS[bits]
    nblocks = scales.numel()
    q = torch.nn.functional.pad(q, (0, nblocks * block - numel)).view(nblocks, block)
    values = q * scales[:, None]
    return values.reshape(-1)[:numel]


# ----------------------------------------------------------------------------- 2-bit bin means
def lut_quantize(values: Tensor) -> tuple[Tensor, Tensor]:
    """(2-bit codes, 4-entry table) of a tensor's kept values, SparseLoCo's quantiser (Sarfi et al.
    2025, its code): centre on the mean μ, bins of width 6σ/4 (σ the unbiased std), code
    c = clamp(round((v − μ) / (1.5σ) + 2), 0, 3); the table holds each bin's mean value (0 where
    a bin is empty), so decoding is one lookup and the decoded values keep the original mean."""
    v = values.detach().reshape(-1).float()
    centred = v - v.mean()
    sigma = centred.norm() / max(v.numel() - 1, 1) ** 0.5
    width = sigma * (LUT_SIGMAS / LUT_BINS)
    width = torch.where(torch.isfinite(width) & (width > 0), width, torch.ones_like(width))  # all equal: one bin
    codes = (centred / width + LUT_BINS // 2).round_().clamp_(0, LUT_BINS - 1).long()
    sums = torch.zeros(LUT_BINS, device=v.device).scatter_add_(0, codes, v)
    counts = torch.zeros(LUT_BINS, device=v.device).scatter_add_(0, codes, torch.ones_like(v))
    return codes.to(torch.uint8), sums / counts.clamp_min(1)


def sign_quantize(values: Tensor, magnitudes: int = 2) -> tuple[Tensor, Tensor]:
    """(codes, (chunks, `magnitudes`) magnitudes) of 2-D (chunks, k) kept values.

    Two magnitudes (2-bit codes): bit 0 the sign (1 = negative), bit 1 whether |v| is above the
    chunk's split, each magnitude the mean |v| of its side (low, high; the low one's when a side is
    empty). The split starts at √(min |v| · max |v|) and takes `_SIGN_REFINE` Lloyd steps (the
    midpoint of the two means): on Student-t(3) values the gain rises from 0.86-0.93 to 0.92-0.94
    (Gaussian: 0.99 either way).

    One magnitude (1-bit codes, the sign alone): the chunk's mean |v|, the least-squares scale of
    its signs (signSGD with the mean magnitude, Bernstein et al. 2018; the top-k values of a chunk
    are the largest, so their magnitudes are close: gain ⟨x̂, x⟩/⟨x, x⟩ 0.98 on Gaussian values, 0.67-0.74
    on Student-t(3), tests/unit/test_codec_roundtrip.py)."""
    if magnitudes not in (1, 2):
        raise ValueError(f"sign_quantize: magnitudes={magnitudes!r}: expected 1 or 2")
    a = values.detach().float().abs()
    if magnitudes == 1:
        return (values < 0).to(torch.uint8).reshape(-1), a.mean(dim=1, keepdim=True)
    split = a.amin(dim=1, keepdim=True).sqrt() * a.amax(dim=1, keepdim=True).sqrt()  # no overflow of min·max
    for step in range(_SIGN_REFINE + 1):
        high = a > split
        n_high = high.sum(dim=1, keepdim=True)
        sum_high = (a * high).sum(dim=1, keepdim=True)
        low_mag = (a.sum(dim=1, keepdim=True) - sum_high) / (a.shape[1] - n_high).clamp_min(1)
        high_mag = torch.where(n_high > 0, sum_high / n_high.clamp_min(1), low_mag)
        split = (low_mag + high_mag) / 2
    codes = high.to(torch.uint8) * 2 + (values < 0).to(torch.uint8)
    return codes.reshape(-1), torch.cat([low_mag, high_mag], dim=1)


def sign_dequantize(codes: Tensor, mags: Tensor) -> Tensor:
    """Values of `sign_quantize`'s 2-D (chunks, k) codes: ±mags[chunk, high], looked up in each chunk's
    row of (+low, −low, +high, −high), or (+m, −m) with one magnitude: the code (2·high +) negative
    indexes it, one gather."""
    table = torch.stack([v for m in mags.unbind(dim=1) for v in (m, -m)], dim=1)
    return torch.gather(table, 1, codes.long().to(mags.device))
