"""A Flower simulation in which one node sends NaN-poisoned updates
(harness/apps/hostile_clientapp.py): the run completes with the other node, and the server log
names the rejected node every round."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from lordo_fed.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def hostile_app(tmp_path: Path) -> Path:
    """This app with harness/apps/hostile_clientapp.py as its ClientApp (a throwaway app directory)."""
    app = tmp_path / "app"
    for d in ("server", "client"):
        shutil.copytree(ROOT / d, app / d, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "harness" / "apps").mkdir(parents=True)
    shutil.copy(ROOT / "harness" / "apps" / "hostile_clientapp.py", app / "harness" / "apps" / "hostile_clientapp.py")
    text = (ROOT / "pyproject.toml").read_text()
    assert 'clientapp = "client.app:app"' in text and 'fab-include = ["server/**/*.py"' in text
    text = text.replace('clientapp = "client.app:app"', 'clientapp = "harness.apps.hostile_clientapp:app"')
    text = text.replace('fab-include = ["server/**/*.py"', 'fab-include = ["harness/apps/hostile_clientapp.py", "server/**/*.py"')
    (app / "pyproject.toml").write_text(text)
    assert tomllib.loads(text)["tool"]["flwr"]["app"]["components"]["clientapp"] == "harness.apps.hostile_clientapp:app"
    return app


@pytest.mark.slow
def test_simulation_drops_a_hostile_client(tmp_path):
    """Two SuperNodes, partition 1 poisons every update with a NaN: both rounds complete with the
    other node alone (min-clients=1), the server names the rejected node each round."""
    from harness.flower import flower_env, run_simulation

    out = tmp_path / "out"
    run_config = {"preset": "quickstart", "num-server-rounds": 2, "local-steps": 2, "batch-size": 2, "seq-len": 16,
                  "eval-batches": 1, "threads": 1, "min-clients": 1, "output-dir": str(out)}
    proc = run_simulation(hostile_app(tmp_path), flower_env(tmp_path), num_supernodes=2, run_config=run_config,
                          timeout=240, check=True, log_path=tmp_path / "sim.log")
    found = re.findall(r"round (\d): dropped reply of node (\d+) \(partition 1\): (\S+): contains NaN or Inf",
                       proc.stdout)
    assert [r for r, _, _ in found] == ["1", "2"], proc.stdout[-3000:]
    assert found[0][1] == found[1][1]  # the same node both rounds
    node = found[0][1]
    records = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for rec in records[1:]:
        assert rec["clients_ok"] == 1 and rec["clients_dropped"] == 1
        assert f"node {node} (partition 1): " in rec["dropped"] and "contains NaN or Inf" in rec["dropped"]
        assert rec["tokens"] == rec["round"] * 2 * 2 * 16  # one client's tokens per round
    tensors, meta = load_checkpoint(out / "checkpoints")
    assert meta["round"] == 2
    assert all(torch.isfinite(t).all() for k, t in tensors.items() if k.startswith("param/"))


@pytest.mark.slow
@pytest.mark.parametrize("sessions", [
    pytest.param(False, marks=pytest.mark.extended),  # the CI lane runs the data plane's sessions
    True,
], ids=["flower-messages", "data-plane-sessions"])
def test_asynchronous_rounds_drop_a_hostile_client(tmp_path, sessions):
    """The same poisoned node under asynchronous rounds (HeLoCo, replies in the virtual clock's
    order, both partitions at one speed: they alternate): each of its replies is refused on arrival
    with the reason, nothing of it reaches θ, the other node's replies are applied, and the run
    ends with every round of the budget accounted for. Its replies travel in Flower messages, or
    as the uploads of its session on the gRPC data plane (no Flower message between its rounds)."""
    from harness.flower import flower_env, run_simulation

    out = tmp_path / "out"
    run_config = {"preset": "quickstart", "variant": "heloco", "num-server-rounds": 2, "local-steps": 2,
                  "batch-size": 2, "seq-len": 16, "eval-batches": 1, "threads": 1, "min-clients": 2,
                  "async-order": "virtual", "async-weight": 0.5, "output-dir": str(out),
                  **({"data-plane": "grpc", "data-plane-insecure": True} if sessions else {})}
    # A session holds its simulated node (a Ray actor) for the whole run: one actor per node.
    proc = run_simulation(hostile_app(tmp_path), flower_env(tmp_path), num_supernodes=2, run_config=run_config,
                          timeout=240, check=True, log_path=tmp_path / "sim.log",
                          federation_config={"init-args-num-cpus": 2} if sessions else None)
    found = re.findall(r"push (\d+): dropped reply of node (\d+) \(partition 1\): (\S+): contains NaN or Inf",
                       proc.stdout)
    records = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    pushes = [sum(r["pushes_by_worker"][p] for r in records[1:]) for p in (0, 1)]
    assert pushes == [2, 2] and records[-1]["pushes"] == 4, records
    assert len(found) == 2 and len({node for _, node, _ in found}) == 1, proc.stdout[-3000:]
    assert sum(r["dropped"] for r in records[1:]) == 2
    assert records[-1]["outer_steps"] == 2  # partition 0's replies alone moved θ
    assert records[-1]["tokens"] == 2 * 2 * 2 * 16  # partition 0's two rounds of 2 steps of 2 x 16 tokens
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    # one Flower message per node opens its session; without sessions, one per round
    assert records[-1]["train_messages"] == (2 if sessions else 4), records[-1]
    tensors, _ = load_checkpoint(out / "checkpoints")
    assert all(torch.isfinite(t).all() for k, t in tensors.items() if k.startswith("param/"))
