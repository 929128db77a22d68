"""The per-round speed-ups of the Flower app keep behaviour: payload wrapping byte-identical to
Flower's own `Array(ndarray)`, the client's config cache and lazy-dynamo shortcut, the shortened
object-pull backoff, and the harness's `isolation="process"` option (benchmarks/round_overhead.py
measures what they buy)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


_CLIENT_SCRIPT = """
import sys
import torch
import client.app as app
import lordo_fed.node.runtime as ca
from lordo_fed.app.config import PRESET_DIR, flat_defaults, load_app_config

assert ca.skip_lazy_dynamo_import()
from lordo_fed.rounds.methods import make_worker, resolve_method
from lordo_fed.model import build_model, lowrank_parameter_names
from lordo_fed.data import TokenShard
import numpy as np

rc = {**flat_defaults(), "preset": "quickstart", "variant": "lordo_local", "local-steps": 2, "batch-size": 2,
      "seq-len": 16}
cfg = ca.app_config(rc, (), PRESET_DIR)
assert cfg == load_app_config(rc, PRESET_DIR)
assert ca.app_config(rc, (), PRESET_DIR) == cfg  # from the cache
settings = resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
model = build_model(cfg.model, 256)
worker = make_worker(0, model, settings, TokenShard(np.arange(10_000) % 256), lowrank_parameter_names(model),
                     4, 2, 16, seed=0)
worker.local_steps(0, 2)
worker.optimizer.zero_grad()
worker.optimizer.load_state_dict(worker.optimizer.state_dict())
print("dynamo imported:", "torch._dynamo" in sys.modules)
print("dtensor imported:", "torch.distributed.tensor" in sys.modules)
"""


def test_client_process_skips_dynamo_and_caches_its_config(tmp_path):
    """A ClientApp process (one per message in a deployment) that trains an unsharded worker loads
    neither dynamo nor DTensor (torch.distributed.tensor: ~0.6 s of imports, FSDP2 only), and
    caches its composed config."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _CLIENT_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamo imported: False" in proc.stdout
    assert "dtensor imported: False" in proc.stdout
    assert list((tmp_path / ".cache" / "lordo_fed" / "appconfig").glob("*.pickle"))


@pytest.mark.slow
def test_deployment_with_process_isolation(tmp_path):
    import json

    from harness.apps import write_echo_app
    from harness.deployment import Deployment
    from harness.processes import alive

    app = write_echo_app(tmp_path / "echo")
    with Deployment(tmp_path, num_nodes=2, isolation="process") as dep:
        assert all(s is not None and s.alive() for s in dep.executors)
        assert "--isolation" in dep.node_command(0)
        result = tmp_path / "result.json"
        dep.run(app, {"num-server-rounds": 2, "result-path": str(result), "min-nodes": 2}, timeout=180, check=True)
        rounds = json.loads(result.read_text())["rounds"]
        assert [r["partition_ids"] for r in rounds] == [[0, 1], [0, 1]]
        # flwr 1.41, 1.42: even with --isolation process, one flwr-clientapp process per message
        assert len({pid for r in rounds for pid in r["client_pids"]}) == 4
        executor_pid = dep.executors[1].pid
        dep.kill_node(1)
        assert not alive([executor_pid])
        pids = dep.all_pids()
    assert not alive(pids)
