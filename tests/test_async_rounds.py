"""Asynchronous rounds on the virtual clock (lordo_fed.async_rounds, the reference trainer's
run_async): the arrival order and staleness by hand, the staleness bound, one worker equal to
synchronous DiLoCo, HeLoCo learning and reproducible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lordo_fed.async_rounds import AsyncConfig, AsyncRule, AsyncServer, VirtualClock
from lordo_fed.methods import resolve_method
from lordo_fed.outer import Average, MomentumLookAhead, Nesterov
from lordo_fed.rounds import RoundConfig
from lordo_fed.trainer.run import run_async, run_rounds

from tests.test_trainer import context, tiny_config


def test_the_clock_orders_by_time_then_worker():
    clock = VirtualClock()
    clock.start(1, 0.0, 6.0)
    clock.start(0, 0.0, 2.0)
    clock.start(2, 2.0, 4.0)  # also at 6: after worker 1
    assert [clock.next() for _ in range(3)] == [(2.0, 0), (6.0, 1), (6.0, 2)]


def test_staleness_and_the_bound():
    """Steps applied between a pull and its push are its staleness; past the bound it is dropped
    (θ and the version unchanged)."""
    server = AsyncServer({"w": torch.zeros(2)}, Average(lr=1.0), AsyncRule(False, False), AsyncConfig(max_staleness=1))
    _, v0 = server.pull()
    _, also_v0 = server.pull()
    assert server.push({"w": torch.ones(2)}, v0, 0, 1.0).staleness == 0
    late = server.push({"w": torch.ones(2)}, also_v0, 1, 2.0)
    assert late.applied and late.staleness == 1  # at the bound: applied
    dropped = server.push({"w": torch.ones(2)}, also_v0, 1, 3.0)
    assert not dropped.applied and dropped.reason == "staleness 2 > max_staleness 1"
    assert server.version == 2 and torch.equal(server.params["w"], torch.full((2,), -2.0))


def test_every_rule_weights_its_arrivals_by_rho():
    """G = ρΔ for async DiLoCo (here with a plain average step: θ moves by −ηρΔ); HeLoCo's first
    arrival (no momentum) likewise."""
    server = AsyncServer({"w": torch.zeros(2)}, Average(lr=1.0), AsyncRule(False, False), AsyncConfig(weight=0.25))
    server.push({"w": torch.tensor([4.0, -8.0])}, 0, 0, 1.0)
    assert torch.equal(server.params["w"], torch.tensor([-1.0, 2.0]))
    heloco = AsyncServer({"w": torch.zeros(1)}, MomentumLookAhead(lr=1.0, momentum=0.5), AsyncRule(True, True),
                         AsyncConfig(weight=0.5))
    heloco.push({"w": torch.tensor([2.0])}, 0, 0, 1.0)  # G = 1: m = 0.5, θ = −(1 + 0.25)
    assert torch.equal(heloco.params["w"], torch.tensor([-1.25]))


def test_look_ahead_pulls_need_the_look_ahead_step():
    with pytest.raises(ValueError, match="need the momentum look-ahead outer step"):
        AsyncServer({"w": torch.zeros(1)}, Nesterov(), AsyncRule(True, False), AsyncConfig())
    server = AsyncServer({"w": torch.zeros(1)}, MomentumLookAhead(lr=1.0, momentum=0.5), AsyncRule(True, False),
                         AsyncConfig())
    server.push({"w": torch.ones(1)}, 0, 0, 1.0)  # m = 0.5, θ = -(1 + 0.25) = -1.25
    theta, version = server.pull()  # θ̄ = θ − η μ m = -1.25 − 0.25
    assert version == 1 and torch.equal(theta["w"], torch.tensor([-1.5]))


@pytest.mark.parametrize("bad,message", [
    (dict(speeds=[1.0]), r"speeds=\[1.0\]: expected 2 values"),
    (dict(speeds=[1.0, 0.0]), "expected virtual seconds per step > 0"),
    (dict(max_staleness=-1), "max_staleness=-1: expected an integer >= 0"),
    (dict(weight=0.0), "weight=0.0: expected a weight > 0"),
    (dict(local_steps=[4]), r"local_steps=\[4\]: expected 2 values"),
    (dict(local_steps=[4, 0]), "expected integers > 0"),
    (dict(order="lifo"), "order='lifo': expected one of"),
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


def test_one_async_worker_is_synchronous_diloco(tmp_path):
    """M = 1: every push is fresh (staleness 0) and one outer step per round, as DiLoCo's."""
    cfg = tiny_config(tmp_path, total_steps=6, rounds=RoundConfig(local_steps=2))
    records: list = []
    ctx = context(cfg, records)
    sync = resolve_method("diloco", cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
    a = dict(run_rounds(ctx, sync).named_parameters())
    b = dict(run_async(ctx, dataclasses.replace(sync, loop="async",
                                                async_rule=AsyncRule(look_ahead=False, correct=False)))
             .named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    moved = [r for r in records if r["method"] == "diloco" and r["round"] == 3][0]
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
    from lordo_fed.appconfig import load_app_config
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
    with pytest.raises(ValueError, match="data_plane.mode='grpc' with the asynchronous variant 'heloco': not built yet"):
        load_app_config({"variant": "heloco", "data-plane": "grpc", "data-plane-insecure": True})
