"""Flower's per-node `Context.state` as a worker-state store (the `client-state='context'`
alternative to lordo_fed.node.store.DiskStore: held in memory by the SuperNode and copied into
the client process with every message; benchmarks/client_state.py measures both)."""

from __future__ import annotations

from flwr.app import Context
from torch import Tensor

from lordo_fed.app.records import records_to_tensors, tensors_to_records
from lordo_fed.node.store import State


class ContextStore:
    """Flower's per-node `Context.state` (in memory on the SuperNode, gone when it restarts)."""

    KEY = "lordo_fed.rounds.worker"

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
