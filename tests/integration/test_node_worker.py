"""Node workers for real: a SuperLink, two SuperNodes, and beside each a long-lived node worker
(`python -m lordo_fed.node`) that its ClientApp hands every round to, over a unix socket, with
the payloads on the gRPC data plane.

- The run ends at the reference trainer's θ bit for bit, and no ClientApp process imported torch.
- A node worker SIGKILLed between rounds and restarted comes back from its disk state: no round
  is lost, no worker starts afresh, and θ still equals the reference bit for bit. The rounds
  are overlapped (`overlap-delay`): each worker trains the next round's first steps on a thread
  while its reply uploads; the restarted one finds the round it sent in its state and trains
  them again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from lordo_fed.checkpoint import load_checkpoint
from lordo_fed.node.channel import check_local
from harness.deployment import Deployment
from harness.flower import check_run
from harness.node_workers import start_node_worker
from harness.processes import alive, stop_process
from tests.integration.test_flower_app import APP, reference_theta, server_records, tiny_run_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def written_records(out: Path) -> list[dict]:
    """The server's records written so far, read while it runs: the complete lines only (a line
    being appended is left for the next read)."""
    path = out / "server.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def wait_for_round_1_saved(out: Path, run, log_path: Path, partition: int = 1, timeout: float = 240,
                           pushed: bool = False) -> None:
    """Block until the server has aggregated round 1 of the run writing to `out` (`run` a
    test_reliability.Background, whose log `log_path` a failure shows) and `partition`'s worker
    state of round 1 is on disk: the moment to kill a node worker between rounds. With `pushed`
    (asynchronous rounds, where round 1's record may hold another partition's pushes only), also
    until a record counts a push of `partition`: the worker saves its round before its upload
    ends, so a kill before its push is applied can land mid-upload, and the ClientApp then runs
    the same job again on the restarted worker (lordo_fed/node/channel.py) instead of failing."""
    state = out / "client_state" / f"partition_{partition}"
    deadline = time.monotonic() + timeout

    def ready() -> bool:
        records = written_records(out)
        if len(records) < 2:
            return False
        return not pushed or sum(r["pushes_by_worker"][partition] for r in records[1:]) >= 1

    while not ready():
        assert run.running() and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)
    while not list(state.glob("*0001*.json")):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_node_workers_match_the_reference_and_survive_a_kill_between_rounds(tmp_path):
    socks = [tmp_path / f"nw{i}.sock" for i in range(2)]
    logs = [tmp_path / f"node-worker-{i}.log" for i in range(2)]
    workers = [start_node_worker(s, log) for s, log in zip(socks, logs)]
    out = tmp_path / "out"
    cfg = tiny_run_config(tmp_path, **{"num-server-rounds": 3, "data-plane-insecure": True,
                                       "output-dir": str(out), "overlap-delay": 2})
    try:
        with Deployment(tmp_path, num_nodes=2, node_configs=[{"node-worker": f"unix://{s}"} for s in socks]) as dep:
            from tests.integration.test_reliability import Background

            run = Background(dep.run, APP, cfg, timeout=300, log_path=tmp_path / "run.log")
            # Kill worker 1 once round 1 is aggregated and its state is on disk; restart it.
            wait_for_round_1_saved(out, run, tmp_path / "run.log")
            killed = workers[1].pid
            os.killpg(killed, signal.SIGKILL)
            workers[1].wait(timeout=10)
            workers[1] = start_node_worker(socks[1], logs[1])
            check_run(run.result(300))
            pids = dep.all_pids()
        assert not alive(pids)
    finally:
        for w in workers:
            stop_process(w)
    records = server_records(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(r["clients_ok"] == 2 and r["clients_missing"] == 0 for r in records[1:]), records
    assert all(r["clients_fresh_state"] == 0 for r in records[1:]), "a restarted worker lost its state"
    assert all(r["clientapps_with_torch"] == 0 for r in records[1:]), "a ClientApp process imported torch"
    assert "upload_seconds" in records[1]
    # Rounds 2 and 3 were overlapped on both nodes, their early steps trained ahead on the workers
    # (but on the restarted one, which trained them once its state was in)
    assert [r["clients_overlapped"] for r in records[1:]] == [0, 2, 2], records
    assert all(r["client_early_seconds"] > 0 for r in records[2:]), records
    # Both workers ran every round themselves; the restarted one started from its disk state.
    assert "listening on" in logs[1].read_text()
    tensors, _ = load_checkpoint(out / "checkpoints")
    theta = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    reference = reference_theta(cfg, workers=2)
    worst = max((theta[n] - reference[n]).abs().max().item() for n in reference)
    assert worst == 0.0, f"max |θ_node_workers − θ_reference| = {worst}"


def test_the_local_channel_stays_on_the_machine():
    assert check_local("unix:///tmp/x.sock") == "unix:///tmp/x.sock"
    assert check_local("127.0.0.1:5000") == "127.0.0.1:5000"
    assert check_local("[::1]:5000") == "[::1]:5000"
    for bad in ("10.0.0.5:5000", "example.com:5000", "127.0.0.1"):
        with pytest.raises(ValueError, match="the local channel stays on this machine"):
            check_local(bad)


@pytest.mark.extended
def test_node_workers_on_flowers_data_plane_match_the_reference(tmp_path):
    """With `data-plane="flower"` the state comes inside the Flower message and the node worker's
    reply goes back inside it too (through the local channel): same θ as the reference."""
    socks = [tmp_path / f"nw{i}.sock" for i in range(2)]
    workers = [start_node_worker(s, tmp_path / f"node-worker-{i}.log") for i, s in enumerate(socks)]
    out = tmp_path / "out"
    cfg = tiny_run_config(tmp_path, **{"data-plane": "flower", "output-dir": str(out)})
    try:
        with Deployment(tmp_path, num_nodes=2, node_configs=[{"node-worker": f"unix://{s}"} for s in socks]) as dep:
            check_run(dep.run(APP, cfg, timeout=300))
    finally:
        for w in workers:
            stop_process(w)
    records = server_records(out)
    assert all(r["clients_ok"] == 2 and r["clientapps_with_torch"] == 0 for r in records[1:]), records
    assert "upload_seconds" not in records[1]  # Flower's path, not the data plane
    tensors, _ = load_checkpoint(out / "checkpoints")
    theta = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    reference = reference_theta(cfg, workers=2)
    assert max((theta[n] - reference[n]).abs().max().item() for n in reference) == 0.0
