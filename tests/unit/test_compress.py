"""Compression codecs (lordo_fed.wire.compress) against plain per-block / per-chunk loops, their
byte counts, hostile encodings refused with a reason, and error feedback's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch

from lordo_fed.wire.payload import resolve_payload
from lordo_fed.wire.compress import CodecSpec, CompressionError, Encoded, ErrorFeedback, decode, encode
from lordo_fed.wire.positions import chunk_layout, topk
from lordo_fed.wire.values import index_bits, pack, packed_size, quantize, unpack


def reference_quantize(x: torch.Tensor, bits: int, block: int) -> tuple[list[int], list[float]]:
    """One block at a time, one value at a time: the codes and scales `quantize` must produce."""
    level = {8: 127, 4: 7}[bits]
    flat = x.reshape(-1).tolist()
    codes, scales = [], []
    for start in range(0, len(flat), block):
        values = flat[start:start + block]
        scale = max(max(abs(v) for v in values) / level, torch.finfo(torch.float32).tiny)
        scale = float(torch.tensor(scale, dtype=torch.float32))
        scales.append(scale)
        for v in values:
            q = float(torch.tensor(v, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
            codes.append(int(min(level, max(-level, round_half_even(q)))) + level)
    return codes, scales


def round_half_even(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32).round())


def reference_topk(x: torch.Tensor, chunk: int, k: int) -> tuple[list[int], list[float]]:
    flat = x.reshape(-1)
    full, k, tail, k_tail = chunk_layout(flat.numel(), chunk, k)
    positions, values = [], []
    for c in range(full + (1 if tail else 0)):
        part = flat[c * chunk:(c + 1) * chunk]
        keep = k if c < full else k_tail
        order = sorted(range(part.numel()), key=lambda i: -abs(float(part[i])))[:keep]
        for i in sorted(order):
            positions.append(i)
            values.append(float(part[i]))
    return positions, values


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(200, 64), (64, 64), (5, 8)])
def test_quantize_equals_the_per_block_loop(bits, numel, block):
    torch.manual_seed(bits + numel)
    x = torch.randn(numel) * torch.logspace(-3, 0, numel)
    x[:3] = 0.0 if numel > 3 else x[:3]
    codes, scales = quantize(x, bits, block)
    ref_codes, ref_scales = reference_quantize(x, bits, block)
    assert codes.tolist() == ref_codes
    assert scales.tolist() == ref_scales


def test_an_all_zero_block_gets_a_positive_scale():
    codes, scales = quantize(torch.zeros(10), 8, 4)
    assert bool((scales > 0).all()) and codes.tolist() == [127] * 10
    assert torch.equal(decode(encode(torch.zeros(10), CodecSpec("quant", bits=4, block=4))), torch.zeros(10))


@pytest.mark.parametrize("numel,chunk,k", [(10000, 4096, 123), (4096, 4096, 4096), (100, 4096, 30), (9, 4, 2)])
def test_topk_equals_the_per_chunk_loop(numel, chunk, k):
    torch.manual_seed(numel)
    x = torch.randn(numel)
    positions, values = topk(x, chunk, k)
    ref_positions, ref_values = reference_topk(x, chunk, k)
    assert positions.tolist() == ref_positions and values.tolist() == ref_values


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 12, 16])
@pytest.mark.parametrize("count", [0, 1, 7, 100])
def test_pack_unpack_round_trip(bits, count):
    codes = torch.randint(0, 1 << bits, (count,))
    data = pack(codes, bits)
    assert len(data) == packed_size(count, bits)
    assert unpack(data, bits, count).tolist() == codes.tolist()


@pytest.mark.parametrize("spec,worst", [
    (CodecSpec("raw"), 0.0),
    (CodecSpec("quant", bits=8, block=64), 0.5 / 127),
    (CodecSpec("quant", bits=4, block=32), 0.5 / 7),
])
def test_dense_codecs_err_by_at_most_half_a_level(spec, worst):
    torch.manual_seed(1)
    x = torch.randn(1000)
    enc = encode(x, spec)
    y = decode(enc)
    blocks = x.view(-1)[: (1000 // spec.block) * spec.block].view(-1, spec.block) if spec.kind == "quant" else None
    if blocks is None:
        assert torch.equal(y, x)
    else:
        err = (y[: blocks.numel()].view_as(blocks) - blocks).abs().amax(dim=1)
        assert bool((err <= worst * blocks.abs().amax(dim=1) * (1 + 1e-6)).all())
    expected = {"raw": 4000, "quant": packed_size(1000, spec.bits) + 4 * math.ceil(1000 / spec.block)}[spec.kind]
    assert enc.nbytes == expected


def test_topk_keeps_the_largest_entries_exactly_and_zeros_the_rest():
    torch.manual_seed(2)
    x = torch.randn(5000)
    spec = CodecSpec("topk", chunk=1000, density=0.02)
    enc = encode(x, spec)
    y = decode(enc)
    kept = y != 0
    assert int(kept.sum()) == 5 * 20 and torch.equal(y[kept], x[kept])
    for c in range(5):
        part = x[c * 1000:(c + 1) * 1000].abs()
        assert float(part[~kept[c * 1000:(c + 1) * 1000]].max()) <= float(part[kept[c * 1000:(c + 1) * 1000]].min())
    assert enc.nbytes == 4 * 100 + packed_size(100, index_bits(1000))
    two_bit = encode(x, CodecSpec("topk", bits=2, chunk=1000, density=0.02, levels="lut"))
    assert two_bit.nbytes == packed_size(100, 2) + 4 * 4 + packed_size(100, 12)  # one 4-entry table
    signs = encode(x, CodecSpec("topk", bits=2, chunk=1000, density=0.02, levels="sign"))
    assert signs.nbytes == packed_size(100, 2) + 8 * 5 + packed_size(100, 12)  # two magnitudes per chunk
    assert torch.equal(torch.sign(decode(signs)), torch.sign(y))
    z = decode(two_bit)
    assert torch.equal(z != 0, kept) and torch.equal(torch.sign(z[kept]), torch.sign(x[kept]))


def hostile_cases() -> list[tuple[str, Encoded, str]]:
    x = torch.randn(300)
    quant = encode(x, CodecSpec("quant", bits=8, block=64))
    sparse = encode(x, CodecSpec("topk", chunk=128, density=0.05))
    sparse_q = encode(x, CodecSpec("topk", bits=4, chunk=128, density=0.05))
    signs = encode(x, CodecSpec("topk", bits=2, chunk=128, density=0.05, levels="sign"))
    table = encode(x, CodecSpec("topk", bits=2, chunk=128, density=0.05, levels="lut"))
    full, k, tail, k_tail = chunk_layout(300, 128, CodecSpec("topk", chunk=128, density=0.05).k)
    positions = unpack(sparse.indices, 12, full * k + k_tail)

    def with_positions(p: torch.Tensor) -> bytes:
        return pack(p, 12)

    def nan_scale(enc: Encoded, value: float) -> bytes:
        s = torch.frombuffer(bytearray(enc.scales), dtype=torch.float32).clone()
        s[1] = value
        return s.numpy().tobytes()

    repeated = positions.clone()
    repeated[1] = repeated[0]
    beyond = positions.clone()
    beyond[k - 1] = 200
    tail_beyond = positions.clone()
    tail_beyond[-1] = tail
    nan_values = torch.frombuffer(bytearray(sparse.data), dtype=torch.float32).clone()
    nan_values[0] = float("nan")
    return [
        ("short data", Encoded(quant.spec, 300, quant.data[:-1], quant.scales), "bytes of 8-bit codes"),
        ("extra scale", Encoded(quant.spec, 300, quant.data, quant.scales + b"\0\0\0\0"), "bytes of scales"),
        ("NaN scale", Encoded(quant.spec, 300, quant.data, nan_scale(quant, float("nan"))), "scale is NaN"),
        ("zero scale", Encoded(quant.spec, 300, quant.data, nan_scale(quant, 0.0)), "zero or negative"),
        ("negative scale", Encoded(sparse_q.spec, 300, sparse_q.data, nan_scale(sparse_q, -1.0), sparse_q.indices),
         "zero or negative"),
        ("repeated index", Encoded(sparse.spec, 300, sparse.data, b"", with_positions(repeated)), "repeated"),
        ("index past the chunk", Encoded(sparse.spec, 300, sparse.data, b"", with_positions(beyond)), ">= chunk size"),
        ("index past the tail", Encoded(sparse.spec, 300, sparse.data, b"", with_positions(tail_beyond)),
         "last chunk"),
        ("more entries than declared", Encoded(sparse.spec, 300, sparse.data + sparse.data[:4], b"", sparse.indices),
         "bytes of top-k values"),
        ("more indices than declared", Encoded(sparse.spec, 300, sparse.data, b"", sparse.indices + b"\0\0\0"),
         "bytes of 12-bit codes"),
        ("NaN value", Encoded(sparse.spec, 300, nan_values.numpy().tobytes(), b"", sparse.indices), "NaN or Inf"),
        ("negative 2-bit magnitude", Encoded(signs.spec, 300, signs.data, nan_scale(signs, -1.0), signs.indices),
         "negative magnitude"),
        ("short 2-bit table", Encoded(table.spec, 300, table.data, table.scales[:-4], table.indices),
         "12 bytes of a 2-bit lookup table, expected 16"),
    ]


@pytest.mark.parametrize("decoder", ["dense", "sparse"])
@pytest.mark.parametrize("case", hostile_cases(), ids=lambda c: c[0])
def test_hostile_encodings_are_refused_with_a_reason(case, decoder):
    """`decode` and `decode_sparse` (a top-k kept sparse on the server) refuse the same encodings."""
    import dataclasses

    from lordo_fed.wire.compress import decode_sparse

    _, enc, reason = case
    with pytest.raises(CompressionError, match=reason) as err:
        if decoder == "dense":
            decode(enc, label="delta/w")
        else:
            decode_sparse(dataclasses.replace(enc, shape=(enc.numel,)), label="delta/w")
    assert str(err.value).startswith("delta/w: ")


@pytest.mark.parametrize("spec", [
    CodecSpec("topk", chunk=64, density=0.1), CodecSpec("topk", bits=2, chunk=64, density=0.1, levels="lut"),
    CodecSpec("topk", bits=2, chunk=64, density=0.1, levels="sign"), CodecSpec("topk", bits=8, chunk=64, density=0.1),
    CodecSpec("topk", bits=2, chunk=64, density=0.1, levels="lut", index_coding="rice"),
    CodecSpec("topk", bits=2, chunk=64, density=0.1, levels="lut", tile=64), CodecSpec("quant", bits=8, block=64)],
    ids=lambda s: s.kind + (f"-{s.bits}-{s.levels}" if s.kind == "topk" else "") + ("-rice" if s.index_coding == "rice" else "")
    + ("-tiled" if s.tile else ""))
def test_sparse_values_stand_for_the_dense_decode_bit_for_bit(spec):
    """What the server does with a top-k reply kept sparse, against the same with its dense decode:
    `dense()` is `decode` and `add_to` is `acc.add_(decode, alpha=w)`, bit for bit, with a zero among the
    kept values, a tail chunk, and a sum that already holds values; it keeps the bytes it was decoded from
    (`encoded`); a tiled top-k and a dense codec come back decoded; x + decode, new or in place, as the
    dense sum."""
    from lordo_fed.wire.compress import SparseValues, add_decoded, decode_sparse, plus_decoded

    g = torch.Generator().manual_seed(3)
    shape = (128, 192) if spec.tile else (150, 77)  # 64x64 tiles; otherwise a tail chunk
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4
    x[0, :10] = 0.0  # a chunk whose kept values include zeros
    enc = encode(x, spec)
    dense = decode(enc).view(x.shape)
    got = decode_sparse(enc)
    base = torch.randn(x.shape, generator=g)
    if spec.kind != "topk" or spec.tile:
        assert isinstance(got, torch.Tensor) and torch.equal(got, dense)
    else:
        assert isinstance(got, SparseValues) and got.shape == tuple(x.shape)
        assert torch.equal(got.dense(), dense)
        assert got.encoded is enc
        for w in (1.0, 0.3141592653, 1 / 3):
            acc, want = base.clone(), base.clone()
            got.add_to(acc, w)
            want.add_(dense, alpha=w)
            assert torch.equal(acc, want), w
    assert torch.equal(plus_decoded(base, enc), base + dense)
    in_place = base.clone()
    assert add_decoded(in_place, enc) is in_place and torch.equal(in_place, base + dense)  # θ_c's commit


def test_error_feedback_sends_everything_eventually():
    """Σ sent + residual = Σ inputs after every round (nothing lost); with top-k of 5% and 4-bit
    values a constant input's residual saturates (8.2x then 8.5x ‖x‖ at rounds 30 and 40, measured)
    and the mean of what was sent approaches x (relative error 0.27 at 30, 0.21 at 40)."""
    torch.manual_seed(3)
    x = torch.randn(2000)
    ef = ErrorFeedback()
    spec = CodecSpec("topk", bits=4, chunk=500, density=0.05)
    sent_total = torch.zeros(2000)
    residual_at, error_at = {}, {}
    for r in range(1, 41):
        _, sent = ef.compress("w", x, spec)
        sent_total += sent
        torch.testing.assert_close(sent_total + ef.residual["w"], r * x, rtol=0, atol=1e-4 * r)
        residual_at[r] = float(ef.residual["w"].norm() / x.norm())
        error_at[r] = float((sent_total / r - x).norm() / x.norm())
    assert residual_at[40] < 10 and residual_at[40] < 1.1 * residual_at[30]  # saturated, not growing with r
    assert error_at[40] < 0.25 and error_at[40] < error_at[30] < error_at[20]
    state = ef.state_dict()
    again = ErrorFeedback()
    again.load_state_dict(state)
    assert torch.equal(again.residual["w"], ef.residual["w"]) and again.nbytes() == 2000 * 4


def test_bad_specs_are_named():
    for spec, message in [(CodecSpec("zip"), "kind='zip'"), (CodecSpec("quant", bits=3), "bits=3"),
                          (CodecSpec("topk", density=0.0), "density=0.0"), (CodecSpec("topk", chunk=70000), "chunk=70000")]:
        with pytest.raises(ValueError, match=message):
            spec.validate()


# ----------------------------------------------------------------------------- on the wire (lordo_fed.wire.encode/decode)
def compressed_update():
    from lordo_fed.wire.messages import WorkerUpdate

    torch.manual_seed(4)
    specs = {"delta": CodecSpec("topk", bits=2, chunk=1024, density=0.03, levels="lut"), "moment": CodecSpec("quant", bits=4, block=32)}
    x, m = torch.randn(64, 48), torch.rand(8, 48)
    update = WorkerUpdate(1, 2, {"w": encode(x, specs["delta"]), "norm": torch.randn(48)},
                          {"exp_avg_sq/w": encode(m, specs["moment"])}, 100, 7, {"train_loss": 1.5})
    return update, specs, x, m


def test_compressed_tensors_round_trip_the_wire_as_protobuf_writes_them():
    from lordo_fed.wire.codec import tensors_nbytes
    from lordo_fed.wire.decode import decode_update, decode_update_reference
    from lordo_fed.wire.encode import encode_update, encode_update_reference
    from lordo_fed.v1 import wire_pb2 as pb

    update, specs, x, m = compressed_update()
    data = encode_update(update, "mid")
    assert data == encode_update_reference(update, "mid", deterministic=True)
    msg = pb.WorkerUpdate.FromString(data)
    assert msg.schema == "lordo_fed.v2.WorkerUpdate"
    assert (msg.delta[0].codec, msg.delta[0].bits, msg.delta[0].chunk, msg.delta[0].topk) == (pb.TOPK_QUANT, 2, 1024, 31)
    assert (msg.moments[0].codec, msg.moments[0].bits, msg.moments[0].block) == (pb.QUANT, 4, 32)
    assert tensors_nbytes(update) == tensors_nbytes(msg) < 4 * (x.numel() + m.numel()) / 5
    for decoded in (decode_update(data, "mid", codecs=specs.values()),
                    decode_update_reference(data, "mid", codecs=frozenset(s.canonical() for s in specs.values()))):
        assert torch.equal(decoded.delta["w"], decode(encode(x, specs["delta"])).view(64, 48))
        assert torch.equal(decoded.moments["exp_avg_sq/w"], decode(encode(m, specs["moment"])).view(8, 48))
        assert torch.equal(decoded.delta["norm"], update.delta["norm"])
    plain = dataclasses_replace(update, delta={"norm": update.delta["norm"]}, moments={})
    assert pb.WorkerUpdate.FromString(encode_update(plain, "mid")).schema == "lordo_fed.v1.WorkerUpdate"


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def tampered(edit) -> bytes:
    from lordo_fed.wire.encode import encode_update
    from lordo_fed.v1 import wire_pb2 as pb

    update, _, _, _ = compressed_update()
    msg = pb.WorkerUpdate.FromString(encode_update(update, "mid"))
    edit(msg)
    return msg.SerializeToString()


def _repeat_first_index(msg) -> None:
    t = msg.delta[0]
    values = len(t.data) - 3 * ((31 * 3 + 1) // 2)  # codes and scales, then 12-bit indices of 93 entries
    idx = unpack(t.data[values:], 12, 93)
    idx[1] = idx[0]
    t.data = t.data[:values] + pack(idx, 12)


@pytest.mark.parametrize("edit,reason", [
    (lambda msg: setattr(msg, "schema", "lordo_fed.v1.WorkerUpdate"), "compressed codecs come in lordo_fed.v2 payloads only"),
    (lambda msg: setattr(msg.delta[1], "bits", 8), "codec RAW with compression fields set"),
    (lambda msg: setattr(msg.delta[0], "topk", 40), "codec top-k 40/1024 2-bit lut is not one this receiver configured"),
    (lambda msg: setattr(msg.delta[0], "chunk", 0), "codec chunk=0: expected an integer in [1, 65536]"),
    (lambda msg: setattr(msg.moments[0], "bits", 3), "codec 'quant' bits=3"),
    (lambda msg: setattr(msg.delta[0], "nbytes", msg.delta[0].nbytes + 1), "does not match shape [64, 48] with codec"),
    (lambda msg: setattr(msg.delta[0], "data", msg.delta[0].data + b"\0"), "payload larger than its declared size"),
    (_repeat_first_index, "WorkerUpdate.delta['w']: top-k indices repeated or out of order"),
    (lambda msg: setattr(msg.moments[0], "data", msg.moments[0].data[:-4] + b"\0\0\xc0\x7f"),
     "WorkerUpdate.moments['exp_avg_sq/w']: a block scale is NaN"),
    (lambda msg: setattr(msg.delta[0], "levels", 7), "WorkerUpdate.delta['w']: unknown levels enum value 7"),
    (lambda msg: setattr(msg.delta[0], "levels", 0), "2-bit values decode to bin means, expected levels 'lut' or 'sign'"),
    (lambda msg: setattr(msg.delta[0], "levels", 2), "codec top-k 31/1024 2-bit sign is not one this receiver configured"),
    (lambda msg: setattr(msg.delta[0], "bits", 1), "'lut' is for 2-bit top-k values, 'sign' for 2- and 1-bit ones"),
    (lambda msg: (setattr(msg.delta[0], "bits", 1), setattr(msg.delta[0], "levels", 2)),
     "codec top-k 31/1024 1-bit sign is not one this receiver configured"),
    (lambda msg: setattr(msg.moments[0], "levels", 1), "levels LUT with codec QUANT"),
    (lambda msg: setattr(msg.delta[1], "levels", 1), "codec RAW with compression fields set"),
    (lambda msg: setattr(msg.delta[0], "data", msg.delta[0].data[:28] + b"\0\0\xc0\x7f" + msg.delta[0].data[32:]),
     "WorkerUpdate.delta['w']: a 2-bit lookup table holds NaN or Inf"),  # codes: 24 bytes, then the table
])
def test_hostile_compressed_payloads_are_refused_with_a_reason(edit, reason):
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update

    _, specs, _, _ = compressed_update()
    with pytest.raises(PayloadError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        decode_update(tampered(edit), "mid", codecs=specs.values())


# ----------------------------------------------------------------------------- in rounds (worker, reference trainer)
def test_compressed_rounds_learn_send_fewer_bytes_and_keep_the_residual(tmp_path):
    """The reference trainer with the compressed presets: workers send Δ compressed with error
    feedback and the moments quantised (bytes counted as encoded), the aggregator gets the
    decoded values; the loss goes down (int8 within 10% of fp32 after 4 rounds; top-k's error
    feedback needs more rounds to catch up, which results.md measures)."""
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.rounds.config import RoundConfig
    from lordo_fed.trainer.run import run_rounds
    from tests.unit.test_trainer import context, tiny_config

    runs = {}
    for dtype in ("fp32", "int8", "topk2bit"):
        cfg = tiny_config(tmp_path / dtype, workers=2, total_steps=8, rounds=RoundConfig(local_steps=2),
                          payload_dtype=dtype)
        records: list = []
        run_rounds(context(cfg, records), resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
        runs[dtype] = records
    plain = runs["fp32"]
    for dtype, least in (("int8", 3.0), ("topk2bit", 5.0)):
        packed = runs[dtype]
        assert packed[-1]["val_loss"] < packed[0]["val_loss"], dtype
        ratio = plain[-1]["bytes_sent_per_worker"] / packed[-1]["bytes_sent_per_worker"]
        assert ratio > least, (dtype, ratio)
    assert abs(runs["int8"][-1]["val_loss"] - plain[-1]["val_loss"]) < 0.1 * plain[-1]["val_loss"]


def test_a_workers_compression_residual_travels_with_its_state(tmp_path):
    from lordo_fed.data import load_dataset
    from lordo_fed.rounds.methods import make_worker, resolve_method
    from lordo_fed.model import build_model
    from lordo_fed.wire.messages import GlobalState
    from tests.unit.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, payload_dtype="topk2bit")
    data = load_dataset(cfg.data, 1)
    model = build_model(cfg.model, data.vocab_size)
    settings = resolve_method("diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
    worker = make_worker(0, model, settings, data.train_shards[0], [], cfg.total_steps, 4, 32, seed=0,
                         payload=resolve_payload("topk2bit"))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = worker.train_round(GlobalState(round=1, params=params))
    assert all(isinstance(d, Encoded) for d in update.delta.values())
    tensors, meta = worker.flat_state()
    assert {k for k in tensors if k.startswith("wire_ef/")} == {f"wire_ef/{n}" for n in params}
    again = make_worker(0, model, settings, data.train_shards[0], [], cfg.total_steps, 4, 32, seed=0,
                        payload=resolve_payload("topk2bit"))
    again.load_flat_state(tensors, meta)
    assert all(torch.equal(again.wire_ef.residual[n], worker.wire_ef.residual[n]) for n in params)
    assert any(float(r.abs().sum()) > 0 for r in again.wire_ef.residual.values())


@pytest.mark.parametrize("preset", ["int8", "topk2bit-both"])
def test_server_and_workers_agree_bit_for_bit_on_the_clients_copy(tmp_path, preset):
    """A compressed downlink (the int8 change of θ_c, or its top-k 2-bit: the server re-sparsifies
    θ − θ_c): after every round the aggregator's θ_c and every worker's are equal bit for bit; a
    worker that missed a round refuses the change (ResyncNeeded) and, sent θ_c whole, holds the
    same copy again."""
    from lordo_fed.data import load_dataset
    from lordo_fed.rounds.methods import make_aggregator, make_worker, resolve_method
    from lordo_fed.model import build_model
    from lordo_fed.rounds.config import RoundConfig
    from lordo_fed.rounds.downlink import ResyncNeeded
    from tests.unit.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, workers=3, rounds=RoundConfig(local_steps=2), payload_dtype=preset)
    data = load_dataset(cfg.data, 3)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.vocab_size)
    settings = resolve_method("diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
    workers = [make_worker(m, model, settings, data.train_shards[m], [], 12, 4, 32, seed=0,
                           payload=resolve_payload(preset))
               for m in range(3)]
    agg = make_aggregator(model, settings, {}, seed=0, payload=resolve_payload(preset))
    from lordo_fed.trainer.run import as_received

    for r in range(1, 5):
        state = agg.global_state()
        assert state.params_delta == (r > 1)
        if r > 1:
            assert all(isinstance(t, Encoded) for t in state.params.values())
        active = workers if r != 2 else workers[:2]  # worker 2 misses round 2
        if r == 3:
            with pytest.raises(ResyncNeeded, match="round 3: the server sent θ as a change to round 2's copy, this "
                                                   "worker holds the copy of round 1"):
                workers[2].train_round(state)
            updates = [w.train_round(state) for w in workers[:2]] + [workers[2].train_round(agg.resync_state())]
        else:
            updates = [w.train_round(state) for w in active]
        if r == 4 and preset == "int8":  # the copy the workers now hold misses θ by at most half an int8 level of the change,
            # plus the fp32 rounding of adding the decoded change to the copy (entries near 1: the norm
            # gains) and of the difference itself: two ulps of the largest entry
            copy = agg.client_copy()
            for n in agg.params:
                change = (agg.params[n] - agg.client_params[n]).abs().max()
                rounding = 2 * torch.finfo(torch.float32).eps * float(agg.params[n].abs().max())
                assert float((agg.params[n] - copy[n]).abs().max()) <= float(change) / 254 * (1 + 1e-5) + rounding
        agg.aggregate([as_received(u) for u in updates])
        for w in active if r != 3 else workers:
            assert w.client_round == r
            assert all(torch.equal(w.client_params[n], agg.client_params[n]) for n in agg.params), (r, w.worker_id)


def test_second_moments_quantise_their_square_roots_rounded_up():
    """Blockwise int8 of v itself zeroes most of a realistic second moment (its values span
    decades within a block) and Adam's m / √v̂ explodes; through √v rounded up, v̂ ≥ v everywhere,
    no positive v decodes to 0, and the step m̂ / √v̂ stays within Adam's own bound (|m| ≤ √v)."""
    torch.manual_seed(5)
    g = torch.randn(100_000) * torch.exp(torch.randn(100_000) * 1.5) * 1e-3
    v, m = g.square(), 0.3 * g
    plain = decode(encode(v, CodecSpec("quant", bits=8, block=64)))
    assert float((plain == 0).float().mean()) > 0.5  # the hazard, measured: 74% zeroed
    spec = CodecSpec("quant", bits=8, block=64, sqrt=True)
    v_hat = decode(encode(v, spec))
    assert bool((v_hat >= v).all()) and bool((v_hat > 0).all())
    m_hat = decode(encode(m, CodecSpec("quant", bits=8, block=64)))
    step = m_hat / (v_hat.sqrt() + 1e-8)
    assert float(step.abs().max()) < 1.0 and float((m / (v.sqrt() + 1e-8)).abs().max()) <= 0.3 + 1e-6
    # √v̂ overshoots √v by at most one level of its block
    s, s_hat = v[:96000].sqrt().view(-1, 64), v_hat[:96000].sqrt().view(-1, 64)
    assert bool(((s_hat - s) <= s.amax(dim=1, keepdim=True) / 127 * (1 + 1e-5)).all())


def test_a_second_moment_on_the_wire_carries_its_sqrt_flag():
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update
    from lordo_fed.wire.encode import encode_update, encode_update_reference
    from lordo_fed.wire.messages import WorkerUpdate
    from lordo_fed.v1 import wire_pb2 as pb
    from lordo_fed.wire.payload import PRESETS

    codecs = PRESETS["int8"]
    v = torch.rand(8, 48) ** 4
    update = WorkerUpdate(0, 1, {"w": torch.zeros(8, 48)}, codecs.encode_moments({"exp_avg_sq/w": v}), 4, 1)
    data = encode_update(update, "mid")
    assert data == encode_update_reference(update, "mid", deterministic=True)
    assert pb.WorkerUpdate.FromString(data).moments[0].sqrt
    got = decode_update(data, "mid", codecs=codecs.specs()).moments["exp_avg_sq/w"]
    assert bool((got >= v).all()) and torch.equal(got, decode(encode(v, codecs.moment_spec("exp_avg_sq/w"))).view(8, 48))
    msg = pb.WorkerUpdate.FromString(data)
    msg.delta[0].sqrt = True  # on a RAW tensor
    with pytest.raises(PayloadError, match="codec RAW with compression fields set"):
        decode_update(msg.SerializeToString(), "mid", codecs=codecs.specs())
    msg = pb.WorkerUpdate.FromString(data)
    msg.moments[0].sqrt = False  # a spec this receiver did not configure
    with pytest.raises(PayloadError, match="codec int8/64 is not one this receiver configured"):
        decode_update(msg.SerializeToString(), "mid", codecs={codecs.moment_spec("exp_avg_sq/w")})


# ----------------------------------------------------------------------------- row-sparse (embeddings)
def test_row_sparse_keeps_the_rows_over_the_threshold():
    """Against a loop over rows: the kept rows are exactly those with ‖row‖ >= threshold x the
    largest, in increasing order; fp32 values exact, int8 within half a level of each row's scale;
    every other row decodes to 0; an all-zero tensor keeps none."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 24, generator=g) * torch.rand(40, 1, generator=g) ** 3  # rows of very different norms
    norms = [float(r.norm()) for r in x]
    expected = [i for i, n in enumerate(norms) if n >= 0.2 * max(norms)]
    assert 0 < len(expected) < 40
    for bits in (0, 8, 4):
        enc = encode(x, CodecSpec("rows", bits=bits, threshold=0.2))
        assert enc.spec.topk == len(expected)
        assert unpack(enc.indices, 16, len(expected)).tolist() == expected
        out = decode(enc).view(40, 24)
        for i in range(40):
            if i not in expected:
                assert float(out[i].abs().max()) == 0.0
            elif bits == 0:
                assert torch.equal(out[i], x[i])
            else:
                level = {8: 127, 4: 7}[bits]
                assert float((out[i] - x[i]).abs().max()) <= 0.5 * float(x[i].abs().max()) / level * (1 + 1e-5)
    assert encode(torch.zeros(5, 3), CodecSpec("rows", bits=8)).spec.topk == 0
    assert torch.equal(decode(encode(torch.zeros(5, 3), CodecSpec("rows", bits=8))), torch.zeros(15))


def test_row_sparse_with_error_feedback_sends_every_row_eventually():
    """A small row left out accumulates in the residual until it qualifies: Σ sent + e = r·x."""
    x = torch.ones(6, 4)
    x[0] *= 10.0
    ef = ErrorFeedback()
    spec = CodecSpec("rows", bits=0, threshold=0.5)
    total, sent_rows = torch.zeros(6, 4), set()
    for r in range(1, 9):
        _, sent = ef.compress("emb", x, spec)
        total += sent
        sent_rows |= {i for i in range(6) if float(sent[i].abs().sum()) > 0}
        torch.testing.assert_close(total + ef.residual["emb"], r * x, rtol=0, atol=1e-5)
    assert sent_rows == set(range(6))


def row_sparse_hostile_cases() -> list[tuple[str, Encoded, str]]:
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(9)) * torch.linspace(0.1, 1, 10)[:, None]
    good = encode(x, CodecSpec("rows", bits=8, threshold=0.6))
    k = good.spec.topk
    assert 2 <= k < 10
    idx = unpack(good.indices, 16, k)

    def with_rows(rows: torch.Tensor, count: int = k) -> Encoded:
        spec = dataclasses_replace(good.spec, topk=count)
        return Encoded(spec, 80, good.data, good.scales, pack(rows, 16), (10, 8))

    repeated, beyond = idx.clone(), idx.clone()
    repeated[1] = repeated[0]
    beyond[-1] = 10
    zero_scale = torch.frombuffer(bytearray(good.scales), dtype=torch.float32).clone()
    zero_scale[0] = 0.0
    return [
        ("repeated row", with_rows(repeated), "row indices repeated or out of order"),
        ("row past the end", with_rows(beyond), "a row index >= the tensor's 10 rows"),
        ("more rows than the tensor", Encoded(dataclasses_replace(good.spec, topk=11), 80, b"", b"", b"", (10, 8)),
         "11 rows declared, the tensor has 10"),
        ("zero scale", Encoded(good.spec, 80, good.data, zero_scale.numpy().tobytes(), good.indices, (10, 8)),
         "zero or negative"),
        ("short codes", Encoded(good.spec, 80, good.data[:-1], good.scales, good.indices, (10, 8)), "bytes of 8-bit codes"),
        ("not 2-D", Encoded(good.spec, 80, good.data, good.scales, good.indices, (80,)), "needs a 2-D shape"),
    ]


@pytest.mark.parametrize("case", row_sparse_hostile_cases(), ids=lambda c: c[0])
def test_hostile_row_sparse_encodings_are_refused_with_a_reason(case):
    _, enc, reason = case
    with pytest.raises(CompressionError, match=reason):
        decode(enc, label="delta/tok_emb.weight")


def test_row_sparse_tensors_cross_the_wire():
    """Codec ROWS with its row count in `topk`: both encoders agree, both decoders return the
    same tensor, the receiver's configured spec is the kind and value bits only (the count and
    threshold are the sender's), and a count that does not match the bytes is refused."""
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update, decode_update_reference
    from lordo_fed.wire.encode import encode_update, encode_update_reference
    from lordo_fed.wire.messages import WorkerUpdate
    from lordo_fed.v1 import wire_pb2 as pb

    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(10)) * torch.linspace(0, 1, 300)[:, None]
    spec = CodecSpec("rows", bits=8, threshold=0.5)
    update = WorkerUpdate(1, 2, {"emb": encode(x, spec)}, {}, 100, 7)
    data = encode_update(update, "mid")
    assert data == encode_update_reference(update, "mid", deterministic=True)
    msg = pb.WorkerUpdate.FromString(data)
    assert (msg.delta[0].codec, msg.delta[0].bits, msg.delta[0].topk) == (pb.ROWS, 8, update.delta["emb"].spec.topk)
    for got in (decode_update(data, "mid", codecs=[CodecSpec("rows", bits=8, threshold=0.9)]),
                decode_update_reference(data, "mid", codecs=frozenset({CodecSpec("rows", bits=8)}))):
        assert torch.equal(got.delta["emb"], decode(encode(x, spec)).view(300, 16))
    with pytest.raises(PayloadError, match="is not one this receiver configured"):
        decode_update(data, "mid", codecs=[CodecSpec("rows", bits=4)])
    msg.delta[0].topk += 1
    with pytest.raises(PayloadError, match="does not match shape"):
        decode_update(msg.SerializeToString(), "mid", codecs=[spec])
