"""Where a client keeps its worker state between rounds (error-feedback buffer, moments not due
for sync, data cursor), so that it survives the client process being recreated every round.

Two stores, chosen by the `client-state` run-config key (benchmarks/client_state.py measures
both): node-local files keyed by partition (default: atomic safetensors checkpoints, written once
per round, read only when the process lost its in-memory copy) and Flower's `Context.state`
(held in memory by the SuperNode and copied into the client process with every message).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flwr.app import Context
from torch import Tensor

from lordo_fed.checkpoint import CheckpointError, checkpoint_stem, list_checkpoints, load_checkpoint, save_checkpoint
from lordo_fed.flower import records_to_tensors, tensors_to_records

State = tuple[dict[str, Tensor], dict]


class StateStore(Protocol):
    def load(self, round_idx: int | None = None) -> State | None: ...
    def save(self, round_idx: int, tensors: dict[str, Tensor], meta: dict) -> None: ...


class DiskStore:
    """`<directory>/partition_<p>/round_<r>.safetensors` + JSON, the two newest rounds, written
    atomically.

    Two, not one: the server checkpoints round r only after the clients trained it, so a server
    killed in between resumes at round r and asks for every client's state as of round r - 1,
    while the clients have already saved round r (tests/test_reliability.py). Older states are
    pruned when round r + 1 is saved, i.e. once the server has checkpointed round r.
    """

    KEEP = 2

    def __init__(self, directory: str | Path, partition_id: int):
        self.directory = Path(directory) / f"partition_{partition_id}"

    def load(self, round_idx: int | None = None) -> State | None:
        """The state saved at the end of round `round_idx` (None: the newest), or None."""
        if not self.directory.is_dir() or not list_checkpoints(self.directory):
            return None
        path = self.directory if round_idx is None else self.directory / f"{checkpoint_stem(round_idx)}.json"
        if not path.exists():
            return None
        try:
            return load_checkpoint(path)
        except CheckpointError:
            return None  # a state cut off mid-write: start this worker's state afresh

    def save(self, round_idx: int, tensors: dict[str, Tensor], meta: dict) -> None:
        save_checkpoint(self.directory, round_idx, tensors, {**meta, "round": round_idx}, keep=self.KEEP)


class ContextStore:
    """Flower's per-node `Context.state` (in memory on the SuperNode, gone when it restarts)."""

    KEY = "lordo_fed.worker"

    def __init__(self, context: Context):
        self.context = context

    def load(self, round_idx: int | None = None) -> State | None:
        """The newest state (one round only: the caller checks its round)."""
        if f"{self.KEY}.tensors" not in self.context.state:
            return None
        sub = {k.removeprefix(self.KEY + "."): v for k, v in self.context.state.items() if k.startswith(self.KEY + ".")}
        from flwr.app import RecordDict

        return records_to_tensors(RecordDict(sub))

    def save(self, round_idx: int, tensors: dict[str, Tensor], meta: dict) -> None:
        for k, v in tensors_to_records(tensors, {**meta, "round": round_idx}).items():
            self.context.state[f"{self.KEY}.{k}"] = v
