"""lordo_fed.codec: round trips, sizes, and every refusal of a bad payload."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from lordo_fed import codec
from lordo_fed.codec import (PAYLOAD_DTYPES, SCHEMA, PayloadError, decode_global_state, decode_update,
                             encode_global_state, encode_update, model_id, payload_nbytes,
                             tensors_nbytes)
from lordo_fed.rounds import GlobalState, WorkerUpdate
from lordo_fed.v1 import wire_pb2 as pb


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _params(seed=0):
    g = _gen(seed)
    return {
        "emb.weight": torch.randn(16, 8, generator=g),
        "blocks.0.attn.weight": torch.randn(8, 8, generator=g),
        "norm.weight": torch.randn(8, generator=g),
        "scale": torch.randn((), generator=g),
    }


def _state(seed=0):
    g = _gen(seed + 1)
    params = _params(seed)
    svd_basis = torch.linalg.qr(torch.randn(8, 2, generator=g))[0].T.contiguous()
    return GlobalState(
        round=3,
        params=params,
        projections={"emb.weight": torch.tensor([0, 2, 5], dtype=torch.int64),   # DCT indices
                     "blocks.0.attn.weight": svd_basis},                                  # SVD basis
        moments={"exp_avg/emb.weight": torch.randn(16, 3, generator=g),
                 "exp_avg_sq/emb.weight": torch.rand(16, 3, generator=g)},
        opt_step=96,
    )


def _update(seed=0):
    g = _gen(seed + 2)
    return WorkerUpdate(
        worker_id=2, round=3,
        delta={k: torch.randn(v.shape, generator=g) for k, v in _params(seed).items()},
        moments={"exp_avg/emb.weight": torch.randn(16, 3, generator=g)},
        tokens=4096, opt_step=128,
        metrics={"train_loss": 2.5, "steps": 32, "lr": 1e-3},
    )


MID = model_id(_params())


def _assert_same(got: dict, want: dict, bf16: bool):
    assert list(got) == list(want)
    for k, w in want.items():
        t = got[k]
        assert t.device.type == "cpu"
        assert t.shape == w.shape, k
        if w.dtype.is_floating_point:
            assert t.dtype == torch.float32, k
            expect = w.to(torch.bfloat16).float() if bf16 else w.float()
            assert torch.equal(t, expect), k
        else:
            assert t.dtype == w.dtype, k
            assert torch.equal(t, w), k


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_global_state_round_trip(payload_dtype):
    s = _state()
    data = encode_global_state(s, MID, payload_dtype)
    assert isinstance(data, bytes) and payload_nbytes(data) == len(data)
    got = decode_global_state(data, expected_model_id=MID)
    assert (got.round, got.opt_step) == (3, 96)
    bf16 = payload_dtype == "bf16"
    _assert_same(got.params, s.params, bf16)
    _assert_same(got.projections, s.projections, False)  # bases always travel in fp32
    _assert_same(got.moments, s.moments, bf16)
    assert got.params["scale"].dim() == 0 and got.params["norm.weight"].dim() == 1


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_update_round_trip(payload_dtype):
    u = _update()
    got = decode_update(encode_update(u, MID, payload_dtype), expected_model_id=MID)
    assert (got.worker_id, got.round, got.tokens, got.opt_step) == (2, 3, 4096, 128)
    assert got.metrics == {"train_loss": 2.5, "steps": 32.0, "lr": 1e-3}
    _assert_same(got.delta, u.delta, payload_dtype == "bf16")
    _assert_same(got.moments, u.moments, payload_dtype == "bf16")


def test_fp32_is_bit_exact_including_specials():
    x = torch.tensor([0.0, -0.0, 1e-45, -3.4028235e38, float("inf"), float("-inf"), 1 / 3])
    x = torch.cat([x, torch.tensor([float("nan")]), torch.randn(100, generator=_gen())])
    got = decode_update(encode_update(WorkerUpdate(0, 1, {"x": x}, {}, 1, 1), MID)).delta["x"]
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))


def test_bf16_rounds_like_torch_and_keeps_specials():
    x = torch.tensor([0.0, -0.0, 1e-40, 3.4e38, -3.4028235e38, float("inf"), float("-inf"),
                      1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 / 3])
    x = torch.cat([x, torch.randn(1000, generator=_gen()) * 1e3])
    got = decode_update(encode_update(WorkerUpdate(0, 1, {"x": x}, {}, 1, 1), MID, "bf16")).delta["x"]
    assert torch.equal(got, x.to(torch.bfloat16).float())
    nan = decode_update(encode_update(WorkerUpdate(0, 1, {"n": torch.tensor([float("nan")])}, {}, 1, 1),
                                      MID, "bf16")).delta["n"]
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_integer_tensors_are_exact_in_both_modes(payload_dtype):
    big = torch.tensor([0, 1, 2 ** 40 + 1, -7, 2 ** 63 - 1], dtype=torch.int64)
    i32 = torch.tensor([[3, -4], [2 ** 31 - 1, 0]], dtype=torch.int32)
    s = GlobalState(round=1, params={}, projections={"a": big, "b": i32})
    got = decode_global_state(encode_global_state(s, MID, payload_dtype))
    assert got.projections["a"].dtype == torch.int64 and torch.equal(got.projections["a"], big)
    assert got.projections["b"].dtype == torch.int32 and torch.equal(got.projections["b"], i32)
    wire = pb.GlobalState.FromString(encode_global_state(s, MID, payload_dtype))
    assert [(t.dtype, t.codec) for t in wire.projections] == [(pb.INT64, pb.RAW), (pb.INT32, pb.RAW)]


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_empty_dicts_and_empty_tensors(payload_dtype):
    s = GlobalState(round=0, params={})
    got = decode_global_state(encode_global_state(s, "", payload_dtype))
    assert got.params == {} and got.projections == {} and got.moments == {} and got.opt_step == 0
    u = WorkerUpdate(worker_id=0, round=1, delta={}, moments={}, tokens=0, opt_step=0)
    got_u = decode_update(encode_update(u, MID, payload_dtype), MID)
    assert got_u.delta == {} and got_u.moments == {} and got_u.metrics == {}
    empties = {"a": torch.zeros(0), "b": torch.zeros(3, 0), "i": torch.zeros(0, dtype=torch.int64)}
    got_e = decode_update(encode_update(WorkerUpdate(0, 1, empties, {}, 1, 1), MID, payload_dtype))
    _assert_same(got_e.delta, empties, payload_dtype == "bf16")


def test_inputs_are_normalised():
    """Non-contiguous, requires_grad, fp64/fp16/bf16 inputs: all come back as plain fp32."""
    base = torch.randn(6, 4, generator=_gen())
    tensors = {"t": base.T, "slice": base[::2, 1:], "grad": base.clone().requires_grad_(True),
               "f64": base.double(), "f16": base.half(), "b16": base.bfloat16()}
    got = decode_update(encode_update(WorkerUpdate(0, 1, tensors, {}, 1, 1), MID)).delta
    for k, t in tensors.items():
        assert got[k].dtype == torch.float32 and not got[k].requires_grad
        assert torch.equal(got[k], t.detach().float()), k


def test_decoded_tensors_own_writable_memory():
    s = _state()
    data = encode_global_state(s, MID)
    got = decode_global_state(data)
    got.params["emb.weight"].add_(1.0)  # would warn/fail on a read-only buffer
    got.projections["emb.weight"][0] = 7
    assert decode_global_state(data).projections["emb.weight"][0] == 0


def test_bf16_payload_is_half_of_fp32():
    g = _gen()
    s = GlobalState(round=1, params={f"p{i}": torch.randn(256, 256, generator=g) for i in range(4)},
                    moments={"exp_avg/p0": torch.randn(256, 16, generator=g)})
    n32 = payload_nbytes(encode_global_state(s, MID, "fp32"))
    n16 = payload_nbytes(encode_global_state(s, MID, "bf16"))
    assert abs(n16 / n32 - 0.5) <= 0.005, (n16, n32)
    numel = sum(t.numel() for t in s.tensors().values())
    assert tensors_nbytes(s, "fp32") == 2 * tensors_nbytes(s, "bf16") == 4 * numel


def test_projection_bases_stay_orthonormal_in_a_bf16_payload():
    """bf16 rounds an orthonormal basis to ‖PPᵀ − I‖ ~ 1e-3; bases travel in fp32 whatever the
    payload dtype, bit-exact (and cost r x n floats per matrix)."""
    from lordo_fed.projection import SVDProjection

    basis = SVDProjection().fit(torch.randn(256, 128, generator=_gen()), 16, "right")
    rounded = basis.to(torch.bfloat16).float()
    eye = torch.eye(16)
    assert (rounded @ rounded.T - eye).abs().max() > 1e-4  # what sending it in bf16 would do
    s = GlobalState(round=2, params={"w": torch.randn(256, 128, generator=_gen())}, projections={"w": basis})
    data = encode_global_state(s, MID, "bf16")
    got = decode_global_state(data).projections["w"]
    assert torch.equal(got, basis)
    assert (got @ got.T - eye).abs().max() < 1e-5
    assert tensors_nbytes(s, "bf16") == 2 * 256 * 128 + 4 * basis.numel() == tensors_nbytes(pb.GlobalState.FromString(data))


def test_tensors_nbytes_matches_the_wire():
    s, u = _state(), _update()
    for pd in PAYLOAD_DTYPES:
        assert tensors_nbytes(pb.GlobalState.FromString(encode_global_state(s, MID, pd))) == \
            tensors_nbytes(s, pd)
        assert tensors_nbytes(pb.WorkerUpdate.FromString(encode_update(u, MID, pd))) == \
            tensors_nbytes(u, pd)


def test_model_id():
    p = _params()
    assert model_id(p) == MID and len(MID) == 16 and int(MID, 16) >= 0
    assert model_id(dict(reversed(list(p.items())))) == MID           # order-independent
    assert model_id({k: v.double() * 3 for k, v in p.items()}) == MID  # values and dtype ignored
    assert model_id({**p, "norm.weight": torch.zeros(9)}) != MID      # shape counts
    assert model_id({("x" + k): v for k, v in p.items()}) != MID      # names count
    assert model_id({}) != MID


def test_encoder_refuses_bad_input():
    with pytest.raises(ValueError, match="payload_dtype='fp16'"):
        encode_global_state(_state(), MID, "fp16")
    with pytest.raises(ValueError, match=r"\['mask'\].*torch.bool"):
        encode_update(WorkerUpdate(0, 1, {"mask": torch.ones(3, dtype=torch.bool)}, {}, 1, 1), MID)
    with pytest.raises(ValueError, match="non-empty string"):
        encode_update(WorkerUpdate(0, 1, {"": torch.ones(3)}, {}, 1, 1), MID)


def test_large_round_trip():
    n = 50 * 2 ** 20 // 4  # ~50 MB of fp32
    x = torch.randn(n, generator=_gen())
    u = WorkerUpdate(0, 1, {"big": x, "idx": torch.arange(1000)}, {}, 1, 1)
    data = encode_update(u, MID)
    assert 50 * 2 ** 20 <= len(data) < 50 * 2 ** 20 + 10_000
    got = decode_update(data, MID)
    assert torch.equal(got.delta["big"], x) and torch.equal(got.delta["idx"], torch.arange(1000))
    half = decode_update(encode_update(u, MID, "bf16"), MID)
    assert torch.equal(half.delta["big"], x.to(torch.bfloat16).float())


# --- refusals -----------------------------------------------------------------------------------


def _tamper_state(fn, payload_dtype="fp32") -> bytes:
    msg = pb.GlobalState.FromString(encode_global_state(_state(), MID, payload_dtype))
    fn(msg)
    return msg.SerializeToString()


def _tamper_update(fn, payload_dtype="fp32") -> bytes:
    msg = pb.WorkerUpdate.FromString(encode_update(_update(), MID, payload_dtype))
    fn(msg)
    return msg.SerializeToString()


def _raises(data: bytes, *fragments: str, update: bool = False, expected_model_id=None):
    decode = decode_update if update else decode_global_state
    with pytest.raises(PayloadError) as info:
        decode(data, expected_model_id)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_wrong_schema_version_names_both():
    data = _tamper_state(lambda m: setattr(m, "schema", "lordo_fed.v2.GlobalState"))
    _raises(data, "'lordo_fed.v2.GlobalState' received", "expected 'lordo_fed.v1.GlobalState'")
    data = _tamper_update(lambda m: setattr(m, "schema", "lordo_fed.v0"))
    _raises(data, "'lordo_fed.v0' received", "expected 'lordo_fed.v1.WorkerUpdate'", update=True)


def test_missing_schema():
    _raises(_tamper_state(lambda m: m.ClearField("schema")), "no schema",
            f"expected '{SCHEMA}.GlobalState'")
    _raises(pb.WorkerUpdate(round=1).SerializeToString(), "no schema", update=True)
    _raises(b"", "no schema")  # an empty payload parses as an empty message


def test_update_is_not_a_global_state_and_vice_versa():
    _raises(encode_update(_update(), MID), "'lordo_fed.v1.WorkerUpdate' received",
            "a WorkerUpdate where a GlobalState was expected")
    _raises(encode_global_state(_state(), MID), "a GlobalState where a WorkerUpdate was expected",
            update=True)


def test_model_id_mismatch():
    other = model_id({"w": torch.zeros(2)})
    _raises(encode_global_state(_state(), other), f"model_id '{other}' received",
            f"expected '{MID}'", expected_model_id=MID)
    _raises(encode_update(_update(), ""), "model_id '' received", update=True, expected_model_id=MID)
    decode_update(encode_update(_update(), other))  # no expectation: not checked


def test_unknown_dtype_and_codec():
    def dtype99(m):
        m.params[0].dtype = 99
    _raises(_tamper_state(dtype99), "GlobalState.params['emb.weight']", "unknown dtype enum value 99")

    def unspecified(m):
        m.delta[1].dtype = pb.DTYPE_UNSPECIFIED
    _raises(_tamper_update(unspecified), "WorkerUpdate.delta['blocks.0.attn.weight']",
            "unknown dtype enum value DTYPE_UNSPECIFIED", update=True)

    def codec7(m):
        m.moments[0].codec = 7
    _raises(_tamper_state(codec7), "GlobalState.moments['exp_avg/emb.weight']",
            "unknown codec enum value 7")


def test_codec_that_does_not_fit_the_dtype():
    def int_as_bf16(m):
        t = m.projections[0]
        t.codec = pb.BF16_BITS
    _raises(_tamper_state(int_as_bf16), "GlobalState.projections['emb.weight']",
            "codec BF16_BITS does not fit dtype INT64")

    def bf16_raw(m):
        m.params[0].dtype = pb.BFLOAT16
    _raises(_tamper_state(bf16_raw), "codec RAW does not fit dtype BFLOAT16")


def test_declared_bfloat16_comes_back_as_bfloat16():
    """dtype is what the receiver reconstructs; this encoder itself always declares FLOAT32."""
    def declare_bf16(m):
        m.params[0].dtype = pb.BFLOAT16
    got = decode_global_state(_tamper_state(declare_bf16, "bf16"))
    assert got.params["emb.weight"].dtype == torch.bfloat16
    assert torch.equal(got.params["emb.weight"], _params()["emb.weight"].to(torch.bfloat16))


def test_negative_shape_dim():
    def neg(m):
        del m.params[0].shape[:]
        m.params[0].shape.extend([-16, -8])
    _raises(_tamper_state(neg), "GlobalState.params['emb.weight']", "negative dimension -16")


def test_non_integer_shape_dims():
    """int64 fields cannot hold 1.5; a sender writing doubles uses the wrong wire type, which
    protobuf would silently read as shape [] (a scalar): refused."""
    def raw_tensor(shape_field: bytes) -> bytes:
        data = b"\x00\x00\x80\x3f"  # 1.0f: 4 bytes, consistent with a 0-d fp32 tensor
        body = (b"\x0a\x01w" + shape_field + b"\x18\x01\x20\x01\x28\x04\x32\x04" + data)
        return b"\x3a" + bytes([len(body)]) + body  # WorkerUpdate.delta = field 7
    header = pb.WorkerUpdate(schema=codec.UPDATE_SCHEMA, round=1).SerializeToString()
    good = decode_update(header + raw_tensor(b""))
    assert good.delta["w"].item() == 1.0
    as_double = bytes([(2 << 3) | 1]) + struct.pack("<d", 1.5)
    _raises(header + raw_tensor(as_double), "WorkerUpdate.delta['w']", "field 'shape'",
            "non-integer shape dimensions", update=True)
    as_float = bytes([(2 << 3) | 5]) + struct.pack("<f", 2.5)
    _raises(header + raw_tensor(as_float), "field 'shape' sent as fixed32", update=True)
    with pytest.raises(TypeError):
        pb.Tensor().shape.append(1.5)


def test_data_larger_or_smaller_than_declared():
    def grow(m):
        m.params[1].data += b"\x00\x00\x00\x00"
    _raises(_tamper_state(grow), "GlobalState.params['blocks.0.attn.weight']",
            "payload larger than its declared size", "260 bytes of data, nbytes=256")

    def shrink(m):
        m.delta[0].data = m.delta[0].data[:-2]
    _raises(_tamper_update(shrink), "WorkerUpdate.delta['emb.weight']",
            "payload smaller than its declared size", update=True)


def test_nbytes_that_does_not_match_the_shape():
    def wrong(m):
        m.params[2].nbytes = 31
    _raises(_tamper_state(wrong), "GlobalState.params['norm.weight']", "nbytes=31",
            "does not match shape [8] x 4 bytes", "= 32")

    def bf16_size_of_fp32(m):  # BF16_BITS carries 2 bytes per element, not 4
        m.params[2].nbytes = 32
    _raises(_tamper_state(bf16_size_of_fp32, "bf16"), "nbytes=32", "x 2 bytes (FLOAT32/BF16_BITS) = 16")

    def negative(m):
        m.params[2].nbytes = -4
    _raises(_tamper_state(negative), "negative declared size")


def test_hostile_sizes_allocate_nothing():
    """A 4 TiB claim that is self-consistent (shape x itemsize = nbytes) fails on len(data)."""
    def huge(m):
        t = m.params[0]
        del t.shape[:]
        t.shape.extend([2 ** 20, 2 ** 20])
        t.nbytes = 2 ** 42
    _raises(_tamper_state(huge), "GlobalState.params['emb.weight']", "smaller than its declared size",
            f"nbytes={2 ** 42}")

    def overflow(m):
        t = m.params[0]
        del t.shape[:]
        t.shape.extend([2 ** 62, 2 ** 62, 2 ** 62])
    _raises(_tamper_state(overflow), "does not match shape")


def test_duplicate_and_missing_names():
    def dup(m):
        m.projections[1].name = "emb.weight"
    _raises(_tamper_state(dup), "GlobalState.projections['emb.weight']", "duplicate tensor name")

    def dup_update(m):
        m.moments.add().CopyFrom(m.moments[0])
    _raises(_tamper_update(dup_update), "WorkerUpdate.moments['exp_avg/emb.weight']",
            "duplicate tensor name", update=True)

    def unnamed(m):
        m.params[0].name = ""
    _raises(_tamper_state(unnamed), "GlobalState.params", "without a name")


def test_negative_counters():
    _raises(_tamper_update(lambda m: setattr(m, "tokens", -1)), "WorkerUpdate.tokens=-1", update=True)
    _raises(_tamper_state(lambda m: setattr(m, "round", -2)), "GlobalState.round=-2")


def test_truncated_payload():
    data = encode_update(_update(), MID)
    for cut in (len(data) // 2, len(data) - 3, 5):
        msg = _raises(data[:cut], update=True)
        assert "not a lordo_fed.v1 message" in msg or "smaller than its declared size" in msg, msg
    big = encode_global_state(GlobalState(1, {"w": torch.randn(1000, generator=_gen())}), MID)
    _raises(big[:-100], "not a lordo_fed.v1 message", f"payload of {len(big) - 100} bytes")


def test_random_bytes():
    rng = random.Random(0)
    for n in (1, 7, 64, 1000, 100_000):
        for _ in range(20):
            blob = rng.randbytes(n)
            with pytest.raises(PayloadError):
                decode_global_state(blob, MID)
            with pytest.raises(PayloadError):
                decode_update(blob)


def test_not_bytes():
    with pytest.raises(TypeError):
        decode_update("lordo")  # type: ignore[arg-type]


def test_memoryview_and_bytearray_accepted():
    data = encode_update(_update(), MID)
    assert decode_update(bytearray(data)).tokens == decode_update(memoryview(data)).tokens == 4096


def test_no_check_before_size_reads_data(monkeypatch):
    """Metadata is validated for every tensor before any tensor's data is touched."""
    built = []
    real = codec._build_tensor
    monkeypatch.setattr(codec, "_build_tensor", lambda *a: built.append(a[0].name) or real(*a))

    def bad_last(m):
        m.moments[-1].nbytes += 4
    _raises(_tamper_state(bad_last), "GlobalState.moments")
    assert built == []
