"""Top-k positions on the wire (lordo_fed.wire.positions, lordo_fed.wire.values): Rice-coded gaps
and 64x64-style tiles, each judged by what comes back against what went in: the positions and
values a receiver decodes against the tensor sent, and the bits against a plain bit-by-bit oracle."""

from __future__ import annotations

import math

import pytest
import torch

from lordo_fed.wire.compress import CodecSpec, CompressionError, Encoded, decode, encode, payload_bounds, support
from lordo_fed.wire.positions import expected_position_bytes, position_bytes
from lordo_fed.wire.values import pack, rice_decode, rice_encode, rice_parameter, unpack


def bits_oracle(codes: list[int], width: int) -> bytes:
    """Codes of `width` bits, least significant first, one bit at a time."""
    stream = [(c >> j) & 1 for c in codes for j in range(width)]
    stream += [0] * (-len(stream) % 8)
    return bytes(sum(bit << j for j, bit in enumerate(stream[i:i + 8])) for i in range(0, len(stream), 8))


def rice_oracle(gaps: list[int], b: int) -> bytes:
    """The Rice codes of `gaps`, written out bit by bit: remainders first, then the unary quotients."""
    unary = [bit for g in gaps for bit in [1] * (g >> b) + [0]]
    unary += [0] * (-len(unary) % 8)
    tail = bytes(sum(bit << j for j, bit in enumerate(unary[i:i + 8])) for i in range(0, len(unary), 8))
    return bits_oracle([g & ((1 << b) - 1) for g in gaps], b) + tail


@pytest.mark.parametrize("width", [1, 3, 5, 7, 11, 13, 2, 4, 12, 16])
def test_codes_of_any_width_pack_as_one_bit_stream(width):
    codes = torch.randint(0, 1 << width, (37,), generator=torch.Generator().manual_seed(width))
    data = pack(codes, width)
    if width != 12:  # 12 bits pads an odd count to a whole pair: three bytes
        assert data == bits_oracle(codes.tolist(), width)
    assert torch.equal(unpack(data, width, 37).long(), codes)


@pytest.mark.parametrize("b", [0, 1, 4, 5])
def test_rice_codes_are_the_bits_written_out_and_decode_back(b):
    gaps = torch.randint(0, 90, (53,), generator=torch.Generator().manual_seed(b))
    data = rice_encode(gaps, b)
    assert data == rice_oracle(gaps.tolist(), b)
    assert torch.equal(rice_decode(data, b, 53), gaps)


def test_the_rice_parameter_is_near_the_entropy_of_the_positions():
    """At 1/32 and 1/64 of 4096 the chosen b codes uniformly spread positions in under 0.2 bit more
    than log2 C(4096, k) / k, against 12 bits fixed."""
    for k, b in ((128, 4), (64, 5), (123, 4)):
        assert rice_parameter(4096, k) == b
        x = torch.randn(64 * 4096, generator=torch.Generator().manual_seed(k))
        enc = encode(x, CodecSpec("topk", chunk=4096, topk=k, index_coding="rice"))
        per_position = 8 * len(enc.indices) / (64 * k)
        entropy = (math.lgamma(4097) - math.lgamma(k + 1) - math.lgamma(4097 - k)) / math.log(2) / k
        assert entropy < per_position < entropy + 0.2, (k, per_position, entropy)
    assert rice_parameter(4096, 4096) == 0  # every position kept: one bit each


CASES = [  # (numel, chunk, k): full chunks, a tail, a tail alone, every value kept, one kept
    (64 * 4096 + 1000, 4096, 128), (10_000, 4096, 64), (300, 4096, 123), (640, 64, 64), (5000, 100, 1),
    (0, 4096, 128)]


@pytest.mark.parametrize("numel,chunk,k", CASES)
@pytest.mark.parametrize("bits,levels", [(0, "grid"), (2, "sign"), (8, "grid")])
def test_rice_coded_positions_return_the_tensor_fixed_ones_do(numel, chunk, k, bits, levels):
    """decode(encode(x)) with Rice-coded positions equals it with 12-bit ones, and the kept values
    are x's own (fp32 values) at x's largest magnitudes; fewer bytes whenever k < chunk / 4."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    fixed = CodecSpec("topk", bits=bits, chunk=chunk, topk=k, levels=levels)
    rice = CodecSpec("topk", bits=bits, chunk=chunk, topk=k, levels=levels, index_coding="rice")
    a, b = encode(x, fixed), encode(x, rice)
    y = decode(b)
    assert torch.equal(y, decode(a))
    assert torch.equal(support(b), support(a))
    lo, hi = payload_bounds(rice, numel)
    assert lo <= b.nbytes <= hi
    if numel and k < chunk / 4:
        assert len(b.indices) < 0.7 * len(a.indices)
    if not bits and numel:
        kept = y != 0
        assert torch.equal(y[kept], x[kept])
        if numel >= chunk:  # the first chunk kept its k largest magnitudes
            first = x[:chunk].abs()
            assert first[kept[:chunk]].min() >= first[~kept[:chunk]].max() if k < chunk else bool(kept[:chunk].all())


def test_expected_rice_bytes_match_uniform_positions():
    """The bytes tables' model (`expected_position_bytes`) against real encodings of iid values."""
    for k in (128, 64):
        x = torch.randn(256 * 4096, generator=torch.Generator().manual_seed(k))
        enc = encode(x, CodecSpec("topk", chunk=4096, topk=k, index_coding="rice"))
        expected = expected_position_bytes(x.numel(), 4096, k, "rice")
        assert abs(len(enc.indices) / expected - 1) < 0.01, (len(enc.indices), expected)
        lo, hi = position_bytes(x.numel(), 4096, k, "rice")
        assert lo < len(enc.indices) < hi


def per_tile_oracle(x: torch.Tensor, tile: int, k: int) -> torch.Tensor:
    """x with, in each tile×tile tile, only its k largest magnitudes kept: a loop over tiles."""
    out = torch.zeros_like(x)
    for i in range(0, x.shape[0], tile):
        for j in range(0, x.shape[1], tile):
            block = x[i:i + tile, j:j + tile]
            keep = block.abs().reshape(-1).topk(k).indices
            flat = torch.zeros(tile * tile)
            flat[keep] = block.reshape(-1)[keep]
            out[i:i + tile, j:j + tile] = flat.view(tile, tile)
    return out


@pytest.mark.parametrize("coding", ["fixed", "rice"])
def test_tiles_keep_each_tiles_largest_values(coding):
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(1))
    spec = CodecSpec("topk", chunk=64, topk=5, tile=8, index_coding=coding)
    y = decode(encode(x, spec)).view_as(x)
    assert torch.equal(y, per_tile_oracle(x, 8, 5))
    flat = CodecSpec("topk", chunk=64, topk=5, index_coding=coding)
    assert not torch.equal(y, decode(encode(x, flat)).view_as(x))  # a tile is not 64 consecutive values
    for odd in (torch.randn(50, 40), torch.randn(2560)):  # sides 8 does not divide, or 1-D: flat chunks
        assert torch.equal(decode(encode(odd, spec)), decode(encode(odd, flat)))


@pytest.mark.parametrize("spec,reason", [
    (dict(tile=8, chunk=4096), "tile=8: expected 0 (flat chunks) or the side of a square chunk"),
    (dict(kind="quant", bits=8, index_coding="rice"), "they are for top-k positions"),
    (dict(index_coding="delta"), "index_coding='delta': expected one of"),
])
def test_bad_position_settings_are_refused(spec, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        CodecSpec(**{"kind": "topk", **spec}).validate()


def hostile_rice(edit) -> Encoded:
    x = torch.randn(3 * 1024, generator=torch.Generator().manual_seed(5))
    enc = encode(x, CodecSpec("topk", chunk=1024, topk=32, index_coding="rice"))
    enc.indices = edit(enc.indices)
    return enc


@pytest.mark.parametrize("edit,reason", [
    (lambda d: d[:40], "fewer than the 48 of 96 4-bit remainders"),
    (lambda d: d[:-1], "the unary codes of Rice-coded indices end after"),
    (lambda d: d + b"\0", "bytes of unary codes, expected"),
    (lambda d: d[:-1] + bytes([d[-1] | 0x80]), "unary codes"),  # a padding bit (or the last terminator) set
    (lambda d: d[:48] + b"\xff" * 8 + d[48:], "a top-k index >= chunk size 1024"),
])
def test_hostile_rice_positions_are_refused_with_a_reason(edit, reason):
    with pytest.raises(CompressionError, match=reason):
        decode(hostile_rice(edit), "w")


@pytest.mark.parametrize("b", [0, 3, 4])
def test_the_rice_decoder_accepts_only_what_the_encoder_writes(b):
    """Any bytes: the decoder refuses them with CompressionError, or returns gaps that encode back to
    exactly those bytes (one encoding per gap list, so no two payloads decode alike). Random byte
    strings and one-byte edits of real encodings."""
    g = torch.Generator().manual_seed(b)
    count = 40
    real = rice_encode(torch.randint(0, 70, (count,), generator=g), b)
    tries = [bytes(torch.randint(0, 256, (n,), generator=g).to(torch.uint8).tolist()) for n in range(0, 60)]
    for i in range(len(real)):
        for flip in (0x01, 0x10, 0x80, 0xFF):
            tries.append(real[:i] + bytes([real[i] ^ flip]) + real[i + 1:])
    accepted = 0
    for data in tries:
        try:
            gaps = rice_decode(data, b, count)
        except CompressionError:
            continue
        accepted += 1
        assert gaps.dtype == torch.int64 and gaps.shape == (count,) and bool((gaps >= 0).all())
        assert rice_encode(gaps, b) == data
    assert accepted > 0  # some edits (a remainder bit) still decode: they are other gaps, encoded canonically


def rice_update():
    from lordo_fed.wire.messages import WorkerUpdate

    spec = CodecSpec("topk", bits=2, chunk=64, density=0.1, levels="sign", index_coding="rice", tile=8)
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(2))
    return WorkerUpdate(1, 2, {"w": encode(x, spec), "norm": torch.randn(40)}, {}, 100, 7), spec, x


def test_rice_coded_tiles_round_trip_the_wire_as_protobuf_writes_them():
    from lordo_fed.v1 import wire_pb2 as pb
    from lordo_fed.wire.decode import decode_update, decode_update_reference
    from lordo_fed.wire.encode import encode_update, encode_update_reference

    update, spec, x = rice_update()
    data = encode_update(update, "mid")
    assert data == encode_update_reference(update, "mid", deterministic=True)
    t = pb.WorkerUpdate.FromString(data).delta[0]
    assert (t.index_coding, t.tile, t.chunk, t.topk) == (pb.RICE, 8, 64, 6)
    for got in (decode_update(data, "mid", codecs=[spec]), decode_update_reference(data, "mid", codecs={spec.canonical()})):
        assert torch.equal(got.delta["w"], decode(encode(x, spec)).view_as(x))


@pytest.mark.parametrize("edit,reason", [
    (lambda t: setattr(t, "index_coding", 5), "WorkerUpdate.delta['w']: unknown index_coding enum value 5"),
    (lambda t: setattr(t, "index_coding", 0), "is not one this receiver configured"),
    (lambda t: setattr(t, "tile", 0), "is not one this receiver configured"),
    (lambda t: setattr(t, "tile", 7), "tile=7: expected 0 (flat chunks) or the side of a square chunk"),
    (lambda t: setattr(t, "nbytes", 10 ** 6), "does not match shape [48, 40] with codec top-k 6/64 8x8 tiles"),
    (lambda t: setattr(t, "data", t.data[:-1]), "payload smaller than its declared size"),
])
def test_hostile_position_fields_are_refused_with_a_reason(edit, reason):
    from lordo_fed.v1 import wire_pb2 as pb
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update
    from lordo_fed.wire.encode import encode_update

    update, spec, _ = rice_update()
    msg = pb.WorkerUpdate.FromString(encode_update(update, "mid"))
    edit(msg.delta[0])
    with pytest.raises(PayloadError, match=reason.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        decode_update(msg.SerializeToString(), "mid", codecs=[spec])


def test_position_fields_on_other_codecs_are_refused():
    from lordo_fed.v1 import wire_pb2 as pb
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update
    from lordo_fed.wire.encode import encode_update

    update, spec, _ = rice_update()
    for field in ("index_coding", "tile"):
        msg = pb.WorkerUpdate.FromString(encode_update(update, "mid"))
        setattr(msg.delta[1], field, 1)
        with pytest.raises(PayloadError, match="codec RAW with compression fields set"):
            decode_update(msg.SerializeToString(), "mid", codecs=[spec])
    quant = CodecSpec("quant", bits=8, block=64)
    moment = dict(update.moments, **{"exp_avg/w": encode(torch.randn(8, 8), quant)})
    msg = pb.WorkerUpdate.FromString(encode_update(type(update)(1, 2, update.delta, moment, 100, 7), "mid"))
    msg.moments[0].index_coding = pb.RICE
    with pytest.raises(PayloadError, match="index_coding RICE / tile 0 with codec QUANT"):
        decode_update(msg.SerializeToString(), "mid", codecs=[spec, quant])


@pytest.mark.parametrize("where,reason", [(-1, "a top-k index >= the last chunk's 100 values"),
                                          (31, "a top-k index >= chunk size 1024")])
def test_rice_gaps_that_run_past_their_chunk_are_refused(where, reason):
    """Rice-coded positions increase within a chunk by construction, so the decoder checks only each chunk's
    last against its bound: a gap re-encoded to run past the tail chunk, or past a full chunk's end."""
    from lordo_fed.wire.positions import chunk_layout
    from lordo_fed.wire.values import rice_decode, rice_encode, rice_parameter

    x = torch.randn(1024 + 100, generator=torch.Generator().manual_seed(5))
    enc = encode(x, CodecSpec("topk", chunk=1024, topk=32, index_coding="rice"))
    full, k, _, k_tail = chunk_layout(enc.numel, 1024, enc.spec.k)
    b = rice_parameter(1024, enc.spec.k)
    gaps = rice_decode(enc.indices, b, full * k + k_tail)
    gaps[where] += 1000
    enc.indices = rice_encode(gaps, b)
    with pytest.raises(CompressionError, match=reason):
        decode(enc, "w")


@pytest.mark.parametrize("rows,width,k", [(1, 7, 7), (5, 4096, 491), (300, 64, 1), (0, 16, 3), (40, 64, 0), (6, 512, 61)])
@pytest.mark.parametrize("values", ["gaussian", "ties", "sparse", "signs", "nan"])
def test_top_rows_against_the_row_loop_and_topk(rows, width, k, values):
    """The CPU's select-and-read-back against the per-row loop (sorted by magnitude, the leftmost first
    among ties), and against the simple path (topk, sorted: a GPU's path) wherever no two magnitudes
    tie at a row's k-th; a row with a NaN as the simple path chooses it (the NaN kept)."""
    from lordo_fed.wire.positions import top_rows

    g = torch.Generator().manual_seed(rows + width + k)
    x = torch.randn(rows, width, generator=g)
    if values == "ties":
        x = torch.round(x * 2) / 2  # a few distinct magnitudes: most rows tie at their k-th
    if values == "sparse":  # most of each row zero (a sum of sparse replies), some rows all zero
        x = x * (torch.rand(rows, width, generator=g) < 0.06)
        x[::3] = 0.0
    if values == "signs":  # most of each row tied at its largest magnitude (numpy's select at its slowest)
        x = torch.sign(x) * (torch.rand(rows, width, generator=g) < 0.9)
    if values == "nan" and rows:
        x[0, 1] = float("nan")
        x[-1, -1] = float("nan")
    got = top_rows(x, k)
    simple = x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    if values == "nan":
        assert torch.equal(got, simple)
        return
    loop = [sorted(sorted(range(width), key=lambda i: -abs(float(r[i])))[:k]) for r in x]
    assert got.tolist() == loop
    if values == "gaussian":
        assert torch.equal(got, simple)
