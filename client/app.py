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
import hashlib
import json
import logging
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from client.state import ContextStore, DiskStore, StateStore
from lordo_fed.appconfig import AppConfig, load_app_config
from lordo_fed.codec import decode_global_state, encode_update, model_id
from lordo_fed.data import TokenShard, load_dataset
from lordo_fed.device import pick_device
from lordo_fed.flower import TICKET, UPLOAD_SHA256, explicit_keys, payload_bytes, payload_record
from lordo_fed.methods import MethodSettings, lowrank_ranks, make_worker, resolve_method
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
CONFIG_CACHE = Path("~/.cache/lordo_fed/appconfig")


def app_config(run_config: dict, explicit: tuple[str, ...] = ()) -> AppConfig:
    """`load_app_config(run_config, PRESETS, explicit)`, cached on local disk across client processes.

    In a deployment every message starts a new ClientApp process, and composing the config costs
    ~0.2 s (Hydra's import and Compose API). The cache key covers everything the result depends
    on: the run config and its explicit keys, the presets' contents and the lordo_fed sources (path, size, mtime). A bad
    config raises as before (and is not cached); an unreadable cache entry is recomposed.
    """
    import lordo_fed

    h = hashlib.sha256(json.dumps([dict(run_config), sorted(explicit)], sort_keys=True, default=str).encode())
    for path in sorted(PRESETS.glob("*.yaml")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(Path(lordo_fed.__file__).parent.rglob("*.py")):
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    cache = CONFIG_CACHE.expanduser() / f"{h.hexdigest()[:32]}.pickle"
    try:
        cfg = pickle.loads(cache.read_bytes())
        if isinstance(cfg, AppConfig):
            return cfg
    except Exception:  # noqa: BLE001 (missing, partial or stale entry: compose afresh)
        pass
    cfg = load_app_config(run_config, PRESETS, explicit)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(cfg))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs the recomposition
    return cfg


def skip_lazy_dynamo_import() -> bool:
    """Spare a fresh client process the ~1 s import of `torch._dynamo` (returns whether it did).

    `torch.optim.Optimizer.add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` are
    wrapped by `torch._disable_dynamo`, which imports `torch._dynamo` on the first call only to keep
    those methods out of `torch.compile` tracing, then calls the plain method through the
    disabling wrapper it caches in the method's `__dynamo_disable` attribute. Nothing in this client
    is compiled, and in a deployment every message gets a new ClientApp process, so every round
    would pay that import for the LoRDO optimizer's constructor. We pre-fill the cache with the
    plain method: outside compilation the disabling wrapper does nothing but call it. Done only
    while `torch._dynamo` is not imported yet, and only on wrappers that look like torch's.
    (AdamW-based variants still import it: `AdamW.step` imports it directly.)
    """
    if "torch._dynamo" in sys.modules:
        return False
    done = False
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        wrapper = getattr(torch.optim.Optimizer, name, None)
        plain = getattr(wrapper, "__wrapped__", None)
        code = getattr(wrapper, "__code__", None)
        if plain is None or code is None or not code.co_filename.endswith("_compile.py") or code.co_name != "inner":
            continue  # not torch._disable_dynamo's wrapper (another torch version): leave it alone
        if getattr(plain, "__dynamo_disable", None) is None:
            setattr(plain, "__dynamo_disable", plain)
            done = True
    return done


def runtime_for(context: Context, explicit: tuple[str, ...] = ()) -> Runtime:
    """The process's Runtime for this run (built on the first message); `explicit`: the run-config
    keys the user set, as the server's message names them."""
    key = json.dumps({"run": context.run_id, "config": dict(context.run_config), "explicit": sorted(explicit)},
                     sort_keys=True, default=str)
    if key not in _RUNTIMES:
        skip_lazy_dynamo_import()
        cfg = app_config(context.run_config, explicit)
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
    """One round: decode the global state, K local steps, reply with the update.

    Reply metrics: `setup-seconds` (runtime, data, decoding, worker state: mostly first-message
    cost in a fresh process), `train-seconds` (the K local steps alone), `codec-seconds` (decoding
    the global state plus encoding the reply), `client-seconds` (the whole handler, what the server
    reports as client time).
    """
    started = time.perf_counter()
    rt = runtime_for(context, explicit_keys(msg))
    node = context.node_config
    pid, nparts = int(node.get("partition-id", 0)), int(node.get("num-partitions", 1))
    shard = rt.shard(pid, nparts, str(node.get("data-path", "")))
    download_started = time.perf_counter()
    received = receive_state(msg, context, rt.cfg.round_timeout)
    decode_started = time.perf_counter()
    state = decode_global_state(received, expected_model_id=rt.model_id)
    decode_seconds = time.perf_counter() - decode_started
    store = state_store(rt.cfg, context, pid)
    worker, state_source = _worker_for_round(rt, store, pid, shard, state.round)
    setup_seconds = time.perf_counter() - started

    bar = None
    if rt.cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=rt.settings.rounds.local_steps, desc=f"client {pid} round {state.round}", leave=False)
    train_started = time.perf_counter()
    update = worker.train_round(state, progress=(lambda i, loss: bar.update(1)) if bar else None)
    train_seconds = time.perf_counter() - train_started
    if bar:
        bar.close()
    tensors, meta = worker.flat_state()
    store.save(state.round, tensors, {**meta, "model_id": rt.model_id, "variant": rt.cfg.variant})
    rt.last_round[pid] = state.round

    encode_started = time.perf_counter()
    sent = encode_update(update, rt.model_id, rt.cfg.payload_dtype)
    encode_seconds = time.perf_counter() - encode_started
    upload_started = time.perf_counter()
    content = send_reply(msg, context, sent, rt.cfg.round_timeout)
    transfer_seconds = (decode_started - download_started) + (time.perf_counter() - upload_started)
    metrics = {
        **update.metrics, "partition-id": pid, "tokens": update.tokens, "bytes-received": len(received),
        "bytes-sent": len(sent), "setup-seconds": setup_seconds, "train-seconds": train_seconds,
        "codec-seconds": decode_seconds + encode_seconds, "transfer-seconds": transfer_seconds,
        "client-seconds": time.perf_counter() - started,
        "fresh-state": int(state_source == "fresh" and state.round > 1),
    }
    content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


def receive_state(msg: Message, context: Context, timeout: float) -> bytes | bytearray:
    """The encoded state a server message brings: inside it (Flower data plane), or fetched from
    the gRPC data plane with the message's ticket (checked against its size and sha256)."""
    config = msg.content.config_records.get("config")
    if config is None or TICKET not in config:
        return payload_bytes(msg.content["state"])
    from lordo_fed.transport.client import download, parse_ticket

    return download(parse_ticket(config[TICKET]), context.node_id, _root_certificates(context), timeout=timeout)


def send_reply(msg: Message, context: Context, data: bytes, timeout: float) -> RecordDict:
    """The reply's content for an encoded update: the update itself (Flower data plane), or only
    its sha256 once the gRPC data plane has confirmed the upload."""
    config = msg.content.config_records.get("config")
    if config is None or TICKET not in config:
        return RecordDict({"update": payload_record(data)})
    from lordo_fed.transport.client import parse_ticket, upload

    sha = upload(parse_ticket(config[TICKET]), context.node_id, data, _root_certificates(context), timeout=timeout)
    return RecordDict({"upload": ConfigRecord({UPLOAD_SHA256: sha})})


def _root_certificates(context: Context) -> str | None:
    """The CA certificate a node verifies the data plane's TLS with: node config `root-certificates`."""
    path = str(context.node_config.get("root-certificates", ""))
    return path or None


@app.query()
def query(msg: Message, context: Context) -> Message:
    """LoRDO-Global's round-0 exchange: this partition's gradient at θ0 for the low-rank weights."""
    rt = runtime_for(context, explicit_keys(msg))
    node = context.node_config
    pid, nparts = int(node.get("partition-id", 0)), int(node.get("num-partitions", 1))
    shard = rt.shard(pid, nparts, str(node.get("data-path", "")))
    state = decode_global_state(receive_state(msg, context, rt.cfg.round_timeout), expected_model_id=rt.model_id)
    worker, _ = _worker_for_round(rt, state_store(rt.cfg, context, pid), pid, shard, 1)
    names = sorted(lowrank_ranks(rt.model, rt.cfg.model.lowrank_pattern, rt.settings.inner.rank, rt.settings.inner.name))
    gradient = worker.gradient(state, names)
    sent = encode_update(gradient, rt.model_id, rt.cfg.payload_dtype)
    return Message(content=send_reply(msg, context, sent, rt.cfg.round_timeout), reply_to=msg)


def _worker_for_round(rt: Runtime, store: StateStore, pid: int, shard: TokenShard,
                      round_idx: int) -> tuple[Worker, str]:
    """This partition's worker with its state as of the end of round `round_idx - 1`, and where
    that state came from: 'memory' if this process trained the previous round of the partition,
    else 'store', else 'fresh' (first round, or state lost: positioned at the round's data cursor).
    """
    if rt.last_round.get(pid) == round_idx - 1 and pid in rt.workers:
        return rt.workers[pid], "memory"
    worker = rt.new_worker(pid, shard)
    saved = store.load(round_idx - 1)  # not the newest: after a server crash it may be round_idx's
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
