"""ClientApp: one train message = one LoRDO round of K local steps, through the library's Worker.

The handler decodes the server's `lordo_fed.v1.GlobalState`, runs `Worker.train_round` on this
node's data partition, and replies with a `lordo_fed.v1.WorkerUpdate` (Δ, due moments, tokens,
metrics). The model, data and per-partition workers are built once per client process and kept
for as long as Flower keeps the process (a Ray actor in simulation); the worker's own state (the
error-feedback buffer, moments not due for sync, the data cursor) also goes to a state store after
every round, so a recreated process picks it up (client/state.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from client.state import ContextStore, DiskStore, StateStore
from lordo_fed.appconfig import AppConfig, load_app_config
from lordo_fed.codec import decode_global_state, encode_update, model_id
from lordo_fed.data import TokenShard, load_dataset
from lordo_fed.device import pick_device
from lordo_fed.flower import payload_bytes, payload_record
from lordo_fed.methods import MethodSettings, make_worker, resolve_method
from lordo_fed.model import build_model, lowrank_parameter_names
from lordo_fed.tokenizer import load_tokenizer
from lordo_fed.worker import Worker

log = logging.getLogger("lordo_fed.client")
PRESETS = Path(__file__).resolve().parents[1] / "examples" / "flower"  # travels in the FAB
app = ClientApp()


@dataclass
class Runtime:
    """Everything a client process builds once per run and keeps between messages."""

    cfg: AppConfig
    settings: MethodSettings
    model: nn.Module
    model_id: str
    lowrank: list[str]
    shards: dict[int, TokenShard]
    workers: dict[int, Worker] = field(default_factory=dict)
    last_round: dict[int, int] = field(default_factory=dict)

    def shard(self, partition_id: int, num_partitions: int, data_path: str) -> TokenShard:
        if partition_id not in self.shards:
            data = self.cfg.data
            if data_path:  # this node brings its own corpus: all of it is its partition
                data = dataclasses.replace(data, path=data_path)
                self.shards[partition_id] = load_dataset(data, 1).train_shards[0]
            else:
                self.shards[partition_id] = load_dataset(data, num_partitions).train_shards[partition_id]
        return self.shards[partition_id]

    def new_worker(self, partition_id: int, shard: TokenShard) -> Worker:
        data = self.cfg.data
        return make_worker(partition_id, self.model, self.settings, shard, self.lowrank, self.cfg.total_steps,
                           data.batch_size, data.seq_len, seed=data.seed)


_RUNTIMES: dict[str, Runtime] = {}


def runtime_for(context: Context) -> Runtime:
    """The process's Runtime for this run (built on the first message)."""
    key = json.dumps({"run": context.run_id, "config": dict(context.run_config)}, sort_keys=True, default=str)
    if key not in _RUNTIMES:
        cfg = load_app_config(context.run_config, PRESETS)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = pick_device(cfg.device)
        settings = resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size).to(device)
        lowrank = lowrank_parameter_names(model, cfg.model.lowrank_pattern) if settings.inner.name == "lordo" else []
        _RUNTIMES.clear()  # one run at a time per process: free the previous run's model
        _RUNTIMES[key] = Runtime(cfg, settings, model, model_id(dict(model.named_parameters())), lowrank, {})
    return _RUNTIMES[key]


def state_store(cfg: AppConfig, context: Context, partition_id: int) -> StateStore:
    if cfg.client_state == "context":
        return ContextStore(context)
    # Keyed by partition, not by run: a resumed run (a new Flower run id) finds its clients' state.
    return DiskStore(cfg.client_state_dir or Path(cfg.out_dir) / "client_state", partition_id)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round: decode the global state, K local steps, reply with the update."""
    started = time.perf_counter()
    rt = runtime_for(context)
    node = context.node_config
    pid, nparts = int(node.get("partition-id", 0)), int(node.get("num-partitions", 1))
    shard = rt.shard(pid, nparts, str(node.get("data-path", "")))
    received = payload_bytes(msg.content["state"])
    state = decode_global_state(received, expected_model_id=rt.model_id)
    setup_seconds = time.perf_counter() - started

    store = state_store(rt.cfg, context, pid)
    worker, state_source = _worker_for_round(rt, store, pid, shard, state.round)
    bar = None
    if rt.cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=rt.settings.rounds.local_steps, desc=f"client {pid} round {state.round}", leave=False)
    update = worker.train_round(state, progress=(lambda i, loss: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    train_seconds = time.perf_counter() - started - setup_seconds
    tensors, meta = worker.flat_state()
    store.save(state.round, tensors, {**meta, "model_id": rt.model_id, "variant": rt.cfg.variant})
    rt.last_round[pid] = state.round

    sent = encode_update(update, rt.model_id, rt.cfg.payload_dtype)
    metrics = {
        **update.metrics, "partition-id": pid, "tokens": update.tokens, "bytes-received": len(received),
        "bytes-sent": len(sent), "setup-seconds": setup_seconds, "train-seconds": train_seconds,
        "client-seconds": time.perf_counter() - started,
        "fresh-state": int(state_source == "fresh" and state.round > 1),
    }
    content = RecordDict({"update": payload_record(sent), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


def _worker_for_round(rt: Runtime, store: StateStore, pid: int, shard: TokenShard,
                      round_idx: int) -> tuple[Worker, str]:
    """This partition's worker with its state as of the end of round `round_idx - 1`, and where
    that state came from: 'memory' if this process trained the previous round of the partition,
    else 'store', else 'fresh' (first round, or state lost: positioned at the round's data cursor).
    """
    if rt.last_round.get(pid) == round_idx - 1 and pid in rt.workers:
        return rt.workers[pid], "memory"
    worker = rt.new_worker(pid, shard)
    saved = store.load()
    if saved is not None and saved[1].get("round") == round_idx - 1 and saved[1].get("model_id") == rt.model_id \
            and saved[1].get("variant") == rt.cfg.variant:
        worker.load_flat_state(*saved)
        source = "store"
    else:
        source = "fresh"
        if round_idx > 1:
            have = None if saved is None else saved[1].get("round")
            log.warning("partition %d: no worker state for round %d (store has %s); starting it afresh",
                        pid, round_idx - 1, have)
        worker.cursor = (round_idx - 1) * rt.settings.rounds.local_steps
    rt.workers[pid] = worker
    return worker, source
