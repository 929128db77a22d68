"""Asynchronous rounds on the virtual clock (lordo_fed.rounds.async_rounds, the reference trainer's
run_async): the arrival order and staleness by hand, the staleness bound, one worker equal to
synchronous DiLoCo, HeLoCo learning and reproducible."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lordo_fed.rounds.async_rounds import AsyncRule, AsyncServer, SpeedMatch, VirtualClock, arrival_weight
from lordo_fed.rounds.config import AsyncConfig
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.rounds.outer import Average, MomentumLookAhead, Nesterov
from lordo_fed.wire.messages import WorkerUpdate
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.trainer.run import run_async, run_rounds

from tests.unit.test_trainer import context, tiny_config


def test_the_clock_orders_by_time_then_worker():
    clock = VirtualClock()
    clock.start(1, 0.0, 6.0)
    clock.start(0, 0.0, 2.0)
    clock.start(2, 2.0, 4.0)  # also at 6: after worker 1
    assert [clock.next() for _ in range(3)] == [(2.0, 0), (6.0, 1), (6.0, 2)]


def reply(worker: int, **delta: torch.Tensor) -> WorkerUpdate:
    return WorkerUpdate(worker_id=worker, round=1, delta=delta, moments={}, tokens=1, opt_step=0)


def test_staleness_and_the_bound():
    """Steps applied between a pull and its push are its staleness; past the bound it is dropped
    (θ and the version unchanged)."""
    server = AsyncServer({"w": torch.zeros(2)}, Average(lr=1.0), AsyncRule(False, False), AsyncConfig(max_staleness=1))
    first, second = server.pull(), server.pull()
    assert first.version == second.version == 0
    assert server.push(reply(0, w=torch.ones(2)), first, 1.0).staleness == 0
    late = server.push(reply(1, w=torch.ones(2)), second, 2.0)
    assert late.applied and late.staleness == 1  # at the bound: applied
    dropped = server.push(reply(1, w=torch.ones(2)), second, 3.0)
    assert not dropped.applied and dropped.reason == "staleness 2 > max_staleness 1"
    assert server.version == 2 and torch.equal(server.params["w"], torch.full((2,), -2.0))


def test_every_rule_weights_its_arrivals_by_rho():
    """G = ρΔ for async DiLoCo (here with a plain average step: θ moves by −ηρΔ); HeLoCo's first
    arrival (no momentum) likewise."""
    server = AsyncServer({"w": torch.zeros(2)}, Average(lr=1.0), AsyncRule(False, False), AsyncConfig(weight=0.25))
    server.push(reply(0, w=torch.tensor([4.0, -8.0])), server.pull(), 1.0)
    assert torch.equal(server.params["w"], torch.tensor([-1.0, 2.0]))
    heloco = AsyncServer({"w": torch.zeros(1)}, MomentumLookAhead(lr=1.0, momentum=0.5), AsyncRule(True, True),
                         AsyncConfig(weight=0.5))
    heloco.push(reply(0, w=torch.tensor([2.0])), heloco.pull(), 1.0)  # G = 1: m = 0.5, θ = −(1 + 0.25)
    assert torch.equal(heloco.params["w"], torch.tensor([-1.25]))


def test_a_stale_reply_is_weighted_down_by_the_staleness_exponent():
    """ρ_s = ρ·(1+s)^−a: with ρ = 0.5 and a = 1, a fresh reply moves θ by −0.5·Δ, one made two outer
    steps ago by −0.5/3·Δ (a plain average step, lr 1); a = 0 keeps the constant ρ."""
    server = AsyncServer({"w": torch.zeros(1)}, Average(lr=1.0), AsyncRule(False, False),
                         AsyncConfig(weight=0.5, staleness_exponent=1.0))
    stale = server.pull()
    for _ in range(2):
        server.push(reply(0, w=torch.tensor([2.0])), server.pull(), 1.0)  # fresh: −0.5·2 each
    assert torch.equal(server.params["w"], torch.tensor([-2.0]))
    arrival = server.push(reply(1, w=torch.tensor([3.0])), stale, 2.0)
    assert arrival.staleness == 2 and torch.allclose(server.params["w"], torch.tensor([-2.5]))  # −2 − 0.5·3/3
    assert arrival_weight(AsyncConfig(weight=0.5), 7) == 0.5


def test_the_cache_steps_on_every_workers_latest_delta():
    """M = 2, ρ = 1, a plain average step (lr 1): θ moves by −v. Arrivals: worker 0 with 4, worker 0
    with 2, worker 1 with 6, worker 0 with 0. CA²FL (v = the mean of the latest Δs as it stood, zero for a
    worker not yet heard, + Δ − h_w): 0 + 4, 2 + (2 − 4), 1 + 6, 4 + (0 − 2)."""
    arrivals = [(0, 4.0), (0, 2.0), (1, 6.0), (0, 0.0)]
    for cache, steps in (("ca2fl", [4.0, 0.0, 7.0, 2.0]),):
        server = AsyncServer({"w": torch.zeros(1)}, Average(lr=1.0), AsyncRule(False, False),
                             AsyncConfig(cache=cache), workers=2)
        theta = 0.0
        for (worker, delta), step in zip(arrivals, steps):
            server.push(reply(worker, w=torch.tensor([delta])), server.pull(), 1.0)
            theta -= step
            assert server.params["w"].item() == theta, (cache, worker, delta)
        assert {w: h["w"].item() for w, h in server.cache.items()} == {0: 0.0, 1: 6.0}


def test_the_cache_composes_with_rho_and_survives_a_checkpoint():
    """v takes Δ's place before ρ (here 0.5): worker 0's [3, 0, 0] then worker 1's [0, 3, 0] move θ by
    −0.5·[3, 0, 0] and −0.5·([3, 0, 0]/3 + [0, 3, 0]) where without the cache the second moves it by −0.5·[0, 3, 0];
    a server restored from `state_dict` continues exactly as the one it was saved from (the cache and its
    running sum)."""
    def server(cache):
        return AsyncServer({"w": torch.zeros(3)}, Average(lr=1.0), AsyncRule(False, False),
                           AsyncConfig(cache=cache, weight=0.5), workers=3)
    torch.manual_seed(0)
    replies = [(w % 3, torch.randn(3)) for w in range(7)]
    for cache in ("ca2fl",):
        a = server(cache)
        for worker, delta in replies[:4]:
            a.push(reply(worker, w=delta), a.pull(), 1.0)
        tensors, meta = a.state_dict()
        b = server(cache)
        b.params["w"].copy_(a.params["w"])
        b.load_state_dict(tensors, meta)
        for worker, delta in replies[4:]:
            for s in (a, b):
                s.push(reply(worker, w=delta), s.pull(), 1.0)
        assert torch.equal(a.params["w"], b.params["w"]) and b.version == 7
    plain, cached = server("none"), server("ca2fl")
    for s in (plain, cached):
        s.push(reply(0, w=torch.tensor([3.0, 0.0, 0.0])), s.pull(), 1.0)
        s.push(reply(1, w=torch.tensor([0.0, 3.0, 0.0])), s.pull(), 1.0)
    assert torch.equal(plain.params["w"], torch.tensor([-1.5, -1.5, 0.0]))  # −ρΔ each
    assert torch.equal(cached.params["w"], torch.tensor([-2.0, -1.5, 0.0]))  # −ρ·[3, 0, 0], −ρ·[1, 3, 0]


def test_a_malformed_cache_key_in_a_checkpoint_is_refused_with_the_key_named():
    """A cache entry whose worker is not a number, is out of range or has no parameter name is refused
    naming the key, not with a bare int() error; the well-formed entry loads."""
    server = AsyncServer({"w": torch.zeros(3)}, Average(lr=1.0), AsyncRule(False, False),
                         AsyncConfig(cache="ca2fl"), workers=2)
    server.push(reply(0, w=torch.ones(3)), server.pull(), 1.0)
    tensors, meta = server.state_dict()
    for bad in ("async_cache/x/w", "async_cache/2/w", "async_cache/0", "async_cache/-1/w"):
        broken = {**tensors, bad: torch.zeros(3)}
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            server.load_state_dict(broken, meta)
    server.load_state_dict(tensors, meta)
    assert torch.equal(server.cache[0]["w"], torch.ones(3))


def test_a_grace_window_takes_every_arrival_within_it():
    """Arrivals at 2, 3, 3.5 and 6: a window of 1.5 s opened at 2 closes at 3.5 with the first three
    (3.5 is within it); the next one opens at 6. No window: one arrival at a time."""
    def clock() -> VirtualClock:
        c = VirtualClock()
        for worker, at in enumerate((3.0, 2.0, 6.0, 3.5)):
            c.start(worker, 0.0, at)
        return c

    c = clock()
    assert c.window(1.5) == (3.5, [(2.0, 1), (3.0, 0), (3.5, 3)])
    assert c.window(1.5) == (7.5, [(6.0, 2)]) and c.peek() is None
    c = clock()
    assert [c.window(0.0) for _ in range(4)] == [(2.0, [(2.0, 1)]), (3.0, [(3.0, 0)]), (3.5, [(3.5, 3)]),
                                               (6.0, [(6.0, 2)])]


def test_look_ahead_pulls_need_the_look_ahead_step():
    with pytest.raises(ValueError, match="need the momentum look-ahead outer step"):
        AsyncServer({"w": torch.zeros(1)}, Nesterov(), AsyncRule(True, False), AsyncConfig())
    server = AsyncServer({"w": torch.zeros(1)}, MomentumLookAhead(lr=1.0, momentum=0.5), AsyncRule(True, False),
                         AsyncConfig())
    server.push(reply(0, w=torch.ones(1)), server.pull(), 1.0)  # m = 0.5, θ = -(1 + 0.25) = -1.25
    pull = server.pull()  # θ̄ = θ − η μ m = -1.25 − 0.25
    assert pull.version == 1 and torch.equal(pull.params["w"], torch.tensor([-1.5]))


@pytest.mark.parametrize("bad,message", [
    (dict(speeds=[1.0]), r"speeds=\[1.0\]: expected 2 values"),
    (dict(speeds=[1.0, 0.0]), "expected virtual seconds per step > 0"),
    (dict(max_staleness=-1), "max_staleness=-1: expected an integer >= 0"),
    (dict(weight=0.0), "weight=0.0: expected a weight > 0"),
    (dict(staleness_exponent=-0.5), "staleness_exponent=-0.5: expected an exponent >= 0"),
    (dict(grace=float("nan")), "grace=nan: expected seconds >= 0"),
    (dict(local_steps=[4]), r"local_steps=\[4\]: expected 2 values"),
    (dict(local_steps=[4, 0]), "expected integers > 0"),
    (dict(order="lifo"), "order='lifo': expected one of"),
    (dict(cache="saga"), "cache='saga': expected one of"),
])
def test_bad_async_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        AsyncConfig(**bad).validate(workers=2)


def test_arrival_order_and_staleness_on_the_virtual_clock(tmp_path):
    """M = 2, speeds 1 and 3, K = 2, 4 pushes. Worker 0 pushes at t = 2, 4, 6 (from versions 0, 1,
    2: staleness 0 each), worker 1 at t = 6 from version 0, after worker 0's (same time, lower
    id): staleness 3. With max_staleness 2 that push is dropped."""
    for bound, dropped in ((0, 0), (2, 1)):
        cfg = tiny_config(tmp_path, workers=2, total_steps=4, rounds=RoundConfig(local_steps=2),
                          async_rounds=AsyncConfig(speeds=[1.0, 3.0], max_staleness=bound))
        records: list = []
        settings = resolve_method("async_diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        run_async(context(cfg, records), settings)
        first, second = [r for r in records if r.get("pushes")]
        assert (first["virtual_time"], first["pushes_by_worker"], first["staleness"]) == (4.0, [2, 0], {"0": 2})
        assert (second["virtual_time"], second["pushes_by_worker"]) == (6.0, [1, 1])
        assert second["staleness"] == {"0": 1, "3": 1} and second["staleness_max"] == 3
        assert second["dropped"] == dropped and second["outer_steps"] == 4 - dropped
        assert second["tokens"] == 4 * 2 * cfg.data.batch_size * cfg.data.seq_len


@pytest.mark.parametrize("method", ["diloco", "lordo_global"])
def test_one_async_worker_is_the_synchronous_method(tmp_path, method):
    """M = 1 with the synchronous rule (pull θ, no correction, ρ = 1): every push is fresh
    (staleness 0) and one outer step per round. DiLoCo: as its rounds. LoRDO-Global (async LoRDO):
    the moments are the worker's (blend weight 1/M = 1), the basis is refitted after each arrival
    from G = Δ with the round's seed: LoRDO-Global's rounds, step for step."""
    cfg = tiny_config(tmp_path, total_steps=6, rounds=RoundConfig(local_steps=2))
    records: list = []
    ctx = context(cfg, records)
    sync = resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
    a = dict(run_rounds(ctx, sync).named_parameters())
    b = dict(run_async(ctx, dataclasses.replace(sync, loop="async",
                                                async_rule=AsyncRule(look_ahead=False, correct=False)))
             .named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    moved = [r for r in records if r["method"] == method and r["round"] == 3][0]
    assert moved["val_loss"] < records[0]["val_loss"]  # the two models trained, and equally


def test_heloco_learns_and_is_reproducible(tmp_path):
    cfg = tiny_config(tmp_path, workers=3, total_steps=8, rounds=RoundConfig(local_steps=2),
                      async_rounds=AsyncConfig(speeds=[1.0, 1.0, 3.0]))
    runs = []
    for _ in range(2):
        records: list = []
        settings = resolve_method("heloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        assert settings.outer.name == "mla" and settings.outer.lr == cfg.diloco_outer.lr
        model = run_async(context(cfg, records), settings)
        runs.append((records, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (records, theta), (_, again) = runs
    assert all(torch.equal(theta[n], again[n]) for n in theta)
    last = records[-1]
    assert last["pushes"] == 12 and last["val_loss"] < records[0]["val_loss"]
    assert sum(r.get("staleness_max", 0) for r in records) > 0  # the slow worker's pushes were stale
    # The correction is wired in: HeLoCo leaves the look-ahead-only run (same schedule, same pulls).
    lookahead = resolve_method("async_lookahead", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
    plain = dict(run_async(context(cfg, []), lookahead).named_parameters())
    assert any(not torch.equal(plain[n], theta[n]) for n in theta)


def test_per_worker_local_steps_on_the_virtual_clock(tmp_path):
    """GradSkip's per-node work: worker 1 runs 1 step per round where worker 0 runs 2, both at
    speed 1, so worker 1 pushes twice as often with half the tokens; the budget is tokens
    (2 workers x 4 steps), 4 + 2 pushes: worker 0 at t = 2, 4; worker 1 at t = 1, 2, 3, 4, so the
    records (every 2 pushes) see [w1, w0], [w1, w1], [w0, w1]."""
    cfg = tiny_config(tmp_path, workers=2, total_steps=4, rounds=RoundConfig(local_steps=2),
                      async_rounds=AsyncConfig(local_steps=[2, 1]))
    records: list = []
    run_async(context(cfg, records), resolve_method("async_diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer))
    pushes = [r for r in records if r.get("pushes")]
    assert [r["pushes_by_worker"] for r in pushes] == [[1, 1], [0, 2], [1, 1]]
    assert [r["virtual_time"] for r in pushes] == [2.0, 3.0, 4.0]
    tokens = cfg.data.batch_size * cfg.data.seq_len
    assert pushes[-1]["tokens"] == 8 * tokens and pushes[-1]["step"] == 4


def test_node_settings_for_asynchronous_rounds_are_checked(tmp_path):
    """A node's `slowdown` and `local-steps` (node config) are checked with a message naming them;
    nodes may run their own local steps only in an asynchronous run; the gRPC data plane does not
    carry asynchronous rounds yet."""
    from lordo_fed.app.config import load_app_config
    from lordo_fed.node.runtime import Job, runtime_for

    for value in (0.5, "fast", True):
        with pytest.raises(ValueError, match=f"node config slowdown={value!r}: expected a number >= 1"):
            Job("train", 1, {}, (), {"slowdown": value}).slowdown
    assert Job("train", 1, {}, (), {"slowdown": 3}).slowdown == 3.0
    base = {"model-preset": "tiny", "output-dir": str(tmp_path), "seq-len": 16}
    sync = Job("train", 7, base, (), {"local-steps": 4})
    with pytest.raises(ValueError, match="node config local-steps=4: nodes may run their own number of local steps "
                                         "only with an asynchronous variant"):
        sync.local_steps(runtime_for(sync))
    run = {**base, "variant": "heloco", "async-local-steps": "5,6"}
    assert Job("train", 8, run, (), {"partition-id": 1}).local_steps(runtime_for(Job("train", 8, run, (), {}))) == 6
    assert Job("train", 8, run, (), {"local-steps": 2}).local_steps(runtime_for(Job("train", 8, run, (), {}))) == 2
    with pytest.raises(ValueError, match=r"no entry for partition 2"):
        Job("train", 8, run, (), {"partition-id": 2}).local_steps(runtime_for(Job("train", 8, run, (), {})))
    # Asynchronous rounds run on the gRPC data plane too (sessions: lordo_fed/node/session.py).
    assert load_app_config({"variant": "heloco", "data-plane": "grpc", "data-plane-insecure": True}).data_plane.mode == "grpc"
    # the method's own checks run when the run's settings load, naming the run-config key
    with pytest.raises(ValueError, match="run-config key 'sync-ef': rounds.sync_ef=True with the asynchronous method "
                                         "'async_lordo'"):
        load_app_config({"variant": "async_lordo", "sync-ef": True})


def test_async_lordo_learns_with_stale_bases(tmp_path):
    """Three workers, one 3x slower: its replies come from bases refitted since its pull (their
    moments are rotated into the current basis); the loss goes down and HeLoCo's correction
    changes the result."""
    cfg = tiny_config(tmp_path, workers=3, total_steps=8, rounds=RoundConfig(local_steps=2),
                      async_rounds=AsyncConfig(speeds=[1.0, 1.0, 3.0], weight=0.6))
    thetas = {}
    for method in ("async_lordo", "heloco_lordo"):
        records: list = []
        settings = resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        assert settings.inner.name == "lordo" and settings.outer.name == "mla"
        thetas[method] = {n: p.detach().clone() for n, p in run_async(context(cfg, records), settings).named_parameters()}
        assert records[-1]["pushes"] == 12 and records[-1]["val_loss"] < records[0]["val_loss"]
        assert max(r.get("staleness_max", 0) for r in records) >= 2
        # replies carry Δ and the low-rank moments; pulls θ, the bases and the moments
        assert records[-1]["bytes_sent_per_worker"] > 4 * sum(t.numel() for t in thetas[method].values())
    assert any(not torch.equal(thetas["async_lordo"][n], thetas["heloco_lordo"][n]) for n in thetas["async_lordo"])


def test_a_stale_replys_moments_are_rotated_from_the_basis_it_trained_in():
    """M = 2, one 5x3 matrix at rank 2. A worker pulls basis 0; two other arrivals refit the
    basis (1); its reply's moments (step 4) are then moved to the shared step count (6) and
    rotated from basis 0 into basis 1 with LDAdam's rule, and blended with weight 1/M into the
    averaged moments; the refit is the top-2 subspace of the two applied updates."""
    from lordo_fed.rounds.aggregator import Aggregator
    from lordo_fed.optim.bias import restep
    from lordo_fed.optim.rotation import rotate_moments
    from lordo_fed.optim.projection import get_projection_method, projection_side

    torch.manual_seed(0)
    shape, betas = (5, 3), (0.9, 0.99)
    agg = Aggregator({"w": torch.zeros(shape)}, {"w": 2}, RoundConfig(local_steps=2), Average(lr=1.0),
                     get_projection_method("svd"), seed=3, betas=betas)
    server = AsyncServer(agg.params, agg.outer, AsyncRule(False, False), AsyncConfig(), lowrank=agg, workers=2)
    side = projection_side(shape)
    low = (5, 2) if side == "right" else (2, 3)

    def moments(scale: float) -> dict[str, torch.Tensor]:
        return {"exp_avg/w": scale * torch.randn(low), "exp_avg_sq/w": scale * torch.rand(low)}

    stale = server.pull()
    assert stale.basis == 0 and set(stale.projections) == {"w"}
    deltas = [torch.randn(shape), torch.randn(shape)]
    for i, d in enumerate(deltas):
        server.push(WorkerUpdate(1, 1, {"w": d}, moments(1.0), 4, opt_step=6), server.pull(), float(i))
    assert server.basis == 1 and server.since_refit == 0
    old_basis = agg.projection.basis(stale.projections["w"], shape, side)
    new_basis = agg.projection.basis(agg.projections["w"], shape, side)
    summed = deltas[0] + deltas[1]
    u, s, vh = torch.linalg.svd(summed)
    expected_basis = u[:, :2] if side == "left" else vh[:2]
    assert torch.allclose((new_basis @ new_basis.T) if side == "left" else (new_basis.T @ new_basis),
                          (expected_basis @ expected_basis.T) if side == "left" else (expected_basis.T @ expected_basis),
                          atol=1e-5)
    before = {k: v.clone() for k, v in agg.moments.items()}
    theirs = moments(2.0)
    server.push(WorkerUpdate(0, 1, {"w": torch.randn(shape)}, theirs, 4, opt_step=4), stale, 2.0)
    u4 = restep(theirs["exp_avg/w"], "exp_avg", 4, 6, betas)
    v4 = restep(theirs["exp_avg_sq/w"], "exp_avg_sq", 4, 6, betas)
    u_rot, v_rot = rotate_moments(u4, v4, old_basis, new_basis, side, 6, betas)
    torch.testing.assert_close(agg.moments["exp_avg/w"], 0.5 * before["exp_avg/w"] + 0.5 * u_rot)
    torch.testing.assert_close(agg.moments["exp_avg_sq/w"], 0.5 * before["exp_avg_sq/w"] + 0.5 * v_rot)
    assert agg.opt_step == 6 and server._bases == {}  # basis 0 is let go once no pull trains in it


def test_speed_match_gives_each_node_the_steps_that_equalise_round_times():
    """`SpeedMatch` with K = 8, hand-computed: node 0 trains 0.1 s a step with 0.2 s of transfers,
    node 1 is 4x slower at computing (0.4 s a step, 0.2 s), node 2 is on a slow link (0.1 s a step,
    3.0 s of transfers). At K steps their rounds take 1.0, 3.4 and 3.8 s, 2.733 s on average; node 2
    cannot finish a round in less than 3.0 + 0.1 = 3.1 s, so that is the target: node 0 gets
    (3.1 − 0.2)/0.1 = 29 steps, node 1 (3.1 − 0.2)/0.4 = 7.25 → 7, node 2 one. Until a node was
    measured it trains K; steps stay within [1, 4K]."""
    match = SpeedMatch(8)
    assert match.target() is None and match.steps(0) == 8
    match.observe(0, round_seconds=1.0, train_seconds=0.8, steps=8)
    assert match.steps(0) == 8 and match.steps(1) == 8  # one node: the target is its own round
    match.observe(1, round_seconds=3.4, train_seconds=3.2, steps=8)
    match.observe(2, round_seconds=3.8, train_seconds=0.8, steps=8)
    assert match.target() == pytest.approx(3.1)
    assert [match.steps(p) for p in (0, 1, 2)] == [29, 7, 1]
    # Without the slow link the target is the mean round at K steps: (1.0 + 3.4) / 2 = 2.2 s.
    two = SpeedMatch(8)
    two.observe(0, 1.0, 0.8, 8)
    two.observe(1, 3.4, 3.2, 8)
    assert two.target() == pytest.approx(2.2) and [two.steps(0), two.steps(1)] == [20, 5]
    # Rounds at those steps take about the target: 0.2 + 29·0.1 = 3.1 s.
    match.observe(0, round_seconds=0.2 + 29 * 0.1, train_seconds=29 * 0.1, steps=29)
    assert match.fixed[0] == pytest.approx(0.2) and match.per_step[0] == pytest.approx(0.1)
    # A much faster node is capped at 4K; a round with nothing trained teaches nothing.
    match.observe(3, round_seconds=0.11, train_seconds=0.08, steps=8)
    assert match.steps(3) == 32
    match.observe(3, round_seconds=5.0, train_seconds=0.0, steps=8)
    assert match.per_step[3] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="expected K >= 1"):
        SpeedMatch(0)


def test_speed_match_needs_arrival_order_and_no_fixed_steps():
    AsyncConfig(match_speed=True).validate()
    for bad in (dict(order="virtual"), dict(local_steps=[2, 3])):
        with pytest.raises(ValueError, match="async_rounds.match_speed=True with order="):
            AsyncConfig(match_speed=True, **bad).validate()


def test_a_node_refuses_local_steps_it_cannot_take(tmp_path):
    """A start point that asks for more local steps than the run has, or any with a synchronous
    method, is refused before training, naming the value."""
    from lordo_fed.node.runtime import Job, run_job, runtime_for
    from lordo_fed.node.store import DiskStore
    from lordo_fed.wire.encode import encode_global_state
    from lordo_fed.wire.messages import GlobalState

    for variant, too_many in (("heloco", True), ("lordo_global", False)):
        run = {"model-preset": "tiny", "output-dir": str(tmp_path), "seq-len": 16, "variant": variant}
        job = Job("train", 9, run, (), {"partition-id": 0, "num-partitions": 2})
        rt = runtime_for(job)
        steps = rt.cfg.total_steps + 1 if too_many else 2
        data = encode_global_state(GlobalState(round=1, params={}, params_from_seed=True, local_steps=steps), rt.model_id)
        with pytest.raises(ValueError, match=f"the server asks for {steps} local steps: expected only in asynchronous "
                                             f"rounds, and at most the run's {rt.cfg.total_steps} steps"):
            run_job(job, lambda timeout: data, store_for=lambda cfg, pid: DiskStore(tmp_path / "state", pid))


def test_each_node_gets_its_pull_as_the_change_from_its_own_copy():
    """Compressed both ways (`NodeCopies`): two nodes pull a moving θ at different times; each is
    sent the int8 change from the copy it holds. What the node starts from (its `Downlink`, as a
    node decodes it) is the server's record of its copy bit for bit, within the codec's error of
    the θ pulled, and what one change leaves out goes with the next: pulled again at a θ that
    stands still, the node's copy closes in on it. A node forgotten (its message failed) gets θ whole."""
    from lordo_fed.rounds.async_rounds import NodeCopies, Pull
    from lordo_fed.rounds.downlink import Downlink
    from lordo_fed.wire.messages import GlobalState
    from lordo_fed.wire.payload import resolve_payload

    torch.manual_seed(0)
    codecs = resolve_payload("int8").codecs
    copies = NodeCopies(codecs)
    nodes = {0: Downlink(codecs), 1: Downlink(codecs)}
    rounds = {0: 0, 1: 0}
    theta = {"w": torch.randn(32, 64), "b": torch.randn(64)}

    def pull(w: int, moments: dict | None = None) -> tuple[GlobalState, dict, dict]:
        rounds[w] += 1
        p = Pull({n: t.clone() for n, t in theta.items()}, 0)
        state = copies.start_point(w, GlobalState(round=rounds[w], params=p.params, moments=moments or {}), p)
        got = nodes[w].theta(state, theta)
        assert all(torch.equal(got[n], p.params[n]) for n in theta), "node and server disagree on the copy"
        return state, got, p.params

    for w in (0, 1):  # first pulls: θ whole
        state, got, _ = pull(w)
        assert not state.params_delta and all(torch.equal(got[n], theta[n]) for n in theta)
    whole = sum(4 * t.numel() for t in theta.values())
    held = {w: {n: t.clone() for n, t in theta.items()} for w in (0, 1)}
    for step in range(6):  # θ moves (other nodes' pushes); the nodes pull in turn, each from its own copy
        for n in theta:
            theta[n] += 0.01 * torch.randn_like(theta[n])
        w = step % 2
        change = {n: theta[n] - held[w][n] for n in theta}
        state, got, _ = pull(w)
        assert state.params_delta
        assert sum(e.nbytes for e in state.params.values()) < whole / 3
        for n in theta:  # int8, one scale per 64 values: |error| ≤ half a step, largest |change| / 127 / 2
            assert (got[n] - theta[n]).abs().max() <= change[n].abs().max() / 254 * (1 + 1e-5), n
        held[w] = {n: t.clone() for n, t in got.items()}
    errors = []
    for _ in range(3):  # θ stands still: the leftover of each change goes with the next pull
        _, got, _ = pull(0)
        errors.append(max((got[n] - theta[n]).abs().max().item() for n in theta))
    assert errors[-1] < 0.05 * errors[0], errors
    state, _, _ = pull(1, moments={"w::m": torch.randn(32, 8)})
    assert all(hasattr(e, "nbytes") and not isinstance(e, torch.Tensor) for e in state.moments.values())

    copies.forget(0)
    for n in theta:
        theta[n] += 0.01 * torch.randn_like(theta[n])
    state, got, _ = pull(0)
    assert not state.params_delta and all(torch.equal(got[n], theta[n]) for n in theta)
    assert copies.start_point(0, GlobalState(round=9, params=theta), Pull(theta, 0)).params_delta
    assert NodeCopies(None).start_point(0, GlobalState(round=1, params=theta), Pull(theta, 0)).params is theta


class _Ranks:
    """A node's control group as one rank sees it: what the lead hands on (`incoming`, for a
    follower), what this rank broadcast (`sent`, for the lead)."""

    def __init__(self, rank: int, incoming=()):
        self.rank, self.lead, self.world = rank, rank == 0, 2
        self.incoming, self.sent = list(incoming), []

    def broadcast_bytes(self, data):
        if data is not None:
            self.sent.append(bytes(data))
            return data
        return bytearray(self.incoming.pop(0))


def test_a_nodes_other_ranks_leave_an_ended_session_quietly(tmp_path, caplog):
    """A node of several ranks in an asynchronous session: when the server has no further round,
    the lead hands on the session's end (not the empty state of a failed download), and the other
    ranks leave that job with one info line, where a failed download is still logged as a failure."""
    import json
    import logging

    from lordo_fed.node.service import SESSION_ENDED, NodeWorkerServicer, follow
    from lordo_fed.transport.client import DataPlaneError, SessionEnded
    from lordo_fed.v1 import node_pb2

    run = {"model-preset": "tiny", "output-dir": str(tmp_path), "seq-len": 16, "variant": "lordo_global"}
    request = node_pb2.NodeJob(kind="train", run_id=9, run_config_json=json.dumps(run),
                               node_config_json=json.dumps({"partition-id": 0, "num-partitions": 2}))
    for cause, handed in ((SessionEnded("no round"), SESSION_ENDED), (DataPlaneError("refused"), b"")):
        lead = _Ranks(0)

        def receive(timeout, cause=cause):
            raise cause
        with pytest.raises(type(cause)):
            NodeWorkerServicer(ranks=lead)._hand_on(request, receive)(60.0)
        assert json.loads(lead.sent[0])["run_id"] == 9 and lead.sent[1:] == [handed]
    lead = _Ranks(0)
    assert bytes(NodeWorkerServicer(ranks=lead)._hand_on(request, lambda timeout: b"state")(60.0)) == b"state"
    assert lead.sent[1:] == [b"state"]

    spec = lead.sent[0]
    follower = _Ranks(1, [spec, SESSION_ENDED, spec, b"", b""])  # session end, failed download, shutdown
    with caplog.at_level(logging.INFO, logger="lordo_fed.node"):
        follow(follower)
    assert follower.incoming == []
    ended = [r for r in caplog.records if "session of run 9 ended" in r.getMessage()]
    failed = [r for r in caplog.records if "job train of run 9 failed" in r.getMessage()]
    assert len(ended) == 1 and ended[0].levelno == logging.INFO and ended[0].exc_info is None
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
    assert "its download failed" in str(failed[0].exc_info[1])
