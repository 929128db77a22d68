"""Asynchronous rounds over real Flower (issue 13): a deployment and the simulation engine against the
reference trainer's virtual clock, and a deployment on 127.0.0.1 with one really slowed node.

- Parity: `async-order='virtual'` applies replies in the virtual clock's order, so a Flower run and
  `run_async` on the same settings apply the same Δs in the same order from the same pulls: the
  same θ (fp32, one thread: max |Δθ| ≤ 1e-5), the same staleness and pushes per worker.
- Deployment: two SuperNodes, one with `slowdown=3` in its node config (it sleeps after its local
  steps until its round took 3 times as long), each running its rounds as one session on the gRPC
  data plane (on node workers); `async-order='arrival'` with
  `async-match-speed`: the slowed node is given fewer local steps a round and the fast one more,
  the budget of tokens is kept and the loss goes down.
"""

import os
import signal
from pathlib import Path

import pytest
import torch

from lordo_fed.app.config import load_app_config
from lordo_fed.checkpoint import checkpoint_stem, load_checkpoint
from lordo_fed.data import load_dataset
from lordo_fed.device import pick_device
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_async
from harness.deployment import Deployment
from harness.node_workers import start_node_worker, stop_process
from harness.flower import check_run, flower_env, run_simulation, stop_local_superlink
from harness.processes import find_pids, pid_alive, tail, wait_for
from tests.unit.test_appconfig import pyproject_config
from tests.integration.test_flower_app import APP, server_records, tiny_run_config
from tests.integration.test_reliability import Background, assert_same_history, assert_same_tensors, latest_round

pytestmark = pytest.mark.slow


def reference_async(run_config: dict, workers: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`run_async` on the Flower run's settings: its final θ and its records."""
    app = load_app_config({**pyproject_config(), **run_config})
    cfg = TrainConfig.of_app(app, workers)
    records: list[dict] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = load_dataset(cfg.data, workers)
        ctx = RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), records.append)
        model = run_async(ctx, resolve_method(app.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer,
                                                cfg.total_steps))
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


def flower_theta(out: Path) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(out / "checkpoints")
    return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}


ON_THE_DATA_PLANE = {"data-plane": "grpc", "data-plane-insecure": True}
"""Asynchronous sessions on the gRPC data plane (one Flower message per node, then rounds on the data plane alone)."""


PARITY = {"num-server-rounds": 3, "min-clients": 3, "async-order": "virtual", "async-speeds": "1,1,3",
          "async-local-steps": "3,2,3", "async-weight": 0.5}
"""Three partitions, one 3x slower, one with its own local steps, replies in the virtual clock's order."""


def assert_matches_the_reference(out: Path, run_config: dict, variant: str, sessions: bool) -> None:
    """The Flower run in `out` against `run_async` on the same settings: θ within fp32 rounding, the
    same records (rounds, pushes, tokens, staleness, pushes per worker, virtual time, outer steps)."""
    records = server_records(out)
    # On the data plane one Flower message per node starts its session, whatever its rounds.
    assert records[-1]["train_messages"] == (3 if sessions else records[-1]["pushes"]), records[-1]
    reference, ref_records = reference_async(run_config, workers=3)
    flower = flower_theta(out)
    worst = max((flower[n] - reference[n]).abs().max().item() for n in reference)
    print(f"async parity ({variant}): max |θ_flower − θ_reference| = {worst:.3g}")
    assert worst <= 1e-5, f"max |θ_flower − θ_reference| = {worst}"
    keys = ("round", "pushes", "tokens", "staleness", "pushes_by_worker", "virtual_time", "outer_steps")
    assert [{k: r[k] for k in keys} for r in records[1:]] == [{k: r[k] for k in keys} for r in ref_records[1:]]
    assert max(r["staleness_max"] for r in records[1:]) >= 1  # the slow worker's replies were stale
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert abs(records[-1]["val_loss"] - ref_records[-1]["val_loss"]) < 1e-4
    if run_config.get("payload-dtype", "fp32") != "fp32":  # each node's second pull on: the change from its copy
        plain = 4 * sum(t.numel() for t in reference.values())
        assert records[-1]["bytes_sent_per_client"] < plain / 2, records[-1]


@pytest.mark.extended  # the CI lane runs the deployment below
@pytest.mark.parametrize("variant,extra", [
    ("heloco", {"async-grace": 1.5, "async-staleness-exponent": 0.5}),
    ("async_diloco", {"payload-dtype": "topk2bit-both-wide"}),
    ("heloco_lordo", {**ON_THE_DATA_PLANE, "payload-dtype": "int8"}),
], ids=["heloco-grace-staleness", "async_diloco-topk2bit-both", "heloco_lordo-data-plane-int8"])
def test_virtual_order_simulation_matches_the_reference_trainer(tmp_path, variant, extra):
    """Under the simulation engine, `PARITY`'s schedule: the Flower server applies the replies in the
    reference trainer's order, to the same θ; for async LoRDO with HeLoCo's correction too (round-0
    gradient bases, moments blended, rotated out of stale bases, bases refitted every 3 replies), its
    rounds run as sessions on the gRPC data plane (no Flower message between a node's rounds); for
    HeLoCo with a grace window of 1.5 virtual seconds (partition 1 arrives at t = 2, partition 0 at
    t = 3 within its window: both pull at t = 3.5) and stale replies weighted down, ρ·(1+s)^−0.5.
    Compressed both ways: async DiLoCo's Δ top-k 2-bit up and each pull the top-k change from that
    node's own copy θ_c down; async LoRDO's Δ and moments int8 up, the moments and θ's change from
    the node's copy int8 down."""
    run_config = tiny_run_config(tmp_path, variant=variant, **{**PARITY, **extra})
    sessions = extra.get("data-plane") == "grpc"
    # A session holds its simulated node (a Ray actor) for the whole run: one actor per node.
    proc = run_simulation(APP, flower_env(tmp_path), num_supernodes=3, run_config=run_config, timeout=300, check=True,
                          log_path=tmp_path / "sim.log", federation_config={"init-args-num-cpus": 3} if sessions else None)
    assert "lordo-fed: metrics" in proc.stdout
    assert_matches_the_reference(tmp_path / "out", run_config, variant, sessions)


def test_virtual_order_deployment_matches_the_reference_trainer(tmp_path):
    """The same parity in a real deployment: a SuperLink and three SuperNodes on 127.0.0.1, async
    LoRDO with HeLoCo's correction in `PARITY`'s schedule, each node's rounds one session on the gRPC
    data plane (its in-process ClientApp keeps the model for the session), compressed both ways
    (int8: Δ and moments up; the moments and each pull's change from the node's own copy down), and the
    server stepping on each node's latest Δ calibrated by the arrival (`async-cache=ca2fl`)."""
    run_config = tiny_run_config(tmp_path, variant="heloco_lordo", **{**PARITY, **ON_THE_DATA_PLANE,
                                                                       "payload-dtype": "int8", "async-cache": "ca2fl"})
    with Deployment(tmp_path, num_nodes=3) as dep:
        proc = dep.run(APP, run_config, timeout=300, check=True)
    assert "lordo-fed: metrics" in proc.stdout
    assert_matches_the_reference(tmp_path / "out", run_config, "heloco_lordo, deployment", sessions=True)


@pytest.mark.extended  # the CI lane kills the ServerApp in synchronous rounds (test_reliability.py)
def test_server_killed_mid_run_resumes_to_the_uninterrupted_state(tmp_path):
    """Async LoRDO with HeLoCo's correction, each node's rounds one session on the gRPC data plane:
    the ServerApp is SIGKILLed after its second record's checkpoint, and the run restarted with
    `resume` ends with the uninterrupted run's θ, outer momentum, bases, averaged moments and
    counters (max |Δ| ≤ 1e-5) and its records. The replies come in the virtual clock's order,
    the two partitions at one speed within a grace window of 1 virtual second: both pull the same
    θ when each window closes, so nothing in flight at a checkpoint was pulled before it (a pull
    the server has lost is sent again from the checkpoint's θ; docs/algorithm.md). The nodes
    find their own state (none fresh), though they may have trained a round past the checkpoint."""
    config = {"variant": "heloco_lordo", "async-order": "virtual", "async-grace": 1.0, "num-server-rounds": 5,
              **ON_THE_DATA_PLANE}
    out, env = tmp_path / "out", flower_env(tmp_path)
    ckpt = out / "checkpoints"
    run = Background(run_simulation, APP, env, 2, tiny_run_config(tmp_path, **config), timeout=300,
                     log_path=tmp_path / "killed.log")
    try:
        wait_for(lambda: latest_round(ckpt) >= 2 or not run.running(), 240, interval=0.01,
                 what="the second record's checkpoint")
        assert run.running(), "the run ended before it could be killed:\n" + tail(tmp_path / "killed.log")
        (server,) = find_pids({"FLWR_HOME": env["FLWR_HOME"]}, ("flwr-simulation",))
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: not pid_alive(server), 30, what="the killed ServerApp process to go")
    finally:
        stop_local_superlink(env)
        run.result(120)
    killed_at = latest_round(ckpt)
    assert 2 <= killed_at < 5, killed_at
    proc = run_simulation(APP, env, 2, tiny_run_config(tmp_path, **config, resume=str(ckpt)), timeout=300,
                          check=True, log_path=tmp_path / "resumed.log")
    assert f"resumed from {ckpt / checkpoint_stem(killed_at)}.json" in proc.stdout
    # The reference runs after, not beside, the killed run: two simulations starting together on 2 cores
    # once kept one's Ray node past Ray's fixed 30 s wait for its raylet to register ("The current node
    # timed out during startup"), and the test failed on a fresh clone.
    reference_dir = tmp_path / "uninterrupted"
    run_simulation(APP, flower_env(reference_dir), 2, tiny_run_config(reference_dir, **config), timeout=300,
                   check=True, log_path=reference_dir / "sim.log")
    got, want = server_records(out), server_records(reference_dir / "out")
    assert sum(r["clients_fresh_state"] for r in got[1:]) == 0
    assert_same_history(got, want)
    a, meta_a = load_checkpoint(reference_dir / "out" / "checkpoints")
    b, meta_b = load_checkpoint(ckpt)
    assert meta_a["async"] == meta_b["async"] and meta_b["async"]["pushes"] == 10
    assert any(k.startswith("async_acc/") or k.startswith("moment/") for k in a), sorted(a)[:5]
    for k in ("rng/numpy", "rng/python"):
        a.pop(k, None), b.pop(k, None)
    worst = assert_same_tensors(a, b, "final server checkpoint")
    print(f"async kill after record {killed_at}, resumed: max |Δ| against the uninterrupted run = {worst:.3g}")


@pytest.mark.extended  # the CI lane runs the asynchronous deployment above; the speed matching: tests/unit/test_async_rounds.py
def test_deployment_with_a_slowed_node(tmp_path):
    """A real SuperLink and two SuperNodes, each served by a node worker, node 2 slowed (node config
    `slowdown=3`): each node runs one session on the gRPC data plane (one Flower message each,
    whatever its number of rounds); replies are applied as they arrive, and with
    `async-match-speed` the server gives the slowed node fewer local steps per round than K and the
    fast one more (from their measured speeds); the run keeps the synchronous run's token budget.
    The budget is large (192 rounds of the tiny model's K = 3 steps): the fast node's rounds take
    ~0.1 s, the slowed node's first one several seconds (a fresh process, its first steps slowed
    too), and the fast node runs at K until the slowed one has been measured.
    (The in-process ClientApp's sessions: the simulation parity test above.)"""
    socks = [tmp_path / f"nw{i}.sock" for i in range(2)]
    workers = [start_node_worker(sock, tmp_path / f"node-worker-{i}.log") for i, sock in enumerate(socks)]
    try:
        with Deployment(tmp_path, num_nodes=2, node_configs=[{"node-worker": f"unix://{socks[0]}"},
                                                            {"slowdown": 3.0, "node-worker": f"unix://{socks[1]}"}]
                        ) as dep:
            run_config = tiny_run_config(tmp_path, variant="heloco", **{
                "num-server-rounds": 192, "async-weight": 0.7, "async-match-speed": True, "data-plane-insecure": True,
                "eval-every": 16})
            proc = dep.run(APP, run_config, timeout=300, check=True)
    finally:
        for worker in workers:
            stop_process(worker)
    assert "lordo-fed: metrics" in proc.stdout
    assert all("session ended after" in (tmp_path / f"node-worker-{i}.log").read_text() for i in range(2))
    records = server_records(tmp_path / "out")
    pushes = [sum(r["pushes_by_worker"][p] for r in records[1:]) for p in (0, 1)]
    assert records[-1]["train_messages"] == 2 < sum(pushes), (records[-1], pushes)
    assert min(pushes) >= 2, pushes  # both measured, both given matched steps
    steps = [r["local_steps_by_worker"] for r in records[1:]]
    # K = 3: once both are measured the fast node trains more a round, the slowed one less
    assert any(s[0] > 3 for s in steps) and any(s[1] < 3 for s in steps), steps
    assert records[-1]["tokens"] == 2 * 192 * 3 * 4 * 32
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    meta = load_checkpoint(tmp_path / "out" / "checkpoints")[1]
    assert meta["async"]["pushes"] == sum(pushes)
    print(f"slowed node: pushes per partition {pushes}, local steps of the last records {steps[-5:]}")


@pytest.mark.extended  # the CI lane kills the ServerApp (above) and a synchronous node worker (test_node_worker.py)
def test_a_node_worker_killed_mid_run_comes_back_from_its_state(tmp_path):
    """Asynchronous rounds (HeLoCo, arrival order) on two node workers, each node's rounds one
    session on the gRPC data plane: node worker 1 is SIGKILLed once the server has applied its
    partition's first push and the worker has saved its state, and restarted. Its session's message fails; the server sends the
    round again in a new session; the restarted worker continues from its disk state (no node
    starts afresh) and the run ends with its whole budget of tokens, the loss down."""
    from tests.integration.test_node_worker import wait_for_round_1_saved

    socks = [tmp_path / f"nw{i}.sock" for i in range(2)]
    logs = [tmp_path / f"node-worker-{i}.log" for i in range(2)]
    workers = [start_node_worker(sock, log) for sock, log in zip(socks, logs)]
    out = tmp_path / "out"
    rounds = 24  # the tiny model's rounds take a fraction of a second: room to kill one mid-run
    run_config = tiny_run_config(tmp_path, variant="heloco", **{"num-server-rounds": rounds, "async-weight": 0.7,
                                                               "data-plane-insecure": True, "eval-every": 6})
    try:
        with Deployment(tmp_path, num_nodes=2, node_configs=[{"node-worker": f"unix://{s}"} for s in socks]) as dep:
            run = Background(dep.run, APP, run_config, timeout=300, log_path=tmp_path / "run.log")
            wait_for_round_1_saved(out, run, tmp_path / "run.log", pushed=True)
            os.killpg(workers[1].pid, signal.SIGKILL)
            workers[1].wait(timeout=10)
            workers[1] = start_node_worker(socks[1], logs[1])
            proc = run.result(300)
    finally:
        for worker in workers:
            stop_process(worker)
    check_run(proc)
    records = server_records(out)
    assert "sending the round again" in proc.stdout, proc.stdout[-3000:]
    assert records[-1]["tokens"] == 2 * rounds * 3 * 4 * 32  # the whole budget, the redone round counted once
    assert sum(r["clients_fresh_state"] for r in records[1:]) == 0, "the restarted worker lost its state"
    pushes = [sum(r["pushes_by_worker"][p] for r in records[1:]) for p in (0, 1)]
    assert min(pushes) >= 2, pushes
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert logs[1].read_text().count("listening on") >= 1
