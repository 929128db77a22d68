"""The two SparseLoCo pieces of a compressed round, against hand-computed values: the decaying
error feedback on the worker (e ← β·e + Δ) and the contributor mean on the server (each index
averaged over the workers that sent it), as the Flower strategy tests do with mocked replies."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lordo_fed.rounds.sparse import contributor_mean
from lordo_fed.optim.projection import projection_side
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.wire.compress import CodecSpec, ErrorFeedback, decode


def test_decaying_error_feedback_by_hand():
    """top-1 of 4 values with fp32 values (lossless on what it keeps), β = 0.5:
    round 1 sends 4 of x = [1, 2, 3, 4] and keeps e = [1, 2, 3, 0];
    round 2: e = 0.5·e + [1, 1, 1, 1] = [1.5, 2, 2.5, 1]: sends 2.5, keeps [1.5, 2, 0, 1]."""
    ef = ErrorFeedback(decay=0.5)
    spec = CodecSpec("topk", chunk=4, density=0.25)
    sent, _ = ef.compress("w", torch.tensor([1.0, 2.0, 3.0, 4.0]), spec)
    assert decode(sent).tolist() == [0.0, 0.0, 0.0, 4.0]
    assert ef.residual["w"].tolist() == [1.0, 2.0, 3.0, 0.0]
    sent, _ = ef.compress("w", torch.ones(4), spec)
    assert decode(sent).tolist() == [0.0, 0.0, 2.5, 0.0]
    assert ef.residual["w"].tolist() == [1.5, 2.0, 0.0, 1.0]
    classic = ErrorFeedback()  # β = 1: Σ sent + e = Σ x
    total = torch.zeros(4)
    for x in (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4)):
        total += decode(classic.compress("w", x, spec)[0])
    assert (total + classic.residual["w"]).tolist() == [2.0, 3.0, 4.0, 5.0]


def test_contributor_mean_by_hand():
    """Three workers, weights 0.5 / 0.25 / 0.25: index 0 sent by all, 1 by worker 0 only, 2 by
    workers 1 and 2, 3 by none."""
    deltas = [torch.tensor([2.0, 4.0, 0.0, 0.0]), torch.tensor([4.0, 0.0, 8.0, 0.0]),
              torch.tensor([8.0, 0.0, 4.0, 0.0])]
    weights = [0.5, 0.25, 0.25]
    total = sum(w * d for w, d in zip(weights, deltas))
    support = sum(w * (d != 0).float() for w, d in zip(weights, deltas))
    out = contributor_mean(total, support)
    assert out.tolist() == [4.0, 4.0, 6.0, 0.0]  # (1 + 1 + 2) / 1, 2 / 0.5, (2 + 1) / 0.5, nothing sent
    assert total.tolist() == [4.0, 2.0, 3.0, 0.0]  # 'all': index 1 shrunk to its sender's weight


@pytest.mark.parametrize("mean", ["all", "contributors"])
def test_the_aggregator_averages_top_k_over_the_senders(mean):
    """Mocked replies of two workers (tokens 300 and 100) through the real aggregator, `topk2bit`
    preset, outer average lr 1: a block matrix (top-k on the wire) gets the senders' mean with
    'contributors', the weighted sum over all with 'all'; the embedding (int8 on the wire, dense)
    is the plain weighted mean either way."""
    from lordo_fed.rounds.aggregator import Aggregator
    from lordo_fed.rounds.outer import Average
    from lordo_fed.wire.messages import WorkerUpdate
    from lordo_fed.wire.payload import resolve_payload

    params = {"layers.0.wq.weight": torch.zeros(1, 4), "embed.weight": torch.zeros(1, 4)}
    agg = Aggregator(params, {}, RoundConfig(local_steps=1, sync_exp_avg_every=0, sync_exp_avg_sq_every=0,
                                             sparse_mean=mean),
                     Average(), None, payload=resolve_payload("topk2bit").codecs)
    wq = [torch.tensor([[4.0, 8.0, 0.0, 0.0]]), torch.tensor([[8.0, 0.0, 4.0, 0.0]])]
    embed = [torch.tensor([[4.0, 8.0, 0.0, 0.0]]), torch.tensor([[8.0, 0.0, 4.0, 0.0]])]
    replies = [WorkerUpdate(worker_id=m, round=1, delta={"layers.0.wq.weight": wq[m], "embed.weight": embed[m]},
                            moments={}, tokens=tokens, opt_step=1) for m, tokens in enumerate((300, 100))]
    result = agg.aggregate(replies)
    assert result.accepted == [0, 1]
    # θ ← θ − Δ̄ (Δ = θ_ref − θ_local)
    expected = [5.0, 8.0, 4.0, 0.0] if mean == "contributors" else [5.0, 6.0, 1.0, 0.0]
    assert (-agg.params["layers.0.wq.weight"]).tolist() == [expected]
    assert (-agg.params["embed.weight"]).tolist() == [[5.0, 6.0, 1.0, 0.0]]
    # whatever the mean: of the 3 indices of the top-k matrix sent, one was sent by both workers (the
    # embedding, dense int8 on the wire, is not counted)
    assert result.metrics["sparse_support_shared"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("mean", ["all", "contributors"])
def test_median_clipping_by_hand(mean):
    """`clip_median`: three workers with equal tokens send Δ of norms 1, 2 and 6 on disjoint indices
    of a top-k block matrix; the round's median is 2, so the third counts as [0, 0, 2, 0]: θ moves by
    the mean of [1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0] ('all': 1/3 each; 'contributors': each
    index is its one sender's, clipped). Without clipping the third index would move by 6 (2)."""
    from lordo_fed.rounds.aggregator import Aggregator
    from lordo_fed.rounds.outer import Average
    from lordo_fed.wire.messages import WorkerUpdate
    from lordo_fed.wire.payload import resolve_payload

    name = "layers.0.wq.weight"
    deltas = [torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 2.0, 0.0, 0.0]]),
              torch.tensor([[0.0, 0.0, 6.0, 0.0]])]
    replies = [WorkerUpdate(worker_id=m, round=1, delta={name: d}, moments={}, tokens=100, opt_step=1)
               for m, d in enumerate(deltas)]
    moved = {}
    for clip, screened in ((False, False), (True, False), (True, True)):  # screened: the norms computed for it
        agg = Aggregator({name: torch.zeros(1, 4)}, {}, RoundConfig(local_steps=1, sync_exp_avg_every=0,
                                                                 sync_exp_avg_sq_every=0, sparse_mean=mean,
                                                                 clip_median=clip),
                         Average(), None, payload=resolve_payload("topk2bit").codecs)
        result = agg.aggregate(replies, screened=screened)
        assert result.accepted == [0, 1, 2]
        moved[clip, screened] = (-agg.params[name])[0].tolist()
        assert result.metrics.get("clients_clipped") == (1.0 if clip else None)
        assert result.metrics["sparse_support_shared"] == 0.0  # disjoint supports
    assert moved[True, True] == moved[True, False]
    moved = {clip: m for (clip, screened), m in moved.items() if not screened}
    scale = 1.0 if mean == "contributors" else 1 / 3
    assert moved[True] == pytest.approx([scale * 1, scale * 2, scale * 2, 0.0])
    assert moved[False] == pytest.approx([scale * 1, scale * 2, scale * 6, 0.0])


def test_median_clipping_refuses_refs_without_their_norm():
    """A caller that builds refs without screening's norms gets a clear error, and θ stays as it was."""
    from lordo_fed.rounds.aggregator import Aggregator
    from lordo_fed.rounds.outer import Average
    from lordo_fed.rounds.screening import ReplyRef
    from lordo_fed.wire.messages import WorkerUpdate

    agg = Aggregator({"w": torch.zeros(4)}, {}, RoundConfig(local_steps=1, sync_exp_avg_every=0, sync_exp_avg_sq_every=0,
                                                           clip_median=True), Average(), None)
    refs = [ReplyRef.of(WorkerUpdate(worker_id=m, round=1, delta={"w": torch.ones(4)}, moments={}, tokens=1,
                                     opt_step=1)) for m in range(2)]
    with pytest.raises(ValueError, match=r"round 1: median clipping needs every reply's \|\|Δ\|\|"):
        agg.aggregate_refs(refs)
    assert agg.params["w"].tolist() == [0.0] * 4 and agg.round == 1


def test_median_clipping_is_for_synchronous_rounds():
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.rounds.outer import OuterConfig

    with pytest.raises(ValueError, match="rounds.clip_median=True with method 'heloco'"):
        resolve_method("heloco", InnerConfig(), RoundConfig(clip_median=True), OuterConfig())
    assert resolve_method("diloco", InnerConfig(), RoundConfig(clip_median=True), OuterConfig()).rounds.clip_median


@pytest.mark.parametrize("field,value,message", [
    ("wire_ef_decay", 1.5, "rounds.wire_ef_decay=1.5: expected a number in [0, 1]"),
    ("wire_ef_decay", True, "rounds.wire_ef_decay=True"),
    ("sparse_mean", "median", "rounds.sparse_mean='median': expected one of ('all', 'contributors')"),
    ("clip_median", "yes", "rounds.clip_median='yes': expected true or false"),
])
def test_bad_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(RoundConfig(), **{field: value}).validate()


def test_a_worker_reports_what_its_wire_residual_holds(tmp_path):
    """`wire_ef_ratio` = ‖e‖/‖Δ‖ after the send, checked against the uplink's own buffers: in (0, 1]
    on the first round of top-k (what was not sent of Δ), above 1 later (the residual grows
    past one round's Δ), absent without a compressed payload."""
    from lordo_fed.rounds.uplink import Uplink
    from lordo_fed.wire.payload import resolve_payload

    up = Uplink(resolve_payload("topk2bit").codecs)
    g = torch.Generator().manual_seed(0)
    deltas = [{"layers.0.wq.weight": torch.randn(64, 64, generator=g)} for _ in range(3)]
    ratios = []
    for d in deltas:
        norm = float(d["layers.0.wq.weight"].norm())
        up.compress_delta({k: v.clone() for k, v in d.items()}, [], lambda n: None)
        ratios.append(up.ef_ratio)
        assert up.ef_ratio == pytest.approx(float(up.ef.residual["layers.0.wq.weight"].norm()) / norm, rel=1e-5)
    assert 0 < ratios[0] <= 1 < ratios[2]
    assert Uplink(None).ef_ratio is None


# ----------------------------------------------------------------------------- bases fitted from the downlink
def downlink_bases_run(tmp_path, payload="topk2bit-both-wide", **rounds):
    from lordo_fed.data import load_dataset
    from lordo_fed.rounds.build import build_run
    from tests.unit.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, workers=3, payload_dtype=payload,
                      rounds=RoundConfig(local_steps=2, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, **rounds))
    cfg.inner.init_projection = "random"
    data = load_dataset(cfg.data, 3)
    torch.manual_seed(0)
    run = build_run(cfg, "lordo_global", data.vocab_size)
    workers = [run.worker(m, data.train_shards[m], 12) for m in range(3)]
    return run, workers, run.aggregator()


@pytest.mark.parametrize("overlap", [0, 1])
def test_workers_fit_the_bases_to_the_downlink_and_agree(tmp_path, overlap):
    """`bases_from='downlink'`: from round 2 the state carries no bases (nothing dense down but round 1's),
    the server fits none, and every worker's basis for each low-rank matrix is the one fitted, with
    the server's method, to the decoded change of θ_c the state carried (the oracle: the state's
    change decoded here and fitted alone), the same in every worker; a worker that missed a round
    and is sent θ_c whole takes round 1's bases with it and fits the next change again (round 4).
    Overlapped rounds (τ = 1, every worker in every round) fit them when they merge the state."""
    from lordo_fed.optim.projection import get_projection_method
    from lordo_fed.rounds.bases import fit_projections
    from lordo_fed.trainer.run import as_received
    from lordo_fed.wire.compress import decoded

    run, workers, agg = downlink_bases_run(tmp_path, bases_from="downlink", overlap_delay=overlap)
    method = get_projection_method("svd")
    first = dict(agg.projections)
    assert first and set(first) == set(run.ranks)
    for r in range(1, 5):
        state = agg.global_state()
        assert bool(state.projections) == (r == 1) and state.params_delta == (r > 1)
        active = workers if r != 2 or overlap else workers[:2]  # worker 2 misses round 2
        if r == 3 and not overlap:
            updates = [w.train_round(state) for w in workers[:2]] + [workers[2].train_round(agg.resync_state())]
        else:
            updates = [w.train_round(state) for w in active]
        if r > 1:
            change = {n: t for n, t in decoded(state.params).items() if n in run.ranks}
            expected = fit_projections(change, run.ranks, method, seed=7919 * (r - 1))
            for w in (active if r != 3 or overlap else workers[:2]):  # round 3: worker 2 got θ_c whole, no change
                for n, stored in expected.items():
                    basis = method.basis(stored, tuple(w.params[n].shape), projection_side(w.params[n].shape))
                    assert torch.equal(w.optimizer.basis(w.params[n]), basis), (r, w.worker_id, n)
        agg.aggregate([as_received(u) for u in updates])
        assert all(torch.equal(agg.projections[n], first[n]) for n in first)  # the server never refits


@pytest.mark.parametrize("overrides,payload,message", [
    (dict(sync_exp_avg_every=1), "topk2bit-both-wide", "rounds.bases_from='downlink' with averaged states"),
    (dict(), "fp32", "rounds.bases_from='downlink' with payload_dtype='fp32'"),
    (dict(), "lowrank+topk2bit-wide", "rounds.bases_from='downlink' with payload_dtype='lowrank+topk2bit-wide'"),
])
def test_bases_from_the_downlink_needs_a_compressed_downlink_and_local_moments(tmp_path, overrides, payload, message):
    from lordo_fed.rounds.build import build_run
    from tests.unit.test_trainer import tiny_config

    rounds = dict(local_steps=2, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, bases_from="downlink")
    rounds.update(overrides)
    cfg = tiny_config(tmp_path, workers=2, payload_dtype=payload, rounds=RoundConfig(**rounds))
    with pytest.raises(ValueError, match=re.escape(message)):
        build_run(cfg, "lordo_global", 256).aggregator()


def test_bases_from_the_downlink_is_lordo_globals():
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.rounds.outer import OuterConfig

    rounds = RoundConfig(sync_exp_avg_every=0, sync_exp_avg_sq_every=0, bases_from="downlink")
    with pytest.raises(ValueError, match="rounds.bases_from='downlink' with method 'diloco'"):
        resolve_method("diloco", InnerConfig(), rounds, OuterConfig())


def test_a_top_k_reply_kept_sparse_counts_its_senders_as_its_dense_decode():
    """`add_sent` on three replies' top-k Δ kept sparse (`SparseValues`) against the same on their dense
    decodes, the simple path: the same counts (0, 1, 2 = more) and the same contributor-mean normaliser, bit
    for bit, with supports that overlap, a zero among the kept values and a tail chunk; `support_overlap`
    against the share counted by hand from the decodes."""
    from lordo_fed.rounds.sparse import add_sent, support_overlap
    from lordo_fed.wire.compress import SparseValues, decode_sparse, encode

    g = torch.Generator().manual_seed(5)
    spec = CodecSpec("topk", bits=2, chunk=256, density=0.1, levels="sign", index_coding="rice")
    common = torch.randn(70, 11, generator=g)  # shared large entries: the supports overlap
    dense, sparse = [], []
    for m in range(3):
        x = common + 0.7 * torch.randn(70, 11, generator=g)
        x[0, :40] = 0.0  # the first chunk keeps zeros
        enc = encode(x, spec)
        dense.append(decode(enc).view(x.shape))
        sparse.append(decode_sparse(enc))
        assert isinstance(sparse[-1], SparseValues)
    weights = (0.5, 0.3141592653, 1 / 3)
    got = {"senders": {"w": None}, "support": {"w": None}}
    want = {"senders": {"w": None}, "support": {"w": None}}
    for w, s, d in zip(weights, sparse, dense):
        add_sent(got["senders"], got["support"], "w", s, w)
        add_sent(want["senders"], want["support"], "w", d, w)
    assert torch.equal(got["senders"]["w"], want["senders"]["w"])
    assert torch.equal(got["support"]["w"], want["support"]["w"])
    count = sum((d != 0).int() for d in dense)
    assert torch.equal(got["senders"]["w"], count.clamp_max(2).to(torch.uint8))
    shared = int((count > 1).sum()) / int((count > 0).sum())
    assert 0.1 < shared < 0.9  # the case tests overlap, not disjoint or equal supports
    assert support_overlap(got["senders"]) == {"sparse_support_shared": pytest.approx(shared, abs=0)}


def test_error_feedback_scaled_by_the_lrs_fall_by_hand():
    """`rounds.wire_ef_lr_scale`: e ← β·s·e + Δ, s = min(1, η_r/η_{r−1}) of the rounds' mean lr.

    WSD over 8 steps, K = 2, no warm-up, the last half decaying to 0: the steps' lr are 1, 1, 1, 1,
    0.75, 0.5, 0.25, 0; round 2 against 1: s = 1; round 3 (mean 0.625) against 2 (mean 1): 0.625;
    round 4 (0.125) against 3: 0.2. A warm-up's rise is not followed (s = 1, never above)."""
    from lordo_fed.optim.config import InnerConfig, lr_at

    inner = InnerConfig(lr=1.0, warmup_steps=0, decay_fraction=0.5, min_lr_ratio=0.0)
    rc = RoundConfig(local_steps=2)
    fall = [rc.lr_fall(r, lambda step: lr_at(step, 8, inner)) for r in (1, 2, 3, 4)]
    assert fall == pytest.approx([1.0, 1.0, 0.625, 0.2])
    warm = InnerConfig(lr=1.0, warmup_steps=4, decay_fraction=0.0)
    assert rc.lr_fall(2, lambda step: lr_at(step, 8, warm)) == 1.0  # mean 0.875 against 0.375: not scaled up
    ef = ErrorFeedback(decay=0.5)
    spec = CodecSpec("topk", chunk=4, density=0.25)
    ef.compress("w", torch.tensor([1.0, 2.0, 3.0, 4.0]), spec)  # sends 4, keeps [1, 2, 3, 0]
    sent, _ = ef.compress("w", torch.ones(4), spec, scale=0.625)  # e = 0.5·0.625·[1, 2, 3, 0] + 1 = [1.3125, 1.625, 1.9375, 1]
    assert decode(sent).tolist() == [0.0, 0.0, 1.9375, 0.0]
    assert ef.residual["w"].tolist() == [1.3125, 1.625, 0.0, 1.0]
