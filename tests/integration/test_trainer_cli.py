"""The reference trainer's command line (lordo-train, Hydra): --help lists every option, a run
writes its outputs, a bad key is named."""

import os
import subprocess
import sys


def test_cli_help_lists_the_options():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "lordo_fed.trainer.cli", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for key in ("methods=", "inner.omega=", "inner.rank=", "rounds.local_steps=", "data.partition=", "outer.name="):
        assert key in out.stdout, key


def test_cli_runs_and_reports_a_bad_key(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    args = [sys.executable, "-m", "lordo_fed.trainer.cli", "model.preset=tiny", "workers=2", "total_steps=2",
            "rounds.local_steps=1", "data.seq_len=16", "data.batch_size=2", "eval_batches=1", "progress=false",
            f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'cli'}", "methods=[lordo_global]"]
    ok = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "lordo_global" in ok.stdout and (tmp_path / "cli" / "lordo_global.jsonl").exists()
    bad = subprocess.run(args + ["inner.omegaa=0.5"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "omegaa" in bad.stderr
