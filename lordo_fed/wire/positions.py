"""Where a chunked top-k's kept values sit: selecting them, laying them out, and their positions on
the wire (lordo_fed.wire.compress builds its top-k codecs on these).

- **Chunks**: the flattened tensor is cut into chunks of `chunk` values, each keeping its k largest
  magnitudes (the tail chunk of n mod chunk values keeps ceil(k · tail / chunk)); positions are
  within their chunk, increasing, the full chunks first, then the tail's (`topk`, `densify`).
- **Tiles** (`tile_order`, `untile`): a 2-D tensor whose sides t divides can be cut into t×t tiles
  instead, each one chunk (SparseLoCo's 64×64 cut, Sarfi et al. 2025): a tile keeps its k largest
  of a block of rows and columns rather than of a run of whole rows.
- **Position codings** (`pack_positions`, `unpack_positions`): 'fixed' packs each position in 12
  bits (chunks of at most 4096) or 16; 'rice' sends the gaps between a chunk's sorted positions as
  Rice codes (lordo_fed.wire.values.rice_encode), lossless, ~6.5 bits a position at 1/32 and 7.5 at
  1/64. A Rice encoding's length varies with the positions, within `position_bytes`'s bounds.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from lordo_fed.wire.values import (CompressionError, index_bits, pack, packed_size, rice_decode, rice_encode,
                                   rice_expected_quotient, rice_parameter, unpack)


def chunk_layout(numel: int, chunk: int, k: int) -> tuple[int, int, int, int]:
    """(full chunks, k per full chunk, tail length, k of the tail) for `numel` values."""
    full, tail = divmod(numel, chunk)
    k = min(k, chunk)
    k_tail = min(tail, max(1, math.ceil(k * tail / chunk))) if tail else 0
    return full, k, tail, k_tail


def topk(x: Tensor, chunk: int, k: int) -> tuple[Tensor, Tensor]:
    """(positions, values): per chunk of the flattened `x`, its k largest magnitudes, positions
    within the chunk in increasing order; the full chunks first, then the tail's."""
    flat = x.detach().reshape(-1).float()
    full, k, tail, k_tail = chunk_layout(flat.numel(), chunk, k)
    positions, values = [], []
    if full:
        body = flat[:full * chunk].view(full, chunk)
        idx = top_rows(body, k)
        positions.append(idx.reshape(-1))
        values.append(body.gather(1, idx).reshape(-1))
    if tail:
        rest = flat[full * chunk:]
        idx = rest.abs().topk(k_tail, sorted=False).indices.sort().values
        positions.append(idx)
        values.append(rest[idx])
    if not positions:
        return torch.zeros(0, dtype=torch.int64, device=flat.device), flat.new_zeros(0)
    return torch.cat(positions), torch.cat(values)


def top_rows(rows: Tensor, k: int) -> Tensor:
    """The columns of each row's k largest magnitudes in 2-D `rows`, in increasing order (int64); among
    magnitudes tied at a row's k-th, the leftmost.

    The simple path, which a GPU takes (free of host syncs): `topk` of the magnitudes, each row sorted
    (its choice among ties is topk's). On a CPU, numpy's introselect finds each row's k-th largest
    magnitude, and the entries above it and the leftmost of those tied at it are read back in order.
    One thread, 9,000 rows of 4,096: 0.24-0.25x the simple path's time keeping 491 of Gaussian values,
    0.33-0.41x keeping 123, 0.5-0.8x where 94% of each row is zero; where most of a row ties at its largest
    magnitude (sign-like values) numpy's select slows: 2.6x the simple path keeping 491, 3.8x keeping 123. A row holding a NaN takes the
    simple path (numpy's select puts a NaN last; topk keeps it, and the receiver refuses it by name).
    tests/unit/test_positions.py compares both paths with the per-row loop."""
    width = rows.shape[1]
    if rows.device.type != "cpu" or not rows.numel() or not k:
        return rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    neg = np.abs(rows.detach().float().numpy())
    np.negative(neg, out=neg)  # the largest magnitudes first: numpy's select stays fast where most are zero
    kth = np.partition(neg, k - 1, axis=1)[:, k - 1:k]
    mask = neg <= kth
    nan = np.isnan(neg.sum(axis=1))
    tie = np.flatnonzero((np.count_nonzero(mask, axis=1) != k) & ~nan)
    if tie.size:  # keep those above the k-th and, of those tied at it, the leftmost
        part, at = neg[tie], kth[tie]
        above, tied = part < at, part == at
        room = k - np.count_nonzero(above, axis=1, keepdims=True)
        mask[tie] = above | (tied & (np.cumsum(tied, axis=1, dtype=np.int32) <= room))
    if nan.any():
        nan = np.flatnonzero(nan)
        mask[nan] = False
        mask[nan[:, None], rows[torch.from_numpy(nan)].abs().topk(k, dim=1, sorted=False).indices.numpy()] = True
    return torch.from_numpy(np.flatnonzero(mask) % width).view(-1, k)


def chunk_offsets(numel: int, chunk: int, k: int) -> Tensor:
    """The flat offset of the chunk each kept entry belongs to (as `topk` lays them out)."""
    full, k, tail, k_tail = chunk_layout(numel, chunk, k)
    body = (torch.arange(full, dtype=torch.int64) * chunk).view(-1, 1).expand(full, k).reshape(-1)
    return torch.cat([body, torch.full((k_tail,), full * chunk, dtype=torch.int64)]) if k_tail else body


def densify(positions: Tensor, values: Tensor, numel: int, chunk: int, k: int) -> Tensor:
    """The flat fp32 tensor with `values` at `positions` (as `topk` laid them out), zeros elsewhere."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[positions + chunk_offsets(numel, chunk, k).to(positions.device)] = values.float()
    return out


def tiled(tile: int, shape: tuple[int, ...]) -> bool:
    """Whether a top-k tensor of `shape` is cut into `tile`-sided tiles (2-D, both sides divisible)."""
    return bool(tile) and len(shape) == 2 and shape[0] % tile == 0 and shape[1] % tile == 0


def tile_order(x: Tensor, tile: int) -> Tensor:
    """The values of 2-D `x` (R, C) tile after tile, flat: R/t × C/t tiles of t×t, each in C order."""
    r, c = x.shape
    return x.reshape(r // tile, tile, c // tile, tile).permute(0, 2, 1, 3).reshape(-1)


def untile(flat: Tensor, shape: tuple[int, ...], tile: int) -> Tensor:
    """`tile_order`'s inverse: a flat tiled tensor back to the C order of `shape`, flat."""
    r, c = shape
    return flat.reshape(r // tile, c // tile, tile, tile).permute(0, 2, 1, 3).reshape(-1)


def pack_positions(positions: Tensor, numel: int, chunk: int, k: int, coding: str) -> bytes:
    """`topk`'s positions as the wire carries them: 'fixed' or 'rice' (the gaps, chunk after chunk)."""
    if coding == "fixed":
        return pack(positions, index_bits(chunk))
    full, k, _, k_tail = chunk_layout(numel, chunk, k)
    groups = [g for g in (positions[:full * k].view(full, k), positions[full * k:].view(1, -1)) if g.numel()]
    gaps = [torch.diff(g, dim=1, prepend=torch.full_like(g[:, :1], -1)).reshape(-1) - 1 for g in groups]
    return rice_encode(torch.cat(gaps) if gaps else positions, rice_parameter(chunk, k))


def unpack_positions(data: bytes, numel: int, chunk: int, k: int, coding: str, label: str) -> Tensor:
    """The positions `pack_positions` wrote; CompressionError (naming `label`) for bytes that cannot
    have come from it or positions outside their chunk or repeated."""
    full, k, _, k_tail = chunk_layout(numel, chunk, k)
    count = full * k + k_tail
    if coding == "fixed":
        positions = unpack(data, index_bits(chunk), count)
    else:
        # In place, one fresh tensor: the gaps g_i = p_i - p_(i-1) - 1 become each chunk's positions.
        positions = rice_decode(data, rice_parameter(chunk, k), count).add_(1)
        if full:
            positions[:full * k].view(full, k).cumsum_(dim=1)
        if k_tail:
            positions[full * k:].cumsum_(dim=0)
        positions.sub_(1)
    # Rice-coded gaps are >= 0, so their positions increase within a chunk by construction: only the bound is left
    check_positions(positions, numel, chunk, k, label, increasing=coding != "fixed")
    return positions


def position_bytes(numel: int, chunk: int, k: int, coding: str) -> tuple[int, int]:
    """(fewest, most) bytes of a top-k encoding's positions: one size for 'fixed'; for 'rice' from
    every gap 0 to every chunk's last position at its end (a chunk of n values with k kept has
    gaps summing to at most n − k, so at most (n − k) >> b quotient bits past its k terminators)."""
    full, k, tail, k_tail = chunk_layout(numel, chunk, k)
    count = full * k + k_tail
    if coding == "fixed":
        size = packed_size(count, index_bits(chunk))
        return size, size
    b = rice_parameter(chunk, k)
    head = packed_size(count, b)
    most = count + full * ((chunk - k) >> b) + ((tail - k_tail) >> b)
    return head + math.ceil(count / 8), head + math.ceil(most / 8)


def expected_position_bytes(numel: int, chunk: int, k: int, coding: str) -> int:
    """A top-k encoding's position bytes: exact for 'fixed'; for 'rice' the expected size when every
    chunk's positions are spread uniformly (`rice_parameter`'s geometric model): what the bytes
    tables lay out (benchmarks/compression.py)."""
    lo, hi = position_bytes(numel, chunk, k, coding)
    if coding == "fixed":
        return lo
    full, k, _, k_tail = chunk_layout(numel, chunk, k)
    count = full * k + k_tail
    b = rice_parameter(chunk, k)
    unary = count * (1.0 + rice_expected_quotient(k / chunk, b))
    return min(hi, packed_size(count, b) + math.ceil(unary / 8))


def check_positions(positions: Tensor, numel: int, chunk: int, k: int, label: str, increasing: bool = False) -> None:
    """Every position inside its chunk, strictly increasing within it (so none repeats). With `increasing`
    (the caller built them so) only each chunk's last, its largest, is checked against the bound."""
    full, k, tail, k_tail = chunk_layout(numel, chunk, k)
    if full:
        body = positions[:full * k].view(full, k)
        if bool(((body[:, -1:] if increasing and k else body) >= chunk).any()):
            raise CompressionError(f"{label}: a top-k index >= chunk size {chunk}")
        if k > 1 and not increasing and not bool((body[:, 1:] > body[:, :-1]).all()):
            raise CompressionError(f"{label}: top-k indices repeated or out of order within a chunk")
    if tail:
        rest = positions[full * k:]
        if bool(((rest[-1:] if increasing else rest) >= tail).any()):
            raise CompressionError(f"{label}: a top-k index >= the last chunk's {tail} values")
        if k_tail > 1 and not increasing and not bool((rest[1:] > rest[:-1]).all()):
            raise CompressionError(f"{label}: top-k indices repeated or out of order in the last chunk")
