"""Asynchronous rounds over real Flower (issue 13): the simulation engine against the reference
trainer's virtual clock, and a deployment on 127.0.0.1 with one really slowed node.

- Parity: `async-order='virtual'` applies replies in the virtual clock's order, so a Flower run and
  `run_async` on the same settings apply the same Δs in the same order from the same pulls: the
  same θ (fp32, one thread: max |Δθ| ≤ 1e-5), the same staleness and pushes per worker.
- Deployment: two SuperNodes, one with `slowdown=20` in its node config (it sleeps after its local
  steps until its round took 20 times as long: a few seconds, against Flower's ~3 s per message
  here); `async-order='arrival'`: the fast node makes more rounds than the slow one and the slow
  one's replies are stale, the budget of tokens is kept and the loss goes down.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lordo_fed.app.config import load_app_config
from lordo_fed.checkpoint import load_checkpoint
from lordo_fed.data import load_dataset
from lordo_fed.device import pick_device
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_async
from harness.deployment import Deployment
from harness.flower import flower_env, run_simulation
from tests.unit.test_appconfig import pyproject_config
from tests.integration.test_flower_app import APP, server_records, tiny_run_config

pytestmark = pytest.mark.slow


def reference_async(run_config: dict, workers: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`run_async` on the Flower run's settings: its final θ and its records."""
    app = load_app_config({**pyproject_config(), **run_config})
    common = {f.name: getattr(app, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(app, f.name)}
    cfg = TrainConfig(**{**common, "methods": [app.variant], "workers": workers, "total_steps": app.total_steps,
                         "progress": False}).validate()
    records: list[dict] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = load_dataset(cfg.data, workers)
        ctx = RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), records.append)
        model = run_async(ctx, resolve_method(app.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer))
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


def flower_theta(out: Path) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(out / "checkpoints")
    return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}


@pytest.mark.parametrize("variant,extra", [
    ("heloco", {"async-grace": 1.5, "async-staleness-exponent": 0.5}),
    ("async_diloco", {}),
    ("heloco_lordo", {}),
], ids=["heloco-grace-staleness", "async_diloco", "heloco_lordo"])
def test_virtual_order_simulation_matches_the_reference_trainer(tmp_path, variant, extra):
    """Three partitions, one 3x slower, one with its own local steps (per-node work): the Flower
    server applies the replies in the reference trainer's order, to the same θ; for async LoRDO
    with HeLoCo's correction too (round-0 gradient bases, moments blended, rotated out of stale
    bases, bases refitted every 3 replies); for HeLoCo with a grace window of 1.5 virtual seconds
    (partition 1 arrives at t = 2, partition 0 at t = 3 within its window: both pull at t = 3.5)
    and stale replies weighted down, ρ·(1+s)^−0.5."""
    run_config = tiny_run_config(tmp_path, variant=variant, **{
        "num-server-rounds": 3, "min-clients": 3, "async-order": "virtual", "async-speeds": "1,1,3",
        "async-local-steps": "3,2,3", "async-weight": 0.5, **extra})
    proc = run_simulation(APP, flower_env(tmp_path), num_supernodes=3, run_config=run_config, timeout=300, check=True,
                          log_path=tmp_path / "sim.log")
    assert "lordo-fed: metrics" in proc.stdout
    records = server_records(tmp_path / "out")
    reference, ref_records = reference_async(run_config, workers=3)
    flower = flower_theta(tmp_path / "out")
    worst = max((flower[n] - reference[n]).abs().max().item() for n in reference)
    print(f"async parity ({variant}): max |θ_flower − θ_reference| = {worst:.3g}")
    assert worst <= 1e-5, f"max |θ_flower − θ_reference| = {worst}"
    keys = ("round", "pushes", "tokens", "staleness", "pushes_by_worker", "virtual_time", "outer_steps")
    assert [{k: r[k] for k in keys} for r in records[1:]] == [{k: r[k] for k in keys} for r in ref_records[1:]]
    assert max(r["staleness_max"] for r in records[1:]) >= 1  # the slow worker's replies were stale
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert abs(records[-1]["val_loss"] - ref_records[-1]["val_loss"]) < 1e-4


def test_async_resume_continues_from_the_checkpoint(tmp_path):
    """A second run with `resume` continues the asynchronous schedule: θ, outer momentum, the shared
    bases, averaged moments and the updates summed since the last refit (async LoRDO), pushes and
    each partition's round from the checkpoint; the nodes find their own state (none fresh)."""
    env = flower_env(tmp_path)
    out = tmp_path / "out"
    config = {"variant": "heloco_lordo", "async-order": "virtual", "async-speeds": "1,2"}
    run_simulation(APP, env, 2, tiny_run_config(tmp_path, **config), timeout=240, check=True)
    first = server_records(out)
    meta = load_checkpoint(out / "checkpoints")[1]
    assert meta["async"]["pushes"] == 4 and meta["async"]["rounds"] == {"0": 3, "1": 1}
    assert meta["async"]["basis"] == 2 and meta["async"]["since_refit"] == 0
    proc = run_simulation(APP, env, 2, tiny_run_config(tmp_path, **config, **{
        "num-server-rounds": 3, "resume": str(out / "checkpoints")}), timeout=240, check=True)
    assert "resumed from" in proc.stdout
    records = server_records(out)
    assert records[:len(first)] == first
    assert [r["pushes"] for r in records[len(first):]] == [6]
    assert records[-1]["tokens"] == 3 * 2 * 3 * 4 * 32
    assert sum(r["clients_fresh_state"] for r in records[1:]) == 0
    meta = load_checkpoint(out / "checkpoints")[1]
    assert sum(meta["async"]["rounds"].values()) == 6 and meta["async"]["version"] == 6


def test_deployment_with_a_slowed_node(tmp_path):
    """A real SuperLink and two SuperNodes, node 2 slowed (node config `slowdown=20`): replies are
    applied as they arrive; the fast node trains more rounds, the slow node's replies are stale;
    the run keeps the synchronous run's token budget."""
    with Deployment(tmp_path, num_nodes=2, node_configs=[{}, {"slowdown": 20.0}]) as dep:
        run_config = tiny_run_config(tmp_path, variant="heloco", **{"num-server-rounds": 4, "async-weight": 0.7})
        dep.run(APP, run_config, timeout=300, check=True)
    records = server_records(tmp_path / "out")
    pushes = [sum(r["pushes_by_worker"][p] for r in records[1:]) for p in (0, 1)]
    assert pushes[0] > pushes[1] >= 1, pushes
    assert records[-1]["tokens"] == 2 * 4 * 3 * 4 * 32
    assert any(int(s) >= 1 for r in records[1:] for s in r["staleness"])
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    meta = load_checkpoint(tmp_path / "out" / "checkpoints")[1]
    assert meta["async"]["pushes"] == sum(pushes)
    print(f"slowed node: pushes per partition {pushes}, staleness "
          f"{json.dumps([r['staleness'] for r in records[1:]])}")
