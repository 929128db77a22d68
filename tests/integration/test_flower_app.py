"""The Flower app for real: simulation engine and a SuperLink with SuperNodes on 127.0.0.1.

- Parity: a Flower simulation run and the reference trainer, same seed and config, fp32, one
  thread each, end at the same θ (max |Δθ| ≤ 1e-5): the app adds nothing and drops nothing.
- Deployment: a real SuperLink and two real SuperNodes run 2 rounds; metrics are checked; every
  process started is stopped. A bad config value stops a run before round 1 with a message.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from lordo_fed.app.config import load_app_config
from lordo_fed.checkpoint import load_checkpoint
from lordo_fed.data import load_dataset
from lordo_fed.device import pick_device
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_rounds
from harness.deployment import Deployment
from harness.flower import flower_env, run_simulation
from tests.unit.test_appconfig import pyproject_config

APP = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def tiny_run_config(tmp_path: Path, **kw) -> dict:
    cfg = {
        "preset": "quickstart", "num-server-rounds": 2, "local-steps": 3, "batch-size": 4, "seq-len": 32,
        "eval-batches": 2, "threads": 1, "min-clients": 2, "output-dir": str(tmp_path / "out"),
    }
    cfg.update(kw)
    return cfg


def reference_theta(run_config: dict, workers: int) -> dict[str, torch.Tensor]:
    """The reference trainer on the same settings (what the Flower run must reproduce)."""
    app = load_app_config({**pyproject_config(), **run_config})
    cfg = TrainConfig.of_app(app, workers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = load_dataset(cfg.data, workers)
        ctx = RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), lambda r: None)
        model = run_rounds(ctx, resolve_method(app.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer,
                                                cfg.total_steps))
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def server_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]


SPARSELOCO = {"payload-dtype": "topk2bit-both-wide", "wire-ef-decay": 0.95, "sparse-mean": "contributors"}
"""SparseLoCo's wire on DiLoCo (the `sparseloco` app preset's, its outer step left DiLoCo's): every tensor
top-k 2-bit both ways, θ down at 12%, decaying error feedback, contributor mean."""
EF_OPTIONS = {"sync-ef": True, "ef-reset": True, "ef-decay": 0.8, "full-rank-term": "gradient", "switch-step": 4}


EXTENDED = pytest.mark.extended  # in the extended lane: the CI lane runs the other configurations


@pytest.mark.parametrize("variant,extra", [("lordo_global", {"dense-sync-factor": 2, "overlap-delay": 2}),
                                           pytest.param("lordo_global", EF_OPTIONS, marks=EXTENDED),
                                           pytest.param("diloco", SPARSELOCO, marks=EXTENDED),
                                           pytest.param("desloc", {"local-steps-ramp": "1,2", "sync-exp-avg-every": 2},
                                                        marks=EXTENDED),
                                           pytest.param("lordo_local", {"late-local-steps": 1, "late-from-step": 3,
                                                                        "outer-late-lr": 1.5}, marks=EXTENDED),
                                           pytest.param("lordo_global", {"preset": "lordo-sparse", "model-preset": "tiny",
                                                                         "rank": 4}, marks=EXTENDED),
                                           ("diloco", {"preset": "diloco-sparse", "payload-dtype": "topk2bit-relay"}),
                                           pytest.param("diloco", {"preset": "diloco-relay"}, marks=EXTENDED)])
def test_simulation_matches_the_reference_trainer(tmp_path, variant, extra):
    """Baselines run through the same app by config: DiLoCo (AdamW, Nesterov outer, no state
    sync; here with SparseLoCo's wire: every tensor top-k 2-bit both ways, the server re-sparsifying
    θ − θ_c at 12%, Rice-coded positions, β = 0.95 error feedback, each index averaged over its senders) and
    DES-LOC (AdamW, states averaged at their own periods; here with its first rounds ramped: 1 step, then
    2, the learning-rate schedule's steps as the reference trainer's, and its first moment averaged every
    2nd round where its own period is 3); LoRDO-Local with its late rounds
    short (round 2 starts at step 3 and runs 1 step) and stepped with their own outer lr; LoRDO-Global with the
    embedding's and norms' moments averaged every second round only (dense-sync-factor=2) in
    overlapped rounds (overlap-delay=2), and
    with the error-feedback options and the two-phase switch (E crosses the wire both ways; the
    switch at step 4 falls inside round 2). Overlapped rounds: round 2 starts
    from each client's own θ and merges the global state after 2 of its 3 steps (the clients keep
    the round they sent in their state between messages). The `lordo-sparse` preset: every tensor top-k
    2-bit both ways, moments kept on the clients and the bases fitted by each client to the downlink's
    change (round 2's state carries no bases). The relay (`topk2bit-relay`, on `diloco-sparse`'s plain average):
    round 2's state carries round 1's top-k reply of the other client (each kept its own), and each client
    replays the round to the server's θ; the `diloco-relay` preset too: 1-bit values (`topk1bit-relay`) and the
    residual scaled by the lr's fall (`wire-ef-lr-scale`).
    Plain LoRDO-Global on the data plane is the TLS deployment's (tests/integration/test_secure_deployment.py), and
    the `lowrank+topk2bit+rows` payload the deployment test's below, bit for bit."""
    run_config = tiny_run_config(tmp_path, variant=variant, **extra)
    env = flower_env(tmp_path)
    proc = run_simulation(APP, env, num_supernodes=2, run_config=run_config, timeout=240, check=True,
                          log_path=tmp_path / "sim.log")
    out = tmp_path / "out"
    records = server_records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["clients_ok"] == 2 for r in records[1:])
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert (out / "val_loss.png").exists() and (out / "bytes.png").exists()
    assert "lordo-fed: metrics" in proc.stdout
    if "outer-late-lr" in extra:  # round 2 is late: the server stepped it with the late lr
        assert [r["outer_lr"] for r in records[1:]] == [1.0, extra["outer-late-lr"]]

    tensors, meta = load_checkpoint(out / "checkpoints")
    assert meta["round"] == 2
    flower = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    reference = reference_theta(run_config, workers=2)
    assert set(flower) == set(reference)
    worst = max((flower[n] - reference[n]).abs().max().item() for n in reference)
    assert worst <= 1e-5, f"max |θ_flower − θ_reference| = {worst}"
    print(f"parity: max |θ_flower − θ_reference| = {worst:.3g}")
    # the ramp "1,2": rounds of 1 and 2 steps (K = 3); late rounds of 1 step from step 3: rounds of 3 and 1
    steps = 1 + 2 if "local-steps-ramp" in extra else 3 + 1 if "late-local-steps" in extra else 2 * 3
    assert records[-1]["tokens"] == 2 * steps * 4 * 32 and records[-1]["step"] == steps
    if "dense-sync-factor" in extra:  # round 1 sends the low-rank moments only, round 2 the full-size ones too
        assert records[1]["bytes_received_per_client"] < records[2]["bytes_received_per_client"]
    if "sync-exp-avg-every" in extra:  # round 1 sends Δ alone, round 2 Δ and the first moment (its own period: 3)
        params = 4 * sum(t.numel() for t in reference.values())
        assert records[2]["bytes_received_per_client"] - records[1]["bytes_received_per_client"] >= params, records
    if extra.get("payload-dtype") == "topk2bit-both-wide":  # ~3% x (2 + 7) bits up, 12% x (2 + 5) down from round 2
        plain = 4 * sum(t.numel() for t in reference.values())
        assert all(r["bytes_received_per_client"] < plain / 8 for r in records[1:]), records
        assert records[2]["bytes_sent_per_client"] < plain / 8, records
    if extra.get("payload-dtype") == "topk2bit-relay" or extra.get("preset") == "diloco-relay":
        # round 2: the other's reply, ~3% x (2 + 7) bits
        plain = 4 * sum(t.numel() for t in reference.values())
        assert records[2]["bytes_sent_per_client"] < plain / 8 and records[1]["bytes_received_per_client"] < plain / 8
        # one reply down, not both (each client kept its own): about the largest reply of round 1, not twice it
        assert records[2]["bytes_sent_per_client"] < 1.5 * records[1]["bytes_received_per_client"], records
    if extra.get("preset") == "lordo-sparse":  # round 1 sends θ0 by seed and the bases; round 2 only the sparse change
        plain = 4 * sum(t.numel() for t in reference.values())
        assert records[2]["bytes_sent_per_client"] < plain / 8 and records[2]["bytes_received_per_client"] < plain / 8
    if extra.get("overlap-delay"):
        assert [r["clients_overlapped"] for r in records[1:]] == [0, 2], records
    if extra.get("sync-ef"):  # each reply carries Δ of every parameter and E of every low-rank matrix
        lowrank = [n for n in reference if re.search(DEFAULT_LOWRANK_PATTERN, n)]
        floats = sum(t.numel() for t in reference.values()) + sum(reference[n].numel() for n in lowrank)
        assert lowrank and all(r["bytes_received_per_client"] >= 4 * floats for r in records[1:])


@pytest.mark.extended
def test_resume_continues_from_the_checkpoint(tmp_path):
    """A second run with `resume` picks up θ, counters and history at round 2 and the clients'
    own state (their disk store, keyed by partition), then trains round 3."""
    env = flower_env(tmp_path)
    out = tmp_path / "out"
    run_simulation(APP, env, 2, tiny_run_config(tmp_path), timeout=240, check=True)
    first = server_records(out)
    proc = run_simulation(APP, env, 2, tiny_run_config(tmp_path, **{"num-server-rounds": 3, "resume": str(out / "checkpoints")}),
                          timeout=240, check=True)
    records = server_records(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert records[:3] == first
    assert records[3]["tokens"] == 3 * 2 * 3 * 4 * 32
    assert "resumed from" in proc.stdout
    assert records[3]["clients_fresh_state"] == 0  # both clients found their round-2 state
    assert load_checkpoint(out / "checkpoints")[1]["round"] == 3


@pytest.mark.extended
def test_a_resumed_relay_run_relays_on_and_ends_as_the_uninterrupted_one(tmp_path):
    """The relay (`topk2bit-relay` on `diloco-sparse`) resumed after round 2: round 3's state carries round 2's
    two top-k replies (the checkpoint keeps them; the clients keep θ_c), not θ whole, where the uninterrupted run
    sends each node the other's only, and the resumed run ends at the uninterrupted run's θ bit for bit."""
    env = flower_env(tmp_path)
    relay = {"variant": "diloco", "preset": "diloco-sparse", "payload-dtype": "topk2bit-relay"}
    whole, out = tmp_path / "whole", tmp_path / "out"
    run_simulation(APP, env, 2, tiny_run_config(tmp_path, **relay, **{"num-server-rounds": 3, "output-dir": str(whole)}),
                   timeout=240, check=True)
    run_simulation(APP, env, 2, tiny_run_config(tmp_path, **relay), timeout=240, check=True)
    run_simulation(APP, env, 2, tiny_run_config(tmp_path, **relay, **{"num-server-rounds": 3,
                                                                      "resume": str(out / "checkpoints")}),
                   timeout=240, check=True)
    records, uninterrupted = server_records(out), server_records(whole)
    assert [r["round"] for r in records] == [0, 1, 2, 3] and records[3]["clients_fresh_state"] == 0
    ended, expected = (load_checkpoint(d / "checkpoints")[0] for d in (out, whole))
    params = [k for k in expected if k.startswith("param/")]
    theta_bytes = 4 * sum(expected[k].numel() for k in params)
    # round 3 relays round 2's top-k replies (~3% x (2 + 7) bits each), not θ whole: both, as the simulation's nodes
    # come back under new node ids, which the checkpoint's node -> partition map does not name (a server resumed
    # under the same nodes leaves each one's own out: tests/unit/test_hostile_payloads.py); the uninterrupted one
    # leaves out each node's own
    assert uninterrupted[3]["bytes_sent_per_client"] < records[3]["bytes_sent_per_client"] < theta_bytes / 10
    assert params and all(torch.equal(ended[k], expected[k]) for k in params)


PLANE_EXTRA = {"flower": {"data-plane": "flower"},
               "grpc-compressed": {"payload-dtype": "lowrank+topk2bit+rows"},
               "grpc-relay": {"variant": "diloco", "preset": "diloco-sparse", "payload-dtype": "topk2bit-relay"}}
"""The deployment tests' run-config keys per case besides the plaintext data plane. Plain LoRDO-Global on the
data plane is the TLS deployment's, bit for bit (tests/integration/test_secure_deployment.py)."""


def run_planes(dep: Deployment, tmp_path: Path, planes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Each case of `PLANE_EXTRA` in `planes` run for 2 rounds in `dep`, its records checked; θ by case."""
    thetas = {}
    for plane in planes:
        out = tmp_path / plane
        extra = PLANE_EXTRA[plane]
        on_grpc = extra.get("data-plane", "grpc") == "grpc"
        dep.run(APP, tiny_run_config(tmp_path, **{"output-dir": str(out), "data-plane": "grpc",
                                                  "data-plane-insecure": on_grpc, **extra}),
                timeout=240, check=True)
        records = server_records(out)
        assert [r["round"] for r in records] == [0, 1, 2]
        assert all(r["clients_ok"] == 2 and r["clients_missing"] == 0 for r in records[1:])
        assert records[-1]["val_loss"] < records[0]["val_loss"]
        assert ("upload_seconds" in records[1]) == on_grpc
        # on the data plane round 2's tickets went out while round 1 ran, compressed downlink or not
        announced = [r["phase_seconds"].get("announced", 0) < 0 for r in records[1:]]
        assert announced == [False, on_grpc], records
        tensors, _ = load_checkpoint(out / "checkpoints")
        thetas[plane] = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        # θ0 is the seeded init both sides build: round 1 sends no θ, round 2 sends θ (compressed:
        # the int8 change of the clients' copy, about a quarter of it).
        theta_bytes = 4 * sum(t.numel() for t in thetas[plane].values())
        if plane == "grpc-relay":  # round 2: one reply down (the other node's), not both
            assert records[2]["bytes_sent_per_client"] < 1.5 * records[1]["bytes_received_per_client"], records
            assert records[2]["bytes_sent_per_client"] < theta_bytes / 8, records
        elif plane == "grpc-compressed":
            assert records[1]["bytes_sent_per_client"] < theta_bytes / 4 < records[2]["bytes_sent_per_client"]
            assert records[2]["bytes_sent_per_client"] < theta_bytes / 2, records
            # up: Δ as r·max(p, q) int8 coordinates + a ~3% x (2 + 12)-bit residual, moments 8 bits
            assert all(r["bytes_received_per_client"] < theta_bytes / 2 for r in records[1:]), records
        else:
            assert records[1]["bytes_sent_per_client"] < theta_bytes <= records[2]["bytes_sent_per_client"], records
        if on_grpc:
            assert not list((out / "dataplane_spool").glob("*")), "spooled replies left behind"
    return thetas


def assert_match_the_reference(tmp_path: Path, thetas: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each case's θ against the reference trainer on that case's training settings, bit for bit."""
    for plane, theta in thetas.items():
        extra = {k: v for k, v in PLANE_EXTRA[plane].items() if k != "data-plane"}
        reference = reference_theta(tiny_run_config(tmp_path, **extra), workers=2)
        worst = max((theta[n] - reference[n]).abs().max().item() for n in reference)
        assert worst == 0.0, f"{plane}: max |θ_deployment − θ_reference| = {worst}"


def test_deployment_on_the_data_plane_matches_the_reference_and_bad_configs_stop(tmp_path):
    """A real SuperLink and two SuperNodes: compressed payloads over the gRPC data plane (plaintext,
    explicitly insecure; lowrank+topk2bit+rows: Δ up as coordinates in the shared basis plus a
    residual, with error feedback, θ down as the int8 change of the clients' copy, which each node
    keeps in its state) end at the same θ as the reference trainer, bit for bit (round 1's θ0 built
    by the clients from the seed, not sent); bad values stop a run before round 1 with a message
    naming them."""
    with Deployment(tmp_path, num_nodes=2) as dep:
        bad = dep.run(APP, tiny_run_config(tmp_path, omega=1.5, **{"output-dir": str(tmp_path / "bad")}), timeout=120)
        assert "run-config key 'omega': inner.omega=1.5: expected a number in [0, 1]" in bad.stdout
        assert not (tmp_path / "bad" / "server.jsonl").exists()
        no_tls = dep.run(APP, tiny_run_config(tmp_path, **{"output-dir": str(tmp_path / "no_tls")}), timeout=120)
        assert "data-plane='grpc' needs TLS: set data-plane-certfile and data-plane-keyfile" in no_tls.stdout
        assert not (tmp_path / "no_tls" / "server.jsonl").exists()
        thetas = run_planes(dep, tmp_path, ("grpc-compressed",))
        pids = dep.all_pids()
    from harness.processes import alive

    assert not alive(pids)
    assert_match_the_reference(tmp_path, thetas)


@pytest.mark.extended  # the CI lane runs the data plane's default transport (TLS) and its compressed payloads
def test_deployment_inside_flowers_messages_and_the_relay_match_the_reference(tmp_path):
    """The same deployment with the payloads inside Flower's messages (`data-plane=flower`), and the relay
    over the data plane (DiLoCo, `topk2bit-relay`: round 2's state is each node's own blob, the other node's
    reply without its own, which its ClientApp process kept in its node store): both end at the reference
    trainer's θ, bit for bit."""
    with Deployment(tmp_path, num_nodes=2) as dep:
        thetas = run_planes(dep, tmp_path, ("flower", "grpc-relay"))
        pids = dep.all_pids()
    from harness.processes import alive

    assert not alive(pids)
    assert_match_the_reference(tmp_path, thetas)
