"""An installed package carries everything a run needs: `pip install .` (not editable) builds a
wheel whose `lordo_fed/app/presets/` holds the Flower presets, and a process that imports that
copy, from a directory that is not the checkout, composes a run from a preset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCES = (".git", ".venv", "outputs", "build", "dist", "run", "runs", ".flwr", ".cache", "*.egg-info",
               "__pycache__", ".pytest_cache")

COMPOSE = """
import json, sys
import lordo_fed
from lordo_fed.app.config import PRESET_DIR, load_app_config
cfg = load_app_config({"preset": "paper-16m", "rank": 16}, explicit=("rank",))
print(json.dumps({"package": lordo_fed.__file__, "presets": sorted(p.name for p in PRESET_DIR.glob("*.yaml")),
                  "preset_dir": str(PRESET_DIR), "model": cfg.model.preset, "rank": cfg.inner.rank,
                  "local_steps": cfg.rounds.local_steps}))
"""


def test_a_wheel_installed_elsewhere_composes_a_run_from_its_own_presets(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("lordo_fed-*.whl"))
    shipped = sorted(Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lordo_fed/app/presets/"))
    assert shipped == sorted(p.name for p in (ROOT / "lordo_fed" / "app" / "presets").glob("*.yaml"))

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", COMPOSE], capture_output=True, text=True, timeout=300,
                         cwd=elsewhere, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["package"]).is_relative_to(site) and Path(got["preset_dir"]).is_relative_to(site), got
    assert got["presets"] == shipped
    assert (got["model"], got["rank"], got["local_steps"]) == ("16m", 16, 32), got
