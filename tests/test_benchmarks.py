"""Benchmarks are not tests, but their --quick modes run here so they cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: str, tmp_path: Path, timeout: float = 300) -> dict:
    out = tmp_path / f"{Path(script).stem}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_client_state_quick(tmp_path):
    result = run_quick("client_state.py", tmp_path)
    (row,) = result["rows"]
    assert row["state_bytes"] > 0 and row["disk_per_round_s"] > 0 and row["context_per_round_s"] > 0
    assert result["machine"]["torch"]
