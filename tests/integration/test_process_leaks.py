"""The session-end check of harness/process_leaks.py can fail: an inner pytest session (a process
of its own, with the plugin) whose only test starts `sleep 300` in a session of its own and never
stops it fails, names the process and the test, and leaves nothing running. (That a session
which stops what it starts passes, this suite's own run shows.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.processes import find_pids, pid_alive
from harness.process_leaks import GRACE_VAR

ROOT = Path(__file__).resolve().parents[2]

INNER_TEST = """
import os, subprocess

def test_starts_a_process():
    subprocess.Popen(["sleep", "300"], start_new_session=True, env={**os.environ, "LEAK_MARK": "{mark}"})
"""


def inner_session(tmp_path: Path, mark: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER_TEST.replace("{mark}", mark))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), GRACE_VAR: "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "harness.process_leaks",
                           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_process_left_running_fails_the_session(tmp_path):
    mark = f"leak-{os.getpid()}-{tmp_path.name}"
    result = inner_session(tmp_path, mark)
    out = result.stdout + result.stderr
    print(out)
    assert result.returncode == 1, out
    assert "1 passed" in out and "processes left running" in out, out
    assert "started by test_inner.py::test_starts_a_process: sleep 300" in out, out
    left = find_pids({"LEAK_MARK": mark})
    assert not left and not any(pid_alive(p) for p in left), f"the leaked process was not ended: {left}"

