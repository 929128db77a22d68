"""The reference trainer's checkpoints: a run killed and started again continues where it stopped.

With `checkpoint_every=N` each method writes, every N rounds and at its last round, everything its loop
needs to go on under `<out_dir>/checkpoints/<method>/`, through the server's atomic writer
(`lordo_fed.checkpoint`: tensors in safetensors, metadata in JSON, the two written so that a kill at any
instant leaves the previous checkpoint whole). A run started again with the same settings loads the
newest one and continues from its round; the continued run ends where the uninterrupted one does, bit for
bit (tests/unit/test_trainer_resume.py). A checkpoint of other settings is refused with the keys that
differ, before anything is written (docs/operations.md, "The reference trainer's checkpoints").

What a checkpoint holds: the loop's tensors under prefixes of its own (synchronous rounds: the aggregator's
`state_dict()` under `server/` and each worker's `flat_state()` under `worker<m>/`; DDP: θ, the one
optimizer and the anchor of the server's bases; asynchronous rounds, whose records count as rounds: also the
rounds in flight under `pending<w>/`, the older bases they train in and each worker's copy θ_c), the RNG states, and in its metadata the run's settings,
the loop's counters, the wall-clock seconds trained so far and every record emitted so far, which the
continued run emits again so that `<method>.jsonl` (and its TensorBoard log) holds the whole run once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from torch import Tensor

from lordo_fed.checkpoint import check_compatible, list_checkpoints, load_checkpoint, rng_state, save_checkpoint
from lordo_fed.checkpoint import set_rng_state

log = logging.getLogger(__name__)

NOT_COMPARED = ("methods", "progress", "out_dir", "threads", "checkpoint_every", "tensorboard")
"""TrainConfig fields a continued run may change: which methods run, how it shows and where it writes
(`out_dir`: a moved folder), the CPU threads (every kernel the trainer runs computes the same at any thread
count on one machine; docs/results.md compares runs of 1 and 2 threads to the bit), and the checkpoints'
own period. Every other field must be the checkpoint's."""


def settings_of(cfg: Any, method: str) -> dict:
    """What a checkpoint records of its run: the method and every compared field of `cfg` (JSON's form)."""
    plain = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return {"method": method, "config": {k: v for k, v in plain.items() if k not in NOT_COMPARED}}


def dotted(node: Any, name: str = "") -> dict[str, Any]:
    """`node`'s leaves by dotted name (`config.inner.lr`), as `check_compatible` looks them up: a refusal
    names each field that differs, not the whole tree."""
    if isinstance(node, dict) and node:
        return {k: v for key, child in node.items() for k, v in dotted(child, f"{name}.{key}" if name else key).items()}
    return {name: node}


def part(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors saved under `prefix` ('server/', 'worker0/'), the prefix taken off."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@dataclasses.dataclass
class Resumed:
    """A loaded checkpoint: its round, its tensors (by prefix, `part`) and the loop's counters."""

    round: int
    tensors: dict[str, Tensor]
    counters: dict[str, Any]


class Checkpoints:
    """One method's checkpoints in one run (`TrainConfig.checkpoint_every`; 0: none, and nothing loaded).

    The loop calls `load()` before it starts (None: start fresh) and `save()` after each round's record;
    `record()` wraps the run's emit so that the records go into the next checkpoint too."""

    def __init__(self, ctx: Any, method: str) -> None:
        self.every = ctx.cfg.checkpoint_every
        self.directory = Path(ctx.cfg.out_dir) / "checkpoints" / method
        self.settings = settings_of(ctx.cfg, method)
        self.history: list[dict] = []
        self._ctx = ctx
        self._started = time.perf_counter()

    def seconds(self) -> float:
        """Wall-clock seconds this run has trained: the killed parts' (as their checkpoint saved them) and this
        process's since the loop began."""
        return self._ctx.seconds_before + time.perf_counter() - self._started

    def record(self, record: dict) -> None:
        """Emit `record` and keep it for the next checkpoint (as JSON reads it back: plain numbers)."""
        self._ctx.emit(record)
        self.history.append(json.loads(json.dumps(record, default=float)))

    def load(self) -> Resumed | None:
        """The newest checkpoint of this method in the folder, its RNG states restored and its records emitted
        again; None without `checkpoint_every` or a checkpoint. CheckpointError (a ValueError) naming each
        setting that differs when the checkpoint is another run's. The run's context gets the seconds trained
        before (`RunContext.seconds_before`), which the run's summary adds to its own."""
        if not self.every or not self.directory.is_dir() or not list_checkpoints(self.directory):
            return None
        tensors, meta = load_checkpoint(self.directory)
        check_compatible(meta, dotted(self.settings), self.directory)
        set_rng_state(tensors)
        self._ctx.seconds_before = float(meta.get("seconds", 0.0))
        for record in meta["history"]:
            self.record(record)
        log.info("%s: resumed from %s at round %d", self.settings["method"], self.directory, meta["round"])
        return Resumed(int(meta["round"]), tensors, meta["counters"])

    def due(self, round_idx: int, last: int) -> bool:
        """Whether round `round_idx` (1-based) of `last` ends with a checkpoint."""
        return bool(self.every) and (round_idx % self.every == 0 or round_idx == last)

    def save(self, round_idx: int, parts: dict[str, dict[str, Tensor]], counters: dict[str, Any]) -> None:
        """Write round `round_idx`'s checkpoint: `parts` (prefix -> tensors), the RNG states, the counters and
        the records so far; the two newest are kept."""
        tensors = {f"{prefix}{k}": v for prefix, named in parts.items() for k, v in named.items()}
        tensors.update(rng_state())
        meta = {**self.settings, "round": round_idx, "counters": counters, "history": self.history,
                "seconds": self.seconds()}
        save_checkpoint(self.directory, round_idx, tensors, meta, keep=2)
