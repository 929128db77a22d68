"""Where a node keeps its worker state between rounds (error-feedback buffer, moments not due
for sync, data cursor), so that it survives its process being recreated or restarted.

`DiskStore` (the default): node-local files keyed by partition, atomic safetensors checkpoints,
written once per round, read only when the process lost its in-memory copy. The other store,
Flower's `Context.state`, is client/state.py's `ContextStore` (the `client-state` run-config key
chooses; benchmarks/client_state.py measures both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torch import Tensor

from lordo_fed.checkpoint import CheckpointError, checkpoint_stem, list_checkpoints, load_checkpoint, save_checkpoint

State = tuple[dict[str, Tensor], dict]


class StateStore(Protocol):
    def load(self, round_idx: int | None = None) -> State | None: ...
    def save(self, round_idx: int, tensors: dict[str, Tensor], meta: dict) -> None: ...


class DiskStore:
    """`<directory>/partition_<p>/round_<r>.safetensors` + JSON, the three newest rounds, written
    atomically.

    Three, not one: the server checkpoints round r only after the clients trained it, and on the
    data plane it publishes round r + 1 before that checkpoint is written (its evaluation and
    checkpoint overlap the nodes' download). A server killed in between resumes at round r and
    asks for every client's state as of round r - 1, while the clients may have saved rounds r and
    r + 1 already (tests/integration/test_reliability.py). Older states are pruned when round r + 2 is saved,
    i.e. once the server has checkpointed round r.
    """

    KEEP = 3

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


