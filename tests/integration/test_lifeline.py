"""lordo_fed.node.lifeline: a process that calls `die_with_parent` dies with its parent (on Linux
by the kernel's parent-death signal; where there is no prctl, by a thread that polls the
parent), and one whose parent died before the signal was armed exits at once.

Each case runs a parent process that starts the child and waits; the child arms its lifeline
and then kills its own parent, so the parent's death comes after the child's first read of it
(the integration test of a node worker under torchrun is in tests/integration/test_ranks.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import pid_alive, wait_for

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(60)
"""

CHILD = """
import os, signal, sys, time
from pathlib import Path
from lordo_fed.node import lifeline

mode, out = sys.argv[1], Path(sys.argv[2])
parent = os.getppid()
real = lifeline._set_parent_death_signal
if mode == "parent died before the signal was armed":
    def arm(sig):  # the parent dies in between: the child is re-parented before prctl
        os.kill(parent, signal.SIGKILL)
        while os.getppid() == parent:
            time.sleep(0.01)
        return real(sig)
    lifeline._set_parent_death_signal = arm
elif mode == "no prctl":
    lifeline._set_parent_death_signal = lambda sig: False
(out / "pid").write_text(str(os.getpid()))
lifeline.die_with_parent(poll_seconds=0.05)
os.kill(parent, signal.SIGKILL)
time.sleep(10)
(out / "survived").write_text("the parent's death did not end this process")
"""


@pytest.mark.parametrize("mode", ["prctl", "no prctl", "parent died before the signal was armed"])
def test_a_process_dies_with_its_parent(tmp_path, mode):
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, str(tmp_path)], cwd=ROOT,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=stderr)
    child = None
    try:
        parent.wait(timeout=60)  # killed by the child
        assert parent.returncode == -signal.SIGKILL, parent.returncode
        child = int((tmp_path / "pid").read_text())
        wait_for(lambda: not pid_alive(child), 5, interval=0.02, what="the child to die with its parent")
        assert not (tmp_path / "survived").exists()
        said = err.read_text()
        if mode == "prctl":
            assert "is gone; exiting" not in said, said  # the kernel's SIGKILL: no last words
        else:
            assert f"its torchrun agent (pid {parent.pid}) is gone; exiting" in said, said
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
