"""What lordo_fed.metrics promises across processes: JSONL lines that survive a killed writer, and
the peak RSS a process reports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from lordo_fed.metrics import peak_rss_bytes, read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_lines_survive_a_killed_process(tmp_path):
    # SIGKILL-like exit: no close(), no atexit, no interpreter buffer flush
    script = textwrap.dedent(f"""
        import os
        from lordo_fed.metrics import MetricsWriter
        mw = MetricsWriter({str(tmp_path)!r}, "killed")
        for step in range(3):
            mw.write({{"step": step, "loss": 1.0 / (step + 1)}})
        os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert read_jsonl(tmp_path / "killed.jsonl") == [
        {"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.0 / 3}
    ]


def test_peak_rss_bytes():
    peak = peak_rss_bytes()
    assert isinstance(peak, int) and peak > 10 * 2**20  # at least the interpreter and torch
    # A fresh interpreter (this one's peak may already be far above anything new): touching a
    # 50 MB buffer raises its own peak by about that much.
    script = textwrap.dedent("""
        import numpy as np
        from lordo_fed.metrics import peak_rss_bytes
        before = peak_rss_bytes()
        buf = np.ones(50 * 2**20 // 8)  # written, so resident
        print(before, peak_rss_bytes())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert 45 * 2**20 < after - before < 80 * 2**20
