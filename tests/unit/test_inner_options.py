"""The inner optimizer's options of the LoRDO-quality issue, against a hand-written oracle.

- error feedback inside a round: the full-rank term on G, E decayed, E reset on a basis change,
  and the update-split diagnostic (‖U_out‖/‖U_in‖);
- the authors' two-phase recipe: betas, ω, moment reset and the learning-rate factor at a switch step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lordo_fed.optim import LoRDO
from lordo_fed.optim.config import InnerConfig, apply_phase, lr_at, phase_betas

P, Q, R = 16, 12, 3  # right projection (p >= q): basis R x Q, g = V Pᵀ, back(x) = x P


def basis(seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(Q, R, generator=torch.Generator().manual_seed(seed)))
    return q.T.contiguous()  # R x Q, orthonormal rows


def grad(t: int) -> torch.Tensor:
    return torch.randn(P, Q, generator=torch.Generator().manual_seed(100 + t))


def oracle(w0: torch.Tensor, steps: int, bases: dict[int, torch.Tensor], *, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
           omega=0.9, ef_decay=1.0, ef_reset=False, full_rank_term="error_fed"):
    """The equations of docs/algorithm.md, step by step (no rotation: bases change only where
    the moments are re-zeroed by the caller's choice of `bases`). Returns W and the per-step
    (‖U_out‖, ‖U_in‖)."""
    w, e = w0.clone(), torch.zeros(P, Q)
    u, v = torch.zeros(P, R), torch.zeros(P, R)
    split = []
    b = bases[0]
    for t in range(steps):
        if t in bases and t > 0:
            b = bases[t]
            if ef_reset:
                e = torch.zeros(P, Q)
        g_full = grad(t)
        vf = g_full + ef_decay * e
        g = vf @ b.T
        e = vf - g @ b
        u = betas[0] * u + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        k = t + 1
        d = (v / (1 - betas[1] ** k)).sqrt() + eps
        s = d.mean()
        x = vf if full_rank_term == "error_fed" else g_full
        out = (1 - omega) * (x - (x @ b.T) @ b) / (s + eps)
        update = (1 - omega) * x / (s + eps) + omega * ((u / (1 - betas[0] ** k)) / d) @ b
        split.append((float(out.norm()), float((update - out).norm())))
        w = w - lr * update
    return w, split


def ours(w0: torch.Tensor, steps: int, bases: dict[int, torch.Tensor], track: bool = False, **kw):
    w = torch.nn.Parameter(w0.clone())
    opt = LoRDO([dict(params=[w], rank=R)], lr=1e-2, omega=kw.pop("omega", 0.9), rotate=False, **kw)
    opt.track_update_split = track
    for t in range(steps):
        if t in bases:
            opt.set_projection(w, bases[t])
        w.grad = grad(t)
        opt.step()
    return w.detach(), opt


OPTIONS = [dict(), dict(full_rank_term="gradient"), dict(ef_decay=0.5), dict(ef_decay=0.0),
           dict(ef_reset=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
def test_low_rank_step_with_each_error_feedback_option_matches_the_equations(options):
    w0 = torch.randn(P, Q, generator=torch.Generator().manual_seed(0))
    bases = {0: basis(1), 4: basis(2)}  # one change of basis mid-way (no rotation: see the oracle)
    expected, _ = oracle(w0, 8, bases, **options)
    got, _ = ours(w0, 8, bases, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if options:  # each option changes the trajectory (so the comparison above can fail)
        paper, _ = oracle(w0, 8, bases)
        assert (paper - expected).abs().max() > 1e-4


def test_ef_reset_zeroes_the_buffer_on_a_change_of_basis_only():
    w0 = torch.randn(P, Q, generator=torch.Generator().manual_seed(0))
    for reset in (False, True):
        w, opt = ours(w0, 3, {0: basis(1)}, ef_reset=reset)
        ef = opt.state[opt.param_groups[0]["params"][0]]["ef"]
        assert ef.abs().sum() > 0
        opt.set_projection(opt.param_groups[0]["params"][0], basis(2))
        assert (ef.abs().sum() == 0) == reset


def test_ef_reset_under_local_refits_drops_e_before_it_is_fed_back():
    """LoRDO-Local refits its basis inside the step, every proj_interval steps: with ef_reset the
    step that refits takes V = G (E dropped), so E afterwards is what the new basis drops of G."""
    w0 = torch.randn(P, Q, generator=torch.Generator().manual_seed(0))
    result = {}
    for reset in (False, True):
        w = torch.nn.Parameter(w0.clone())
        opt = LoRDO([dict(params=[w], rank=R)], lr=1e-2, omega=0.9, projection_source="local", proj_interval=3,
                    ef_reset=reset)
        for t in range(4):  # refits at steps 0 and 3
            w.grad = grad(t)
            opt.step()
        b = opt.basis(w)
        residual = grad(3) - (grad(3) @ b.T) @ b
        result[reset] = (w.detach().clone(), opt.state[w]["ef"].clone(), residual)
    _, ef, residual = result[True]
    torch.testing.assert_close(ef, residual, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(result[False][1], result[False][2], atol=1e-3)  # without: E carries the old one
    assert (result[False][0] - result[True][0]).abs().max() > 1e-5


def test_update_split_is_the_out_of_subspace_share_of_the_update():
    """‖U_out‖/‖U_in‖ per step, as the oracle computes it; with a fixed basis and the paper's
    settings the out-of-subspace share keeps growing over a round of 32 steps as E builds up
    (0.22 -> 3.3 here); with the full-rank term on G it levels off (0.22 -> 0.66)."""
    w0 = torch.randn(P, Q, generator=torch.Generator().manual_seed(0))
    last = {}
    for name, options in (("paper", dict()), ("gradient", dict(full_rank_term="gradient"))):
        _, split = oracle(w0, 32, {0: basis(1)}, **options)
        _, opt = ours(w0, 32, {0: basis(1)}, track=True, **options)
        got = [(float(o.sqrt()), float(i.sqrt())) for o, i in opt.update_split]
        assert len(got) == 32
        for (go, gi), (eo, ei) in zip(got, split):
            assert go == pytest.approx(eo, rel=1e-4) and gi == pytest.approx(ei, rel=1e-4)
        last[name] = got[-1][0] / got[-1][1]
        assert last[name] > 2 * got[0][0] / got[0][1]
    assert last["paper"] > 3 * last["gradient"]
    _, opt = ours(w0, 4, {0: basis(1)}, track=True, omega=1.0)
    assert all(float(o) == 0 for o, _ in opt.update_split)  # ω = 1: nothing outside the subspace


def test_bad_error_feedback_options_are_named():
    w = torch.nn.Parameter(torch.zeros(P, Q))
    with pytest.raises(ValueError, match=r"ef_decay=1\.5: expected a number in \[0, 1\]"):
        LoRDO([w], rank=R, ef_decay=1.5)
    with pytest.raises(ValueError, match=r"full_rank_term='grad': expected one of \('error_fed', 'gradient'\)"):
        LoRDO([w], rank=R, full_rank_term="grad")
    with pytest.raises(ValueError, match=r"inner\.ef_decay=-0\.1"):
        InnerConfig(ef_decay=-0.1).validate()
    with pytest.raises(ValueError, match=r"inner\.switch_reset='some'"):
        InnerConfig(switch_reset="some").validate()
    with pytest.raises(ValueError, match=r"inner\.switch_lr_factor=0"):
        InnerConfig(switch_lr_factor=0).validate()


def test_a_state_saved_before_the_options_existed_loads_with_the_papers_defaults():
    w = torch.nn.Parameter(torch.randn(P, Q))
    opt = LoRDO([dict(params=[w], rank=R)], omega=0.9)
    opt.set_projection(w, basis(1))
    w.grad = grad(0)
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        for key in ("ef_decay", "ef_reset", "full_rank_term"):
            del g[key]
    fresh = LoRDO([dict(params=[w], rank=R)], omega=0.9)
    fresh.load_state_dict(sd)
    g = fresh.param_groups[0]
    assert (g["ef_decay"], g["ef_reset"], g["full_rank_term"]) == (1.0, False, "error_fed")


# ----------------------------------------------------------------------------- two phases


SWITCH = InnerConfig(lr=0.01, betas=(0.9, 0.999), omega=0.95, warmup_steps=0, schedule="constant", switch_step=5,
                     switch_betas=(0.99, 0.995), switch_omega=0.98, switch_lr_factor=0.5)


def test_learning_rate_and_betas_switch_at_the_switch_step():
    assert [lr_at(s, 100, SWITCH) for s in (0, 4, 5, 99)] == [0.01, 0.01, 0.005, 0.005]
    assert phase_betas(4, SWITCH) == (0.9, 0.999) and phase_betas(5, SWITCH) == (0.99, 0.995)
    one_phase = dataclasses.replace(SWITCH, switch_step=0)
    assert [lr_at(s, 100, one_phase) for s in (0, 5, 99)] == [0.01, 0.01, 0.01]
    # the factor multiplies the schedule (here WSD's decay) from the switch on
    wsd = dataclasses.replace(SWITCH, schedule="wsd", decay_fraction=0.5, min_lr_ratio=0.0)
    plain = dataclasses.replace(wsd, switch_step=0)
    assert lr_at(80, 100, wsd) == pytest.approx(0.5 * lr_at(80, 100, plain))


@pytest.mark.parametrize("reset", ["moments", "all", "none"])
def test_the_switch_sets_every_groups_hyperparameters_and_resets_the_moments(reset):
    cfg = dataclasses.replace(SWITCH, switch_reset=reset)
    w, b = torch.nn.Parameter(torch.randn(P, Q)), torch.nn.Parameter(torch.randn(Q))
    lordo = LoRDO([dict(params=[w], rank=R), dict(params=[b])], betas=cfg.betas, omega=cfg.omega)
    lordo.set_projection(w, basis(1))
    w2 = torch.nn.Parameter(torch.randn(P, Q))
    adamw = torch.optim.AdamW([w2], betas=cfg.betas)
    for opt, params in ((lordo, (w, b)), (adamw, (w2,))):
        for t in range(5):
            apply_phase(opt, cfg, t)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
        apply_phase(opt, cfg, 5)  # the first step of phase 2
        for group in opt.param_groups:
            assert tuple(group["betas"]) == (0.99, 0.995)
            assert group.get("omega", 0.98) == 0.98
        for p in params:
            st, old = opt.state[p], before[id(p)]
            zeroed = reset != "none"
            assert (st["exp_avg"].abs().sum() == 0) == zeroed and (st["exp_avg_sq"].abs().sum() == 0) == zeroed
            assert int(st["step"]) == (0 if reset == "all" else 5)
            if "ef" in st:  # E is not a moment: kept
                assert torch.equal(st["ef"], old["ef"])
        if reset != "none":
            opt.state[params[0]]["exp_avg"].add_(1.0)
            apply_phase(opt, cfg, 6)  # later steps do not reset again
            assert opt.state[params[0]]["exp_avg"].abs().sum() > 0


def test_auto_projection_is_exact_except_local_refits_on_cuda():
    """proj_method='auto' (the default): the exact SVD, but LoRDO-Local's per-step refits on a GPU
    take the randomized SVD; an explicit choice is kept everywhere."""
    import torch

    from lordo_fed.optim.config import InnerConfig, resolved_proj_method

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert InnerConfig().proj_method == "auto"
    assert resolved_proj_method(InnerConfig(projection="global"), cuda) == "svd"
    assert resolved_proj_method(InnerConfig(projection="local"), cpu) == "svd"
    assert resolved_proj_method(InnerConfig(projection="local"), cuda) == "rsvd"
    assert resolved_proj_method(InnerConfig(projection="local", proj_method="svd"), cuda) == "svd"
    assert resolved_proj_method(InnerConfig(projection="global", proj_method="dct"), cpu) == "dct"
