"""HeLoCo's correction and outer step against values computed by hand (lordo_fed.rounds.heloco,
lordo_fed.rounds.outer.MomentumLookAhead): each of the correction's three cases, the first arrival,
the degenerate norms, the look-ahead start point, and one arrival end to end."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lordo_fed.rounds.heloco import HeLoCoConfig, correct, correct_tensor, look_ahead
from lordo_fed.rounds.outer import MomentumLookAhead, OuterConfig, build_outer_optimizer

CFG = HeLoCoConfig()  # the authors' defaults: c_ok 0.2, k_s 0.5, k_d 1, κ 3, β_max 0.5, ε 1e-8 (and ρ 1)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_aligned_passes_unchanged_and_rho_weights_it():
    # Δ = (3, 4), m = (6, 8): c = 1 >= c_ok
    assert torch.equal(correct_tensor(t(3, 4), t(6, 8), CFG), t(3, 4))
    assert torch.equal(correct_tensor(t(3, 4), t(6, 8), CFG, rho=0.5), t(1.5, 2))
    # exactly c_ok passes too: Δ = (0.2, sqrt(0.96)), m = (1, 0) gives c = 0.2
    d = t(0.2, math.sqrt(0.96))
    assert torch.equal(correct_tensor(d, t(1, 0), HeLoCoConfig(c_ok=float(d[0] / d.norm()))), d)


def test_anti_aligned_is_shrunk_along_the_momentum():
    # Δ = (3, 4): ‖Δ‖ = 5; m = (-1, 0): ‖m‖ = 1, m̂ = (-1, 0)
    # c = -3/5 = -0.6; conf = 5 / (5 + 3·1) = 0.625; β = min(0.5 · 0.6 · 0.625, 0.5) = 0.1875
    # Δ − β·c·‖Δ‖·m̂ = (3, 4) − (0.1875 · -0.6 · 5) · (-1, 0) = (3, 4) − (0.5625, 0) = (2.4375, 4)
    got = correct_tensor(t(3, 4), t(-1, 0), CFG)
    torch.testing.assert_close(got, t(2.4375, 4), rtol=0, atol=1e-6)
    # β is capped: k_s = 10 gives 10 · 0.6 · 0.625 = 3.75 -> β_max 0.5: (3, 4) − (0.5 · -0.6 · 5)·(-1, 0) = (1.5, 4)
    got = correct_tensor(t(3, 4), t(-1, 0), HeLoCoConfig(k_s=10.0))
    torch.testing.assert_close(got, t(1.5, 4), rtol=0, atol=1e-6)


def test_weakly_aligned_is_blended_toward_the_momentum_keeping_its_norm():
    # Δ = (0, 2): ‖Δ‖ = 2, Δ̂ = (0, 1); m = (1, 0): c = 0 (a blend, not a shrink)
    # conf = 2 / (2 + 3) = 0.4; λ = min(1 · (1 − 0) · 0.4, 1) = 0.4
    # u = 0.6·(0, 1) + 0.4·(1, 0) = (0.4, 0.6), ‖u‖ = sqrt(0.52); result 2·u/‖u‖
    got = correct_tensor(t(0, 2), t(1, 0), CFG)
    want = t(0.4, 0.6) * (2 / math.sqrt(0.52))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert float(got.norm()) == pytest.approx(2.0, abs=1e-6)
    # 0 < c < c_ok: Δ = (1, 9), m = (2, 0): c = 1/sqrt(82); conf = sqrt(82) / (sqrt(82) + 6)
    n = math.sqrt(82)
    c, conf = 1 / n, n / (n + 6)
    lam = min((1 - c) * conf, 1.0)
    u = ((1 - lam) / n * 1 + lam, (1 - lam) / n * 9)
    norm_u = math.hypot(*u)
    got = correct_tensor(t(1, 9), t(2, 0), CFG)
    torch.testing.assert_close(got, t(n * u[0] / norm_u, n * u[1] / norm_u), rtol=1e-6, atol=1e-6)


def test_first_arrival_and_degenerate_norms_keep_delta():
    d = t(1, -2, 3)
    assert torch.equal(correct_tensor(d, None, CFG, rho=0.25), d * 0.25)  # no momentum yet
    assert torch.equal(correct_tensor(d, torch.zeros(3), CFG), d)  # ‖m‖ < ε
    tiny = t(1e-10, 0, 0)
    assert torch.equal(correct_tensor(tiny, t(-1, 0, 0), CFG), tiny)  # ‖Δ‖ < ε, though anti-aligned


def test_dtype_shapes_and_names():
    d = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    got = correct_tensor(d, t(-1, 0).reshape(1, 2), CFG)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 2)
    assert torch.equal(got, torch.tensor([[2.4375, 4.0]]).to(torch.bfloat16))
    out = correct({"a": t(3, 4), "b": t(0, 2)}, {"a": t(-1, 0)}, CFG)  # "b" has no momentum: ρΔ
    torch.testing.assert_close(out["a"], t(2.4375, 4), rtol=0, atol=1e-6)
    assert torch.equal(out["b"], t(0, 2))
    with pytest.raises(ValueError, match=r"momentum of shape \(3,\) for a pseudo-gradient of shape \(2,\)"):
        correct_tensor(t(1, 2), t(1, 2, 3), CFG)


@pytest.mark.parametrize("field,value,expected", [
    ("c_ok", 1.5, "a cosine in [-1, 1]"), ("k_s", -1.0, "a number >= 0"),
    ("beta_max", 2.0, "a number in [0, 1]"), ("eps", 0.0, "a number > 0"), ("kappa", float("nan"), "a finite number"),
])
def test_bad_settings_are_named(field, value, expected):
    with pytest.raises(ValueError, match=rf"heloco\.{field}=.*expected {re.escape(expected)}"):
        HeLoCoConfig(**{field: value}).validate()


def test_momentum_look_ahead_step_by_hand():
    # η 0.7, μ 0.9, θ = 1, G = 0.5 twice:
    #   m = 0.1·0.5 = 0.05;            θ = 1 − 0.7·(0.5 + 0.9·0.05) = 0.6185
    #   m = 0.9·0.05 + 0.05 = 0.095;   θ = 0.6185 − 0.7·(0.5 + 0.9·0.095) = 0.20865
    opt = build_outer_optimizer(OuterConfig(name="mla", lr=0.7, momentum=0.9))
    assert isinstance(opt, MomentumLookAhead) and opt.momentum_buffers() is None
    theta = {"w": t(1.0)}
    opt.step(theta, {"w": t(0.5)})
    torch.testing.assert_close(theta["w"], t(0.6185), rtol=0, atol=1e-6)
    opt.step(theta, {"w": t(0.5)})
    torch.testing.assert_close(theta["w"], t(0.20865), rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.momentum_buffers()["w"], t(0.095), rtol=0, atol=1e-7)
    assert set(opt.state_dict()) == {"momentum.w"}


def test_look_ahead_start_point():
    theta = {"w": t(1.0, 2.0), "b": t(3.0)}
    same = look_ahead(theta, None, lr=0.7, mu=0.9)  # no momentum yet: θ itself, as copies
    assert torch.equal(same["w"], theta["w"]) and same["w"] is not theta["w"]
    got = look_ahead(theta, {"w": t(0.1, -0.2)}, lr=0.7, mu=0.9)  # θ − 0.63·m; "b" has none
    torch.testing.assert_close(got["w"], t(1.0 - 0.063, 2.0 + 0.126), rtol=0, atol=1e-6)
    assert torch.equal(got["b"], t(3.0)) and torch.equal(theta["w"], t(1.0, 2.0))
    assert torch.equal(look_ahead(theta, {"w": t(0.1, -0.2)}, lr=0.7, mu=0.0)["w"], theta["w"])


def test_one_arrival_corrects_against_the_momentum_before_its_own_step():
    """Arrival 1 (no momentum): G = ρΔ1. Arrival 2, anti-aligned with m: corrected against the m
    left by arrival 1, then stepped."""
    opt, cfg = MomentumLookAhead(lr=1.0, momentum=0.5), HeLoCoConfig()
    theta = {"w": t(0.0, 0.0)}
    opt.step(theta, correct({"w": t(-1.0, 0.0)}, opt.momentum_buffers(), cfg))
    # m = 0.5·(-1, 0) = (-0.5, 0); θ = −(G + 0.5 m) = −((-1, 0) + (-0.25, 0)) = (1.25, 0)
    torch.testing.assert_close(opt.momentum_buffers()["w"], t(-0.5, 0.0))
    torch.testing.assert_close(theta["w"], t(1.25, 0.0))
    g = correct({"w": t(3.0, 4.0)}, opt.momentum_buffers(), cfg)["w"]
    # m̂ = (-1, 0), ‖m‖ = 0.5: c = -0.6, conf = 5 / (5 + 1.5) = 10/13, β = 0.5·0.6·10/13 = 3/13
    # G = (3, 4) − (3/13 · -0.6 · 5)·(-1, 0) = (3 − 9/13, 4)
    torch.testing.assert_close(g, t(3 - 9 / 13, 4.0), rtol=0, atol=1e-6)
    opt.step(theta, {"w": g})
    m = t(-0.25, 0.0) + 0.5 * g
    torch.testing.assert_close(opt.momentum_buffers()["w"], m, rtol=0, atol=1e-6)
    torch.testing.assert_close(theta["w"], t(1.25, 0.0) - (g + 0.5 * m), rtol=0, atol=1e-6)
