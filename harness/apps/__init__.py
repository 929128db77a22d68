"""Flower apps the tests and benchmarks run besides the real one (server/, client/), and the
helpers that write them: `flower_app_pyproject` (the pyproject.toml of a throwaway app) and
`write_echo_app` (a minimal app for the harness's own tests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.flower import flatten_config, toml_value

_APP_PYPROJECT = """\
[project]
name = {name}
version = "0.1.0"
description = {description}
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "lordofed"

[tool.flwr.app.components]
serverapp = "{module}.server_app:app"
clientapp = "{module}.client_app:app"

[tool.flwr.app.config]
"""


def flower_app_pyproject(name: str, module: str, description: str, config: Mapping[str, Any]) -> str:
    """The pyproject.toml of a throwaway Flower app: project `name`, its ServerApp and ClientApp
    at `<module>.server_app:app` / `<module>.client_app:app`, run-config defaults `config` (TOML
    values as in `format_run_config`: strings quoted, numbers as they are)."""
    head = _APP_PYPROJECT.format(name=toml_value(name), description=toml_value(description), module=module)
    return head + "".join(f"{k} = {toml_value(v)}\n" for k, v in flatten_config(config).items())


_ECHO_CONFIG = {"num-server-rounds": 2, "result-path": "", "min-nodes": 1, "node-wait-timeout": 60.0,
                "round-timeout": 120.0, "fail-on-round": 0}

_ECHO_SERVER = '''\
"""ServerApp: wait for min-nodes, then each round send one train message per connected node
and record who answered; write a JSON summary to run_config["result-path"]."""

import json
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    t_start = time.monotonic()
    min_nodes = int(cfg["min-nodes"])
    while len(list(grid.get_node_ids())) < min_nodes:
        if time.monotonic() - t_start > float(cfg["node-wait-timeout"]):
            raise RuntimeError(f"fewer than {min_nodes} nodes connected")
        time.sleep(0.1)
    out = {"node_wait_s": time.monotonic() - t_start, "rounds": []}
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        if rnd == int(cfg["fail-on-round"]):
            raise RuntimeError(f"fail-on-round={rnd}")
        t0 = time.monotonic()
        node_ids = sorted(grid.get_node_ids())
        messages = [
            Message(
                content=RecordDict({"config": ConfigRecord({"round": rnd})}),
                message_type=MessageType.TRAIN,
                dst_node_id=node_id,
                group_id=str(rnd),
            )
            for node_id in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=float(cfg["round-timeout"])))
        ok = [m for m in replies if not m.has_error()]
        metrics = [m.content["metrics"] for m in ok]
        out["rounds"].append({
            "round": rnd,
            "node_ids": [int(n) for n in node_ids],
            "partition_ids": sorted(int(m["partition-id"]) for m in metrics),
            "echo_rounds": sorted(int(m["round"]) for m in metrics),
            "client_pids": sorted(int(m["pid"]) for m in metrics),
            "errors": len(replies) - len(ok),
            "seconds": time.monotonic() - t0,
        })
    out["total_s"] = time.monotonic() - t_start
    with open(cfg["result-path"], "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
'''

_ECHO_CLIENT = '''\
"""ClientApp: echo partition-id (node config) and the round back in a MetricRecord."""

import os

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({
        "partition-id": int(context.node_config["partition-id"]),
        "round": int(msg.content["config"]["round"]),
        "pid": os.getpid(),
    })
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
'''


def write_echo_app(app_dir: str | os.PathLike, name: str = "lordofed-echo") -> Path:
    """Write a minimal Flower app (echo ServerApp/ClientApp, see the strings above) into
    `app_dir`; returns it. Run config: num-server-rounds, result-path (absolute), min-nodes,
    node-wait-timeout, round-timeout, fail-on-round (0 = never)."""
    app_dir = Path(app_dir)
    module = name.replace("-", "_")
    (app_dir / module).mkdir(parents=True, exist_ok=True)
    (app_dir / "pyproject.toml").write_text(flower_app_pyproject(
        name, module, "Throwaway Flower app for lordo-fed harness tests", _ECHO_CONFIG))
    (app_dir / module / "__init__.py").write_text("")
    (app_dir / module / "server_app.py").write_text(_ECHO_SERVER)
    (app_dir / module / "client_app.py").write_text(_ECHO_CLIENT)
    return app_dir
