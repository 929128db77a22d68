"""Flower apps the tests and benchmarks run besides the real one (server/, client/), each a real
directory here (`harness/apps/<name>/`: a pyproject.toml and a package of modules that can be read,
linted and imported), and the helpers that copy them for a run.

Why copies: `flwr run <dir>` builds its FAB from the files under `<dir>` (harness/flower.py,
`fab_source`), so a run is given a clean copy (no `__pycache__`) in its own temporary directory,
where a caller may also set the app's run-config defaults (`copy_app(..., config=...)`: the
SuperLink refuses a run whose `--run-config` has a key the app's pyproject.toml does not declare,
flwr 1.41 and 1.42 `control_handlers`).

- `echo/`: a minimal app for the harness's own tests (`write_echo_app`).
- `dataplane_bench/`: benchmarks/dataplane_throughput.py's app (the data plane against Flower's path).
- `payload_bench/`: benchmarks/payload_throughput.py's app (payloads inside Flower's messages).
- `server_memory_bench/`: benchmarks/server_memory_deployment.py's app (the product ServerApp,
  stand-in clients; the product's run-config defaults are set when it is copied).
- `stock_bench/`: benchmarks/round_overhead.py's stock Flower app (FedAvg.start, a torch ClientApp).

`hostile_clientapp.py` is not an app directory: the real app with a corrupting ClientApp
(tests/integration/test_hostile_client.py).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from harness.flower import flatten_config, toml_value

APPS = Path(__file__).resolve().parent
"""The directory that holds the app directories."""
CONFIG_TABLE = "[tool.flwr.app.config]"
"""The run-config defaults of an app: the last table of its pyproject.toml, so that `copy_app`
can rewrite it without a TOML writer."""


def copy_app(name: str, dest: str | os.PathLike, config: Mapping[str, Any] | None = None) -> Path:
    """Copy the app `harness/apps/<name>/` to `dest` (created if missing; its files overwritten)
    without caches, and return `dest`. `config` sets run-config defaults in the copy's
    pyproject.toml: its keys replace the app's values or are added after them (TOML values as in
    `format_run_config`)."""
    source = APPS / name
    if not (source / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no Flower app {name!r} in {APPS} (no {source / 'pyproject.toml'})")
    dest = Path(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    if config:
        set_app_config(dest / "pyproject.toml", config)
    return dest


def set_app_config(pyproject: str | os.PathLike, config: Mapping[str, Any]) -> None:
    """Rewrite the `[tool.flwr.app.config]` table of an app's pyproject.toml (its last table) with
    its current values updated by `config`; the rest of the file stays as it is, comments inside
    the table are dropped."""
    path = Path(pyproject)
    text = path.read_text(encoding="utf-8")
    head, header, table = text.partition(f"\n{CONFIG_TABLE}\n")
    if not header or re.search(r"^\s*\[", table, re.M):
        raise ValueError(f"{path}: {CONFIG_TABLE} must be the file's last table")
    values = flatten_config(tomllib.loads(text)["tool"]["flwr"]["app"]["config"])
    values.update(flatten_config(config))
    path.write_text(head + header + "".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()), encoding="utf-8")


def write_echo_app(app_dir: str | os.PathLike) -> Path:
    """A copy of the echo app (harness/apps/echo/: the ServerApp sends one train message per node
    and round, the ClientApp echoes its partition id) in `app_dir`; returns it. Run config:
    num-server-rounds, result-path (absolute: where the ServerApp writes its JSON summary),
    min-nodes, node-wait-timeout, round-timeout, fail-on-round (0 = never)."""
    return copy_app("echo", app_dir)
