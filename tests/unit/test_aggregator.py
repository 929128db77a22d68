"""The aggregator with mocked replies (Flower-strategy style).

Every reply is a hand-built `WorkerUpdate` with tiny tensors; the expected global state after a
round is worked out by hand and written below as literal numbers.

Shared set-up of the hand-computed rounds: θ0 = {w: [[1, 2], [3, 4]], b: [0.5, -0.5]} and
three round-1 replies with tokens 100 / 300 / 600, i.e. weights 0.1 / 0.3 / 0.6:

    Δ1 = w [[1, 0], [0, 1]]  b [ 1, 0]
    Δ2 = w [[2, 2], [0, 0]]  b [ 0, 1]
    Δ3 = w [[0, 1], [1, 3]]  b [-1, 2]
    Δ̄  = w [[0.1·1 + 0.3·2, 0.3·2 + 0.6·1], [0.6·1, 0.1·1 + 0.6·3]] = [[0.7, 1.2], [0.6, 1.9]]
         b [0.1 − 0.6, 0.3 + 0.6·2] = [-0.5, 1.5]

Round 2 (when there is one) has two replies of 200 tokens each whose mean is
Δ̄2 = w [[2, 1], [0, 1]], b [1, -1].
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_update
from lordo_fed.rounds.aggregator import Aggregator, RoundResult
from lordo_fed.rounds.bases import fit_projections, low_rank_shape, subspace_diagnostics
from lordo_fed.optim.bias import restep
from lordo_fed.rounds.outer import QHM, Average, Nesterov, OuterConfig
from lordo_fed.optim.projection import SVDProjection, projection_side
from lordo_fed.wire.messages import (
    DIAGNOSTIC_METRICS, MOMENT_KEYS, GlobalState, WorkerUpdate, moment_key, split_moment_key)
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.rounds.config import RoundConfig

AGG_LOGGER = "lordo_fed.rounds.aggregator"


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def theta0() -> dict[str, torch.Tensor]:
    return {"w": t([[1.0, 2.0], [3.0, 4.0]]), "b": t([0.5, -0.5])}


def upd(worker_id: int, tokens: int, w, b, round_: int = 1, moments: dict | None = None,
        opt_step: int = 4, metrics: dict | None = None) -> WorkerUpdate:
    return WorkerUpdate(worker_id=worker_id, round=round_, delta={"w": t(w), "b": t(b)},
                        moments=dict(moments or {}), tokens=tokens, opt_step=opt_step,
                        metrics=dict(metrics or {}))


def round1_replies() -> list[WorkerUpdate]:
    return [
        upd(1, 100, [[1.0, 0.0], [0.0, 1.0]], [1.0, 0.0], metrics={"train_loss": 2.0}),
        upd(2, 300, [[2.0, 2.0], [0.0, 0.0]], [0.0, 1.0], metrics={"train_loss": 3.0}),
        upd(3, 600, [[0.0, 1.0], [1.0, 3.0]], [-1.0, 2.0], metrics={"train_loss": 4.0}),
    ]


def round2_replies() -> list[WorkerUpdate]:
    return [
        upd(1, 200, [[1.0, 1.0], [1.0, 1.0]], [0.0, 0.0], round_=2),
        upd(2, 200, [[3.0, 1.0], [-1.0, 1.0]], [2.0, -2.0], round_=2),
    ]


def make_agg(outer=None, rounds: RoundConfig | None = None, **kw) -> Aggregator:
    return Aggregator(theta0(), {}, rounds or RoundConfig(local_steps=4, sync_exp_avg_every=0,
                                                         sync_exp_avg_sq_every=0),
                      outer or Average(lr=1.0), None, **kw)


def assert_params(actual: dict[str, torch.Tensor], expected: dict[str, list]) -> None:
    assert set(actual) == set(expected)
    for name, values in expected.items():
        torch.testing.assert_close(actual[name], t(values), rtol=0, atol=1e-6, msg=f"param {name}")


# ----------------------------------------------------------------------------- token weighting


def test_average_weights_replies_by_tokens():
    agg = make_agg()
    result = agg.aggregate(round1_replies())
    assert isinstance(result, RoundResult)
    assert result.accepted == [1, 2, 3] and result.rejected == {}
    # θ0 − Δ̄ = [[1 − 0.7, 2 − 1.2], [3 − 0.6, 4 − 1.9]], [0.5 + 0.5, −0.5 − 1.5]
    assert_params(agg.params, {"w": [[0.3, 0.8], [2.4, 2.1]], "b": [1.0, -2.0]})
    assert_params(result.state.params, {"w": [[0.3, 0.8], [2.4, 2.1]], "b": [1.0, -2.0]})
    assert agg.round == 2 and result.state.round == 2
    # metrics: token-weighted train loss 0.1·2 + 0.3·3 + 0.6·4 = 3.5; ||Δ̄|| = sqrt(0.49+1.44+0.36+3.61+0.25+2.25)
    assert result.metrics["train_loss"] == pytest.approx(3.5)
    assert result.metrics["tokens"] == 1000.0
    assert result.metrics["delta_norm"] == pytest.approx(8.4 ** 0.5, rel=1e-6)
    assert result.metrics["clients_ok"] == 3.0 and result.metrics["clients_dropped"] == 0.0


def test_delta_retention_is_the_average_s_length_against_the_replies():
    """`delta_retention` = ||Δ̄|| / Σ w_m ||Δ_m||, hand-computed: ||Δ1|| = √3, ||Δ2|| = 3, ||Δ3|| = 4
    (w and b together), so Σ w ||Δ|| = 0.1·√3 + 0.3·3 + 0.6·4 and ||Δ̄|| = √8.4; two equal replies
    keep all of it, two opposite ones none. Only with diagnostics on."""
    assert "delta_retention" not in make_agg().aggregate(round1_replies()).metrics
    result = make_agg(diagnostics=True).aggregate(round1_replies())
    assert result.metrics["delta_retention"] == pytest.approx(8.4 ** 0.5 / (0.1 * 3 ** 0.5 + 0.9 + 2.4), rel=1e-6)
    same = [upd(1, 100, [[1.0, 2.0], [0.0, 0.0]], [3.0, 0.0]), upd(2, 300, [[1.0, 2.0], [0.0, 0.0]], [3.0, 0.0])]
    assert make_agg(diagnostics=True).aggregate(same).metrics["delta_retention"] == pytest.approx(1.0)
    opposite = [upd(1, 100, [[1.0, 2.0], [0.0, 0.0]], [3.0, 0.0]), upd(2, 100, [[-1.0, -2.0], [0.0, 0.0]], [-3.0, 0.0])]
    assert make_agg(diagnostics=True).aggregate(opposite).metrics["delta_retention"] == pytest.approx(0.0, abs=1e-7)


def test_a_second_reply_for_the_same_worker_is_refused(caplog):
    """Worker 2 answers twice (two nodes with one partition-id): its shard counts once, the first
    reply is kept, and the round equals the three-reply round above."""
    caplog.set_level(logging.WARNING, logger=AGG_LOGGER)
    agg = make_agg()
    replies = round1_replies()
    replies.insert(2, upd(2, 900, [[50.0, 0.0], [0.0, 50.0]], [9.0, 9.0]))
    result = agg.aggregate(replies)
    assert result.accepted == [1, 2, 3] and "partition) 2 already answered" in result.rejected[2]
    assert "worker 2" in caplog.text
    assert_params(agg.params, {"w": [[0.3, 0.8], [2.4, 2.1]], "b": [1.0, -2.0]})
    assert result.metrics["tokens"] == 1000.0 and result.metrics["clients_dropped"] == 1.0


def test_average_is_not_the_unweighted_mean():
    """Same Δs with equal tokens give the plain mean: the weights really come from `tokens`."""
    agg = make_agg()
    replies = round1_replies()
    for r in replies:
        r.tokens = 50
    agg.aggregate(replies)
    # plain mean Δ: w [[1, 1], [1/3, 4/3]], b [0, 1]
    assert_params(agg.params, {"w": [[0.0, 1.0], [3.0 - 1.0 / 3.0, 4.0 - 4.0 / 3.0]], "b": [0.5, -1.5]})


def test_average_lr_scales_the_step():
    agg = make_agg(outer=Average(lr=0.5))
    agg.aggregate(round1_replies())
    # θ0 − 0.5 Δ̄
    assert_params(agg.params, {"w": [[0.65, 1.4], [2.7, 3.05]], "b": [0.75, -1.25]})


def test_the_late_rounds_take_the_late_outer_lr():
    """K = 4 and late rounds from step 8: rounds 1 and 2 step with lr 0.5, round 3 on with the late lr 2
    (the same replies each round: θ0 − 0.5 Δ̄ − 0.5 Δ̄ − 2 Δ̄ = θ0 − 3 Δ̄), and the lr is the round's alone."""
    rounds = RoundConfig(local_steps=4, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, late_from_step=8)
    agg = make_agg(outer=Average(lr=0.5), rounds=rounds, late_lr=2.0)
    assert [agg.outer_lr(r) for r in (1, 2, 3, 9)] == [0.5, 0.5, 2.0, 2.0]
    lrs = [agg.aggregate([dataclasses.replace(u, round=r) for u in round1_replies()]).metrics["outer_lr"]
           for r in (1, 2, 3)]
    assert lrs == [0.5, 0.5, 2.0]
    # Δ̄ = w [[0.7, 1.2], [0.6, 1.9]], b [-0.5, 1.5] (test_average_weights_replies_by_tokens)
    assert_params(agg.params, {"w": [[1 - 2.1, 2 - 3.6], [3 - 1.8, 4 - 5.7]], "b": [0.5 + 1.5, -0.5 - 4.5]})
    assert make_agg(outer=Average(lr=0.5), rounds=rounds).outer_lr(3) == 0.5  # no late lr: lr throughout


def test_qhm_two_rounds_by_hand():
    agg = make_agg(outer=QHM(lr=1.0, beta=0.5, nu=0.5))
    agg.aggregate(round1_replies())
    # m1 = 0.5 Δ̄1 ; θ1 = θ0 − (0.5 Δ̄1 + 0.5 m1) = θ0 − 0.75 Δ̄1
    assert_params(agg.params, {"w": [[0.475, 1.1], [2.55, 2.575]], "b": [0.875, -1.625]})
    agg.aggregate(round2_replies())
    # m2 = 0.5 m1 + 0.5 Δ̄2 = w [[1.175, 0.8], [0.15, 0.975]], b [0.375, -0.125]
    # θ2 = θ1 − 0.5 Δ̄2 − 0.5 m2
    assert_params(agg.params, {"w": [[-1.1125, 0.2], [2.475, 1.5875]], "b": [0.1875, -1.0625]})
    assert agg.round == 3


def test_nesterov_two_rounds_by_hand():
    agg = make_agg(outer=Nesterov(lr=0.7, momentum=0.9))
    agg.aggregate(round1_replies())
    # b1 = Δ̄1 ; θ1 = θ0 − 0.7 (Δ̄1 + 0.9 b1) = θ0 − 1.33 Δ̄1
    assert_params(agg.params, {"w": [[0.069, 0.404], [2.202, 1.473]], "b": [1.165, -2.495]})
    agg.aggregate(round2_replies())
    # b2 = 0.9 Δ̄1 + Δ̄2 = w [[2.63, 2.08], [0.54, 2.71]], b [0.55, 0.35]
    # θ2 = θ1 − 0.7 (Δ̄2 + 0.9 b2)
    assert_params(agg.params, {"w": [[-2.9879, -1.6064], [1.8618, -0.9343]], "b": [0.1185, -2.0155]})


def test_global_state_is_what_workers_get():
    agg = make_agg()
    state = agg.global_state()
    assert isinstance(state, GlobalState)
    assert state.round == 1 and state.opt_step == 0
    assert state.projections == {} and state.moments == {}
    assert_params(state.params, {"w": [[1.0, 2.0], [3.0, 4.0]], "b": [0.5, -0.5]})
    agg.aggregate(round1_replies())
    assert agg.global_state().opt_step == 4  # the replies' (shared) opt_step


def test_opt_step_is_the_maximum_over_accepted_replies():
    agg = make_agg()
    replies = round1_replies()
    for r, s in zip(replies, (7, 5, 9)):
        r.opt_step = s
    agg.aggregate(replies)
    assert agg.opt_step == 9 and agg.global_state().opt_step == 9


def test_moments_of_replies_with_fewer_steps_are_rescaled_before_averaging():
    """A reply with fewer optimizer steps (a worker that joined late or lost its state) is moved to
    the shared count before averaging: u·(1−β1^S)/(1−β1^k), v·(1−β2^S)/(1−β2^k), so each reply's
    bias-corrected moments are what is averaged (by hand, betas (0.9, 0.99))."""
    agg = make_agg(rounds=RoundConfig(4, 1, 1), betas=(0.9, 0.99))
    u0, v0, u1, v1 = t([1.0, 2.0]), t([0.5, 0.25]), t([3.0, -1.0]), t([0.125, 1.0])
    replies = [upd(0, 100, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], moments={"exp_avg/b": u0, "exp_avg_sq/b": v0},
                   opt_step=12),
               upd(1, 300, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], moments={"exp_avg/b": u1, "exp_avg_sq/b": v1},
                   opt_step=4)]
    agg.aggregate(replies)
    assert agg.opt_step == 12
    f1, f2 = (1 - 0.9**12) / (1 - 0.9**4), (1 - 0.99**12) / (1 - 0.99**4)
    torch.testing.assert_close(agg.moments["exp_avg/b"], 0.25 * u0 + 0.75 * f1 * u1)
    torch.testing.assert_close(agg.moments["exp_avg_sq/b"], 0.25 * v0 + 0.75 * f2 * v1)
    # the averaged v̂ at S = 12 is the token-weighted mean of each reply's own v̂
    torch.testing.assert_close(agg.moments["exp_avg_sq/b"] / (1 - 0.99**12),
                               0.25 * v0 / (1 - 0.99**12) + 0.75 * v1 / (1 - 0.99**4))


def test_params_are_copied_and_kept_fp32():
    start = {"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.bfloat16)}
    agg = Aggregator(start, {}, RoundConfig(), Average(), None)
    assert all(p.dtype == torch.float32 for p in agg.params.values())
    start["w"].fill_(5.0)
    assert torch.equal(agg.params["w"], torch.ones(2, 2))


# ----------------------------------------------------------------------------- moments and periods


def test_due_every_round_and_every_second_round():
    rc = RoundConfig(sync_exp_avg_every=1, sync_exp_avg_sq_every=2)
    assert rc.due(1) == ("exp_avg",)
    assert rc.due(2) == ("exp_avg", "exp_avg_sq")
    assert rc.due(3) == ("exp_avg",)


def test_due_desloc_periods_over_twelve_rounds():
    rc = RoundConfig(sync_exp_avg_every=3, sync_exp_avg_sq_every=6)
    got = {r: rc.due(r) for r in range(1, 13)}
    assert got == {
        1: (), 2: (), 3: ("exp_avg",), 4: (), 5: (), 6: ("exp_avg", "exp_avg_sq"),
        7: (), 8: (), 9: ("exp_avg",), 10: (), 11: (), 12: ("exp_avg", "exp_avg_sq"),
    }


def test_dense_sync_factor_stretches_the_periods_of_parameters_that_are_not_low_rank():
    rc = RoundConfig(sync_exp_avg_every=1, sync_exp_avg_sq_every=2, dense_sync_factor=3)
    assert [rc.due(r) for r in range(1, 7)] == [("exp_avg",), ("exp_avg", "exp_avg_sq")] * 3
    assert [rc.due(r, low_rank=False) for r in range(1, 7)] == [(), (), ("exp_avg",), (), (), ("exp_avg", "exp_avg_sq")]
    assert rc.periods(low_rank=False) == {"exp_avg": 3, "exp_avg_sq": 6}
    never = RoundConfig(dense_sync_factor=0)
    assert all(never.due(r, low_rank=False) == () and never.due(r) == MOMENT_KEYS for r in range(1, 9))
    with pytest.raises(ValueError, match=r"rounds.dense_sync_factor=-1: expected an integer >= 0"):
        RoundConfig(dense_sync_factor=-1).validate()


def test_a_dense_moment_is_accepted_only_in_its_own_rounds():
    """w is low-rank (rank 1), b is not; F = 2: b's first moment is due in even rounds only."""
    agg = Aggregator(theta0(), {"w": 1}, RoundConfig(local_steps=4, sync_exp_avg_sq_every=0, dense_sync_factor=2),
                     Average(), SVDProjection(), init_projection="random")
    low_u = torch.zeros(agg.expected_moment_shape("w"))  # rank-1 moment of the 2x2 w
    assert low_u.numel() == 2
    early = upd(1, 100, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], moments={"exp_avg/w": low_u, "exp_avg/b": t([0.1, 0.1])})
    assert "unexpected moment 'exp_avg/b'" in agg.check(early) and "due this round for 'b': []" in agg.check(early)
    early.moments.pop("exp_avg/b")
    assert agg.check(early) is None
    agg.aggregate([early])
    late = upd(1, 100, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], round_=2,
               moments={"exp_avg/w": low_u, "exp_avg/b": t([0.1, 0.1])})
    assert agg.check(late) is None


def test_due_zero_means_never():
    assert all(RoundConfig(sync_exp_avg_every=0, sync_exp_avg_sq_every=0).due(r) == () for r in range(1, 25))
    only_v = RoundConfig(sync_exp_avg_every=0, sync_exp_avg_sq_every=2)
    assert [only_v.due(r) for r in range(1, 5)] == [(), ("exp_avg_sq",), (), ("exp_avg_sq",)]


def test_round_config_validate():
    with pytest.raises(ValueError, match="local_steps"):
        RoundConfig(local_steps=0).validate()
    with pytest.raises(ValueError, match="sync_exp_avg_sq_every"):
        RoundConfig(sync_exp_avg_sq_every=-1).validate()


def moment_agg() -> Aggregator:
    return make_agg(rounds=RoundConfig(local_steps=4, sync_exp_avg_every=1, sync_exp_avg_sq_every=2))


def test_round1_averages_only_the_first_moment_and_rejects_a_second(caplog):
    caplog.set_level(logging.WARNING, logger=AGG_LOGGER)
    agg = moment_agg()
    a, b, c = round1_replies()
    a.moments = {"exp_avg/w": t([[1.0, 2.0], [3.0, 4.0]]), "exp_avg/b": t([1.0, 1.0])}
    b.moments = {"exp_avg/w": t([[5.0, 6.0], [7.0, 8.0]]), "exp_avg/b": t([-3.0, 5.0])}
    c.moments = {"exp_avg/w": t([[0.0, 0.0], [0.0, 0.0]]), "exp_avg_sq/w": t([[1.0, 1.0], [1.0, 1.0]])}
    c.tokens = 600
    result = agg.aggregate([a, b, c])
    assert result.accepted == [1, 2]
    assert set(result.rejected) == {3}
    assert "unexpected moment 'exp_avg_sq/w'" in result.rejected[3]
    assert "exp_avg" in result.rejected[3] and "due this round" in result.rejected[3]
    assert "worker 3" in caplog.text
    # weights 100/400 and 300/400: w 0.25·[[1,2],[3,4]] + 0.75·[[5,6],[7,8]]; b 0.25·[1,1] + 0.75·[-3,5]
    assert set(result.state.moments) == {"exp_avg/w", "exp_avg/b"}
    torch.testing.assert_close(result.state.moments["exp_avg/w"], t([[4.0, 5.0], [6.0, 7.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(result.state.moments["exp_avg/b"], t([-2.0, 4.0]), rtol=0, atol=1e-6)
    # θ from a and b only: Δ̄ = 0.25 Δ1 + 0.75 Δ2 = w [[1.75, 1.5], [0, 0.25]], b [0.25, 0.75]
    assert_params(agg.params, {"w": [[-0.75, 0.5], [3.0, 3.75]], "b": [0.25, -1.25]})


def test_round2_averages_both_moments_over_the_replies_that_carry_them():
    agg = moment_agg()
    agg.aggregate(round1_replies())  # no moments at all in round 1: accepted, nothing averaged
    assert agg.moments == {}
    a, b = round2_replies()
    a.tokens, b.tokens = 100, 300
    c = upd(3, 600, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], round_=2)
    a.moments = {"exp_avg/w": t([[1.0, 0.0], [0.0, 0.0]]), "exp_avg_sq/w": t([[1.0, 1.0], [1.0, 1.0]])}
    b.moments = {"exp_avg/w": t([[0.0, 1.0], [0.0, 0.0]]), "exp_avg_sq/w": t([[2.0, 2.0], [2.0, 6.0]])}
    c.moments = {"exp_avg/w": t([[0.0, 0.0], [1.0, 1.0]])}  # the second moment missing: still accepted
    result = agg.aggregate([a, b, c])
    assert result.accepted == [1, 2, 3] and result.rejected == {}
    assert set(result.state.moments) == {"exp_avg/w", "exp_avg_sq/w"}
    # exp_avg over all three (0.1, 0.3, 0.6); exp_avg_sq over a and b only (0.25, 0.75)
    torch.testing.assert_close(result.state.moments["exp_avg/w"], t([[0.1, 0.3], [0.6, 0.6]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(result.state.moments["exp_avg_sq/w"], t([[1.75, 1.75], [1.75, 4.75]]),
                               rtol=0, atol=1e-6)
    # round 3 (exp_avg only due): the previous round's moments are replaced, not kept
    d = upd(1, 10, [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], round_=3, moments={"exp_avg/b": t([2.0, 3.0])})
    result = agg.aggregate([d])
    assert set(result.state.moments) == {"exp_avg/b"}
    assert torch.equal(result.state.moments["exp_avg/b"], t([2.0, 3.0]))


def test_no_moments_are_accepted_when_none_are_due():
    agg = make_agg()  # periods (0, 0)
    a, b, c = round1_replies()
    a.moments = {"exp_avg/w": t([[1.0, 2.0], [3.0, 4.0]])}
    result = agg.aggregate([a, b, c])
    assert result.accepted == [2, 3]
    assert "unexpected moment 'exp_avg/w'" in result.rejected[1] and "[]" in result.rejected[1]


# ----------------------------------------------------------------------------- rejections


def _bad(kind: str) -> tuple[WorkerUpdate, list[str]]:
    """A reply from worker 7 with one problem, and substrings its rejection reason must contain."""
    good_w, good_b = [[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]
    u = upd(7, 500, good_w, good_b)
    if kind == "wrong_round":
        u.round = 2
        return u, ["round 2", "round 1"]
    if kind == "wrong_round_stale":
        u.round = 0
        return u, ["round 0", "round 1"]
    if kind == "nan":
        u.delta["w"][0, 1] = float("nan")
        return u, ["delta/w", "NaN or Inf"]
    if kind == "inf":
        u.delta["b"][1] = float("-inf")
        return u, ["delta/b", "NaN or Inf"]
    if kind == "wrong_shape":
        u.delta["w"] = torch.ones(3, 2)
        return u, ["delta/w", "shape (3, 2)", "(2, 2)"]
    if kind == "int_dtype":
        u.delta["b"] = torch.tensor([1, 1], dtype=torch.int64)
        return u, ["delta/b", "torch.int64", "floating-point"]
    if kind == "not_a_tensor":
        u.delta["b"] = [1.0, 1.0]
        return u, ["delta/b", "expected a tensor"]
    if kind == "missing_tensor":
        del u.delta["b"]
        return u, ["missing ['b']"]
    if kind == "extra_tensor":
        u.delta["c"] = t([1.0])
        return u, ["unexpected ['c']"]
    if kind == "bad_moment_kind":
        u.moments = {"exp_avgg/w": t([[1.0, 1.0], [1.0, 1.0]])}
        return u, ["'exp_avgg/w'", "exp_avg|exp_avg_sq"]
    if kind == "bad_moment_no_param":
        u.moments = {"exp_avg": t([[1.0, 1.0], [1.0, 1.0]])}
        return u, ["'exp_avg'"]
    if kind == "bad_moment_unknown_param":
        u.moments = {"exp_avg/nope": t([1.0])}
        return u, ["unexpected moment 'exp_avg/nope'"]
    if kind == "moment_nan":
        u.moments = {"exp_avg/w": t([[1.0, float("nan")], [1.0, 1.0]])}
        return u, ["exp_avg/w", "NaN or Inf"]
    if kind == "moment_shape":
        u.moments = {"exp_avg/b": t([1.0, 1.0, 1.0])}
        return u, ["exp_avg/b", "shape (3,)", "(2,)"]
    if kind == "tokens_zero":
        u.tokens = 0
        return u, ["tokens=0", "positive"]
    if kind == "tokens_negative":
        u.tokens = -5
        return u, ["tokens=-5", "positive"]
    if kind == "tokens_float":
        u.tokens = 500.0
        return u, ["tokens=500.0"]
    raise AssertionError(kind)


BAD_KINDS = ["wrong_round", "wrong_round_stale", "nan", "inf", "wrong_shape", "int_dtype", "not_a_tensor",
             "missing_tensor", "extra_tensor", "bad_moment_kind", "bad_moment_no_param",
             "bad_moment_unknown_param", "moment_nan", "moment_shape", "tokens_zero", "tokens_negative",
             "tokens_float"]


def _moment_every_round_agg() -> Aggregator:
    # moments due every round, so that only the malformed moment replies are at fault
    return make_agg(rounds=RoundConfig(local_steps=4, sync_exp_avg_every=1, sync_exp_avg_sq_every=1))


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_only_reply_changes_nothing(kind, caplog):
    caplog.set_level(logging.WARNING, logger=AGG_LOGGER)
    agg = _moment_every_round_agg()
    bad, needles = _bad(kind)
    result = agg.aggregate([bad])
    assert result.accepted == []
    assert list(result.rejected) == [7]
    for needle in needles:
        assert needle in result.rejected[7], (needle, result.rejected[7])
    assert_params(agg.params, {"w": [[1.0, 2.0], [3.0, 4.0]], "b": [0.5, -0.5]})
    assert agg.round == 1 and result.state.round == 1
    assert agg.moments == {} and agg.opt_step == 0
    assert result.metrics == {}
    assert "worker 7" in caplog.text
    assert any(r.levelno == logging.WARNING and "worker 7" in r.getMessage() for r in caplog.records)
    assert "no usable reply" in caplog.text


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_reply_is_dropped_and_the_others_applied(kind, caplog):
    caplog.set_level(logging.WARNING, logger=AGG_LOGGER)
    agg = _moment_every_round_agg()
    a, b, _ = round1_replies()  # tokens 100 and 300
    a.moments = {"exp_avg/b": t([4.0, 0.0])}
    b.moments = {"exp_avg/b": t([0.0, 4.0])}
    bad, needles = _bad(kind)
    result = agg.aggregate([a, bad, b])
    assert result.accepted == [1, 2]
    assert list(result.rejected) == [7]
    for needle in needles:
        assert needle in result.rejected[7]
    # Δ̄ = 0.25 Δ1 + 0.75 Δ2 = w [[1.75, 1.5], [0, 0.25]], b [0.25, 0.75]: worker 7's 500 tokens not counted
    assert_params(agg.params, {"w": [[-0.75, 0.5], [3.0, 3.75]], "b": [0.25, -1.25]})
    assert set(agg.moments) == {"exp_avg/b"}
    torch.testing.assert_close(agg.moments["exp_avg/b"], t([1.0, 3.0]), rtol=0, atol=1e-6)
    assert agg.round == 2
    assert result.metrics["clients_ok"] == 2.0 and result.metrics["clients_dropped"] == 1.0
    assert result.metrics["tokens"] == 400.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker 7" in warnings[0]


def test_each_bad_reply_gets_its_own_reason():
    agg = _moment_every_round_agg()
    nan, _ = _bad("nan")
    nan.worker_id = 11
    neg, _ = _bad("tokens_negative")
    neg.worker_id = 12
    result = agg.aggregate([nan, neg, round1_replies()[0]])
    assert result.accepted == [1]
    assert "NaN" in result.rejected[11] and "tokens=-5" in result.rejected[12]


def test_rejects_a_full_size_moment_of_a_low_rank_parameter():
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    agg = Aggregator({"w": w}, {"w": 2}, RoundConfig(1, 1, 1), Average(), SVDProjection())
    assert agg.expected_moment_shape("w") == (6, 2)
    u = WorkerUpdate(0, 1, {"w": torch.ones(6, 4)}, {"exp_avg/w": torch.zeros(6, 4)}, tokens=10, opt_step=1)
    result = agg.aggregate([u])
    assert "exp_avg/w: shape (6, 4), expected (6, 2)" in result.rejected[0]


# ----------------------------------------------------------------------------- outliers


def outlier_replies() -> list[WorkerUpdate]:
    replies = [upd(i, 100, [[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0]) for i in range(3)]
    replies[1].delta["w"] = t([[0.0, 1.0], [1.0, 0.0]])  # all three have norm sqrt(2)
    replies.append(upd(3, 100, [[100.0, 0.0], [0.0, 100.0]], [0.0, 0.0]))  # 100x: norm 100 sqrt(2)
    return replies


def test_outlier_is_rejected_with_the_median_in_the_reason(caplog):
    caplog.set_level(logging.WARNING, logger=AGG_LOGGER)
    agg = make_agg(outlier_factor=3)
    result = agg.aggregate(outlier_replies())
    assert result.accepted == [0, 1, 2]
    assert list(result.rejected) == [3]
    reason = result.rejected[3]
    assert "median" in reason and "141.4" in reason and "1.414" in reason
    assert "worker 3" in caplog.text
    # mean of the three kept: w [[2/3, 1/3], [1/3, 2/3]], b [0, 0]
    assert_params(agg.params, {"w": [[1.0 / 3.0, 5.0 / 3.0], [8.0 / 3.0, 10.0 / 3.0]], "b": [0.5, -0.5]})


def test_outlier_rule_off_with_factor_zero():
    agg = make_agg(outlier_factor=0)
    result = agg.aggregate(outlier_replies())
    assert result.accepted == [0, 1, 2, 3] and result.rejected == {}
    # mean: w [[102/4, 1/4], [1/4, 102/4]], b [0, 0]
    assert_params(agg.params, {"w": [[-24.5, 1.75], [2.75, -21.5]], "b": [0.5, -0.5]})


def test_outlier_rule_keeps_replies_within_the_factor():
    agg = make_agg(outlier_factor=3)
    replies = outlier_replies()
    replies[3].delta["w"] = t([[2.0, 0.0], [0.0, 2.0]])  # 2 sqrt(2) <= 3 sqrt(2): kept
    assert agg.aggregate(replies).rejected == {}


# ----------------------------------------------------------------------------- LoRDO-Global projections


W_SHAPE = (6, 4)


def lowrank_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(*W_SHAPE, generator=g), "b": torch.randn(4, generator=g)}


def lowrank_agg(seed: int = 5, rounds: RoundConfig | None = None) -> Aggregator:
    return Aggregator(lowrank_params(), {"w": 2}, rounds or RoundConfig(4, 1, 1), Average(), SVDProjection(),
                      seed=seed, betas=(0.9, 0.99))


def lowrank_replies(round_: int = 1, opt_steps=(10, 12)) -> list[WorkerUpdate]:
    g = torch.Generator().manual_seed(100 + round_)
    out = []
    for i, (tokens, step) in enumerate(zip((100, 300), opt_steps)):
        out.append(WorkerUpdate(
            worker_id=i, round=round_,
            delta={"w": torch.randn(*W_SHAPE, generator=g), "b": torch.randn(4, generator=g)},
            moments={"exp_avg/w": torch.randn(6, 2, generator=g) * 0.1,
                     "exp_avg_sq/w": torch.rand(6, 2, generator=g) * 0.1 + 0.01,
                     "exp_avg/b": torch.randn(4, generator=g),
                     "exp_avg_sq/b": torch.rand(4, generator=g)},
            tokens=tokens, opt_step=step))
    return out


def test_low_rank_shape_follows_galore_side():
    assert projection_side(W_SHAPE) == "right" and low_rank_shape(W_SHAPE, 2) == (6, 2)
    assert projection_side((4, 6)) == "left" and low_rank_shape((4, 6), 2) == (2, 6)


def test_round1_projection_is_the_seeded_initial_one():
    agg = lowrank_agg(seed=5)
    expected = SVDProjection().initial(W_SHAPE, 2, "right", seed=5)
    assert set(agg.projections) == {"w"}
    assert torch.equal(agg.projections["w"], expected)
    assert torch.equal(agg.global_state().projections["w"], expected)
    p = agg.projections["w"]
    assert p.shape == (2, 4)
    torch.testing.assert_close(p @ p.T, torch.eye(2), rtol=0, atol=1e-5)
    assert torch.equal(lowrank_agg(seed=5).projections["w"], expected)  # deterministic
    assert not torch.allclose(lowrank_agg(seed=6).projections["w"], expected)  # seed matters


def test_projection_refresh_is_the_top_subspace_of_the_averaged_delta():
    agg = lowrank_agg()
    replies = lowrank_replies()
    delta_bar = 0.25 * replies[0].delta["w"] + 0.75 * replies[1].delta["w"]
    agg.aggregate(replies)
    p_new = agg.projections["w"]
    assert p_new.shape == (2, 4)
    _, _, vh = torch.linalg.svd(delta_bar)
    v2 = vh[:2].T  # 4×2, top-2 right singular vectors
    torch.testing.assert_close(p_new.T @ p_new, v2 @ v2.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(p_new @ p_new.T, torch.eye(2), rtol=0, atol=1e-5)
    assert agg.global_state().projections["w"] is p_new


def test_averaged_low_rank_moments_are_rotated_into_the_new_basis():
    agg = lowrank_agg()
    p_old = agg.projections["w"].clone()
    replies = lowrank_replies(opt_steps=(12, 12))
    w0, w1 = 0.25, 0.75
    u_avg = w0 * replies[0].moments["exp_avg/w"] + w1 * replies[1].moments["exp_avg/w"]
    v_avg = w0 * replies[0].moments["exp_avg_sq/w"] + w1 * replies[1].moments["exp_avg_sq/w"]
    result = agg.aggregate(replies)
    p_new = agg.projections["w"]
    c = p_old @ p_new.T  # right projection: C = P_old P_newᵀ
    assert result.state.moments["exp_avg/w"].shape == (6, 2)
    torch.testing.assert_close(result.state.moments["exp_avg/w"], u_avg @ c, rtol=1e-5, atol=1e-6)
    # LDAdam's second-moment rule with k = opt_step = 12, betas (0.9, 0.99)
    bc1, bc2 = 1 - 0.9 ** 12, 1 - 0.99 ** 12
    m_hat, v_hat = u_avg / bc1, v_avg / bc2
    v_new = ((v_hat - m_hat ** 2) @ (c * c) + (m_hat @ c) ** 2).abs() * bc2
    torch.testing.assert_close(result.state.moments["exp_avg_sq/w"], v_new, rtol=1e-5, atol=1e-7)
    # full-rank parameters' moments are averaged, not rotated
    torch.testing.assert_close(result.state.moments["exp_avg/b"],
                               w0 * replies[0].moments["exp_avg/b"] + w1 * replies[1].moments["exp_avg/b"])
    torch.testing.assert_close(result.state.moments["exp_avg_sq/b"],
                               w0 * replies[0].moments["exp_avg_sq/b"] + w1 * replies[1].moments["exp_avg_sq/b"])
    assert agg.opt_step == 12


def test_projection_refreshes_even_when_no_moment_is_due():
    agg = lowrank_agg(rounds=RoundConfig(4, 0, 0))
    p_old = agg.projections["w"].clone()
    replies = lowrank_replies()
    for r in replies:
        r.moments = {}
    agg.aggregate(replies)
    assert agg.moments == {}
    assert not torch.allclose(agg.projections["w"], p_old)


def test_make_aggregator_owns_projections_only_under_lordo_global():
    from lordo_fed.rounds.methods import make_aggregator, resolve_method
    from lordo_fed.optim.config import InnerConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=True))  # weight 6×4 named "0.weight"
    g = resolve_method("lordo_global", InnerConfig(init_projection="random"), RoundConfig(), OuterConfig())
    agg = make_aggregator(model, g, {"0.weight": 2}, seed=3)
    assert torch.equal(agg.projections["0.weight"], SVDProjection().initial((6, 4), 2, "right", seed=3))
    by_gradient = resolve_method("lordo_global", InnerConfig(init_projection="gradient"), RoundConfig(), OuterConfig())
    assert make_aggregator(model, by_gradient, {"0.weight": 2}, seed=3).needs_gradient_init
    assert torch.equal(agg.params["0.weight"], model[0].weight.detach())
    agg.params["0.weight"].add_(1.0)  # a copy: the server's θ is not the model's tensor
    assert not torch.equal(agg.params["0.weight"], model[0].weight.detach())
    local = resolve_method("lordo_local", InnerConfig(), RoundConfig(), OuterConfig(), total_steps=64)
    assert make_aggregator(model, local, {"0.weight": 2}, seed=3).projections == {}
    diloco = resolve_method("diloco", InnerConfig(), RoundConfig(), OuterConfig(),
                            diloco_outer=OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    agg = make_aggregator(model, diloco, {}, seed=3)
    assert isinstance(agg.outer, Nesterov) and agg.projections == {}
    assert agg.rounds.due(1) == () and agg.rounds.due(6) == ()


# ----------------------------------------------------------------------------- checkpoints


def full_agg() -> Aggregator:
    return Aggregator(lowrank_params(), {"w": 2}, RoundConfig(4, 1, 1), Nesterov(lr=0.7, momentum=0.9),
                      SVDProjection(), seed=5, betas=(0.9, 0.99))


def assert_same_state(a: Aggregator, b: Aggregator) -> None:
    for name in ("params", "projections", "moments"):
        x, y = getattr(a, name), getattr(b, name)
        assert set(x) == set(y), name
        for k in x:
            assert torch.equal(x[k], y[k]), (name, k)
    sx, sy = a.outer.state_dict(), b.outer.state_dict()
    assert set(sx) == set(sy) and all(torch.equal(sx[k], sy[k]) for k in sx)
    assert (a.round, a.opt_step) == (b.round, b.opt_step)


def test_state_dict_round_trip_mid_run(tmp_path):
    a = full_agg()
    a.aggregate(lowrank_replies(1))
    sd = a.state_dict()
    assert {"param/w", "param/b", "outer/momentum_buffer.w", "outer/momentum_buffer.b", "proj/w",
            "moment/exp_avg/w", "moment/exp_avg_sq/w", "moment/exp_avg/b", "moment/exp_avg_sq/b",
            "counter/round", "counter/opt_step"} == set(sd)
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    save_file(sd, str(tmp_path / "agg.safetensors"))
    b = full_agg()
    b.load_state_dict(load_file(str(tmp_path / "agg.safetensors")))
    assert_same_state(a, b)
    assert b.round == 2 and b.opt_step == 12
    for r in (2, 3):
        ra, rb = a.aggregate(lowrank_replies(r)), b.aggregate(lowrank_replies(r))
        assert ra.accepted == rb.accepted == [0, 1]
        assert_same_state(a, b)
    assert a.round == 4


def test_continuing_without_the_outer_momentum_differs():
    """Without the momentum in the checkpoint, continuing would differ: the round trip is not vacuous."""
    a = full_agg()
    a.aggregate(lowrank_replies(1))
    sd = {k: v for k, v in a.state_dict().items() if not k.startswith("outer/")}
    b = full_agg()
    b.load_state_dict(sd)
    a.aggregate(lowrank_replies(2))
    b.aggregate(lowrank_replies(2))
    assert not torch.allclose(a.params["w"], b.params["w"])


def test_load_state_dict_rejects_a_missing_parameter():
    sd = full_agg().state_dict()
    del sd["param/b"]
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        full_agg().load_state_dict(sd)


def test_load_state_dict_rejects_an_unexpected_parameter():
    sd = full_agg().state_dict()
    sd["param/extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="extra"):
        full_agg().load_state_dict(sd)


def test_load_state_dict_rejects_a_mis_shaped_parameter():
    sd = full_agg().state_dict()
    sd["param/w"] = torch.zeros(5, 4)
    agg = full_agg()
    before = agg.params["w"].clone()
    with pytest.raises(ValueError, match=r"parameter w has shape \(5, 4\), model has \(6, 4\)"):
        agg.load_state_dict(sd)
    assert torch.equal(agg.params["w"], before)


# ----------------------------------------------------------------------------- round-1 projections from gradients


def test_initial_projections_are_fitted_to_the_token_weighted_mean_gradient(caplog):
    shape = (6, 4)
    params = {"w": torch.zeros(shape), "b": torch.zeros(4)}
    agg = Aggregator(params, {"w": 2}, RoundConfig(local_steps=1), Average(), SVDProjection(), seed=3,
                     init_projection="gradient")
    assert agg.needs_gradient_init and agg.global_state().projections == {}
    g = torch.Generator().manual_seed(0)
    g1, g2 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    replies = [
        WorkerUpdate(worker_id=0, round=0, delta={"w": g1}, moments={}, tokens=100, opt_step=0),
        WorkerUpdate(worker_id=1, round=0, delta={"w": g2}, moments={}, tokens=300, opt_step=0),
        WorkerUpdate(worker_id=2, round=0, delta={"w": torch.full(shape, float("nan"))}, moments={}, tokens=100, opt_step=0),
    ]
    with caplog.at_level(logging.WARNING):
        result = agg.init_projections(replies)
    assert result.accepted == [0, 1] and "NaN" in result.rejected[2] and "worker 2" in caplog.text
    mean = 0.25 * g1 + 0.75 * g2
    _, _, vh = torch.linalg.svd(mean, full_matrices=False)
    p = agg.projections["w"]
    torch.testing.assert_close(p.T @ p, vh[:2].T @ vh[:2], atol=1e-5, rtol=0)
    assert not agg.needs_gradient_init and agg.global_state().round == 1


def test_initial_projections_count_each_worker_once():
    shape = (6, 4)
    agg = Aggregator({"w": torch.zeros(shape)}, {"w": 2}, RoundConfig(local_steps=1), Average(), SVDProjection(),
                     seed=3, init_projection="gradient")
    g = torch.Generator().manual_seed(0)
    g1, g2 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    replies = [WorkerUpdate(worker_id=0, round=0, delta={"w": g1}, moments={}, tokens=100, opt_step=0),
               WorkerUpdate(worker_id=0, round=0, delta={"w": g2}, moments={}, tokens=100, opt_step=0)]
    result = agg.init_projections(replies)
    assert result.accepted == [0] and "already answered" in result.rejected[0]
    _, _, vh = torch.linalg.svd(g1, full_matrices=False)  # fitted to the first reply alone
    p = agg.projections["w"]
    torch.testing.assert_close(p.T @ p, vh[:2].T @ vh[:2], atol=1e-5, rtol=0)


def test_random_initial_projections_need_no_gradients():
    agg = Aggregator({"w": torch.zeros(6, 4)}, {"w": 2}, RoundConfig(), Average(), SVDProjection(), seed=3)
    assert not agg.needs_gradient_init and agg.projections["w"].shape == (2, 4)


# ----------------------------------------------------------------------------- streaming from reply refs
#
# A deployment keeps a `ReplyRef` per reply (its payload spooled, its tensors dropped after the
# on-arrival checks) and aggregates by loading one reply at a time. The oracle is the list-based
# round as the aggregator computed it before refs existed (`oracle_round`, written out plainly):
# streaming must give bit-identical θ, outer state, moments, projections and metrics.


def stream_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(6, 4, generator=g), "v": torch.randn(4, 6, generator=g), "b": torch.randn(4, generator=g)}


def stream_agg() -> Aggregator:
    """LoRDO-Global over a right- and a left-projected matrix: u every round, v every second round,
    E every round, Nesterov outer, the two-phase betas switching inside round 2, outliers refused."""
    return Aggregator(stream_params(), {"w": 2, "v": 2}, RoundConfig(4, 1, 2, sync_ef=True),
                      Nesterov(lr=0.7, momentum=0.9), SVDProjection(), seed=5, outlier_factor=3.0,
                      betas=(0.9, 0.99), switch_step=6, switch_betas=(0.95, 0.999), diagnostics=True)


def stream_reply(agg: Aggregator, round_: int, worker_id: int, tokens: int, opt_step: int, seed: int,
                 scale: float = 1.0, drop: tuple[str, ...] = ()) -> WorkerUpdate:
    """A well-formed reply of round `round_` carrying every state due then, less the kinds in `drop`."""
    g = torch.Generator().manual_seed(seed)
    delta = {n: scale * torch.randn(p.shape, generator=g) for n, p in agg.params.items()}
    moments = {}
    for name, p in agg.params.items():
        for kind in agg.rounds.due(round_, name in agg.ranks):
            if kind in drop:
                continue
            shape = tuple(p.shape) if kind == "ef" else agg.expected_moment_shape(name)
            moments[moment_key(kind, name)] = (torch.rand(shape, generator=g) * 0.1 + 0.01 if kind == "exp_avg_sq"
                                               else torch.randn(shape, generator=g) * 0.1)
    metrics = {"train_loss": 3.0 + float(torch.rand(1, generator=g)),
               **{k: float(torch.rand(1, generator=g)) for k in DIAGNOSTIC_METRICS}}
    return WorkerUpdate(worker_id=worker_id, round=round_, delta=delta, moments=moments, tokens=tokens,
                        opt_step=opt_step, metrics=metrics)


def stream_replies(agg: Aggregator, round_: int) -> list[WorkerUpdate]:
    """Round `round_`'s replies in arrival order (not worker order). Workers 0, 1, 3 have trained
    from the start (different tokens); worker 2 joins in round 2 with one round of steps and
    without its second moments; worker 5 is refused: NaN in round 1, a norm outlier in round 3;
    in round 2 worker 1 answers twice (the second reply is refused)."""
    steps = 4 * round_
    replies = [stream_reply(agg, round_, 3, 600, steps, seed=10 * round_ + 3),
               stream_reply(agg, round_, 0, 100, steps, seed=10 * round_)]
    if round_ >= 2:
        replies.append(stream_reply(agg, round_, 2, 250, 4 if round_ == 2 else steps - 4, seed=10 * round_ + 2,
                                    drop=("exp_avg_sq",) if round_ == 2 else ()))
    replies.append(stream_reply(agg, round_, 1, 300, steps, seed=10 * round_ + 1))
    if round_ == 1:
        bad = stream_reply(agg, round_, 5, 400, steps, seed=15)
        bad.delta["v"][1, 2] = float("nan")
        replies.insert(1, bad)
    elif round_ == 2:
        replies.append(stream_reply(agg, round_, 1, 900, steps, seed=99))
    else:
        replies.insert(2, stream_reply(agg, round_, 5, 400, steps, seed=10 * round_ + 5, scale=100.0))
    return replies


def oracle_round(agg: Aggregator, updates: list[WorkerUpdate]) -> RoundResult:
    """One round as the list-based aggregator computed it, all replies in memory: screened, then
    per tensor an fp32 sum over the list in partition order, acc += w·t (ALGORITHM.md, "One
    round", step 3)."""
    updates = sorted(updates, key=lambda u: u.worker_id)  # stable: the first of a worker's replies first
    reasons, _ = agg.screen(updates)
    good = [u for u, r in zip(updates, reasons) if r is None]
    rejected = {u.worker_id: r for u, r in zip(updates, reasons) if r is not None}

    def weighted_sum(tensors, weights):
        acc = torch.zeros_like(tensors[0], dtype=torch.float32)
        for x, w in zip(tensors, weights):
            acc.add_(x.float(), alpha=w)
        return acc

    total = sum(u.tokens for u in good)
    weights = [u.tokens / total for u in good]
    delta = {n: weighted_sum([u.delta[n] for u in good], weights) for n in agg.params}
    lengths = [math.sqrt(sum(float(d.square().sum()) for d in u.delta.values())) for u in good]  # no coords here
    retention = (math.sqrt(sum(float(d.square().sum()) for d in delta.values()))
                 / sum(w * n for w, n in zip(weights, lengths)))
    agg.outer.step(agg.params, delta)
    diagnostics = {**subspace_diagnostics(delta, agg.ranks, agg.projection, agg.projections), "delta_retention": retention}
    agg.opt_step = max(u.opt_step for u in good)
    moments = {}
    for key in sorted({k for u in good for k in u.moments}):
        kind = split_moment_key(key)[0]
        have = [(u.moments[key] if kind == "ef" else
                 restep(u.moments[key], kind, u.opt_step, agg.opt_step, agg.round_betas(), agg.bias_correction), w)
                for u, w in zip(good, weights) if key in u.moments]
        norm = sum(w for _, w in have)
        moments[key] = weighted_sum([x for x, _ in have], [w / norm for _, w in have])
    new = fit_projections(delta, agg.ranks, agg.projection, agg.seed + 7919 * agg.round)
    agg.moments = agg.rotated_moments(moments, agg.projections, new)
    agg.projections = new
    metrics = {
        "train_loss": sum(w * u.metrics["train_loss"] for u, w in zip(good, weights)),
        "tokens": float(total),
        "delta_norm": math.sqrt(sum(float(d.square().sum()) for d in delta.values())),
        "clients_ok": float(len(good)),
        "clients_dropped": float(len(rejected)),
        **diagnostics,
        **{k: sum(w * u.metrics[k] for u, w in zip(good, weights)) for k in DIAGNOSTIC_METRICS},
    }
    agg.round += 1
    return RoundResult(agg.global_state(), [u.worker_id for u in good], rejected, metrics)


class Spool:
    """The server's side of streaming: each reply arrives as a payload, is decoded and checked
    once, and kept as a `ReplyRef` whose `load` decodes the payload again (a file or an mmap in a
    deployment). Counts loads, and the most loaded replies alive at once: a loaded reply is alive
    while any of its tensors is."""

    def __init__(self) -> None:
        self.loaded: list[list[weakref.ref]] = []
        self.peak_alive = 0

    @property
    def loads(self) -> int:
        return len(self.loaded)

    def alive(self) -> int:
        return sum(any(r() is not None for r in refs) for refs in self.loaded)

    def loader(self, payload: bytes):
        def load() -> WorkerUpdate:
            update = decode_update(payload)
            self.loaded.append([weakref.ref(x) for x in (*update.delta.values(), *update.moments.values())])
            self.peak_alive = max(self.peak_alive, self.alive())
            return update
        return load

    def receive(self, agg: Aggregator, updates: list[WorkerUpdate]) -> tuple[list[ReplyRef], dict[int, str]]:
        """Screen on arrival, keep refs only: the usable refs and the refused replies' reasons."""
        refs, norms, reasons = [], [], []
        for u in updates:
            payload = encode_update(u, "test-model")
            arrived = decode_update(payload)
            reason, norm = agg.check_reply(arrived)
            refs.append(ReplyRef.of(arrived, load=self.loader(payload)))
            norms.append(norm)
            reasons.append(reason)
            del arrived  # from here on the server holds the payload and the ref, not the tensors
        reasons = agg.screen_round([r.worker_id for r in refs], norms, reasons)
        return ([r for r, why in zip(refs, reasons) if why is None],
                {r.worker_id: why for r, why in zip(refs, reasons) if why is not None})


NORM_METRICS = ("delta_norm", "delta_retention")
"""Lengths the oracle sums as Σ d² and the aggregator as one `vector_norm` per tensor: the same value up to
the order of fp32 additions (θ, the bases and the moments are compared bit for bit)."""


def assert_same_result(a: RoundResult, b: RoundResult) -> None:
    assert (a.accepted, a.rejected) == (b.accepted, b.rejected)
    assert a.metrics.keys() == b.metrics.keys()
    for key, value in a.metrics.items():
        assert value == (pytest.approx(b.metrics[key], rel=1e-6) if key in NORM_METRICS else b.metrics[key]), key
    assert a.state.round == b.state.round and a.state.opt_step == b.state.opt_step
    for name in ("params", "projections", "moments"):
        x, y = getattr(a.state, name), getattr(b.state, name)
        assert list(x) == list(y), name
        assert all(torch.equal(x[k], y[k]) for k in x), name


def test_streaming_from_refs_is_bit_identical_to_the_list_path_over_four_rounds():
    oracle, listed, streamed = stream_agg(), stream_agg(), stream_agg()
    spool = Spool()
    for round_ in range(1, 5):
        replies = stream_replies(oracle, round_)
        expected = oracle_round(oracle, replies)
        via_list = listed.aggregate(stream_replies(listed, round_))
        loads_before = spool.loads
        refs, rejected = spool.receive(streamed, stream_replies(streamed, round_))
        via_refs = streamed.aggregate_refs(refs, rejected)
        assert spool.loads - loads_before == len(refs)  # each usable reply loaded once
        for result in (via_list, via_refs):
            assert_same_result(result, expected)
        for agg in (listed, streamed):
            assert_same_state(agg, oracle)
        # the scenario is what it claims: the refused reply and the late joiner's states
        assert set(expected.rejected) == {1: {5}, 2: {1}, 3: {5}, 4: {5}}[round_]
        assert expected.accepted == ([0, 1, 3] if round_ == 1 else [0, 1, 2, 3])
    assert spool.peak_alive == 1
    assert set(oracle.moments) >= {"exp_avg/w", "exp_avg_sq/w", "ef/v", "exp_avg/b"}


def test_the_scenario_exercises_what_bit_identity_is_claimed_for():
    """Reasons of the refused replies, and the late joiner's rescaling and missing moments, in the
    rounds of the test above (so it cannot pass on a scenario that skips them)."""
    agg = stream_agg()
    results = [agg.aggregate(stream_replies(agg, r)) for r in (1, 2, 3)]
    assert "NaN" in results[0].rejected[5]
    assert "already answered" in results[1].rejected[1]
    assert "outlier_factor" in results[2].rejected[5]
    late = stream_replies(stream_agg(), 2)[2]
    assert late.worker_id == 2 and late.opt_step == 4 and not any(k.startswith("exp_avg_sq") for k in late.moments)
    assert agg.opt_step == 12 and results[1].metrics["tokens"] == 1250.0


def test_streaming_does_not_depend_on_arrival_order():
    a, b = stream_agg(), stream_agg()
    replies = stream_replies(a, 1)
    ra = a.aggregate(replies)
    rb = b.aggregate(list(reversed(stream_replies(b, 1))))
    assert_same_result(ra, rb)
    assert ra.accepted == [0, 1, 3]


def test_streaming_holds_one_loaded_reply_at_a_time():
    """Peak of loaded replies alive during `aggregate_refs` is 1 (θ, outer state and accumulators
    aside, server memory does not grow with M); the counter does see M when a caller decodes all
    replies first, as the list path does."""
    agg = stream_agg()
    spool = Spool()
    refs, rejected = spool.receive(agg, stream_replies(agg, 1) + [stream_reply(agg, 1, 7 + i, 50, 4, seed=70 + i)
                                                                for i in range(5)])
    assert len(refs) == 8 and spool.alive() == 0  # screening on arrival kept no tensors
    agg.aggregate_refs(refs, rejected)
    assert spool.peak_alive == 1 and spool.loads == 8 and spool.alive() == 0
    naive = Spool()
    refs, _ = naive.receive(stream_agg(), stream_replies(stream_agg(), 1))
    updates = [r.load() for r in refs]
    stream_agg().aggregate(updates, screened=True)
    assert naive.peak_alive == len(refs) == 3


def test_a_load_that_returns_another_reply_is_refused_and_changes_nothing():
    agg = stream_agg()
    before = agg.state_dict()
    by_id = {u.worker_id: u for u in stream_replies(agg, 1)}
    refs = [ReplyRef.of(by_id[0]), ReplyRef.of(by_id[1], load=lambda: by_id[3])]  # 1's ref, 3's reply
    with pytest.raises(ValueError, match="worker 1 is not the one screened: worker_id=3, the ref says 1"):
        agg.aggregate_refs(refs)
    after = agg.state_dict()
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert agg.round == 1


def test_refs_must_be_screened():
    agg = stream_agg()
    by_id = {u.worker_id: u for u in stream_replies(agg, 1)}
    a, b = by_id[0], by_id[1]
    with pytest.raises(ValueError, match="more than one ref per worker"):
        agg.aggregate_refs([ReplyRef.of(a), ReplyRef.of(a)])
    b.round = 2
    with pytest.raises(ValueError, match=r"refs of workers \[1\] are for another round"):
        agg.aggregate_refs([ReplyRef.of(a), ReplyRef.of(b)])
    assert agg.round == 1


def test_check_reply_and_screen_round_are_the_rules_of_screen():
    agg = make_agg(outlier_factor=3)
    replies = outlier_replies()
    verdicts = [agg.check_reply(u) for u in replies]
    assert [r for r, _ in verdicts] == [None] * 4
    assert [n for _, n in verdicts] == pytest.approx([2 ** 0.5] * 3 + [100 * 2 ** 0.5])
    bad, _ = _bad("nan")
    reason, norm = agg.check_reply(bad)
    assert "NaN" in reason and math.isnan(norm)
    ids = [u.worker_id for u in replies]
    final = agg.screen_round(ids, [n for _, n in verdicts], [r for r, _ in verdicts])
    assert agg.screen(replies) == (final, [n for _, n in verdicts]) and final[:3] == [None] * 3 and "outlier_factor 3" in final[3]
    # the median is over the replies still usable, and needs three of them
    norms = [n for _, n in verdicts]
    assert agg.screen_round(ids, norms, ["refused", None, None, None])[3] is not None
    assert agg.screen_round(ids, norms, ["refused", "refused", None, None]) == ["refused", "refused", None, None]
    # a repeated worker is refused before the median is taken
    assert "already answered" in agg.screen_round([0, 0, 1, 2], [1.0, 1.0, 1.0, 1.0], [None] * 4)[1]


def test_initial_projections_from_refs_equal_the_list_path_one_gradient_at_a_time():
    def gradient_agg() -> Aggregator:
        return Aggregator(stream_params(), {"w": 2, "v": 2}, RoundConfig(local_steps=1), Average(), SVDProjection(),
                          seed=3, init_projection="gradient")

    g = torch.Generator().manual_seed(4)
    shapes = {n: p.shape for n, p in stream_params().items() if n in ("w", "v")}
    gradients = [WorkerUpdate(worker_id=i, round=0, delta={n: torch.randn(s, generator=g) for n, s in shapes.items()},
                              moments={}, tokens=tokens, opt_step=0) for i, tokens in ((2, 50), (0, 100), (1, 300))]
    listed, streamed = gradient_agg(), gradient_agg()
    expected = listed.init_projections(gradients)
    spool = Spool()
    reasons = [streamed.check_gradient(u) for u in gradients]
    reasons = streamed.screen_gradient_round([u.worker_id for u in gradients], reasons)
    assert reasons == [None] * 3
    refs = [ReplyRef.of(u, load=spool.loader(encode_update(u, "test-model"))) for u in gradients]
    result = streamed.init_projections_refs(refs)
    assert result.accepted == expected.accepted == [0, 1, 2]
    assert all(torch.equal(streamed.projections[n], listed.projections[n]) for n in ("w", "v"))
    assert spool.peak_alive == 1 and spool.loads == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_agrees_with_testing_every_value(dtype):
    """The one-reduction finiteness test against `torch.isfinite` on every value: NaN and ±Inf anywhere,
    and finite values whose squares overflow (the norm is Inf, every value is finite)."""
    from lordo_fed.rounds.screening import norm_of
    from lordo_fed.wire.values import all_finite

    cases = [torch.randn(1000), torch.zeros(7), torch.full((64,), 3e38), torch.tensor([1e30, -1e30, 2.0])]
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 500, 999):
            t = torch.randn(1000)
            t[where] = bad
            cases.append(t)
    for t in cases:
        t = t.to(dtype)
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    parts = [torch.randn(3, 5), torch.randn(17)]
    assert norm_of(parts) == pytest.approx(math.sqrt(sum(float((p.double() ** 2).sum()) for p in parts)), rel=1e-6)
