"""Every result file names the code it measured (benchmarks/common.py `result_header`): the tree's
commit, and where `lordo_fed` came from, with a warning when that is another tree."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks.common import ROOT, code_info, result_header


def test_a_result_names_this_trees_commit_and_package():
    header = result_header("x", True, {"k": 1})
    code = header["code"]
    assert Path(code["package"]) == ROOT / "lordo_fed"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout: no commit to compare")
    assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    assert header["config"] == {"k": 1} and header["quick"] is True


def test_a_package_from_another_tree_is_warned_about_and_recorded(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "other-checkout" / "lordo_fed"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("")
    fake = types.ModuleType("lordo_fed")
    fake.__file__ = str(elsewhere / "__init__.py")
    monkeypatch.setitem(sys.modules, "lordo_fed", fake)
    code = code_info()
    assert code["package"] == str(elsewhere.resolve())
    err = capsys.readouterr().err
    assert f"lordo_fed is imported from {elsewhere.resolve()}, not from this tree ({ROOT})" in err
    assert f"PYTHONPATH={ROOT}" in err


def test_a_cached_run_trained_on_another_host_is_refused_by_name(tmp_path):
    """quality.execute (every quality benchmark's runs) reads a cached result only where it was trained on this
    host type, or where it predates the record; another host's is refused naming both hosts."""
    from benchmarks.common import host_of, machine_info
    from benchmarks.quality import Run, execute

    run = Run("cached", "test", "lordo_global", ("total_steps=8",))
    (tmp_path / run.label).mkdir()
    here = {**host_of(machine_info()), "device": "cpu"}  # the quick runs' device on a machine without CUDA
    if torch.cuda.is_available():
        pytest.skip("the quick run would train on CUDA: its host record names the GPU")
    for host in (here, None):  # this host's, and one from before results recorded theirs
        cached = {"val_loss": 1.5, **({"host": host} if host else {})}
        (tmp_path / run.label / "result.json").write_text(json.dumps(cached))
        assert execute(run, True, tmp_path, False) == cached
    other = {**here, "cpu_model": "Other CPU"}
    (tmp_path / run.label / "result.json").write_text(json.dumps({"val_loss": 1.5, "host": other}))
    with pytest.raises(ValueError, match=r"result\.json: trained on \{'cpu_model': 'Other CPU'.*this machine is "
                                         r"\{'cpu_model': .*train it here \(--fresh, or another --work\)"):
        execute(run, True, tmp_path, False)


def test_another_host_is_refused_naming_the_kernels_that_would_give_its_runs():
    """`require_host`: the same host passes; another CPU model is refused naming both hosts and the remedy; where
    only torch's kernel set differs, the refusal also names the variable that gives torch the other's kernels."""
    from benchmarks.common import require_host

    mine = {"cpu_model": "AMD EPYC", "torch_cpu_capability": "AVX512", "torch": "2.13.0+cpu"}
    require_host(dict(mine), mine, "--reference r.json", "run it here")
    with pytest.raises(ValueError, match=r"^--reference r\.json: measured on \{'cpu_model': 'AMD EPYC', "
                                         r"'torch_cpu_capability': 'AVX2'.*run it here, or give torch their kernels "
                                         r"where this CPU has them \(ATEN_CPU_CAPABILITY=avx2\)$"):
        require_host({**mine, "torch_cpu_capability": "AVX2"}, mine, "--reference r.json", "run it here")
    with pytest.raises(ValueError, match=r"trained on \{'cpu_model': 'Other CPU'.*run it here$"):
        require_host({**mine, "cpu_model": "Other CPU", "torch_cpu_capability": "AVX2"}, mine, "x", "run it here",
                     verb="trained")


@pytest.mark.parametrize("handled", [True, False])
def test_a_benchmark_killed_by_sigterm_stops_the_trainer_it_waits_on(tmp_path, handled):
    """`stop_children_on_sigterm`: a process waiting in `subprocess.run` on a child (as compression.quality_run
    waits on the trainer) and killed with SIGTERM takes its child with it; without the handler the child runs on
    (the control: the test can tell the two apart)."""
    import os
    import signal
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = ("import subprocess, sys\n"
              + ("from benchmarks.common import stop_children_on_sigterm\nstop_children_on_sigterm()\n" if handled else "")
              + f"subprocess.run([sys.executable, '-c', {child!r}])\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the child did not start"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == (128 + signal.SIGTERM if handled else -signal.SIGTERM)

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    try:
        assert alive() is not handled
    finally:
        if alive():
            os.kill(pid, signal.SIGKILL)
