"""Overlapped rounds (`rounds.overlap_delay` = τ, Streaming DiLoCo's overlap): a worker starts round
r+1 from its own θ once it has sent round r, and merges round r+1's global state after τ steps.

The merge is checked against its equations computed by hand (docs/algorithm.md, "Overlapping
rounds"), with the LoRDO basis changing at the merge; a worker restarted from its saved state, and
one that trained the early steps ahead (as a node worker does while the state downloads), must
produce the very same round. Model and data as tests/unit/test_worker.py (tiny model, random tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lordo_fed.rounds.methods import lowrank_ranks, make_aggregator, make_worker, resolve_method
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN, lowrank_parameter_names
from lordo_fed.optim import rotate_moments
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.optim.projection import projection_side
from lordo_fed.wire.messages import GlobalState, moment_key
from lordo_fed.rounds.config import RoundConfig
from tests.unit.test_worker import BATCH, EMB, K, RANK, SEQ, TOTAL_STEPS, W2, WQ, _fast_cpu, shard, snapshot, tiny_model  # noqa: F401

TAU = 2


def overlap_setup(method: str = "lordo_global", tau: int = TAU, workers: int = 1, sync: tuple[int, int] = (1, 1),
                  model_seed: int = 0):
    """(workers, aggregator) as the reference trainer builds them, with overlap delay `tau`."""
    rounds = RoundConfig(local_steps=K, sync_exp_avg_every=sync[0], sync_exp_avg_sq_every=sync[1], overlap_delay=tau)
    s = resolve_method(method, InnerConfig(rank=RANK), rounds, OuterConfig())
    if method == "local_adam":  # its spec fixes (1, 1); keep the periods asked for
        s = dataclasses.replace(s, rounds=rounds)
    model = tiny_model(model_seed)
    lowrank = lowrank_parameter_names(model) if s.inner.name == "lordo" else []
    ranks = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    ws = [make_worker(m, model, s, shard(m), lowrank, TOTAL_STEPS, BATCH, SEQ, seed=0) for m in range(workers)]
    agg = make_aggregator(model, s, ranks, seed=0)
    if agg.needs_gradient_init:
        agg.init_projections([w.gradient(agg.gradient_request(), sorted(ranks)) for w in ws])
    return ws, agg


def live(worker) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Copies of the worker's θ and optimizer moments, by parameter name."""
    theta = {n: p.detach().clone() for n, p in worker.params.items()}
    state = {n: {k: v.clone() for k, v in worker.optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq")}
             for n, p in worker.params.items()}
    return theta, state


def perturbed(state: GlobalState, sent_moments: dict[str, torch.Tensor], seed: int = 3) -> GlobalState:
    """Round r+1's state with θ and the averaged moments moved away from what the worker sent (as
    other workers' replies would move them)."""
    g = torch.Generator().manual_seed(seed)
    out = snapshot(state)
    out.params = {n: p + 1e-2 * torch.randn(p.shape, generator=g) for n, p in out.params.items()}
    out.moments = {k: (v * (1.0 + 0.5 * torch.rand(v.shape, generator=g))) for k, v in out.moments.items()}
    return out


def test_merge_of_adamw_moments_and_theta_follows_the_equations():
    """AdamW (moments averaged every round): θ ← θ_now + (θ_g − θ_send); u ← u_now + β1^τ(ū − u_send);
    v ← v_now + β2^τ(v̄ − v_send) (no basis to rotate)."""
    (w,), agg = overlap_setup("local_adam")
    agg.aggregate([w.train_round(snapshot(agg.global_state()))])
    sent = w.sent
    assert sent is not None and sent.round == 1 and sent.early is None
    assert w.train_early() and len(sent.early) == TAU and w.cursor == K + TAU
    theta_now, moments_now = live(w)
    state = perturbed(agg.global_state(), sent.moments)
    sent_theta = {n: t.clone() for n, t in sent.theta.items()}
    sent_moments = {k: t.clone() for k, t in sent.moments.items()}
    theta_g = w.merge_global_state(state)
    beta1, beta2 = w.optimizer.param_groups[0]["betas"]
    for n, p in w.params.items():
        torch.testing.assert_close(p.detach(), theta_now[n] + (state.params[n] - sent_theta[n]), rtol=0, atol=1e-6)
        torch.testing.assert_close(theta_g[n], state.params[n])
        st = w.optimizer.state[p]
        for kind, beta in (("exp_avg", beta1), ("exp_avg_sq", beta2)):
            key = moment_key(kind, n)
            expected = moments_now[n][kind] + beta ** TAU * (state.moments[key] - sent_moments[key])
            torch.testing.assert_close(st[kind], expected.clamp_min(0) if kind == "exp_avg_sq" else expected,
                                       rtol=1e-6, atol=1e-9)
    assert w.sent is None


def test_merge_under_lordo_rotates_into_the_new_basis():
    """LoRDO-Global: the server's new projections arrive with the merge; the worker's moments (τ steps
    on in the old basis) and the ones it sent are both rotated with LDAdam's rule, then merged.
    With one worker and the plain average the server's answer is what the worker sent, so the merge
    reduces to rotating the worker's own moments (and θ does not move)."""
    (w,), agg = overlap_setup("lordo_global")
    agg.aggregate([w.train_round(snapshot(agg.global_state()))])
    old = {n: w.sent.bases[n].clone() for n in (WQ, W2)}
    w.train_early()
    theta_now, moments_now = live(w)
    sent_moments = {k: t.clone() for k, t in w.sent.moments.items()}
    state = snapshot(agg.global_state())
    assert set(state.projections) >= {WQ, W2}
    step, group = int(w.optimizer.state[w.params[WQ]]["step"]), w.optimizer.param_groups[0]
    w.merge_global_state(state)
    for name in (WQ, W2):
        p = w.params[name]
        new = w.optimizer.basis(p).detach()
        assert not torch.allclose(new, old[name])  # the basis did change
        side = projection_side(p.shape)
        u, v = rotate_moments(moments_now[name]["exp_avg"], moments_now[name]["exp_avg_sq"], old[name], new, side,
                              step, group["betas"], group["bias_correction"])
        st = w.optimizer.state[p]
        torch.testing.assert_close(st["exp_avg"], u, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"], v, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(p.detach(), theta_now[name], rtol=0, atol=1e-6)
        # and the general rule, with the averaged moments moved away from what this worker sent
    (w2,), agg2 = overlap_setup("lordo_global")
    agg2.aggregate([w2.train_round(snapshot(agg2.global_state()))])
    w2.train_early()
    old = {n: w2.sent.bases[n].clone() for n in (WQ,)}
    theta_now, moments_now = live(w2)
    sent_moments = {k: t.clone() for k, t in w2.sent.moments.items()}
    state = perturbed(agg2.global_state(), sent_moments)
    w2.merge_global_state(state)
    p = w2.params[WQ]
    new, side = w2.optimizer.basis(p).detach(), projection_side(p.shape)
    beta1, beta2 = group["betas"]
    u_now, v_now = rotate_moments(moments_now[WQ]["exp_avg"], moments_now[WQ]["exp_avg_sq"], old[WQ], new, side,
                                  step, group["betas"], group["bias_correction"])
    u_sent, v_sent = rotate_moments(sent_moments[moment_key("exp_avg", WQ)], sent_moments[moment_key("exp_avg_sq", WQ)],
                                    old[WQ], new, side, step - TAU, group["betas"], group["bias_correction"])
    st = w2.optimizer.state[p]
    torch.testing.assert_close(st["exp_avg"], u_now + beta1 ** TAU * (state.moments[moment_key("exp_avg", WQ)] - u_sent),
                               rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        st["exp_avg_sq"],
        (v_now + beta2 ** TAU * (state.moments[moment_key("exp_avg_sq", WQ)] - v_sent)).clamp_min(0),
        rtol=1e-4, atol=1e-9)
    assert bool((st["exp_avg_sq"] >= 0).all())


def test_overlapped_round_trains_k_steps_and_reports_delta_against_the_global_state():
    """Round 2 takes τ steps before the merge and K − τ after: K steps of tokens, the cursor K on,
    Δ = θ_g − θ_end; the sync path (τ = 0) takes the same tokens from θ_g directly."""
    ws, agg = overlap_setup("lordo_global", workers=2)
    agg.aggregate([w.train_round(snapshot(agg.global_state())) for w in ws])
    state = snapshot(agg.global_state())
    w = ws[0]
    update = w.train_round(state)
    assert update.tokens == K * BATCH * SEQ and update.metrics["overlap_steps"] == TAU
    assert w.cursor == 2 * K and w.sent.round == 2
    for n, p in w.params.items():
        torch.testing.assert_close(update.delta[n], state.params[n] - w.sent.theta[n], rtol=0, atol=1e-6)
        assert torch.equal(w.sent.theta[n], p.detach())
    # the sync path from the same state differs: its first τ steps were taken at θ_g
    (s0,), agg0 = overlap_setup("lordo_global", tau=0, workers=1)
    assert s0.sent is None and not s0.overlapping(2)


def test_early_steps_ahead_of_time_and_a_restarted_worker_give_the_same_round():
    """A node worker trains the early steps while the state downloads; the in-process ClientApp
    trains them when the state is there; a worker restarted from the state saved after round 1
    trains them again. All three produce bit-identical round-2 and round-3 updates."""
    (a,), agg = overlap_setup("lordo_global", model_seed=0)
    (b,), _ = overlap_setup("lordo_global", model_seed=1)
    (c,), _ = overlap_setup("lordo_global", model_seed=2)
    first = snapshot(agg.global_state())
    ua = a.train_round(first)
    b.train_round(first)
    tensors, meta = b.flat_state()
    assert any(k.startswith("sent/theta/") for k in tensors) and meta["sent"]["round"] == 1
    c.load_flat_state({k: v.clone() for k, v in tensors.items()}, meta)
    agg.aggregate([ua])
    for round_ in (2, 3):
        a.train_early()  # ahead, as a node worker
        state = snapshot(agg.global_state())
        updates = [w.train_round(snapshot(state)) for w in (a, b, c)]
        for u in updates[1:]:
            assert set(u.delta) == set(updates[0].delta)
            for n in u.delta:
                assert torch.equal(u.delta[n], updates[0].delta[n]), (round_, n)
            for k in u.moments:
                assert torch.equal(u.moments[k], updates[0].moments[k]), (round_, k)
        agg.aggregate([updates[0]])


def test_overlap_reaches_the_loss_of_synchronous_rounds_in_the_reference_trainer(tmp_path):
    """Two workers, LoRDO-Global: overlapped rounds train (the loss falls as far as synchronous
    rounds', within 5% here; docs/results.md has the perplexity comparison) and are not the
    synchronous run (the merge did something)."""
    from tests.unit.test_trainer import context, tiny_config
    from lordo_fed.data import DataConfig
    from lordo_fed.trainer.run import run_rounds

    finals, thetas = {}, {}
    for tau in (0, 3):
        cfg = tiny_config(tmp_path, workers=2, total_steps=48, eval_every=100,
                          data=DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=64, batch_size=8),
                          inner=InnerConfig(rank=8, lr=8e-3, warmup_steps=4),
                          rounds=RoundConfig(local_steps=8, overlap_delay=tau))
        records: list = []
        model = run_rounds(context(cfg, records), resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
        evals = [r["val_loss"] for r in records if "val_loss" in r]
        finals[tau], thetas[tau] = evals[-1], {n: p.detach().clone() for n, p in model.named_parameters()}
        assert evals[-1] < evals[0] - 2.0
        assert records[-1]["tokens"] == 2 * 48 * 8 * 64
    assert abs(finals[3] - finals[0]) / finals[0] < 0.05, finals
    assert any(not torch.equal(thetas[0][n], thetas[3][n]) for n in thetas[0])


@pytest.mark.parametrize("rounds,method,message", [
    (dict(local_steps=4, overlap_delay=4), "lordo_global", "overlap_delay=4: expected an integer from 0"),
    (dict(local_steps=4, overlap_delay=-1), "lordo_global", "overlap_delay=-1"),
    (dict(local_steps=4, overlap_delay=1, sync_ef=True), "lordo_global", "sync_ef=True"),
    (dict(local_steps=4, overlap_delay=1), "async_diloco", "overlap applies to synchronous rounds"),
    (dict(local_steps=4, overlap_delay=1), "ddp", "overlap applies to synchronous rounds"),
])
def test_bad_overlap_settings_are_refused(rounds, method, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(method, InnerConfig(rank=RANK), RoundConfig(**rounds), OuterConfig())


def test_overlap_delay_run_config_key():
    from lordo_fed.app.config import load_app_config
    from tests.unit.test_appconfig import pyproject_config

    cfg = load_app_config({**pyproject_config(), "overlap-delay": 5}, explicit=["overlap-delay"])
    assert cfg.rounds.overlap_delay == 5
    with pytest.raises(ValueError, match="overlap_delay=32"):
        load_app_config({**pyproject_config(), "overlap-delay": 32}, explicit=["overlap-delay"])


def test_overlap_with_compressed_payloads_trains(tmp_path):
    """Overlapped rounds with a compressed payload preset (`lowrank+topk2bit+rows`: Δ as int8
    coordinates in the round's shared basis plus a top-k residual with error feedback; θ down as the
    int8 change of the clients' copy): the merge adds the decoded change to the copy, Δ is split in
    the basis the merge set, and the run trains as far as the synchronous one does (within 5%)."""
    from tests.unit.test_trainer import context, tiny_config
    from lordo_fed.data import DataConfig
    from lordo_fed.trainer.run import run_rounds

    finals = {}
    for tau in (0, 2):
        cfg = tiny_config(tmp_path, workers=2, total_steps=48, eval_every=100, payload_dtype="lowrank+topk2bit+rows",
                          data=DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=64, batch_size=8),
                          inner=InnerConfig(rank=8, lr=8e-3, warmup_steps=4),
                          rounds=RoundConfig(local_steps=8, overlap_delay=tau))
        records: list = []
        run_rounds(context(cfg, records), resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
        evals = [r["val_loss"] for r in records if "val_loss" in r]
        assert evals[-1] < evals[0] - 2.0, evals
        finals[tau] = evals[-1]
    assert abs(finals[2] - finals[0]) / finals[0] < 0.05, finals
