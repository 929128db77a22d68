"""What runs on a node, without Flower: the model, data and workers a node keeps between rounds,
and one round's job from the received state to the encoded reply.

Two hosts call it: the ClientApp in-process (client/app.py: simulation, quick starts; a new
process per message in a deployment) and the long-lived node worker (lordo_fed/node/service.py),
which keeps everything on its device between rounds and persists the worker state off the
critical path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lordo_fed.app.config import PRESET_DIR, AppConfig, load_app_config
from lordo_fed.data import TokenShard, load_dataset
from lordo_fed.node.config import NodeConfig
from lordo_fed.node.ranks import LocalRanks
from lordo_fed.node.store import DiskStore, StateStore
from lordo_fed.rounds.build import Run, build_run
from lordo_fed.rounds.methods import MethodSettings
from lordo_fed.rounds.worker import Worker
from lordo_fed.wire.decode import adoptable, decode_global_state
from lordo_fed.wire.encode import StreamingEncode, encode_update

log = logging.getLogger("lordo_fed.client")
CONFIG_CACHE = Path("~/.cache/lordo_fed/appconfig")
TRAIN, QUERY = "train", "query"


@dataclass(frozen=True)
class Job:
    """What one server message asks of a node, in plain values (Flower's Context and Message
    stay in client/app.py)."""

    kind: str
    """TRAIN (K local steps, reply with the update) or QUERY (the round-0 gradient at θ0)."""
    run_id: int
    run_config: dict
    """The run's merged run config (Flower's `Context.run_config`)."""
    explicit: tuple[str, ...]
    """The run-config keys the user set (they win over a preset)."""
    node_config: dict
    """This node's config: partition-id, num-partitions, data-path, ..."""

    @functools.cached_property
    def node(self) -> NodeConfig:
        """`node_config`, typed and checked (ValueError naming a bad key or value)."""
        return NodeConfig.from_flower(self.node_config)

    @property
    def partition(self) -> tuple[int, int]:
        return self.node.partition_id, self.node.num_partitions

    @property
    def slowdown(self) -> float:
        """Node config `slowdown` (default 1): this node sleeps after its local steps until a round
        has taken `slowdown` times as long as they did: a really slow node, for tests and demos."""
        return self.node.slowdown

    def local_steps(self, rt: "Runtime") -> int:
        """This node's local steps per round: node config `local-steps`, else the run's
        `async_rounds.local_steps[partition]`, else K. Only asynchronous methods let nodes differ."""
        pid, _ = self.partition
        default = rt.settings.rounds.local_steps
        value = self.node.local_steps
        if value is None:
            per_worker = rt.cfg.async_rounds.local_steps
            if rt.settings.loop != "async" or not per_worker:
                return default
            if pid >= len(per_worker):
                raise ValueError(f"async_rounds.local_steps={list(per_worker)!r} has no entry for partition {pid}: "
                                 "expected one value per partition")
            return int(per_worker[pid])
        if rt.settings.loop != "async" and value != default:
            raise ValueError(f"node config local-steps={value}: nodes may run their own number of local steps only "
                             f"with an asynchronous variant (this run's {rt.cfg.variant!r} has K={default} for all)")
        return value


@dataclass
class Runtime:
    """Everything a client process builds once per run and keeps between messages."""

    cfg: AppConfig
    """The run's settings, as the server composed them."""
    run: Run
    """The run's components (lordo_fed.rounds.build: the same θ0 as the server's)."""
    shards: dict[int, TokenShard] = field(default_factory=dict)
    workers: dict[int, Worker] = field(default_factory=dict)
    last_round: dict[int, int] = field(default_factory=dict)

    @property
    def settings(self) -> MethodSettings:
        return self.run.settings

    @property
    def model_id(self) -> str:
        return self.run.model_id

    def shard(self, partition_id: int, num_partitions: int, data_path: str) -> TokenShard:
        if partition_id not in self.shards:
            data = self.cfg.data
            if data_path:  # this node brings its own corpus: all of it is its partition
                data = dataclasses.replace(data, path=data_path)
                self.shards[partition_id] = load_dataset(data, 1).train_shards[0]
            else:
                self.shards[partition_id] = load_dataset(data, num_partitions).train_shards[partition_id]
        return self.shards[partition_id]

    def new_worker(self, partition_id: int, shard: TokenShard, local_steps: int | None = None) -> Worker:
        return self.run.worker(partition_id, shard, self.cfg.total_steps, local_steps, ranks=LOCAL_RANKS)


LOCAL_RANKS: LocalRanks | None = None
"""This process's place in a node of several ranks (set by the node worker under torchrun); None
for a node of one process."""


class ReadOnlyStore:
    """The store as a rank that is not the lead sees it: it loads the lead's copy of the node's
    state (replicated under DDP, gathered whole under FSDP2), and saves nothing."""

    def __init__(self, store: StateStore):
        self.store = store

    def load(self, round_idx: int | None = None):
        return self.store.load(round_idx)

    def save(self, round_idx: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        pass



_RUNTIMES: dict[str, Runtime] = {}


def app_config(run_config: dict, explicit: tuple[str, ...] = (), presets: Path = PRESET_DIR) -> AppConfig:
    """`load_app_config(run_config, presets, explicit)`, cached on local disk across client processes.

    In a deployment every message starts a new ClientApp process, and composing the config costs
    ~0.2 s (Hydra's import and Compose API). The cache key covers everything the result depends
    on: the run config and its explicit keys, the presets' contents and the lordo_fed sources (path, size, mtime). A bad
    config raises as before (and is not cached); an unreadable cache entry is recomposed.
    """
    import lordo_fed

    h = hashlib.sha256(json.dumps([dict(run_config), sorted(explicit)], sort_keys=True, default=str).encode())
    for path in sorted(presets.glob("*.yaml")):
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
    cfg = load_app_config(run_config, presets, explicit)
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


def runtime_for(job: Job) -> Runtime:
    """The process's Runtime for this run (built on the first message)."""
    key = json.dumps({"run": job.run_id, "config": dict(job.run_config), "explicit": sorted(job.explicit)},
                     sort_keys=True, default=str)
    if key not in _RUNTIMES:
        skip_lazy_dynamo_import()
        cfg = app_config(job.run_config, job.explicit)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        _RUNTIMES.clear()  # one run at a time per process: free the previous run's model
        _RUNTIMES[key] = Runtime(cfg, build_run(cfg, cfg.variant))
    return _RUNTIMES[key]


def disk_store(cfg: AppConfig, partition_id: int) -> DiskStore:
    # Keyed by partition, not by run: a resumed run (a new Flower run id) finds its clients' state.
    return DiskStore(cfg.client_state_dir or Path(cfg.out_dir) / "client_state", partition_id)


def _background_priority() -> None:
    """The saver thread yields the CPU to the round's critical path (encode, upload, the next
    download): on a node with few cores a state save at normal priority slowed the reply's encoding
    5-10x (results.md section 13)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):  # not Linux, or not permitted: normal priority
        pass


_SAVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lordo-state-save", initializer=_background_priority)
_PENDING_SAVES: dict[int, Future] = {}


def _rank_device() -> None:
    """The early-steps thread trains on this rank's GPU: a CUDA current device is per thread (a new
    one starts on device 0), and torchrun's rank k trains on device LOCAL_RANK (`LocalRanks`)."""
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


_EARLY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lordo-early-steps", initializer=_rank_device)
_PENDING_EARLY: dict[int, Future] = {}
"""Overlapped rounds on a node worker: the next round's first τ steps, started once the round is
sent, so that they run while the reply uploads and the next state downloads."""


def _train_early(worker: Worker, save: Future | None) -> float:
    """The next round's early steps once the state save that reads the live tensors is done;
    returns their seconds."""
    if save is not None:
        save.result()
    started = time.perf_counter()
    worker.train_early()
    return time.perf_counter() - started


def run_job(job: Job, receive: Callable[[float], bytes | bytearray | memoryview],
            store_for: Callable[[AppConfig, int], StateStore] = disk_store,
            save_in_background: bool = False, stream_reply: bool = False, encode_reply: bool = True
            ) -> tuple[bytes | memoryview | StreamingEncode, dict[str, float]]:
    """One server message: the received state in, the encoded reply and its metrics out.

    `receive(timeout)` returns the encoded state (from the message, or downloaded from the data
    plane). TRAIN: K local steps from it, the worker state saved to `store_for(cfg, partition)`
    (with `save_in_background`, on a low-priority thread, off the critical path, from the live
    tensors: the next job waits for it once its download is in, before it touches the state, so a
    worker killed between rounds finds the round on disk). QUERY: the gradient at θ0 of the
    low-rank weights. With `rounds.overlap_delay` and `save_in_background` (a node worker), the
    next round's first τ steps start on a thread once this round is sent (after its state save),
    so they overlap the upload, the server's aggregation and the next download; the next job
    waits for them before it merges its state (`Worker.train_round`). With `stream_reply`, a
    TRAIN reply is returned as a `StreamingEncode` still being written (the caller uploads it as
    it fills); without `encode_reply` (a rank that is not its node's lead) the reply is not
    encoded at all (b"").

    Metrics: `setup-seconds` (runtime, data, worker state: mostly first-message cost in a fresh
    process), `train-seconds` (the K local steps alone), `codec-seconds` (decoding the state plus
    encoding the reply), `download-seconds`, `save-seconds` (the worker state saved, or handed
    to the background save), `save-wait-seconds` (waiting for the previous round's background
    save), `fresh-state`, the worker's own metrics and tokens.
    """
    started = time.perf_counter()
    pid, nparts = job.partition
    rt = runtime_for(job)
    shard = rt.shard(pid, nparts, job.node.data_path)
    download_started = time.perf_counter()
    received = receive(rt.cfg.round_timeout)
    decode_started = time.perf_counter()
    # A download is a writable buffer of our own: its fp32 tensors are used in place (no copy).
    state = decode_global_state(received, expected_model_id=rt.model_id, adopt=adoptable(received),
                                codecs=rt.run.payload.downlink_specs)
    received_bytes = len(received)
    del received
    if state.params_from_seed:
        state.params = rt.run.seeded_params()
    decode_seconds = time.perf_counter() - decode_started
    # The previous round's background saves read the live worker state (no copy): they finish
    # before this round touches it, while the download above overlapped them.
    save_wait_started = time.perf_counter()
    wait_for_saves()
    save_wait_seconds = time.perf_counter() - save_wait_started
    early_wait_started = time.perf_counter()
    early_seconds = wait_for_early(pid)
    early_wait_seconds = time.perf_counter() - early_wait_started
    store = store_for(rt.cfg, pid)
    if job.kind == QUERY:
        worker, _ = worker_for_round(rt, store, pid, shard, 1)
        return encode_update(worker.gradient(state, sorted(rt.run.ranks)), rt.model_id, rt.run.payload.wire_dtype), {}
    if job.kind != TRAIN:
        raise ValueError(f"job kind {job.kind!r}: expected {TRAIN!r} or {QUERY!r}")
    steps = job.local_steps(rt)
    if state.local_steps:  # the server matched this round's steps to the node's speed (async-match-speed)
        if rt.settings.loop != "async" or state.local_steps > rt.cfg.total_steps:
            raise ValueError(f"the server asks for {state.local_steps} local steps: expected only in asynchronous "
                             f"rounds, and at most the run's {rt.cfg.total_steps} steps")
        steps = state.local_steps
    worker, state_source = worker_for_round(rt, store, pid, shard, state.round, steps)
    slowdown = job.slowdown
    setup_seconds = time.perf_counter() - started

    bar = None
    if rt.cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=worker.rounds.steps_of(state.round), desc=f"client {pid} round {state.round}", leave=False)
    train_started = time.perf_counter()
    update = worker.train_round(state, progress=(lambda i, loss: bar.update(1)) if bar else None)
    # Whether this round found no state of the previous one; in the reply itself, so that the server
    # sees it however the reply travels (an asynchronous session has no Flower reply per round).
    update.metrics["fresh_state"] = float(state_source == "fresh" and state.round > 1)
    train_seconds = time.perf_counter() - train_started
    if bar:
        bar.close()
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * train_seconds)
    # The round's training seconds (a slowed node's sleep included), for the server's speed match.
    update.metrics["train_seconds"] = train_seconds * max(slowdown, 1.0)
    snapshot_started = time.perf_counter()
    tensors, meta = worker.flat_state()
    meta = {**meta, "model_id": rt.model_id, "variant": rt.cfg.variant}
    if save_in_background:  # the live tensors: nothing changes them before the next job waits for this
        _PENDING_SAVES[pid] = _SAVER.submit(store.save, state.round, tensors, meta)
    else:
        store.save(state.round, tensors, meta)
    save_seconds = time.perf_counter() - snapshot_started
    rt.last_round[pid] = state.round
    if save_in_background and worker.sent is not None:  # overlap: the next round's early steps start now
        _PENDING_EARLY[pid] = _EARLY.submit(_train_early, worker, _PENDING_SAVES.get(pid))

    encode_started = time.perf_counter()
    if not encode_reply:
        sent = b""
    elif stream_reply:  # encoded on a thread while the caller uploads it (its encode-seconds are set then)
        sent = StreamingEncode(update, rt.model_id, rt.run.payload.wire_dtype)
    else:
        sent = encode_update(update, rt.model_id, rt.run.payload.wire_dtype)
    encode_seconds = time.perf_counter() - encode_started
    metrics = {
        **update.metrics, "partition-id": pid, "tokens": update.tokens, "bytes-received": received_bytes,
        "bytes-sent": len(sent.buffer if stream_reply else sent),
        "setup-seconds": setup_seconds, "train-seconds": train_seconds,
        "codec-seconds": decode_seconds + encode_seconds, "decode-seconds": decode_seconds,
        "encode-seconds": encode_seconds, "download-seconds": decode_started - download_started,
        "save-wait-seconds": save_wait_seconds, "save-seconds": save_seconds,
        "early-seconds": early_seconds, "early-wait-seconds": early_wait_seconds,
        "fresh-state": int(state_source == "fresh" and state.round > 1),
        "local-steps": worker.rounds.steps_of(state.round), "slowdown": slowdown,
    }
    return sent, metrics


def wait_for_saves() -> None:
    """Block until every background state save finished (a node worker's shutdown)."""
    for pid in list(_PENDING_SAVES):
        _PENDING_SAVES.pop(pid).result()


def wait_for_early(pid: int | None = None) -> float:
    """Block until the early steps started for partition `pid` (every partition: None) are done;
    returns their training seconds (0 when there were none). A failure in them raises here."""
    seconds = 0.0
    for key in [pid] if pid is not None else list(_PENDING_EARLY):
        future = _PENDING_EARLY.pop(key, None)
        if future is not None:
            seconds += future.result()
    return seconds


def worker_for_round(rt: Runtime, store: StateStore, pid: int, shard: TokenShard,
                      round_idx: int, local_steps: int | None = None) -> tuple[Worker, str]:
    """This partition's worker with its state as of the end of round `round_idx - 1`, and where
    that state came from: 'memory' if this process trained the previous round of the partition,
    else 'store', else 'fresh' (first round, or state lost: positioned at the round's data cursor).
    """
    steps = local_steps or rt.settings.rounds.local_steps
    if rt.last_round.get(pid) == round_idx - 1 and pid in rt.workers and rt.workers[pid].rounds.local_steps == steps:
        return rt.workers[pid], "memory"
    worker = rt.new_worker(pid, shard, steps)
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
        worker.cursor = (round_idx - 1) * steps
    rt.workers[pid] = worker
    return worker, source
