"""The worker: one round of K local steps on the real tiny model, state in and out.

Model: `ModelConfig(preset="tiny")` (dim 64, 2 layers), vocabulary 256; batches of 4 windows of
16 tokens from a `TokenShard` of random tokens. K = 3 local steps per round unless stated.
"""

from __future__ import annotations

import dataclasses

import io

import numpy as np
import pytest
import torch

from lordo_fed.rounds.bases import low_rank_shape
from lordo_fed.data import TokenShard
from lordo_fed.rounds.methods import lowrank_ranks, make_aggregator, make_worker, resolve_method
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN, ModelConfig, build_model, lowrank_parameter_names
from lordo_fed.optim import LoRDO, rotate_moments
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.optim.projection import SVDProjection, projection_side
from lordo_fed.wire.messages import GlobalState
from lordo_fed.rounds.config import RoundConfig

VOCAB, BATCH, SEQ, K, TOTAL_STEPS, RANK = 256, 4, 16, 3, 60, 4
WQ = "layers.0.attn.wq.weight"  # 64×64: low-rank, right projection
W2 = "layers.1.mlp.w2.weight"  # 64×192: low-rank, left projection
EMB = "tok_emb.weight"  # 256×64: full rank (embedding, tied head)
NORM = "norm.weight"  # (64,): full rank


@pytest.fixture(autouse=True, scope="module")
def _fast_cpu():
    """Flush denormals, as the trainer does on CPU (lordo_fed.device.pick_device): denormals make the
    backward pass ~20x slower. One intra-op thread: the matmuls are tiny, and on a shared 2-core machine
    two threads fighting other processes make a round ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


def shard(seed: int = 0) -> TokenShard:
    return TokenShard(np.random.default_rng(seed).integers(0, VOCAB, size=4096), shard_id=0)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="tiny"), VOCAB)


def settings(method: str = "lordo_global", sync: tuple[int, int] | None = (1, 2), k: int = K):
    """`method`'s settings with moment-sync periods `sync` (None: the method's own, `MethodSpec.sync`)."""
    inner = InnerConfig(rank=RANK)
    rounds = RoundConfig(local_steps=k, **({} if sync is None else dict(sync_exp_avg_every=sync[0],
                                                                         sync_exp_avg_sq_every=sync[1])))
    return resolve_method(method, inner, rounds, OuterConfig())


def setup(method: str = "lordo_global", sync: tuple[int, int] | None = (1, 2), model_seed: int = 0, k: int = K):
    """(worker, aggregator) as the reference trainer builds them."""
    s = settings(method, sync, k)
    model = tiny_model(model_seed)
    lowrank = lowrank_parameter_names(model) if s.inner.name == "lordo" else []
    ranks = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    worker = make_worker(0, model, s, shard(), lowrank, TOTAL_STEPS, BATCH, SEQ, seed=0)
    aggregator = make_aggregator(model, s, ranks, seed=0)
    if aggregator.needs_gradient_init:  # LoRDO-Global's round-0 exchange, as the trainer does it
        cursor = worker.cursor
        aggregator.init_projections([worker.gradient(aggregator.gradient_request(), sorted(ranks))])
        assert worker.cursor == cursor and not aggregator.needs_gradient_init
    return worker, aggregator


def fresh_worker(method: str = "lordo_global", sync: tuple[int, int] | None = (1, 2), model_seed: int = 1, worker_id=0,
                 k: int = K):
    """Another worker with its own (differently initialised) model and a new optimizer."""
    s = settings(method, sync, k)
    model = tiny_model(model_seed)
    lowrank = lowrank_parameter_names(model) if s.inner.name == "lordo" else []
    return make_worker(worker_id, model, s, shard(), lowrank, TOTAL_STEPS, BATCH, SEQ, seed=0)


def snapshot(state: GlobalState) -> GlobalState:
    """A deep copy: the aggregator updates its θ in place after the round."""
    return GlobalState(round=state.round, params={k: v.clone() for k, v in state.params.items()},
                       projections={k: v.clone() for k, v in state.projections.items()},
                       moments={k: v.clone() for k, v in state.moments.items()}, opt_step=state.opt_step)


# ----------------------------------------------------------------------------- one round


@pytest.mark.parametrize("method", ["lordo_global", "local_adam"])
def test_train_round_returns_the_pseudo_gradient(method):
    worker, agg = setup(method, sync=(1, 2) if method == "lordo_global" else None)
    state = snapshot(agg.global_state())
    names = [n for n, _ in worker.model.named_parameters()]
    update = worker.train_round(state)
    assert update.worker_id == 0 and update.round == 1
    assert set(update.delta) == set(names) == set(state.params)
    after = dict(worker.model.named_parameters())
    for n in names:
        d = update.delta[n]
        assert d.dtype == torch.float32 and d.device.type == "cpu" and d.shape == after[n].shape
        # Δ = θ_ref − θ_after, bit for bit
        assert torch.equal(d, state.params[n] - after[n].detach()), n
        assert d.abs().sum() > 0, f"{n} did not move"
    assert update.tokens == K * BATCH * SEQ == 192
    assert np.isfinite(update.metrics["train_loss"])
    assert 4.0 < update.metrics["train_loss"] < 7.0  # ≈ ln 256 = 5.55 at initialisation
    assert update.opt_step == K
    assert worker.opt_step() == K


def test_train_round_loads_theta_first():
    """Whatever the model held before, the round starts from the global θ."""
    worker, agg = setup()
    state = snapshot(agg.global_state())
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(1.0)
    update = worker.train_round(state)
    after = dict(worker.model.named_parameters())
    for n, ref in state.params.items():
        assert torch.equal(update.delta[n], ref - after[n].detach())
        assert update.delta[n].abs().max() < 0.5  # K small steps from θ, not from θ + 1


def test_update_is_accepted_by_the_aggregator():
    worker, agg = setup()
    u1 = worker.train_round(agg.global_state())
    r1 = agg.aggregate([u1])
    assert r1.accepted == [0] and r1.rejected == {}
    u2 = worker.train_round(agg.global_state())
    r2 = agg.aggregate([u2])
    assert r2.accepted == [0] and r2.rejected == {}
    assert agg.round == 3 and agg.opt_step == 2 * K


# ----------------------------------------------------------------------------- due moments


def test_due_moments_follow_the_periods_and_have_low_rank_shapes():
    worker, agg = setup("lordo_global", sync=(1, 2))
    ranks = agg.ranks
    shapes = {n: tuple(p.shape) for n, p in worker.model.named_parameters()}
    # the low-rank set: every attention/MLP matrix, rank 4 < 64
    assert set(ranks) == {f"layers.{i}.{m}.weight" for i in (0, 1)
                          for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")}

    u1 = worker.train_round(agg.global_state())
    assert set(u1.moments) == {f"exp_avg/{n}" for n in shapes}  # round 1: first moment only
    agg.aggregate([u1])
    u2 = worker.train_round(agg.global_state())
    assert set(u2.moments) == {f"{k}/{n}" for k in ("exp_avg", "exp_avg_sq") for n in shapes}
    for key, m in u2.moments.items():
        name = key.split("/", 1)[1]
        expected = low_rank_shape(shapes[name], RANK) if name in ranks else shapes[name]
        assert tuple(m.shape) == expected, key
        assert m.dtype == torch.float32 and m.device.type == "cpu"
        assert torch.isfinite(m).all()
    assert tuple(u2.moments[f"exp_avg/{WQ}"].shape) == (64, 4)
    assert tuple(u2.moments[f"exp_avg_sq/{W2}"].shape) == (4, 192)  # left projection
    assert tuple(u2.moments["exp_avg/layers.0.mlp.w1.weight"].shape) == (192, 4)
    assert tuple(u2.moments[f"exp_avg/{EMB}"].shape) == (256, 64)
    assert tuple(u2.moments[f"exp_avg_sq/{NORM}"].shape) == (64,)
    # the moments are the optimizer's, copied
    st = worker.optimizer.state[worker.params[WQ]]
    assert torch.equal(u2.moments[f"exp_avg/{WQ}"], st["exp_avg"])
    u2.moments[f"exp_avg/{WQ}"].add_(1.0)
    assert not torch.equal(u2.moments[f"exp_avg/{WQ}"], st["exp_avg"])


def test_moments_of_parameters_that_are_not_low_rank_follow_the_dense_factor():
    """rounds.dense_sync_factor=2 with (K_u, K_v) = (1, 1): the low-rank matrices' moments go every
    round, the embedding's and the norms' every second round; the aggregator takes both."""
    s = settings("lordo_global", sync=(1, 1))
    s.rounds = dataclasses.replace(s.rounds, dense_sync_factor=2)
    model = tiny_model(0)
    ranks = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    worker = make_worker(0, model, s, shard(), lowrank_parameter_names(model), TOTAL_STEPS, BATCH, SEQ, seed=0)
    agg = make_aggregator(model, s, ranks, seed=0)
    agg.init_projections([worker.gradient(agg.gradient_request(), sorted(ranks))])
    dense = sorted(set(worker.params) - set(ranks))
    assert EMB in dense and NORM in dense and len(ranks) == 14
    for r in (1, 2, 3, 4):
        u = worker.train_round(agg.global_state())
        names = {k.split("/", 1)[1] for k in u.moments}
        assert names == (set(worker.params) if r % 2 == 0 else set(ranks)), r
        assert agg.check(u) is None
        agg.aggregate([u])
        assert {k.split("/", 1)[1] for k in agg.global_state().moments} == names


def test_sync_ef_averages_the_error_feedback_buffers_of_the_low_rank_matrices():
    """rounds.sync_ef: every round each worker also sends E (full size, low-rank matrices only),
    the aggregator averages it by tokens and every worker continues from the average."""
    s = settings("lordo_global", sync=(1, 1))
    s.rounds = dataclasses.replace(s.rounds, sync_ef=True)
    model = tiny_model(0)
    ranks = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    workers = [make_worker(i, model, s, shard(i), lowrank_parameter_names(model), TOTAL_STEPS, BATCH, SEQ, seed=i)
               for i in range(2)]
    agg = make_aggregator(model, s, ranks, seed=0)
    agg.init_projections([w.gradient(agg.gradient_request(), sorted(ranks)) for w in workers])
    updates = [w.train_round(snapshot(agg.global_state())) for w in workers]
    for u, w in zip(updates, workers):
        efs = {k.split("/", 1)[1]: v for k, v in u.moments.items() if k.startswith("ef/")}
        assert set(efs) == set(ranks)
        for name, e in efs.items():
            assert e.shape == w.params[name].shape and torch.equal(e, w.optimizer.state[w.params[name]]["ef"])
        assert agg.check(u) is None
    # E is as large as Δ of the low-rank matrices: the reply grows by exactly that
    ef_bytes = sum(4 * updates[0].delta[n].numel() for n in ranks)
    assert sum(4 * v.numel() for k, v in updates[0].moments.items() if k.startswith("ef/")) == ef_bytes
    agg.aggregate(updates)
    state = snapshot(agg.global_state())
    for name in ranks:
        expected = 0.5 * updates[0].moments[f"ef/{name}"] + 0.5 * updates[1].moments[f"ef/{name}"]
        torch.testing.assert_close(state.moments[f"ef/{name}"], expected)
    for w in workers:
        w.load_global_state(state)
        for name in ranks:
            assert torch.equal(w.optimizer.state[w.params[name]]["ef"], state.moments[f"ef/{name}"])
    # without sync_ef nothing of E leaves a worker
    plain, agg2 = setup("lordo_global", sync=(1, 1))
    assert not any(k.startswith("ef/") for k in plain.train_round(agg2.global_state()).moments)


def test_two_phase_switch_inside_a_round():
    """inner.switch_step = 4 with K = 3: round 2 (global steps 3, 4, 5) switches at its second step;
    after it every group has the phase-2 betas and ω, the lr carries the factor, the moments were
    reset ('all': step count restarted, 2 steps since), and the aggregator rotates and rescales
    round 2's moments with the phase-2 betas."""
    s = settings("lordo_global", sync=(1, 1))
    s.inner = dataclasses.replace(s.inner, switch_step=4, switch_betas=(0.99, 0.995), switch_omega=0.9,
                                  switch_reset="all", switch_lr_factor=0.5, schedule="constant", warmup_steps=0)
    model = tiny_model(0)
    ranks = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    worker = make_worker(0, model, s, shard(), lowrank_parameter_names(model), TOTAL_STEPS, BATCH, SEQ, seed=0)
    agg = make_aggregator(model, s, ranks, seed=0)
    agg.init_projections([worker.gradient(agg.gradient_request(), sorted(ranks))])
    u1 = worker.train_round(snapshot(agg.global_state()))
    assert u1.opt_step == 3 and agg.round_betas() == s.inner.betas
    assert all(tuple(g["betas"]) == s.inner.betas and g["omega"] == s.inner.omega
               for g in worker.optimizer.param_groups)
    agg.aggregate([u1])
    u2 = worker.train_round(snapshot(agg.global_state()))
    assert u2.opt_step == 2  # reset at step 4, then steps 4 and 5
    assert all(tuple(g["betas"]) == (0.99, 0.995) and g["omega"] == 0.9 for g in worker.optimizer.param_groups)
    assert u2.metrics["lr"] == pytest.approx(0.5 * s.inner.lr)
    assert agg.round_betas() == (0.99, 0.995)


def test_no_moments_when_never_due():
    worker, agg = setup("diloco", sync=None)
    u = worker.train_round(agg.global_state())
    assert u.moments == {}
    assert not isinstance(worker.optimizer, LoRDO)


# ----------------------------------------------------------------------------- state in


def _trained_worker():
    """A LoRDO worker after round 1, and a round-2 state with θ and the round-1 projections."""
    worker, agg = setup("lordo_global", sync=(1, 1))
    state1 = snapshot(agg.global_state())
    worker.train_round(state1)
    return worker, state1


def test_loaded_moments_overwrite_the_optimizer_state_exactly():
    worker, state1 = _trained_worker()
    opt = worker.optimizer
    g = torch.Generator().manual_seed(7)
    given = {
        f"exp_avg/{EMB}": torch.randn(256, 64, generator=g),
        f"exp_avg_sq/{EMB}": torch.rand(256, 64, generator=g),
        f"exp_avg/{WQ}": torch.randn(64, 4, generator=g),
        f"exp_avg_sq/{W2}": torch.rand(4, 192, generator=g),
    }
    untouched = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in worker.params.items()}
    state = GlobalState(round=2, params=state1.params, moments={k: v.clone() for k, v in given.items()},
                        opt_step=K)
    worker.load_global_state(state)
    for key, value in given.items():
        kind, name = key.split("/", 1)
        assert torch.equal(opt.state[worker.params[name]][kind], value), key
    state.moments[f"exp_avg/{EMB}"].add_(1.0)  # copied, not aliased
    assert torch.equal(opt.state[worker.params[EMB]]["exp_avg"], given[f"exp_avg/{EMB}"])
    # everything not given is as it was (no projections in this state: no rotation)
    for n, before in untouched.items():
        st = opt.state[worker.params[n]]
        for k, v in before.items():
            if f"{k}/{n}" not in given:
                assert torch.equal(st[k], v), (n, k)
        assert int(st["step"]) == K  # the worker's count and the state's agree: nothing is rescaled


def test_new_projection_rotates_the_local_moments():
    worker, state1 = _trained_worker()
    opt = worker.optimizer
    p_wq = worker.params[WQ]
    st = opt.state[p_wq]
    u, v, step = st["exp_avg"].clone(), st["exp_avg_sq"].clone(), int(st["step"])
    p_old = state1.projections[WQ]
    assert torch.equal(st["proj"], p_old)
    p_new = SVDProjection().fit(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)), RANK, "right")
    assert projection_side(p_wq.shape) == "right"
    worker.load_global_state(GlobalState(round=2, params=state1.params, projections={WQ: p_new}, opt_step=K))
    exp_u, exp_v = rotate_moments(u, v, p_old, p_new, "right", step, (0.9, 0.999), True)
    torch.testing.assert_close(st["exp_avg"], exp_u, rtol=0, atol=0)
    torch.testing.assert_close(st["exp_avg_sq"], exp_v, rtol=0, atol=0)
    # by hand: u' = u (P_old P_newᵀ)
    torch.testing.assert_close(st["exp_avg"], u @ (p_old @ p_new.T), rtol=1e-5, atol=1e-7)
    assert torch.equal(st["proj"], p_new)


def test_local_moments_are_rotated_before_the_averaged_ones_are_loaded():
    worker, state1 = _trained_worker()
    st = worker.optimizer.state[worker.params[WQ]]
    u, v, step = st["exp_avg"].clone(), st["exp_avg_sq"].clone(), int(st["step"])
    p_old = state1.projections[WQ]
    p_new = SVDProjection().fit(torch.randn(64, 64, generator=torch.Generator().manual_seed(4)), RANK, "right")
    u_avg = torch.randn(64, 4, generator=torch.Generator().manual_seed(5))
    worker.load_global_state(GlobalState(round=2, params=state1.params, projections={WQ: p_new},
                                         moments={f"exp_avg/{WQ}": u_avg}, opt_step=K))
    # exp_avg: the averaged value as sent (already in the new basis), not rotated again
    assert torch.equal(st["exp_avg"], u_avg)
    # exp_avg_sq: the local one, rotated with the local first moment
    _, exp_v = rotate_moments(u, v, p_old, p_new, "right", step, (0.9, 0.999), True)
    torch.testing.assert_close(st["exp_avg_sq"], exp_v, rtol=0, atol=0)


def test_projections_need_a_lordo_optimizer():
    worker, agg = setup("local_adam", sync=None)
    state = GlobalState(round=1, params=agg.params, projections={WQ: torch.eye(4, 64)})
    with pytest.raises(ValueError, match="not LoRDO"):
        worker.load_global_state(state)


def test_late_joiner_adopts_the_shared_step_count():
    worker, agg = setup("lordo_global", sync=(1, 1))
    agg.aggregate([worker.train_round(agg.global_state())])
    state2 = snapshot(agg.global_state())
    assert {k.split("/")[0] for k in state2.moments} == {"exp_avg", "exp_avg_sq"}
    late = fresh_worker(sync=(1, 1))
    late.load_global_state(state2)
    for key, value in state2.moments.items():
        kind, name = key.split("/", 1)
        st = late.optimizer.state[late.params[name]]
        assert torch.equal(st[kind], value) and int(st["step"]) == K
    update = late.train_round(state2)
    assert update.opt_step == 2 * K


@pytest.mark.parametrize("method, rounds_before", [("lordo_global", 1), ("desloc", 3)])
def test_late_joiner_with_only_the_first_moment_due_starts_afresh(method, rounds_before):
    # lordo_global with periods (1, 2): round 2's state has exp_avg only;
    # desloc (AdamW, periods (3, 6)): round 4's state has exp_avg only
    sync = (1, 2) if method == "lordo_global" else None
    worker, agg = setup(method, sync=sync)
    for _ in range(rounds_before):
        agg.aggregate([worker.train_round(agg.global_state())])
    state = snapshot(agg.global_state())
    assert {k.split("/")[0] for k in state.moments} == {"exp_avg"}
    late = fresh_worker(method, sync=sync)
    update = late.train_round(state)
    assert update.opt_step == K  # u, v and the step count started at zero, as a new optimizer's
    for key, value in update.moments.items():
        kind, name = key.split("/", 1)
        st = late.optimizer.state[late.params[name]]
        assert int(st["step"]) == K and torch.equal(value, st[kind].cpu()), key


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().square().sum() for t in tensors.values()).sqrt())


@pytest.mark.parametrize("method", ["desloc", "lordo_global"])
def test_late_joiners_update_is_the_size_of_an_established_workers(method):
    """The late-joiner bug: a worker without state that receives u but not v used to start v at
    zero under the shared step count, so v̂ ≈ 0 and its steps were ~1000x an established worker's
    here (DES-LOC joining at round 9). Now it starts as a new optimizer does: its first step is of
    the size of any Adam's first step (all coordinates near ±lr: ~5x an established worker's on
    this tiny model), and its whole round is bit for bit a new optimizer's."""
    k = 8
    sync = (1, 2) if method == "lordo_global" else None  # desloc: its own periods (3, 6)
    worker, agg = setup(method, sync=sync, k=k)
    for _ in range(9):
        agg.aggregate([worker.train_round(agg.global_state())])
    state = snapshot(agg.global_state())
    assert {key.split("/")[0] for key in state.moments} == {"exp_avg"} and state.opt_step == 9 * k
    blank_state = dataclasses.replace(snapshot(state), moments={}, opt_step=0)  # what a new optimizer knows
    first_step = {}
    for name, w, st in (("established", worker, state), ("joiner", fresh_worker(method, sync=sync, k=k), state),
                        ("new optimizer", fresh_worker(method, sync=sync, k=k), blank_state)):
        w.load_global_state(snapshot(st))
        before = {n: p.detach().clone() for n, p in w.params.items()}
        w.local_steps(9 * k, 1)
        first_step[name] = _norm({n: before[n] - p.detach() for n, p in w.params.items()})
    assert first_step["joiner"] <= first_step["new optimizer"] * (1 + 1e-6), first_step
    assert first_step["joiner"] < 10 * first_step["established"], first_step
    joined = fresh_worker(method, sync=sync, k=k).train_round(snapshot(state))
    blank = fresh_worker(method, sync=sync, k=k).train_round(blank_state)
    for n in joined.delta:
        assert torch.equal(joined.delta[n], blank.delta[n]), n


def test_a_skipped_round_leaves_step_counts_and_moments_consistent():
    """After a round the server skipped (fewer replies than min_clients) the worker is re-sent the
    same state: its step count must come back to the state's, and the moments it keeps must be
    rescaled so their bias-corrected values (what the step uses) do not change."""
    worker, agg = setup("desloc", sync=None)  # its own periods (3, 6)
    for _ in range(3):
        agg.aggregate([worker.train_round(agg.global_state())])
    state = snapshot(agg.global_state())
    worker.train_round(snapshot(state))  # trained, but the server skips this round
    opt, (b1, b2) = worker.optimizer, worker.optimizer.param_groups[0]["betas"]
    k_worker, k_server = 4 * K, 3 * K
    assert worker.opt_step() == k_worker and state.opt_step == k_server
    kept = {n: (opt.state[p]["exp_avg_sq"].clone(), opt.state[p]["exp_avg"].clone()) for n, p in worker.params.items()}
    worker.load_global_state(snapshot(state))
    for n, p in worker.params.items():
        st = opt.state[p]
        assert int(st["step"]) == k_server, n
        v_before, u_before = kept[n]
        # v is not in this state (desloc: due every 6 rounds): v̂ is what it was
        torch.testing.assert_close(st["exp_avg_sq"] / (1 - b2**k_server), v_before / (1 - b2**k_worker),
                                   rtol=1e-6, atol=0)
        # u is in it (due every 3 rounds): the server's, as sent
        assert torch.equal(st["exp_avg"], state.moments[f"exp_avg/{n}"]), n
    assert worker.train_round(snapshot(state)).opt_step == k_server + K


def test_global_state_lacking_a_parameter_is_an_error():
    worker, agg = setup()
    params = dict(agg.params)
    del params[WQ]
    with pytest.raises(ValueError, match=r"lacks parameters \['layers\.0\.attn\.wq\.weight'\]"):
        worker.load_global_state(GlobalState(round=1, params=params, projections=agg.projections))


# ----------------------------------------------------------------------------- data cursor, checkpoints


def test_data_cursor_advances_by_k_per_round():
    worker, agg = setup()
    assert worker.cursor == 0
    agg.aggregate([worker.train_round(agg.global_state())])
    assert worker.cursor == K
    agg.aggregate([worker.train_round(agg.global_state())])
    assert worker.cursor == 2 * K
    assert int(worker.state_dict()["cursor"]) == 2 * K


def _assert_same_update(a, b) -> None:
    assert set(a.delta) == set(b.delta) and set(a.moments) == set(b.moments)
    for n in a.delta:
        assert torch.equal(a.delta[n], b.delta[n]), n
    for k in a.moments:
        assert torch.equal(a.moments[k], b.moments[k]), k
    assert (a.tokens, a.opt_step, a.round) == (b.tokens, b.opt_step, b.round)
    assert a.metrics == b.metrics


def test_restored_worker_continues_bit_identically():
    original, agg = setup("lordo_global", sync=(1, 2))
    agg.aggregate([original.train_round(agg.global_state())])
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    saved = buf.getvalue()
    restored = fresh_worker(sync=(1, 2), model_seed=1)
    restored.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
    assert restored.cursor == K
    # control: the same checkpoint with the data cursor reset to 0
    rewound = fresh_worker(sync=(1, 2), model_seed=2)
    sd = torch.load(io.BytesIO(saved), weights_only=True)
    sd["cursor"] = torch.tensor(0)
    rewound.load_state_dict(sd)
    for round_ in (2, 3):
        state = snapshot(agg.global_state())
        assert state.round == round_
        ua, ub = original.train_round(state), restored.train_round(state)
        _assert_same_update(ua, ub)
        if round_ == 2:  # control: other batches, another Δ (so the comparison above can fail)
            uc = rewound.train_round(state)
            assert not torch.equal(uc.delta[WQ], ua.delta[WQ])
        agg.aggregate([ua])
    assert original.cursor == restored.cursor == 3 * K


def test_restored_adamw_worker_continues_bit_identically():
    original, agg = setup("desloc", sync=None)
    agg.aggregate([original.train_round(agg.global_state())])
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    buf.seek(0)
    restored = fresh_worker("desloc", sync=None, model_seed=1)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    state = snapshot(agg.global_state())
    _assert_same_update(original.train_round(state), restored.train_round(state))
