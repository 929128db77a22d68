"""The per-round speed-ups of the Flower app keep behaviour: payload wrapping byte-identical to
Flower's own `Array(ndarray)`, the client's config cache and lazy-dynamo shortcut, the shortened
object-pull backoff (benchmarks/round_overhead.py measures what they buy). The harness's
`isolation="process"` option runs in test_flower_harness.py's deployment."""

import os
import subprocess
import sys
from pathlib import Path


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
settings = resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps)
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
