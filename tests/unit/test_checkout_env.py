"""harness.processes.checkout_env: a child imports this checkout first and keeps the caller's
PYTHONPATH (on a GPU machine the carried wheels sit on it; a benchmark that replaced it lost Hydra)."""

import os
from pathlib import Path

from harness.processes import checkout_env

ROOT = str(Path(__file__).resolve().parents[2])


def test_the_checkout_comes_first_and_the_callers_path_is_kept():
    env = checkout_env({"PYTHONPATH": os.pathsep.join(["/tmp/site", ROOT, "/opt/x"]), "HOME": "/h"}, OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/tmp/site", "/opt/x"]
    assert env["HOME"] == "/h" and env["OMP_NUM_THREADS"] == "1"


def test_without_a_pythonpath_it_is_the_checkout_alone():
    assert checkout_env({})["PYTHONPATH"] == ROOT
