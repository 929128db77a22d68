"""Where should a client keep its worker state between rounds? Context.state against disk files.

The state is what a LoRDO worker must not lose between rounds: the error-feedback buffer, the
moments not due for sync, the data cursor (`Worker.flat_state()`). Two stores (client/state.py):

- disk: `save_checkpoint` (safetensors + JSON, sha256, fsync, atomic rename) once per round, and
  `load_checkpoint` only when the client process lost its in-memory copy;
- context: Flower's `Context.state`. In deployment the SuperNode sends the whole Context to the
  ClientApp process with every message and receives it back (protobuf over its Runtime API), so
  the cost per round is the records conversion plus a `context_to_proto`/`context_from_proto`
  round trip in each direction, whether or not the process already had the state.

    python benchmarks/client_state.py            # tiny, small, 16m
    python benchmarks/client_state.py --quick    # tiny only
Writes benchmarks/results/client_state.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import Context, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto

from benchmarks.common import machine_info
from client.state import ContextStore
from lordo_fed.node.store import DiskStore
from lordo_fed.data import TokenShard
from lordo_fed.rounds.methods import make_worker, resolve_method
from lordo_fed.metrics import tensor_bytes
from lordo_fed.model import ModelConfig, build_model, lowrank_parameter_names
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.rounds.config import RoundConfig

RESULTS = Path(__file__).resolve().parent / "results"


def worker_state(preset: str, rank: int) -> tuple[dict, dict]:
    """A LoRDO-Global worker's state after one local step on random tokens."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset), 256)
    settings = resolve_method("lordo_global", InnerConfig(rank=rank), RoundConfig(local_steps=1), OuterConfig())
    import numpy as np

    shard = TokenShard(np.random.default_rng(0).integers(0, 256, 100_000))
    worker = make_worker(0, model, settings, shard, lowrank_parameter_names(model), 10, 2, 32, seed=0)
    for p, _ in worker.optimizer.low_rank_params():
        from lordo_fed.optim.projection import get_projection_method, projection_side

        worker.optimizer.set_projection(p, get_projection_method("svd").initial(p.shape, rank, projection_side(p.shape), 0))
    worker.local_steps(0, 1)
    return worker.flat_state()


def time_it(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(preset: str, rank: int, repeats: int) -> dict:
    tensors, meta = worker_state(preset, rank)
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(tmp, 0)
        save = time_it(lambda: disk.save(1, tensors, meta), repeats)
        load = time_it(disk.load, repeats)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    store = ContextStore(context)

    def context_round_trip() -> None:
        # What deployment does per message: SuperNode -> ClientApp process -> SuperNode.
        there = context_from_proto(context_to_proto(context))
        back = context_from_proto(context_to_proto(there))
        assert len(back.state) == len(context.state)

    ctx_save = time_it(lambda: store.save(1, tensors, meta), repeats)
    ctx_load = time_it(store.load, repeats)
    ctx_transport = time_it(context_round_trip, repeats)
    return {
        "preset": preset, "rank": rank, "state_bytes": tensor_bytes(tensors),
        "disk_save_s": save, "disk_load_s": load,
        "context_save_s": ctx_save, "context_load_s": ctx_load, "context_transport_per_message_s": ctx_transport,
        # Per round in deployment (a new process per message): disk = save + load;
        # context = records in/out + the Context travelling both ways.
        "disk_per_round_s": save + load,
        "context_per_round_s": ctx_save + ctx_load + ctx_transport,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny preset only, 2 repeats")
    parser.add_argument("--out", default=str(RESULTS / "client_state.json"))
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    cases = [("tiny", 8)] if args.quick else [("tiny", 8), ("small", 16), ("16m", 32)]
    rows = [measure(p, r, 2 if args.quick else 5) for p, r in cases]
    result = {
        "benchmark": "client_state", "quick": args.quick,
        "machine": machine_info(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'preset':8} {'state MB':>9} {'disk s/round':>13} {'context s/round':>16}")
    for r in rows:
        print(f"{r['preset']:8} {r['state_bytes'] / 1e6:9.2f} {r['disk_per_round_s']:13.4f} {r['context_per_round_s']:16.4f}")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
