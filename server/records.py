"""What the server keeps of a run: each round's log and record (with its link-bound ideal),
server.jsonl (and TensorBoard), the plots, and the checkpoints a run resumes from.

The strategies (server/strategy.py, server/async_strategy.py) hold one `Recorder`; a round's
`RoundLog` is filled by the courier (server/courier.py: bytes, decode time, drops, arrivals) and
by the strategy (each usable reply's client metrics), then turned into the round's record here.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import Tensor

from lordo_fed.app.config import AppConfig, as_dict
from lordo_fed.checkpoint import (RUN_KEY, CheckpointError, check_compatible, checkpoint_stem, describe_directory,
                                  load_checkpoint, rng_state, save_checkpoint)
from lordo_fed.metrics import MetricsWriter, peak_rss_bytes, plot_curves
from lordo_fed.wan.links import NodeLink, ideal_round_seconds, overlap_bound_seconds

log = logging.getLogger("lordo_fed.server")

#: Settings a resumed run may change: where and how it runs, how long, what it logs. Any other
#: setting (model, data, optimizers, rounds, payload, seed, method) must equal the checkpoint's, or
#: the continued run would be a different run under the old one's name.
RESUMABLE_CHANGES = frozenset({
    "num_rounds", "resume", "out_dir", "device", "threads", "tensorboard", "eval_every", "eval_batches",
    "min_clients", "round_timeout", "checkpoint_keep", "outlier_factor", "client_state", "client_state_dir",
    "progress", "data_plane", "data.cache_dir"})

#: Client metrics kept per client in a round's `links` record: where a node's time went.
LINK_METRICS = ("download-seconds", "download-wait-seconds", "upload-seconds", "decode-seconds", "encode-seconds",
                "setup-seconds",
                "save-seconds", "save-wait-seconds", "early-seconds", "early-wait-seconds", "client-seconds")


@dataclass
class RoundLog:
    """What one round saw on the wire (measured from the serialized payloads)."""

    sent_bytes: int = 0
    received: dict[int, int] = field(default_factory=dict)
    client_seconds: dict[int, float] = field(default_factory=dict)
    client_train_seconds: dict[int, float] = field(default_factory=dict)
    client_codec_seconds: dict[int, float] = field(default_factory=dict)
    client_transfer_seconds: dict[int, float] = field(default_factory=dict)
    """Each client's own download + upload seconds on the data plane."""
    encode_seconds: float = 0.0
    """Server: encoding the global state once for all clients."""
    decode_seconds: float = 0.0
    """Server: unwrapping and decoding every reply."""
    fresh_state: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    transfer_seconds: dict[int, float] = field(default_factory=dict)
    """Data plane: seconds each reply took to stream in (first to last byte)."""
    clientapp_torch: int = 0
    """Replies whose ClientApp process imported torch (0 when every node has a node worker)."""
    replied: set[int] = field(default_factory=set)
    """Nodes whose reply arrived (not an error reply): they hold this round's copy of θ."""
    partitions: dict[int, int] = field(default_factory=dict)
    """Node -> the partition of its reply that passed screening (a relaying state leaves that reply out of
    the node's next state: lordo_fed.rounds.relay.for_worker)."""
    marks: dict[str, float] = field(default_factory=dict)
    """When the round reached each phase (time.perf_counter()): 'published', 'uploads_in', 'replies_in'."""
    link_rate: dict[int, float] = field(default_factory=dict)
    """Each client's link rate in bytes/s, as its node config `link-rate` declares (lordo_fed.wan)."""
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    """Each client's reply metrics (for the per-client breakdown of `links`)."""

    def add_reply(self, worker: int, size: int, metrics: Mapping[str, Any]) -> None:
        """A usable reply of partition `worker`: its payload size and what its client measured."""
        self.received[worker] = size
        self.client_seconds[worker] = float(metrics.get("client-seconds", 0.0))
        # all of the round's local steps: an overlapped round's early ones ran before its message
        self.client_train_seconds[worker] = (float(metrics.get("train-seconds", 0.0))
                                             + float(metrics.get("early-seconds", 0.0)))
        self.client_codec_seconds[worker] = float(metrics.get("codec-seconds", 0.0))
        self.client_transfer_seconds[worker] = float(metrics.get("transfer-seconds", 0.0))
        self.client_metrics[worker] = {k: float(v) for k, v in metrics.items()
                                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if metrics.get("link-bytes-per-second", 0):
            self.link_rate[worker] = float(metrics["link-bytes-per-second"])
        if metrics.get("fresh-state", 0):
            self.fresh_state.append(worker)
        if metrics.get("clientapp-torch", 0):
            self.clientapp_torch += 1


def link_record(rl: RoundLog, seconds: float, aggregation_seconds: float, overlap: bool) -> dict[str, Any]:
    """The round against its link-bound ideal (lordo_fed.wan.links), when every client that
    replied declared its link rate (node config `link-rate`): `ideal_seconds`,
    `round_over_ideal`, the bounding node, and per client the bytes each way, its rate and its
    own download/upload/training seconds; with overlapping rounds (`overlap`), the bound of an
    overlapped round as well."""
    if not rl.received or set(rl.link_rate) != set(rl.received):
        return {}
    nodes = {w: NodeLink(rl.sent_bytes, rl.received[w], rl.link_rate[w], rl.client_train_seconds.get(w, 0.0))
             for w in rl.received}
    ideal, bound = ideal_round_seconds(nodes, aggregation_seconds)
    bounds = {}
    if overlap:
        limit, _ = overlap_bound_seconds(nodes)
        bounds = {"overlap_bound_seconds": limit, "round_over_bound": seconds / limit}
    return {"ideal_seconds": ideal, "round_over_ideal": seconds / ideal, "link_bound_client": bound,
            "link_seconds": nodes[bound].link_seconds(), **bounds,
            "links": {str(w): {"down_bytes": n.down_bytes, "up_bytes": n.up_bytes, "rate": n.rate,
                               "train_seconds": n.train_seconds,
                               **{key.replace("-", "_"): rl.client_metrics.get(w, {})[key] for key in LINK_METRICS
                                  if key in rl.client_metrics.get(w, {})}}
                      for w, n in sorted(nodes.items())}}


def rounded(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` for the log line: floats to 4 decimals."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}


class Recorder:
    """A run's records: the history (server.jsonl, TensorBoard), its plots and its checkpoints."""

    def __init__(self, cfg: AppConfig, out_dir: Path, model_id: str):
        self.cfg = cfg
        self.out_dir = out_dir
        self.model_id = model_id
        self.checkpoint_dir = out_dir / "checkpoints"
        self.history: list[dict] = []
        self.run_uid = ""
        """This run's identity (checkpoint meta `run_uid`): new for a fresh run, the checkpoint's on resume."""
        self.last_round = 0
        """The last round checkpointed (0: none yet)."""
        self._writer: MetricsWriter | None = None
        self._started = time.perf_counter()

    # ----------------------------------------------------------------------------- run identity
    def claim_fresh(self) -> None:
        """Start a new run in `out_dir`, refused when its checkpoint directory holds another run
        (docs/operations.md, "One run per output directory"): a second run there would mix its
        checkpoints and server.jsonl with the first one's. Nothing is written before this check."""
        self._refuse_if_taken(None)
        self.run_uid = uuid.uuid4().hex

    def adopt(self, meta: dict, source: Path) -> None:
        """Continue the run of the checkpoint `meta` (loaded from `source`): the same settings but
        those in RESUMABLE_CHANGES, and an output directory that is free or holds this very run."""
        differ = settings_differ(meta.get("config", {}), as_dict(self.cfg))
        if differ:
            raise CheckpointError(
                f"checkpoint {source} was written with other settings: " + "; ".join(
                    f"{k} is {a!r} there, {b!r} now" for k, a, b in differ)
                + ". Resume with the checkpoint's settings, or start a new run in another output-dir")
        self.run_uid = meta.get(RUN_KEY) or uuid.uuid4().hex  # checkpoints from before run uids: adopted
        self.last_round = int(meta.get("round", 0))
        self._refuse_if_taken(self.run_uid)

    def _refuse_if_taken(self, run_uid: str | None) -> None:
        found = describe_directory(self.checkpoint_dir)
        if found is None or (run_uid is not None and found["run_uid"] in (run_uid, None)):
            return
        what = (f"round {found['round']}" + (f" of {found['num_rounds']}" if found["num_rounds"] else "")
                + f" of a {found['variant'] or '?'} run, preset {found['preset'] or '?'}"
                + (f", run {found['run_uid']}" if found["run_uid"] else "") + f", saved {found['saved'] or '?'}")
        raise CheckpointError(
            f"output-dir {self.out_dir} already holds another run's checkpoints ({what}). "
            f"To resume that run: resume='{self.checkpoint_dir}' with its settings. To start a new run: give "
            f"another output-dir, or delete {self.checkpoint_dir} (and its server.jsonl).")

    def write_status(self, status: str) -> None:
        """`out_dir/run.json`: this run's status ('running', 'finished', 'failed'), the last round
        checkpointed and the `resume` value that continues it. Scripts read it to tell a run that
        finished from one that was interrupted (scripts/simulate.sh)."""
        doc = {"run_uid": self.run_uid, "status": status, "round": self.last_round, "num_rounds": self.cfg.num_rounds,
               "variant": self.cfg.variant, "resume": str(self.checkpoint_dir) if self.last_round else ""}
        tmp = self.out_dir / f".run.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.out_dir / "run.json")

    # ----------------------------------------------------------------------------- records
    def start_clock(self) -> None:
        """From now on `elapsed()` counts (the strategy's `start`)."""
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since `start_clock()`."""
        return time.perf_counter() - self._started

    def open(self) -> None:
        """server.jsonl (and TensorBoard) rewritten from the history: the checkpoint's history is
        the truth, records a crashed run wrote after it are dropped."""
        (self.out_dir / "server.jsonl").unlink(missing_ok=True)
        writer = MetricsWriter(self.out_dir, "server", tensorboard=self.cfg.tensorboard)
        for rec in self.history:
            writer.write(rec)
        self._writer = writer

    def add(self, record: dict) -> None:
        """`record` into the history, and into server.jsonl once it is open."""
        record = {"variant": self.cfg.variant, **record}
        self.history.append(record)
        if self._writer is not None:
            self._writer.write(record)

    def close(self) -> None:
        """The end of a run: server.jsonl closed, the plots drawn."""
        self._writer.close()
        self.plot()
        log.info("Finished: metrics %s, plots %s, checkpoints %s", self.out_dir / "server.jsonl",
                 self.out_dir / "val_loss.png", self.checkpoint_dir)

    def round_record(self, r: int, rl: RoundLog, train_loss: float | None, tokens: int, cum_bytes: int,
                     seconds: float, aggregation_seconds: float, refusals: list | None,
                     evaluation: Callable[[], dict] | None) -> dict[str, Any]:
        """The record of synchronous round `r` (server.jsonl; docs/results.md names its fields).

        `refusals`: what the data plane refused this round (None: Flower's own data plane, no
        upload fields); `evaluation`: called for the validation metrics when they are due."""
        received = list(rl.received.values())
        record = {
            "round": r, "step": self.cfg.rounds.steps_before(r + 1), "tokens": tokens,
            "train_loss": train_loss,
            "clients_ok": len(received), "clients_dropped": len(rl.dropped), "clients_missing": len(rl.missing),
            "clients_fresh_state": len(rl.fresh_state), "clientapps_with_torch": rl.clientapp_torch,
            "bytes_sent_per_client": rl.sent_bytes,
            "bytes_received_per_client": (sum(received) / len(received)) if received else 0,
            "cum_bytes_per_client": cum_bytes,
            "round_seconds": seconds, "aggregation_seconds": aggregation_seconds,
            "client_seconds": max(rl.client_seconds.values(), default=0.0),
            "client_train_seconds": max(rl.client_train_seconds.values(), default=0.0),
            "client_codec_seconds": max(rl.client_codec_seconds.values(), default=0.0),
            "client_transfer_seconds": max(rl.client_transfer_seconds.values(), default=0.0),
            "server_encode_seconds": rl.encode_seconds, "server_decode_seconds": rl.decode_seconds,
            # this process's peak resident memory so far, before this round's evaluation: with the
            # data plane it should not grow with the number of clients (results.md section 9)
            "server_peak_rss_bytes": peak_rss_bytes(),
        }
        if refusals is not None:
            record["upload_seconds"] = max(rl.transfer_seconds.values(), default=0.0)
            if refusals:
                record["data_plane_refusals"] = "; ".join(f"node {x.node_id} {x.what}: {x.reason}" for x in refusals)
        record["overhead_seconds"] = seconds - record["client_seconds"]
        if self.cfg.rounds.overlap_delay:  # clients that merged this round into one started from their own θ
            record["clients_overlapped"] = sum(m.get("overlap_steps", 0) > 0 for m in rl.client_metrics.values())
            record["client_early_seconds"] = max((m.get("early-seconds", 0.0) for m in rl.client_metrics.values()),
                                                 default=0.0)
        if "started" in rl.marks:  # seconds from the round's start to each phase (docs/results.md)
            record["phase_seconds"] = {k: v - rl.marks["started"] for k, v in rl.marks.items() if k != "started"}
        record.update(link_record(rl, seconds, aggregation_seconds, bool(self.cfg.rounds.overlap_delay)))
        # seconds since this process entered start(), at the end of this round's aggregation:
        # consecutive differences are the full round cycle (with evaluation and checkpoint)
        record["elapsed_seconds"] = self.elapsed()
        if evaluation is not None:
            record.update(evaluation())
        if rl.missing or rl.dropped:
            record["missing"] = ", ".join(rl.missing)
            record["dropped"] = "; ".join(f"{k}: {v}" for k, v in rl.dropped.items())
        return record

    def plot(self) -> None:
        runs = {self.cfg.variant: self.history}
        plot_curves(runs, "tokens", "val_loss", self.out_dir / "val_loss.png", title="Validation loss against tokens")
        plot_curves(runs, "tokens", "cum_bytes_per_client", self.out_dir / "bytes.png",
                    title="Cumulative bytes per client against tokens")
        linked = [r for r in self.history if r.get("ideal_seconds")]
        if linked:  # every node declared its link-rate: each round against its link-bound ideal
            plot_curves({"measured": [{"round": r["round"], "seconds": r["round_seconds"]} for r in linked],
                         "link-bound ideal": [{"round": r["round"], "seconds": r["ideal_seconds"]} for r in linked]},
                        "round", "seconds", self.out_dir / "link.png", title="Round time against its link-bound ideal")

    # ----------------------------------------------------------------------------- checkpoints
    def save(self, r: int, state: Mapping[str, Tensor], tokens: int, cum_bytes: int, extra: dict | None = None,
             extra_tensors: Mapping[str, Tensor] | None = None) -> None:
        """An atomic checkpoint after round `r`: `state` (the aggregator's), the RNG states, the
        counters and the history (`extra`, `extra_tensors`: more metadata and tensors, e.g. the
        asynchronous schedule's)."""
        tensors = {**state, **rng_state(), **(extra_tensors or {})}
        meta = {"model_id": self.model_id, "variant": self.cfg.variant, "round": r, "tokens": tokens,
                "cum_bytes": cum_bytes, "config": as_dict(self.cfg), "history": self.history, RUN_KEY: self.run_uid,
                **(extra or {})}
        save_checkpoint(self.checkpoint_dir, r, tensors, meta, keep=self.cfg.checkpoint_keep)
        self.last_round = r
        self.write_status("running")

    def load(self, path: str) -> tuple[dict[str, Tensor], dict, Path]:
        """(tensors, metadata, the round file loaded) of the checkpoint at `path`, refused when it
        is another run's (model id, model preset, method: the preset makes a model mismatch
        readable) before anything is written.

        `path` is a round JSON or a checkpoint directory (then its newest complete checkpoint:
        lordo_fed.checkpoint skips, with a warning, one cut off mid-write). Errors and the log
        name the round file actually loaded, not just the directory: with fallbacks, an operator
        must be able to tell which one it was."""
        tensors, meta = load_checkpoint(path)
        source = Path(path)
        if (source.is_dir() or source.name == "latest.json") and isinstance(meta.get("round"), int):
            source = (source if source.is_dir() else source.parent) / f"{checkpoint_stem(meta['round'])}.json"
        expected = {"model_id": self.model_id, "config.model.preset": self.cfg.model.preset, "variant": self.cfg.variant}
        if not self.model_id:  # `preflight`, which builds no model: the preset and the method still tell a mismatch
            del expected["model_id"]
        check_compatible(meta, expected, source)
        return tensors, meta, source

    def finished(self) -> bool:
        """The run has checkpointed its last round already (a resumed run that is complete)."""
        return self.last_round >= self.cfg.num_rounds

    def nothing_to_do(self) -> str:
        """What a complete run that was resumed says instead of training."""
        return (f"lordo-fed: the run in {self.out_dir} finished all {self.cfg.num_rounds} rounds already "
                f"(round {self.last_round} checkpointed): nothing to do. To train longer, resume with a larger "
                f"num-server-rounds.")

    def warn_if_schedule_differs(self, meta: Mapping[str, Any]) -> None:
        """A warning when the resumed checkpoint's run had another num-server-rounds."""
        saved_rounds = meta.get("config", {}).get("num_rounds")
        if saved_rounds != self.cfg.num_rounds:
            # The learning-rate schedule's horizon is num_rounds x K: a resumed run with another
            # num-server-rounds continues fine but no longer matches an uninterrupted run.
            log.warning("the checkpoint's run had num-server-rounds=%s, this run has %d: the learning-rate "
                        "schedule differs from the original run's", saved_rounds, self.cfg.num_rounds)


def preflight(cfg: AppConfig, base: Path) -> str | None:
    """The ServerApp's checks of a run's output-dir and `resume` (`Recorder.claim_fresh`, `Recorder.load`,
    `Recorder.adopt`), made before Flower starts, where the output-dir is on this machine
    (scripts/simulate.sh): CheckpointError where the ServerApp would refuse the run, `nothing_to_do()`'s
    message where it would not train, else None. Relative paths are taken from `base` (the app directory,
    as simulate.sh takes them). Nothing is written."""
    def here(path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else base / p

    recorder = Recorder(cfg, here(cfg.out_dir).resolve(), "")
    if not cfg.resume:
        recorder.claim_fresh()
        return None
    _, meta, source = recorder.load(str(here(cfg.resume)))
    recorder.adopt(meta, source)
    return recorder.nothing_to_do() if recorder.finished() else None


def settings_differ(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every setting that differs between a
    checkpoint's config and this run's, but those a resumed run may change (RESUMABLE_CHANGES)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        path = prefix + key
        if path in RESUMABLE_CHANGES:
            continue
        a, b = saved.get(key), now.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += settings_differ(a, b, path + ".")
        elif json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
            out.append((path, a, b))
    return out
