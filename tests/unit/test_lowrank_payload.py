"""Low-rank Δ on the wire (lordo_fed.wire.lowrank, the `lowrank+` payload presets): coordinates in
the round's shared basis plus a compressed residual, with error feedback; the wire field
WorkerUpdate.delta_coords; the server rebuilding Δ (hand-computed, Flower-strategy style); hostile
coordinates refused; the presets refused where no shared basis exists."""

from __future__ import annotations

import pytest
import torch

from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.outer import Average
from lordo_fed.optim.projection import SVDProjection, project, projection_side
from lordo_fed.wire.messages import WorkerUpdate
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.wire import lowrank
from lordo_fed.wire.compress import CodecSpec, Encoded, ErrorFeedback, decode, encode
from lordo_fed.wire.payload import PRESETS, resolve_payload

INT8 = CodecSpec("quant", bits=8, block=64)
TOPK2BIT = CodecSpec("topk", bits=2, chunk=256, density=0.03, levels="lut")


def orthonormal_basis(shape: tuple[int, int], rank: int, seed: int) -> torch.Tensor:
    """A random orthonormal basis in the canonical form of `shape`'s side (r x q right, p x r left)."""
    side = projection_side(shape)
    n = shape[1] if side == "right" else shape[0]
    q, _ = torch.linalg.qr(torch.randn(n, rank, generator=torch.Generator().manual_seed(seed)))
    return q.T.contiguous() if side == "right" else q


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)], ids=["left", "right"])
def test_split_and_join_rebuild_the_matrix(shape):
    """join(R, Ĉ) = target with the residual sent exactly; a matrix inside the subspace leaves
    only the coordinates' int8 rounding in the residual (under 1% of it)."""
    side = projection_side(shape)
    basis = orthonormal_basis(shape, 8, seed=1)
    target = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    coords, residual = lowrank.split(target, basis, side, INT8)
    assert isinstance(coords, Encoded) and coords.shape == tuple(project(target, basis, side).shape)
    rebuilt = lowrank.join(residual, decode(coords).view(coords.shape), basis, side)
    torch.testing.assert_close(rebuilt, target, rtol=0, atol=1e-5)

    inside = lowrank.lift(torch.randn(coords.shape, generator=torch.Generator().manual_seed(3)), basis, side)
    _, residual = lowrank.split(inside, basis, side, INT8)
    assert float(residual.norm()) < 0.01 * float(inside.norm())


def test_error_feedback_of_the_residual_loses_nothing():
    """Round after round, Σ (P·Ĉ + R̂) + e = r·x: coordinates and residual together carry all of x
    (the coordinates' rounding rides in R, what top-k leaves out of R stays in e). For an x mostly
    inside the basis (+ noise of 8% of its energy) the first round already delivers all but the
    noise (error 0.24 ||x||, measured), where top-k alone delivers under 15% of it."""
    shape = (64, 96)
    side = projection_side(shape)
    basis = orthonormal_basis(shape, 8, seed=4)
    g = torch.Generator().manual_seed(5)
    x = lowrank.lift(torch.randn(8, 96, generator=g), basis, side) + 0.1 * torch.randn(shape, generator=g)
    ef = ErrorFeedback()
    sent_total = torch.zeros(shape)
    for r in range(1, 11):
        enc, coords = ef.compress_split("w", x, TOPK2BIT, lambda t: lowrank.split(t, basis, side, INT8))
        assert coords.shape == (8, 96)
        sent = lowrank.join(decode(enc).view(shape), decode(coords).view(coords.shape), basis, side)
        sent_total += sent
        torch.testing.assert_close(sent_total + ef.residual["w"], r * x, rtol=0, atol=1e-4 * r)
        if r == 1:
            assert float((sent - x).norm()) < 0.3 * float(x.norm())
            alone = decode(encode(x, TOPK2BIT)).view(shape)
            assert float((alone - x).norm()) > 0.85 * float(x.norm())
    assert set(ef.state_dict()) == {"wire_ef/w"}


def test_coordinates_cross_the_wire_as_a_v2_field():
    """WorkerUpdate.delta_coords: both encoders write the same bytes, both decoders read the same
    tensors; a v1 payload carrying the field, and a coordinate codec the receiver did not
    configure, are refused with a reason."""
    from lordo_fed.wire.codec import PayloadError
    from lordo_fed.wire.decode import decode_update, decode_update_reference
    from lordo_fed.wire.encode import encode_update, encode_update_reference
    from lordo_fed.v1 import wire_pb2 as pb

    c = torch.randn(8, 48, generator=torch.Generator().manual_seed(6))
    residual = torch.randn(64, 48, generator=torch.Generator().manual_seed(7))
    update = WorkerUpdate(1, 2, {"w": encode(residual, TOPK2BIT)}, {}, 100, 7, {"train_loss": 1.5},
                          coords={"w": encode(c, INT8)})
    data = encode_update(update, "mid")
    assert data == encode_update_reference(update, "mid", deterministic=True)
    msg = pb.WorkerUpdate.FromString(data)
    assert msg.schema == "lordo_fed.v2.WorkerUpdate" and [t.name for t in msg.delta_coords] == ["w"]
    specs = [INT8, TOPK2BIT]
    for got in (decode_update(data, "mid", codecs=specs),
                decode_update_reference(data, "mid", codecs=frozenset(s.canonical() for s in specs))):
        assert torch.equal(got.coords["w"], decode(encode(c, INT8)).view(8, 48))
        assert torch.equal(got.delta["w"], decode(encode(residual, TOPK2BIT)).view(64, 48))

    raw = WorkerUpdate(1, 2, {"w": residual}, {}, 100, 7, coords={"w": c})
    assert pb.WorkerUpdate.FromString(encode_update(raw, "mid")).schema == "lordo_fed.v2.WorkerUpdate"
    v1 = pb.WorkerUpdate.FromString(encode_update(raw, "mid"))
    v1.schema = "lordo_fed.v1.WorkerUpdate"
    with pytest.raises(PayloadError, match="delta_coords in a lordo_fed.v1 payload"):
        decode_update(v1.SerializeToString(), "mid")
    with pytest.raises(PayloadError, match=r"WorkerUpdate.delta_coords\['w'\]: codec int8/64 is not one this receiver"):
        decode_update(data, "mid", codecs=[TOPK2BIT])


# ----------------------------------------------------------------------------- the server (hand-computed)
# θ0: w (3 x 2, a right basis: r x q = 1 x 2), b (2,); shared basis P = [[0.6, 0.8]] (rank 1).
# Reply 1 (100 tokens, weight 0.25): C = [[1], [0], [2]], residual w [[0, 0], [0.1, 0], [0, 0]], b [1, 0]
#   Δ1 w = C·P + R = [[0.6, 0.8], [0.1, 0], [1.2, 1.6]]
# Reply 2 (300 tokens, weight 0.75): C = [[0], [4], [0]], residual 0, b [0, 2]
#   Δ2 w = [[0, 0], [2.4, 3.2], [0, 0]]
# Δ̄ w = 0.25·Δ1 + 0.75·Δ2 = [[0.15, 0.2], [0.025 + 1.8, 2.4], [0.3, 0.4]] = [[0.15, 0.2], [1.825, 2.4], [0.3, 0.4]]
# Δ̄ b = [0.25, 1.5]; with Average(lr = 1): θ1 = θ0 − Δ̄.
def lowrank_server() -> Aggregator:
    theta = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "b": torch.tensor([0.5, -0.5])}
    agg = Aggregator(theta, {"w": 1}, RoundConfig(local_steps=4, sync_exp_avg_every=0, sync_exp_avg_sq_every=0),
                     Average(lr=1.0), SVDProjection(), payload=PRESETS["lowrank+topk2bit"])
    agg.projections = {"w": torch.tensor([[0.6, 0.8]])}
    return agg


def lowrank_reply(worker_id: int, tokens: int, coords, residual, b) -> WorkerUpdate:
    return WorkerUpdate(worker_id, 1, {"w": torch.tensor(residual), "b": torch.tensor(b)}, {}, tokens, 4,
                        coords={"w": torch.tensor(coords)})


def test_the_server_rebuilds_delta_from_coordinates_and_residual():
    agg = lowrank_server()
    replies = [lowrank_reply(1, 100, [[1.0], [0.0], [2.0]], [[0.0, 0.0], [0.1, 0.0], [0.0, 0.0]], [1.0, 0.0]),
               lowrank_reply(2, 300, [[0.0], [4.0], [0.0]], [[0.0, 0.0]] * 3, [0.0, 2.0])]
    result = agg.aggregate(replies)
    assert result.accepted == [1, 2]
    torch.testing.assert_close(agg.params["w"], torch.tensor([[0.85, 1.8], [1.175, 1.6], [4.7, 5.6]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(agg.params["b"], torch.tensor([0.25, -2.0]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("coords,reason", [
    ({}, r"low-rank coordinates differ: missing \['w'\]"),
    ({"w": [[1.0], [0.0], [2.0]], "b": [[1.0]]}, r"unexpected \['b'\]"),
    ({"w": [[1.0, 0.0], [0.0, 0.0], [2.0, 0.0]]}, r"coords/w: shape \(3, 2\), expected \(3, 1\)"),
    ({"w": [[1.0], [float("nan")], [2.0]]}, "coords/w: contains NaN or Inf"),
])
def test_hostile_coordinates_are_refused_with_a_reason(coords, reason):
    agg = lowrank_server()
    reply = WorkerUpdate(1, 1, {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, {}, 100, 4,
                         coords={k: torch.tensor(v) for k, v in coords.items()})
    problem = agg.check(reply)
    assert problem is not None and __import__("re").search(reason, problem), problem


def test_coordinates_are_refused_by_a_server_that_did_not_configure_them():
    theta = {"w": torch.zeros(3, 2)}
    agg = Aggregator(theta, {}, RoundConfig(local_steps=4, sync_exp_avg_every=0, sync_exp_avg_sq_every=0),
                     Average(lr=1.0), None)
    reply = WorkerUpdate(1, 1, {"w": torch.zeros(3, 2)}, {}, 100, 4, coords={"w": torch.zeros(3, 1)})
    assert "this run's payload sends no coordinates" in agg.check(reply)


def test_lowrank_presets_need_shared_bases():
    resolve_payload("lowrank+topk2bit").check_method(shared_bases=True)
    resolve_payload("topk2bit").check_method(shared_bases=False, asynchronous=True)
    with pytest.raises(ValueError, match="only LoRDO-Global"):
        resolve_payload("lowrank+topk2bit").check_method(shared_bases=False)
    with pytest.raises(ValueError, match="asynchronous rounds"):
        resolve_payload("lowrank+topk2bit").check_method(shared_bases=True, asynchronous=True)


def test_workers_send_coordinates_of_the_low_rank_matrices_and_learn(tmp_path):
    """The reference trainer with `lowrank+topk2bit` under LoRDO-Global: each reply carries int8
    coordinates for exactly the matrices with a shared basis, the loss goes down, and its bytes
    are far below fp32's; DiLoCo (no shared basis) refuses the preset by name."""
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.trainer.run import run_rounds
    from tests.unit.test_trainer import context, tiny_config

    import lordo_fed.rounds.worker as worker_module

    sent: list[WorkerUpdate] = []
    original = worker_module.Worker.train_round

    def spy(self, state, progress=None):
        update = original(self, state, progress)
        sent.append(update)
        return update

    runs = {}
    for dtype in ("fp32", "lowrank+topk2bit"):
        cfg = tiny_config(tmp_path / dtype, workers=2, total_steps=8, rounds=RoundConfig(local_steps=2),
                          payload_dtype=dtype)
        records: list = []
        worker_module.Worker.train_round = spy
        try:
            run_rounds(context(cfg, records), resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
        finally:
            worker_module.Worker.train_round = original
        runs[dtype] = records
    compressed = [u for u in sent if u.coords]
    assert compressed and all(set(u.coords) == set(compressed[0].coords) and
                              all(isinstance(c, Encoded) and c.spec == INT8 for c in u.coords.values())
                              for u in compressed)
    assert all("norm" not in n and "emb" not in n for n in compressed[0].coords)
    packed = runs["lowrank+topk2bit"]
    assert packed[-1]["val_loss"] < packed[0]["val_loss"]
    assert runs["fp32"][-1]["bytes_sent_per_worker"] > 3 * packed[-1]["bytes_sent_per_worker"]

    cfg = tiny_config(tmp_path / "diloco", workers=2, total_steps=4, rounds=RoundConfig(local_steps=2),
                      payload_dtype="lowrank+topk2bit")
    with pytest.raises(ValueError, match="only LoRDO-Global"):
        run_rounds(context(cfg, []), resolve_method("diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer))
