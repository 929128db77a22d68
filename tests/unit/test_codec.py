"""lordo_fed.wire.codec, .encode, .decode and .protowire: round trips, sizes, and every refusal of a bad payload."""

from __future__ import annotations

import dataclasses
import io
import mmap
import random
import struct

import numpy as np
import pytest
import torch

from lordo_fed.wire import codec
from lordo_fed.wire import decode as wire_decode
from lordo_fed.wire import encode as wire_encode
from lordo_fed.wire.codec import PAYLOAD_DTYPES, SCHEMA, PayloadError, model_id, payload_nbytes, tensors_nbytes
from lordo_fed.wire.decode import (decode_global_state, decode_global_state_reference, decode_update,
                                   decode_update_reference, mapped_payload)
from lordo_fed.wire.encode import (StreamingEncode, encode_global_state, encode_global_state_into,
                                   encode_global_state_reference, encode_into, encode_update, encode_update_into,
                                   encode_update_reference, encoded_size)
from lordo_fed.wire.protowire import read_varint, varint
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
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
    assert isinstance(data, memoryview) and not data.readonly and data.format == "B"  # a buffer of its own
    assert payload_nbytes(data) == len(data)
    got = decode_global_state(data, expected_model_id=MID)
    assert (got.round, got.opt_step, got.local_steps) == (3, 96, 0)
    assert decode_global_state(encode_global_state(dataclasses.replace(s, local_steps=7), MID, payload_dtype),
                               expected_model_id=MID).local_steps == 7
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
    from lordo_fed.optim.projection import SVDProjection

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
    data = _tamper_state(lambda m: setattr(m, "schema", "lordo_fed.v3.GlobalState"))
    _raises(data, "'lordo_fed.v3.GlobalState' received", "expected 'lordo_fed.v1.GlobalState' (or "
            "'lordo_fed.v2.GlobalState' with compressed tensors)")
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
    _raises(_tamper_state(lambda m: setattr(m, "local_steps", -3)), "GlobalState.local_steps=-3")


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
    real = wire_decode._build_tensor
    monkeypatch.setattr(wire_decode, "_build_tensor", lambda *a: built.append(a[0].name) or real(*a))

    def bad_last(m):
        m.moments[-1].nbytes += 4
    _raises(_tamper_state(bad_last), "GlobalState.moments")
    assert built == []


# --- the direct encoder and the in-place decoder against the protobuf path -------------------
#
# `encode_*` write the wire format themselves and `decode_*` read it in place; the protobuf
# message path they replace is kept as `encode.encode_*_reference` / `decode.decode_*_reference`
# and is the oracle here: same bytes out, same tensors or the same refusal back.


def _wire_case(name: str):
    """(message, model_id) of a named encoder case."""
    g = _gen(11)
    if name == "state":
        return _state(), MID
    if name == "update":
        return _update(), MID
    if name == "empty_state":
        return GlobalState(round=0, params={}), ""
    if name == "empty_update":
        return WorkerUpdate(worker_id=0, round=0, delta={}, moments={}, tokens=0, opt_step=0), ""
    if name == "scalars_and_empties":
        return WorkerUpdate(3, 1, {"s": torch.tensor(2.5), "e": torch.zeros(0), "e2": torch.zeros(4, 0, 2),
                                   "i0": torch.tensor(7), "ie": torch.zeros(0, dtype=torch.int32)},
                            {"exp_avg/s": torch.tensor(-0.0)}, 1, 1, {"only": 1.0}), MID
    if name == "integers":
        return GlobalState(round=1, params={"w": torch.randn(4, 4, generator=g)},
                           projections={"w": torch.tensor([0, 3, 2 ** 40 + 1, -7, 2 ** 63 - 1, -2 ** 63]),
                                        "v": torch.tensor([[3, -4], [2 ** 31 - 1, -2 ** 31]], dtype=torch.int32),
                                        "basis": torch.randn(2, 4, generator=g)}), MID
    if name == "input_dtypes":
        base = torch.randn(6, 5, generator=g)
        return WorkerUpdate(0, 1, {"f64": base.double() * 1e-3, "f16": base.half(), "b16": base.bfloat16(),
                                   "t": base.T, "slice": base[::2, 1::2], "grad": base.clone().requires_grad_(True),
                                   "expanded": torch.randn(3, 1, generator=g).expand(3, 4)},
                            {}, 1, 1), MID
    if name == "specials":
        x = torch.tensor([0.0, -0.0, 1e-45, 1e-40, -3.4028235e38, float("inf"), float("-inf"), float("nan"),
                          1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 / 3])
        return WorkerUpdate(0, 1, {"x": x, "x64": x.double() + 2 ** -30}, {}, 1, 1, {"nan": float("nan")}), MID
    if name == "unicode_and_counters":
        return WorkerUpdate(worker_id=2 ** 40, round=-1, delta={"блок.0/вес": torch.randn(3, generator=g)},
                            moments={"exp_avg/😀": torch.randn(2, generator=g)}, tokens=2 ** 63 - 1,
                            opt_step=-(2 ** 63), metrics={"ünï": -0.0, 1: 2.0, "1": 3.0, "": float("inf"),
                                                          "b": 1e-300, "a": -1.5}), "模型"
    if name == "big":  # > 2^21 bytes: 4-byte length varints for the data and the Tensor
        return GlobalState(round=5, params={"big": torch.randn(3, 200_001, generator=g), "b": torch.randn(9, generator=g)},
                           projections={"big": torch.randn(2, 200_001, generator=g)}, opt_step=2 ** 35), MID
    raise KeyError(name)


WIRE_CASES = ("state", "update", "empty_state", "empty_update", "scalars_and_empties", "integers", "input_dtypes",
              "specials", "unicode_and_counters", "big")
_RANDOM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def _random_tensors(rng: random.Random, g: torch.Generator, count: int, prefix: str) -> dict:
    out = {}
    for i in range(count):
        shape = [rng.choice((0, 1, 2, 3, 5, 7, 64)) for _ in range(rng.randint(0, 4))]
        dtype = rng.choice(_RANDOM_DTYPES)
        t = torch.randn(shape, generator=g) * 10 ** rng.uniform(-3, 3)
        t = t.round().to(dtype) if not dtype.is_floating_point else t.to(dtype)
        if t.dim() >= 2 and rng.random() < 0.5:
            t = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not C-contiguous
        out[f"{prefix}{i}.{rng.randint(0, 10 ** 6)}"] = t
    return out


def _random_case(seed: int):
    rng, g = random.Random(seed), _gen(seed)
    if seed % 2:
        return GlobalState(round=rng.randint(0, 10 ** 6), params=_random_tensors(rng, g, rng.randint(0, 6), "p"),
                           projections=_random_tensors(rng, g, rng.randint(0, 3), "q"),
                           moments=_random_tensors(rng, g, rng.randint(0, 4), "exp_avg/m"),
                           opt_step=rng.randint(0, 2 ** 40), local_steps=rng.choice((0, 1, rng.randint(2, 10 ** 4)))), \
            model_id(_params(seed))
    return WorkerUpdate(worker_id=rng.randint(0, 99), round=rng.randint(0, 999),
                        delta=_random_tensors(rng, g, rng.randint(0, 6), "d"),
                        moments=_random_tensors(rng, g, rng.randint(0, 4), "exp_avg_sq/m"),
                        tokens=rng.randint(0, 2 ** 50), opt_step=rng.randint(0, 999),
                        metrics={f"m{rng.randint(0, 99)}": rng.uniform(-1e9, 1e9) for _ in range(rng.randint(0, 5))}), \
        model_id(_params(seed))


def _encode(msg, mid, pd):
    return (encode_global_state if isinstance(msg, GlobalState) else encode_update)(msg, mid, pd)


def _reference(msg, mid, pd, deterministic=True) -> bytes:
    if isinstance(msg, GlobalState):
        return encode_global_state_reference(msg, mid, pd, deterministic)
    return encode_update_reference(msg, mid, pd, deterministic)


def _map_entries(data: bytes, start: int) -> list[bytes]:
    """The metrics map entries (field 9, the last field) of a WorkerUpdate from offset `start`."""
    view, entries = memoryview(data), []
    while start < len(data):
        assert data[start] == (9 << 3) | 2, data[start:]
        size, pos = read_varint(view, start + 1, len(data))
        entries.append(data[start:pos + size])
        start = pos + size
    return entries


def _check_against_reference(msg, mid, pd, tmp_path=None):
    """`msg` encoded every way equals SerializeToString's bytes (see the module docstring for
    the metrics map: same entries, byte for byte, written sorted by key)."""
    want = _reference(msg, mid, pd, deterministic=False)
    got = _encode(msg, mid, pd)
    assert isinstance(got, memoryview) and not got.readonly and got.format == "B"
    assert encoded_size(msg, mid, pd) == len(got) == len(want)
    if isinstance(msg, WorkerUpdate) and len({str(k) for k in msg.metrics}) > 1:
        head = len(_reference(dataclasses.replace(msg, metrics={}), mid, pd))
        assert bytes(got[:head]) == want[:head]
        entries = _map_entries(bytes(got), head)
        assert sorted(entries) == sorted(_map_entries(want, head))
        keys = [pb.WorkerUpdate.FromString(e).metrics for e in entries]
        assert [next(iter(k)).encode() for k in keys] == sorted(str(k).encode() for k in {str(k) for k in msg.metrics})
        assert pb.WorkerUpdate.FromString(bytes(got)) == pb.WorkerUpdate.FromString(want)
        want = bytes(got)  # from here on: every other way of encoding gives these bytes
    else:
        assert bytes(got) == want
    # into a caller's buffer (larger than needed: the tail is left alone) and into files
    buf = bytearray(b"\xab" * (len(want) + 7))
    assert encode_into(msg, mid, buf, pd) == len(want)
    assert bytes(buf[:len(want)]) == want and buf[len(want):] == b"\xab" * 7
    sink = io.BytesIO()
    assert encode_into(msg, mid, sink, pd) == len(want) and sink.getvalue() == want
    if tmp_path is not None:
        path = tmp_path / "payload.bin"
        with open(path, "wb") as f:
            encode_into(msg, mid, f, pd)
        assert path.read_bytes() == want
    return want


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
@pytest.mark.parametrize("case", WIRE_CASES)
def test_encoder_writes_the_bytes_protobuf_writes(case, payload_dtype, tmp_path):
    msg, mid = _wire_case(case)
    _check_against_reference(msg, mid, payload_dtype, tmp_path)


@pytest.mark.parametrize("seed", range(24))
def test_encoder_matches_protobuf_on_random_messages(seed):
    msg, mid = _random_case(seed)
    for pd in PAYLOAD_DTYPES:
        data = _check_against_reference(msg, mid, pd)
        decoded = (decode_global_state if isinstance(msg, GlobalState) else decode_update)(data, mid)
        assert _outcome_of(decoded) == _outcome_of(
            (decode_global_state_reference if isinstance(msg, GlobalState) else decode_update_reference)(data, mid))


def test_length_varints_of_every_width():
    """Tensor data of 0, 1, 127, 128, 2^14 - 1, 2^14, 2^21 - 1 bytes... and the enclosing Tensor
    lengths around the same boundaries (the header shifts them by a few bytes)."""
    for nbytes in (2, 126, 128, 130, 2 ** 14 - 10, 2 ** 14 - 2, 2 ** 14, 2 ** 14 + 2, 2 ** 21 - 20, 2 ** 21, 2 ** 21 + 2):
        u = WorkerUpdate(0, 1, {"w": torch.arange(nbytes // 2, dtype=torch.float32)}, {}, 1, 1)
        _check_against_reference(u, MID, "bf16")


def test_file_encoding_in_small_chunks(monkeypatch, tmp_path):
    """Through the staging buffer (casts, bf16, non-contiguous tensors) in 64-byte chunks: the
    chunks cover each tensor in C order."""
    monkeypatch.setattr(wire_encode, "_CHUNK_BYTES", 64)
    base = torch.randn(9, 7, 5, generator=_gen())
    u = WorkerUpdate(0, 1, {"nc": base.permute(2, 0, 1), "rows": base.transpose(0, 1)[:, 2:], "f64": base.double(),
                            "big_rows": torch.randn(3, 40, generator=_gen()).T, "i": torch.arange(100)},
                     {"exp_avg/x": base[:, :, 1]}, 1, 1, {"loss": 1.0})
    for pd in PAYLOAD_DTYPES:
        _check_against_reference(u, MID, pd, tmp_path)


def test_encode_into_refuses_bad_outputs():
    u = _update()
    size = encoded_size(u, MID)
    with pytest.raises(ValueError, match=f"smaller than the {size}-byte payload"):
        encode_update_into(u, MID, bytearray(size - 1))
    with pytest.raises(TypeError, match="read-only"):
        encode_update_into(u, MID, bytes(size))
    with pytest.raises(TypeError, match="writable buffer or a binary file"):
        encode_update_into(u, MID, "out.bin")
    with pytest.raises(TypeError, match="expected a WorkerUpdate"):
        encode_update_into(_state(), MID, bytearray(size))
    with pytest.raises(TypeError, match="expected a GlobalState"):
        encode_global_state_into(u, MID, bytearray(size))
    with pytest.raises(ValueError, match="out of the int64 range"):
        encode_update(WorkerUpdate(0, 2 ** 63, {}, {}, 1, 1), MID)
    with pytest.raises(ValueError):  # the protobuf path refuses it too
        encode_update_reference(WorkerUpdate(0, 2 ** 63, {}, {}, 1, 1), MID)
    # refused before anything is written
    buf = bytearray(size)
    with pytest.raises(ValueError, match="torch.bool"):
        encode_update_into(WorkerUpdate(0, 1, {"a": torch.ones(3), "m": torch.ones(2, dtype=torch.bool)}, {}, 1, 1),
                                 MID, buf)
    assert buf == bytearray(size)


def test_encode_into_a_numpy_array_and_a_writable_mmap(tmp_path):
    s = _state()
    want = _reference(s, MID, "bf16")
    arr = np.zeros(len(want) // 4 + 1, dtype=np.float32)  # any writable buffer, whatever its item type
    encode_global_state_into(s, MID, arr, "bf16")
    assert arr.tobytes()[:len(want)] == want
    path = tmp_path / "spool.bin"
    path.write_bytes(b"\0" * len(want))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        encode_global_state_into(s, MID, mm, "bf16")
        got = decode_global_state(mm, MID)
    assert path.read_bytes() == want
    _assert_same(got.params, s.params, True)


# --- decoding in place ---------------------------------------------------------------------------


def _outcome_of(msg) -> tuple:
    """Everything a decoded message carries, comparable with == (tensor bits included)."""
    def bits(t):
        return (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if isinstance(msg, GlobalState):
        return ("GlobalState", msg.round, msg.opt_step,
                *([(k, bits(v)) for k, v in d.items()] for d in (msg.params, msg.projections, msg.moments)))
    return ("WorkerUpdate", msg.worker_id, msg.round, msg.tokens, msg.opt_step, sorted(msg.metrics.items()),
            *([(k, bits(v)) for k, v in d.items()] for d in (msg.delta, msg.moments)))


def _decode_outcome(decode, data, mid) -> tuple:
    try:
        return ("ok", _outcome_of(decode(data, mid)))
    except PayloadError as exc:
        text = str(exc)
        if " message (" in text:  # the DecodeError detail differs (parsed from the skeleton)
            text = text[:text.index(" message (")]
        return ("refused", text)


def _same_decision(data, mid=None, update=True) -> tuple:
    new, ref = (decode_update, decode_update_reference) if update else \
        (decode_global_state, decode_global_state_reference)
    got = _decode_outcome(new, data, mid)
    assert got == _decode_outcome(ref, data, mid)
    return got


@pytest.fixture
def no_fallback(monkeypatch):
    """Fail if a decode leaves the in-place path for the protobuf one."""
    def fail(*args):
        raise AssertionError("decoded through the protobuf path")
    monkeypatch.setattr(wire_decode, "decode_update_reference", fail)
    monkeypatch.setattr(wire_decode, "decode_global_state_reference", fail)


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_decode_from_bytes_bytearray_memoryview_and_mmap(payload_dtype, tmp_path, no_fallback):
    s = _state()
    data = bytes(encode_global_state(s, MID, payload_dtype))
    path = tmp_path / "state.bin"
    path.write_bytes(data)
    floats = np.frombuffer(data + b"\0" * (-len(data) % 4), np.float32)  # a buffer of another item type
    inputs = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(b"xx" + data + b"yy")[2:-2],
              "memoryview of floats": memoryview(floats).cast("B")[:len(data)]}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        inputs["mmap"] = mm
        for how, payload in inputs.items():
            got = decode_global_state(payload, MID)
            _assert_same(got.params, s.params, payload_dtype == "bf16")
            _assert_same(got.projections, s.projections, False)
            _assert_same(got.moments, s.moments, payload_dtype == "bf16")
            got.params["emb.weight"].add_(1.0)  # owned and writable, whatever the input
        with pytest.raises(PayloadError, match="a GlobalState where a WorkerUpdate") as kept:
            decode_update(mm)  # the exception, kept with its traceback, must not pin the mapping
        del inputs
    assert mm.closed and kept.traceback  # closing did not raise BufferError: no view of mm was left
    grown = bytearray(data)
    with pytest.raises(PayloadError, match="model_id") as kept:
        decode_global_state(grown, "another model")
    grown.extend(b"\x00")  # resizable again: no view of it is left behind either


def test_mapped_payload(tmp_path, no_fallback):
    path = tmp_path / "upload.bin"
    u = _update()
    with open(path, "wb") as f:
        encode_update_into(u, MID, f, "bf16")
    with mapped_payload(path) as data:
        assert isinstance(data, mmap.mmap)
        got = decode_update(data, MID)
    assert data.closed
    _assert_same(got.delta, u.delta, True)
    path.write_bytes(b"")  # an empty upload: no mapping, refused as an empty message is
    with mapped_payload(path) as data, pytest.raises(PayloadError, match="no schema"):
        decode_update(data)


def test_decoded_tensors_do_not_alias_the_payload(no_fallback):
    data = encode_update(_update(), MID)
    got = decode_update(data, MID)
    data[:] = b"\0" * len(data)
    assert _outcome_of(got) == _outcome_of(decode_update(encode_update(_update(), MID), MID))


@pytest.mark.parametrize("payload_dtype", PAYLOAD_DTYPES)
def test_adopt_uses_a_writable_buffers_fp32_tensors_in_place(payload_dtype, tmp_path, no_fallback):
    """adopt=True: fp32 tensors of an aligned span in a writable buffer are views of it (the
    same values as a copying decode); bf16 wire data and read-only buffers (bytes, a read-only
    mmap) are copied as without it."""
    import ctypes

    s = _state()
    data = bytes(encode_global_state(s, MID, payload_dtype))
    buf = bytearray(data)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    got = decode_global_state(buf, MID, adopt=True)
    want = decode_global_state(data, MID)
    for group in ("params", "projections", "moments"):
        for name, t in getattr(want, group).items():
            mine = getattr(got, group)[name]
            assert torch.equal(mine, t), (group, name)
            aliased = start <= mine.data_ptr() < start + len(buf)
            fp32_on_wire = payload_dtype == "fp32" or group == "projections"
            if mine.numel() and fp32_on_wire:
                assert aliased, (group, name)
                mine.add_(0)  # usable in place (most such views are not 4-byte aligned)
            if not fp32_on_wire:
                assert not aliased, (group, name)
    assert any(start <= t.data_ptr() < start + len(buf) for t in got.projections.values())
    with pytest.raises(BufferError):
        buf.extend(b"\x00")  # pinned while the tensors live
    del got, mine  # the last tensor the loop looked at is a view too
    buf.extend(b"\x00")  # and free again once they are gone
    for readonly in (data,):
        copied = decode_global_state(readonly, MID, adopt=True)
        copied.params["emb.weight"].add_(1.0)  # owned and writable
    path = tmp_path / "state.bin"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        from_map = decode_global_state(mm, MID, adopt=True)
        del from_map
    assert mm.closed  # nothing kept a view of the read-only mapping


def test_adoptable_takes_a_download_buffer_and_nothing_read_only(tmp_path):
    """What a node hands to `adopt`: the data plane's download buffer (a writable memoryview of its
    own, `new_buffer`) and a bytearray are decoded in place; bytes, a read-only view and an mmap are
    copied from. (The benchmark harness once tested `isinstance(data, bytearray)` and so copied every
    download the product adopts.)"""
    from lordo_fed.wire.decode import adoptable
    from lordo_fed.wire.protowire import new_buffer

    data = bytes(encode_global_state(_state(), MID, "fp32"))
    download = new_buffer(len(data))
    download[:] = data
    assert adoptable(download) and adoptable(bytearray(data))
    assert not adoptable(data) and not adoptable(memoryview(data)) and not adoptable(memoryview(bytearray(data)).toreadonly())
    got = decode_global_state(download, MID, adopt=adoptable(download))
    base = np.frombuffer(download, dtype=np.uint8).ctypes.data
    emb = got.params["emb.weight"]
    assert base <= emb.data_ptr() < base + len(download)  # a view of the download, not a copy
    assert torch.equal(emb, decode_global_state(data, MID).params["emb.weight"])
    path = tmp_path / "state.bin"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert not adoptable(mm)


def test_new_buffer_holds_what_is_written_small_and_mapped():
    """`new_buffer`, the download's and the encoders' memory: a bytearray under a MiB, its own
    anonymous mapping from a MiB on; either way exactly `n` writable bytes that give back what was
    written, and a state decoded in place from a mapped one stays valid after the buffer's name is
    gone (the tensors keep the mapping alive)."""
    import gc

    from lordo_fed.wire.protowire import new_buffer

    rng = np.random.default_rng(0)
    for n in (0, 1, 1000, (1 << 20) - 1, 1 << 20, (3 << 20) + 7):
        buf = new_buffer(n)
        assert isinstance(buf, memoryview) and not buf.readonly and len(buf) == n and buf.format == "B"
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        buf[:] = data
        assert bytes(buf) == data
    big = _state()
    big.params["big"] = torch.randn(1 << 19)  # 2 MiB: a mapped buffer
    data = bytes(encode_global_state(big, MID, "fp32"))
    download = new_buffer(len(data))
    download[:] = data
    got = decode_global_state(download, MID, adopt=True)
    base = np.frombuffer(download, dtype=np.uint8).ctypes.data
    assert base <= got.params["big"].data_ptr() < base + len(download)  # adopted, not copied
    del download, base
    gc.collect()
    assert torch.equal(got.params["big"], big.params["big"])
    assert torch.equal(got.params["emb.weight"], big.params["emb.weight"])


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    key = varint((number << 3) | wire_type)
    return key + (varint(len(payload)) + payload if wire_type == 2 else payload)


def _tensor_bytes(*fields: bytes) -> bytes:
    return b"".join(fields)


_ONE = struct.pack("<f", 1.0)
_GOOD_TENSOR = (_field(1, 2, b"w"), _field(3, 0, b"\x01"), _field(4, 0, b"\x01"), _field(5, 0, b"\x04"),
                _field(6, 2, _ONE))


def _update_with(*tensor_bodies: bytes, extra: bytes = b"") -> bytes:
    header = pb.WorkerUpdate(schema=codec.UPDATE_SCHEMA, model_id=MID, round=1).SerializeToString()
    return header + b"".join(_field(7, 2, body) for body in tensor_bodies) + extra


WIRE_EDGE_CASES = {
    "plain": _update_with(b"".join(_GOOD_TENSOR)),
    "data twice, last wins": _update_with(b"".join(_GOOD_TENSOR) + _field(6, 2, struct.pack("<f", 2.0))),
    "data twice, last too long": _update_with(b"".join(_GOOD_TENSOR) + _field(6, 2, _ONE * 2)),
    "no data": _update_with(b"".join(_GOOD_TENSOR[:4])),
    "data first": _update_with(_GOOD_TENSOR[4] + b"".join(_GOOD_TENSOR[:4])),
    "unknown fields everywhere": _update_with(
        b"".join(_GOOD_TENSOR) + _field(7, 0, b"\x96\x01") + _field(99, 2, b"junk") + _field(12, 5, b"abcd")
        + _field(13, 1, b"12345678"), extra=_field(11, 2, b"x" * 300) + _field(2 ** 29 - 1, 0, b"\x00")),
    "data as varint": _update_with(b"".join(_GOOD_TENSOR[:4]) + _field(6, 0, b"\x05")),
    "data as varint and bytes": _update_with(b"".join(_GOOD_TENSOR) + _field(6, 0, b"\x05")),
    "shape as fixed64": _update_with(b"".join(_GOOD_TENSOR) + _field(2, 1, struct.pack("<d", 1.0))),
    "shape packed and unpacked": _update_with(
        _field(1, 2, b"w") + _field(2, 2, b"\x01\x02") + _field(2, 0, b"\x02") + b"".join(_GOOD_TENSOR[1:3])
        + _field(5, 0, b"\x10") + _field(6, 2, _ONE * 4)),
    "delta as varint": _update_with(extra=_field(7, 0, b"\x01")),
    "moments as fixed32": _update_with(b"".join(_GOOD_TENSOR), extra=_field(8, 5, b"\0\0\0\0")),
    "round as bytes": _update_with(extra=_field(3, 2, b"\x01")),
    "tensor of nothing": _update_with(b""),
    "enum beyond int32": _update_with(_field(1, 2, b"w") + _field(3, 0, varint(2 ** 32 + 1))
                                      + b"".join(_GOOD_TENSOR[2:])),
    "negative enum": _update_with(_field(1, 2, b"w") + _field(3, 0, varint(-1)) + b"".join(_GOOD_TENSOR[2:])),
    "invalid utf-8 name": _update_with(_field(1, 2, b"\xff") + b"".join(_GOOD_TENSOR[1:])),
    "invalid utf-8 schema": _update_with(extra=_field(1, 2, b"\xc3")),
    "metrics entry with an unknown field": _update_with(extra=_field(9, 2, _field(1, 2, b"a") + _field(2, 1, _ONE * 2)
                                                                     + _field(3, 0, b"\x01"))),
    "metrics entry key as varint": _update_with(extra=_field(9, 2, _field(1, 0, b"\x01"))),
    "metrics twice": _update_with(extra=_field(9, 2, _field(1, 2, b"a") + _field(2, 1, _ONE * 2))
                                  + _field(9, 2, _field(1, 2, b"a") + _field(2, 1, b"\0" * 8))),
    "counter twice, last wins": _update_with(extra=_field(3, 0, b"\x07") + _field(3, 0, b"\x09")),
    "11-byte varint": _update_with(extra=b"\x18" + b"\xff" * 10 + b"\x01"),
    "10-byte varint": _update_with(extra=b"\x18" + b"\xff" * 9 + b"\x7f"),
    "overlong key": _update_with(extra=b"\x98\x00\x05"),
    "overlong key of a tensor": _update_with(extra=b"\xba\x00" + varint(len(b"".join(_GOOD_TENSOR)))
                                             + b"".join(_GOOD_TENSOR)),
    "overlong length of data": _update_with(b"".join(_GOOD_TENSOR[:4]) + b"\x32\x84\x00" + _ONE),
    "6-byte key": _update_with(extra=b"\x98\x80\x80\x80\x80\x00\x05"),
    "field number 0": _update_with(extra=b"\x00\x01"),
    "field number 2^29": _update_with(extra=varint(2 ** 29 << 3) + b"\x01"),
    "group at the top": _update_with(extra=b"\x53\x08\x01\x54"),
    "group in a tensor": _update_with(b"".join(_GOOD_TENSOR) + b"\x53\x08\x01\x54"),
    "known field as group": _update_with(extra=b"\x1b\x1c"),
    "end group": _update_with(extra=b"\x1c"),
    "wire type 6": _update_with(extra=b"\x1e"),
    "tensor past the end": _update_with(extra=b"\x3a\x40" + b"".join(_GOOD_TENSOR)),
    "data past the tensor": _update_with(b"".join(_GOOD_TENSOR[:4]) + b"\x32\x08" + _ONE),
    "truncated fixed64": _update_with(extra=_field(13, 1, b"1234")),
    "truncated varint": _update_with(extra=b"\x18\x80"),
    "packed shape truncated": _update_with(_field(2, 2, b"\x81") + b"".join(_GOOD_TENSOR)),
    "many header fields": _update_with(b"".join(_GOOD_TENSOR), extra=_field(3, 0, b"\x01") * 5000),
    "many tensor fields": _update_with(b"".join(_GOOD_TENSOR) + _field(3, 0, b"\x01") * 100),
}


@pytest.mark.parametrize("case", sorted(WIRE_EDGE_CASES))
def test_wire_edge_cases_decide_as_protobuf_does(case):
    _same_decision(WIRE_EDGE_CASES[case])
    _same_decision(WIRE_EDGE_CASES[case].replace(codec.UPDATE_SCHEMA.encode(), codec.GLOBAL_STATE_SCHEMA.encode()),
                   update=False)


def test_plain_edge_cases_stay_on_the_in_place_path(no_fallback):
    """Unknown fields, repeated fields, wrong wire types, absent data: the scanner handles them
    (only irregular varints, groups and the like go to protobuf)."""
    for case in ("plain", "data twice, last wins", "no data", "data first", "unknown fields everywhere",
                 "data as varint", "shape as fixed64", "shape packed and unpacked", "metrics entry with an unknown field",
                 "invalid utf-8 name", "counter twice, last wins", "10-byte varint"):
        try:
            decode_update(WIRE_EDGE_CASES[case])
        except PayloadError:
            pass
    assert decode_update(WIRE_EDGE_CASES["data twice, last wins"]).delta["w"].item() == 2.0


def test_mutated_payloads_decide_as_protobuf_does():
    """Random byte flips, insertions, deletions and cuts of real payloads: the in-place decoder
    returns the same tensors or refuses with the same message as the protobuf path."""
    rng = random.Random(1)
    small = WorkerUpdate(1, 2, {"a": torch.randn(3, generator=_gen()), "i": torch.arange(2)},
                         {"exp_avg/a": torch.randn(3, generator=_gen())}, 5, 6, {"loss": 1.0})
    payloads = [(bytes(encode_update(_update(), MID, "bf16")), True), (bytes(encode_update(small, MID)), True),
                (bytes(encode_global_state(_state(), MID)), False)]
    seen = set()
    for base, update in payloads:
        for _ in range(400):
            data = bytearray(base)
            for _ in range(rng.choice((1, 1, 2, 3))):
                op, at = rng.random(), rng.randrange(len(data))
                if op < 0.5:
                    data[at] = rng.randrange(256) if rng.random() < 0.5 else data[at] ^ (1 << rng.randrange(8))
                elif op < 0.7:
                    data[at:at] = bytes([rng.randrange(256)])
                elif op < 0.9:
                    del data[at]
                else:
                    del data[at:]
                    break
            seen.add(_same_decision(bytes(data), MID if rng.random() < 0.5 else None, update)[0])
    assert seen == {"ok", "refused"}


def test_random_bytes_decide_as_protobuf_does():
    rng = random.Random(2)
    for n in (1, 3, 8, 40, 300):
        for _ in range(50):
            _same_decision(rng.randbytes(n))
            _same_decision(rng.randbytes(n), update=False)


def test_tampered_payloads_decide_as_protobuf_does():
    """The protobuf-level tampering of the refusal tests above, through both decoders."""
    def edits():
        yield lambda m: m.params[0].ClearField("data")
        yield lambda m: setattr(m.params[1], "data", m.params[1].data + b"\0" * 4)
        yield lambda m: setattr(m.params[2], "nbytes", 31)
        yield lambda m: setattr(m.params[0], "dtype", 99)
        yield lambda m: setattr(m.projections[0], "codec", pb.BF16_BITS)
        yield lambda m: setattr(m.projections[1], "name", "emb.weight")
        yield lambda m: setattr(m.params[0], "name", "")
        yield lambda m: setattr(m, "round", -2)
        yield lambda m: setattr(m, "model_id", "other")
        yield lambda m: m.params[0].shape.extend([2 ** 62])
    for edit in edits():
        for pd in PAYLOAD_DTYPES:
            outcome = _same_decision(_tamper_state(edit, pd), MID, update=False)
            assert outcome[0] == "refused"


def test_hostile_claims_allocate_nothing_in_place(monkeypatch, no_fallback):
    """A self-consistent 4 TiB claim carried by a few bytes is refused from the data span's
    length; nothing of the claimed size is allocated (numpy would raise MemoryError first)."""
    body = (_field(1, 2, b"w") + _field(2, 2, varint(2 ** 20) * 2) + _field(3, 0, b"\x01")
            + _field(4, 0, b"\x01") + _field(5, 0, varint(2 ** 42)) + _field(6, 2, _ONE))
    allocations = []
    real = np.frombuffer
    monkeypatch.setattr(np, "frombuffer", lambda *a, **k: allocations.append(a) or real(*a, **k))
    with pytest.raises(PayloadError, match=f"smaller than its declared size .4 bytes of data, nbytes={2 ** 42}"):
        decode_update(_update_with(body))
    assert allocations == []


def test_params_from_seed_round_trips_and_refuses_params_beside_it():
    """Round 1's state carries no θ (the seeded θ0 both sides build), only the flag."""
    state = GlobalState(round=1, params={}, projections={"w": torch.randn(3, 8)}, params_from_seed=True)
    data = encode_global_state(state, "m")
    assert bytes(data) == encode_global_state_reference(state, "m")
    for decode in (decode_global_state, decode_global_state_reference):
        back = decode(bytes(data), expected_model_id="m")
        assert back.params_from_seed and back.params == {} and torch.equal(back.projections["w"], state.projections["w"])
    assert not decode_global_state(encode_global_state(GlobalState(round=2, params={}), "m")).params_from_seed
    both = GlobalState(round=1, params={"w": torch.zeros(2)}, params_from_seed=True)
    with pytest.raises(codec.PayloadError, match="params_from_seed is set but 1 parameter tensors came too"):
        decode_global_state(encode_global_state(both, "m"))


@pytest.mark.parametrize("kind", ["update", "state"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streaming_encode_writes_the_encoders_bytes_in_order(dtype, kind):
    """StreamingEncode (a node uploads its reply while it is encoded; the server serves an announced
    round's state so) gives exactly encode_update's / encode_global_state's bytes; `wait_for(n)`
    returns only once the first n bytes are final, in every prefix, and `written` never runs ahead."""
    message, encoder = (_update(3), encode_update) if kind == "update" else (_state(3), encode_global_state)
    oracle = encoder(message, "m" * 16, dtype)
    stream = StreamingEncode(message, "m" * 16, dtype)
    assert len(stream.buffer) == len(oracle)
    for n in (1, 100, len(oracle) // 2, len(oracle)):
        stream.wait_for(n)
        written = stream.written
        assert written >= n and stream.buffer[:written] == oracle[:written]
    assert stream.result() == oracle and stream.seconds > 0 and stream.written == len(oracle)


def test_streaming_encode_reraises_an_encoding_error_in_the_waiter(monkeypatch):
    def broken(plan, out, progress=None):
        progress(10)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(wire_encode, "_write_plan_into", broken)
    stream = StreamingEncode(_update(1), "m" * 16)
    stream.wait_for(10)  # what was written is readable
    with pytest.raises(RuntimeError, match="disk on fire"):
        stream.wait_for(11)
    with pytest.raises(RuntimeError, match="disk on fire"):
        stream.result()
