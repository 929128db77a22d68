"""A new user's first hour with the main job's script, on real Flower (the simulation engine):
scripts/simulate.sh takes any run-config key and prints a resume line that works as printed, one
run per output directory, a finished run resumed says "nothing to do" (both told before Flower starts;
the ServerApp's own refusals are tests/unit/test_run_identity.py's), an interrupted run exits
non-zero naming its round and the resume command, the PID files exist while the run does, and a
SIGTERM to the script's process group leaves nothing behind.

Each test runs the scripts of a copy of the checkout (`harness.flower.fab_source`: the files git
tracks, so `flwr run` builds the same app quickly) with its own FLWR_HOME, local SuperLink ports,
output and PID directories.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.flower import ENV_ID_VAR, fab_source, flower_env, stop_local_superlink
from harness.processes import find_pids, pid_alive, proc_cmdline, terminate, wait_for

ROOT = Path(__file__).resolve().parents[2]
#: Tiny rounds (~0.15 s each on 2 cores): what the tests change of the quickstart preset.
TINY = "local-steps=3 batch-size=4 seq-len=32 eval-batches=2 threads=1 model-preset='tiny'"
#: Rounds long enough (~1 s) that a run is still going when a test interrupts it after round 1.
SLOW = "local-steps=120"
#: Seconds what a script stopped gets to exit before the test counts it as left running (the session's
#: leak check gives 10, harness/process_leaks.py).
LEFT_GRACE = 10.0


@pytest.fixture
def user(tmp_path):
    """(the app copy, an environment like a user's shell for the scripts); afterwards, nothing of
    this environment may be left running."""
    app = fab_source(ROOT)
    env = flower_env(tmp_path)
    env.update(OUTPUT_DIR=str(tmp_path / "out"), FLOWER_RUN_DIR=str(tmp_path / "run"), NUM_CLIENTS="2")
    yield app, env
    # What the scripts stopped may take a moment to go (Ray's workers exit once their raylet has,
    # slower on a loaded machine); still there after LEFT_GRACE seconds, it was left running.
    deadline = time.monotonic() + LEFT_GRACE
    while (left := find_pids({ENV_ID_VAR: env[ENV_ID_VAR]})) and time.monotonic() < deadline:
        time.sleep(0.2)
    cmdlines = {pid: " ".join(proc_cmdline(pid))[:200] for pid in left}
    stop_local_superlink(env)
    terminate(left)
    assert not left, f"processes left running: {cmdlines}"


def simulate(app: Path, env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(app / "scripts" / "simulate.sh"), *args], cwd=app, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return proc


def printed_resume(output: str) -> list[str]:
    """The resume command simulate.sh printed, as the argument list a shell would make of it."""
    line = re.search(r"(scripts/simulate\.sh .*resume=.*)$", output, re.M)
    assert line, output[-3000:]
    return shlex.split(line.group(1))[1:]


def wait_round(out: Path, at_least: int, timeout: float = 180) -> None:
    def reached() -> bool:
        try:
            return json.loads((out / "run.json").read_text())["round"] >= at_least
        except (OSError, ValueError, KeyError):
            return False
    wait_for(reached, timeout, what=f"round {at_least} checkpointed")


@contextlib.contextmanager
def training(app: Path, env: dict, out: Path, *args: str) -> Iterator[subprocess.Popen]:
    """simulate.sh with `args`, started in its own process group and yielded once round 1 is
    checkpointed; killed with its group if the test leaves it running."""
    proc = subprocess.Popen(["bash", str(app / "scripts" / "simulate.sh"), *args], cwd=app, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_round(out, 1)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_overrides_an_interrupt_reruns_and_resume_as_printed(user, tmp_path):
    """A user's first run, with overrides, interrupted after round 1 (the issue's case: `flwr run` alone
    gets the SIGINT): the script exits non-zero naming the round reached and the resume command; a second
    run into that output directory is refused; the resume as printed finishes the run; resumed again, it
    has nothing to do; a misspelt key is named."""
    app, env = user
    out, run_dir = tmp_path / "out", tmp_path / "run"
    assert "usage: simulate.sh" in simulate(app, env, "--help").stdout and not out.exists()  # runs nothing

    # a user's first run: no Flower config yet (flwr writes its own); the script still finds and
    # stops the local SuperLink flwr starts (it was left running: the fixture finds what is left)
    (Path(env["FLWR_HOME"]) / "config.toml").unlink()
    # a preset given on the command line wins over the script's default (it was refused as a
    # duplicate key before), and keys given after the first string reach the run
    with training(app, env, out, "preset='lordo-local'", "num-server-rounds=6", TINY, SLOW, "rank=4") as proc:
        # while it runs, every process the script started is on file, and stop_all.sh would find it
        pids = {f.name: int(f.read_text()) for f in run_dir.glob("*.pid")}
        assert set(pids) == {"flwr-run.pid", "local-superlink.pid"} and all(map(pid_alive, pids.values()))
        os.kill(pids["flwr-run.pid"], signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output[-4000:]
    status = json.loads((out / "run.json").read_text())
    reached = status["round"]
    assert status["status"] == "running" and 1 <= reached < 6, output[-4000:]
    assert "the run did not finish" in output and f"reached round {reached} of 6" in output
    assert "finished (log" not in output and "metrics:" not in output
    assert not list(run_dir.glob("*.pid"))
    assert not pid_alive(pids["local-superlink.pid"]), "the interrupted run's local SuperLink is still running"
    # the newest checkpoint (run.json follows each one at once: the same round, unless the kill fell between)
    saved = json.loads((out / "checkpoints" / "latest.json").read_text())["round"]
    assert saved in (reached, reached + 1)
    meta = json.loads((out / "checkpoints" / f"round_{saved:05d}.json").read_text())["meta"]
    assert meta["config"]["inner"]["rank"] == 4 and meta["config"]["model"]["preset"] == "tiny"
    assert meta["variant"] == "lordo_local" and meta["config"]["num_rounds"] == 6
    history = (out / "server.jsonl").read_bytes()

    # a second run into the same output directory is refused, on the screen, and changes nothing; it is
    # told before Flower starts (no run log: `flwr run` never ran), as the ServerApp would tell it
    runs = sorted(p.name for p in run_dir.iterdir())
    again = simulate(app, env, "num-server-rounds=3", TINY, "rank=4")
    assert again.returncode == 2
    assert f"already holds another run's checkpoints (round {saved} of 6" in again.stdout, again.stdout[-4000:]
    assert f"resume='{out / 'checkpoints'}'" in again.stdout
    assert (out / "server.jsonl").read_bytes() == history
    assert sorted(p.name for p in run_dir.iterdir()) == runs

    # the resume line the interrupted run printed, as printed: it trains the rest
    resumed = simulate(app, env, *printed_resume(output))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"at round {saved + 1}" in resumed.stdout
    assert [json.loads(x)["round"] for x in (out / "server.jsonl").read_text().splitlines()] == list(range(7))
    assert "SuperLink still running" not in resumed.stdout  # the script stops it: no advice to stop it
    superlink = find_pids({}, cmdline_contains=["flower-superlink", str(Path(env["FLWR_HOME"]) / "local-superlink")])
    assert not superlink, f"the local SuperLink of the resumed run is still running: {sorted(superlink)}"
    history = (out / "server.jsonl").read_bytes()

    # the resume line printed after the finished run, as printed: a finished run has nothing to do
    runs = sorted(p.name for p in run_dir.iterdir())
    done = simulate(app, env, *printed_resume(resumed.stdout))
    assert done.returncode == 0 and "finished all 6 rounds already" in done.stdout and "nothing to do" in done.stdout
    assert (out / "server.jsonl").read_bytes() == history
    assert sorted(p.name for p in run_dir.iterdir()) == runs

    # a misspelt key is named on the screen, with the key meant, and nothing starts
    typo = simulate(app, env, "num-server-round=2")
    assert typo.returncode == 2 and "unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'?" \
        in typo.stdout


@pytest.mark.extended
def test_sigterm_to_the_scripts_process_group_ends_the_whole_tree(user, tmp_path):
    app, env = user
    with training(app, env, tmp_path / "out", "num-server-rounds=50", TINY, SLOW) as proc:
        assert find_pids({ENV_ID_VAR: env[ENV_ID_VAR]}, ("flower-superlink",))  # the SuperLink is ours
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-4000:]
    assert "the run did not finish" in output and "resume it with:" in output
    deadline = time.monotonic() + 20  # Ray's workers go with their raylet
    while find_pids({ENV_ID_VAR: env[ENV_ID_VAR]}) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = find_pids({ENV_ID_VAR: env[ENV_ID_VAR]})
    assert not left, [" ".join(open(f"/proc/{p}/cmdline").read().split("\0"))[:200] for p in left]


@pytest.mark.extended  # a second way to interrupt a run: the CI lane interrupts `flwr run` and checks the PID files
def test_stop_all_stops_a_run_in_progress(user, tmp_path):
    """The PID files are written when the processes start, not after `flwr run` returns: stop_all.sh
    used to say "nothing to stop" while the run trained on."""
    app, env = user
    with training(app, env, tmp_path / "out", "num-server-rounds=50", TINY, SLOW) as proc:
        stop = subprocess.run(["bash", str(app / "scripts" / "stop_all.sh"), "--dir", str(tmp_path / "run")], env=env,
                              text=True, capture_output=True, timeout=60)
        output, _ = proc.communicate(timeout=120)
    assert stop.returncode == 0 and "nothing to stop" not in stop.stdout, stop.stdout + stop.stderr
    assert "flwr-run: stopping pid" in stop.stdout and "local-superlink: stopping pid" in stop.stdout
    assert proc.returncode != 0 and "the run did not finish" in output, output[-4000:]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["round"] < 50


def test_the_readmes_direct_flwr_run_lines_work_as_written(user, tmp_path):
    """The README's `flwr run . local --stream ...` block, run by bash as written (in a shell
    without Flower's opt-out variable, as a user's is), with run-config strings appended that make
    it tiny and put its outputs in tmp_path (a later `--run-config` wins). Before, the line failed:
    Flower `uv sync`ed the app (code 608, exit 0) until the variable was set."""
    app, env = user
    env = {k: v for k, v in env.items() if k != "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"}
    text = (ROOT / "README.md").read_text()
    block = text[text.index("# Simulation with flwr itself"):text.index("# Paper flavours")]
    lines = [line for line in block.splitlines() if not line.startswith("#")]
    assert "flwr run . local --stream" in lines[-2]
    script = "\n".join(lines) + (f" --run-config \"num-server-rounds=1 min-clients=4 {TINY}\""
                                 f" --run-config \"output-dir='{tmp_path / 'out'}'\"\n")
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=app, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    finally:
        assert stop_local_superlink(env)  # flwr run leaves it running, as the README says
    assert proc.returncode == 0 and "Exit Code" not in proc.stdout, proc.stdout[-4000:]
    rounds = [json.loads(x)["round"] for x in (tmp_path / "out" / "server.jsonl").read_text().splitlines()]
    assert rounds == [0, 1]
    meta = json.loads((tmp_path / "out" / "checkpoints" / "round_00001.json").read_text())["meta"]
    assert meta["config"]["inner"]["rank"] == 16 and meta["config"]["payload_dtype"] == "bf16"
