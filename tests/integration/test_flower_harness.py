"""The Flower test harness (harness/flower.py, harness/deployment.py, harness/processes.py): fast
unit checks, then a throwaway echo app (harness/apps/) run end to end (slow) in simulation
(`flwr run <app> local`, 2 simulated SuperNodes) and in a real deployment (flower-superlink + 2
flower-supernode subprocesses on 127.0.0.1). After each, no process the harness started may
survive.

Wall times of each phase are printed ('[flower timing] ...'; see them with `pytest -s`).
Measured on the 2-core CPU box (flwr 1.41.0): simulation ~20 s per `flwr run` (of which round 1
~8.5 s: Ray start; later rounds ~0.1 s); deployment startup ~6 s, ~5 s until the ServerApp runs,
then ~6.2 s per round with a trivial ClientApp (3 s polling + one flwr-clientapp process per
message).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness.flower as fh
import harness.processes as procs
from harness.apps import write_echo_app
from harness.deployment import Deployment

ROUNDS = 2


def timing(label: str, seconds: float) -> None:
    print(f"[flower timing] {label}: {seconds:.2f} s", flush=True)


def assert_echo_result(path: Path, num_nodes: int) -> dict:
    result = json.loads(path.read_text())
    assert [r["round"] for r in result["rounds"]] == list(range(1, ROUNDS + 1))
    for r in result["rounds"]:
        assert r["partition_ids"] == list(range(num_nodes)), r
        assert r["echo_rounds"] == [r["round"]] * num_nodes, r
        assert r["errors"] == 0, r
    return result


# ---------------------------------------------------------------------------------------------
# fast unit checks
# ---------------------------------------------------------------------------------------------


def test_format_run_config_round_trips_through_flower_parser():
    from flwr.common.config import parse_config_args

    config = {
        "num-server-rounds": 3,
        "lr": 1e-5,
        "beta": 0.95,
        "name": "two words",
        "path": "/tmp/a b/c\\d",
        "quote": 'say "hi"',
        "flag": True,
        "off": False,
        "neg": -2,
        "nested": {"k": 1, "deeper": {"s": "x"}},
    }
    text = fh.format_run_config(config)
    assert 'flag=true' in text and 'off=false' in text and 'name="two words"' in text
    expected = {k: v for k, v in config.items() if k != "nested"}
    expected.update({"nested.k": 1, "nested.deeper.s": "x"})
    assert parse_config_args([text]) == expected
    assert fh.format_run_config(None) == "" and fh.format_run_config({}) == ""
    with pytest.raises(TypeError):
        fh.format_run_config({"xs": [1, 2]})
    with pytest.raises(ValueError):
        fh.format_run_config({"s": "both ' and \""})
    with pytest.raises(ValueError):
        fh.format_run_config({"bad key": 1})


def test_flower_env_writes_connections(tmp_path):
    tomllib = fh.tomllib
    port = procs.free_port()
    env = fh.flower_env(tmp_path, deployment_port=port)
    for key, value in fh.FLOWER_ENV_DEFAULTS.items():
        assert env[key] == value
    home = Path(env["FLWR_HOME"])
    assert home == tmp_path / "flwr_home"
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["superlink"]["default"] == "local"
    assert config["superlink"]["local"] == {"address": ":local:"}
    assert config["superlink"]["deployment"] == {"address": f"127.0.0.1:{port}", "insecure": True}
    assert len(env["RAY_TMPDIR"]) <= 38 and Path(env["RAY_TMPDIR"]).is_dir()
    assert int(env[fh.LOCAL_SUPERLINK_PORT_VAR]) != fh.DEFAULT_LOCAL_SUPERLINK_PORT
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    # Updating keeps the other connections.
    fh.write_flower_config(home, {"other": "10.0.0.1:8000", "deployment": None})
    config = tomllib.loads((home / "config.toml").read_text())
    assert set(config["superlink"]) == {"default", "local", "other"}


def test_terminate_kills_process_tree_and_owned_orphans(tmp_path):
    """A parent in its own session, a child in another session (like SuperLink -> SuperExec),
    and a grandchild: terminate() by parent PID/group gets all three, owner-tagged ones too."""
    script = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import subprocess,sys,time; subprocess.Popen([sys.executable, \"-c\", "
        "\"import time; time.sleep(60)\"]); time.sleep(60)'], start_new_session=True)\n"
        "print(c.pid, flush=True); time.sleep(60)\n"
    )
    env = {**__import__("os").environ, procs.OWNER_VAR: "test-owner-" + tmp_path.name}
    parent = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        int(parent.stdout.readline())
        procs.wait_for(lambda: len(procs.descendants([parent.pid])) >= 2, 10, what="grandchild")
        tree = {parent.pid} | procs.descendants([parent.pid])
        assert procs.find_pids({procs.OWNER_VAR: env[procs.OWNER_VAR]}) == tree
        t0 = time.monotonic()
        assert procs.terminate([parent.pid], [parent.pid], timeout=5) == set()
        assert time.monotonic() - t0 < 6
        assert procs.alive(tree) == set()
    finally:
        procs.terminate([parent.pid], [parent.pid], timeout=2, owner=env[procs.OWNER_VAR])
        parent.wait(timeout=10)


def test_fab_source_builds_the_same_fab_as_the_checkout_without_what_git_ignores():
    """`flwr run` on fab_source(checkout) ships the FAB that `flwr run <checkout>` ships, byte
    for byte, and the copy holds none of the ignored trees (.venv, caches) that made the CLI slow;
    a directory that is not a checkout is used as it is."""
    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[2]
    copy = fh.fab_source(root)
    assert copy != root and fh.fab_source(root) == copy  # made once
    assert (copy / "pyproject.toml").is_file() and (copy / ".gitignore").is_file()
    assert not (copy / ".venv").exists() and not list(copy.rglob("__pycache__"))
    assert build_fab_from_disk(copy) == build_fab_from_disk(root)
    assert fh.fab_source(copy) == copy.resolve()


def test_run_failure_detects_flower_exit_codes():
    ok = subprocess.CompletedProcess(["flwr"], 0, stdout="Successfully started run 12\n...")
    failed = subprocess.CompletedProcess(["flwr"], 0, stdout="ERROR :     Exit Code: 201\n")
    assert fh.run_failure(ok) is None and fh.parse_run_id(ok.stdout) == 12
    assert "201" in fh.run_failure(failed)
    with pytest.raises(fh.FlowerRunError):
        fh.check_run(failed)


# ---------------------------------------------------------------------------------------------
# end to end (slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.extended
def test_simulation_two_supernodes(tmp_path):
    app = write_echo_app(tmp_path / "app")
    env = fh.flower_env(tmp_path / "sim")
    result_path = tmp_path / "sim_result.json"
    started: set[int] = set()
    try:
        t0 = time.monotonic()
        res = fh.run_simulation(
            app,
            env,
            num_supernodes=2,
            run_config={"num-server-rounds": ROUNDS, "result-path": str(result_path), "min-nodes": 2},
            timeout=120,
            cpus_per_client=1,
            log_path=tmp_path / "flwr_run.log",
            keep_superlink=True,  # to time and check the stop separately below
            check=True,
        )
        wall = time.monotonic() - t0
        started = fh.local_superlink_pids(env)
        started |= procs.descendants(started)
        assert started, "flwr run ... local should leave its SuperLink running"
        t1 = time.monotonic()
        stopped = fh.stop_local_superlink(env)
        stop_s = time.monotonic() - t1
    finally:
        fh.stop_local_superlink(env)
    assert "Starting local SuperLink on 127.0.0.1:" + env[fh.LOCAL_SUPERLINK_PORT_VAR] in res.stdout
    assert started <= stopped
    assert procs.alive(started) == set()
    assert fh.local_superlink_pids(env) == set()
    assert procs.find_pids({procs.OWNER_VAR: f"sim-{env[fh.ENV_ID_VAR]}"}) == set()
    assert not procs.port_open(int(env[fh.LOCAL_SUPERLINK_PORT_VAR]))

    result = assert_echo_result(result_path, 2)
    rounds = [r["seconds"] for r in result["rounds"]]
    timing("simulation: flwr run wall (SuperLink start + Ray + all rounds)", wall)
    timing("simulation: startup (wall minus ServerApp main)", wall - result["total_s"])
    timing("simulation: ServerApp wait for 2 nodes", result["node_wait_s"])
    for i, seconds in enumerate(rounds, 1):
        timing(f"simulation: round {i}{' (includes Ray start)' if i == 1 else ''}", seconds)
    timing("simulation: stop local SuperLink", stop_s)


@pytest.mark.slow
@pytest.mark.extended  # the harness's `isolation="process"`: every CI-lane deployment test runs its default, and
# test_reliability.py its node restart
@pytest.mark.timeout(150)
def test_deployment_superlink_and_two_supernodes(tmp_path):
    app = write_echo_app(tmp_path / "app")
    result_path = tmp_path / "dep_result.json"
    t0 = time.monotonic()
    # isolation="process": each SuperNode with its own `flower-superexec`, which the harness starts and stops
    with Deployment(tmp_path, num_nodes=2, startup_timeout=60, isolation="process") as dep:
        startup = time.monotonic() - t0
        assert all(s is not None and s.alive() for s in dep.executors)
        assert "--isolation" in dep.node_command(0)
        first_ids = [dep.node_id(i) for i in range(2)]
        assert all(first_ids) and len(set(first_ids)) == 2
        t1 = time.monotonic()
        res = dep.run(
            app,
            {"num-server-rounds": ROUNDS, "result-path": str(result_path), "min-nodes": 2},
            timeout=120,
            log_path=tmp_path / "flwr_run.log",
            check=True,
        )
        run_s = time.monotonic() - t1
        assert fh.parse_run_id(res.stdout) is not None
        rounds = json.loads(result_path.read_text())["rounds"]
        assert [r["partition_ids"] for r in rounds] == [[0, 1]] * ROUNDS
        # flwr 1.41, 1.42: even with --isolation process, one flwr-clientapp process per message
        assert len({pid for r in rounds for pid in r["client_pids"]}) == 2 * ROUNDS
        executor_pid = dep.executors[1].pid
        # Crash and restart a node: it comes back with a new SuperNode ID.
        t2 = time.monotonic()
        dep.restart_node(1, sig=signal.SIGKILL)
        restart_s = time.monotonic() - t2
        assert dep.node_alive(1) and dep.node_id(1) not in first_ids
        assert not procs.alive([executor_pid]), "the killed node's SuperExec outlived it"
        assert dep.executors[1] is not None and dep.executors[1].alive() and dep.executors[1].pid != executor_pid
        pids = dep.all_pids()
        t3 = time.monotonic()
    stop_s = time.monotonic() - t3
    assert len(pids) >= 5  # SuperLink, its SuperExec, 2 x (SuperNode, SuperExec), ...
    assert procs.alive(pids) == set()
    assert procs.find_pids({procs.OWNER_VAR: dep.owner}) == set()
    assert not procs.port_open(dep.superlink_port)

    result = assert_echo_result(result_path, 2)
    timing("deployment: SuperLink start (until /health)", dep.timings["superlink_start_s"])
    timing("deployment: 2 SuperNodes start (until registered)", dep.timings["nodes_start_s"])
    timing("deployment: startup total", startup)
    timing("deployment: flwr run wall", run_s)
    timing("deployment: until ServerApp main loop (run wall minus main)", run_s - result["total_s"])
    for r in result["rounds"]:
        timing(f"deployment: round {r['round']}", r["seconds"])
    timing("deployment: SIGKILL + restart one SuperNode (until registered)", restart_s)
    timing("deployment: stop all", stop_s)
