"""Typed configuration of the reference trainer (Hydra structured config, torchtitan style)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from lordo_fed.data import DataConfig
from lordo_fed.methods import METHODS
from lordo_fed.model import ModelConfig
from lordo_fed.optim.config import InnerConfig
from lordo_fed.outer import OuterConfig
from lordo_fed.rounds import RoundConfig


@dataclass
class TrainConfig:
    """One reference-trainer invocation: several methods on the same data, model and seed."""

    methods: List[str] = field(default_factory=lambda: ["lordo_global", "ddp"])
    """Methods to run, in order: ddp, lowrank_ddp, diloco, local_adam, desloc, lordo_global, lordo_local."""
    workers: int = 4
    """M: number of workers (data partitions), run in turn."""
    total_steps: int = 128
    """Optimizer steps per worker; every method trains on the same M × batch_size × seq_len × total_steps tokens."""
    eval_every: int = 1
    """Rounds (K steps each) between validation passes."""
    eval_batches: int = 8
    """Validation batches per pass (fixed, sequential windows of the held-out split)."""
    seed: int = 0
    """Seeds model init, data sampling and projections; identical for every method."""
    device: str = "auto"
    """'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'."""
    threads: int = 0
    """torch CPU threads (0 = torch's default)."""
    out_dir: str = "outputs/reference"
    """Where JSONL metrics, TensorBoard logs, the plot and the summary go."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under out_dir/tb."""
    progress: bool = True
    """Show a progress bar."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(preset="small"))
    """The model (preset name or explicit sizes, or a local HF config.json)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer, split, partition, batch and sequence length."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """The workers' local optimizer."""
    rounds: RoundConfig = field(default_factory=RoundConfig)
    """K local steps per round and the moment-sync periods."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """Outer optimizer of the round-based methods (LoRDO, Local Adam, DES-LOC)."""
    diloco_outer: OuterConfig = field(default_factory=lambda: OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    """Outer optimizer of DiLoCo (Nesterov, lr 0.7, momentum 0.9 as in the DiLoCo paper)."""

    def validate(self) -> "TrainConfig":
        """Raise ValueError naming the key, the value and what is allowed."""
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"methods: {m!r} is not a method; expected any of {sorted(METHODS)}")
        if not self.methods:
            raise ValueError("methods=[]: expected at least one method")
        for name in ("workers", "total_steps", "eval_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer > 0")
        if self.eval_batches < 0 or self.threads < 0:
            raise ValueError(f"eval_batches={self.eval_batches}, threads={self.threads}: expected integers >= 0")
        if self.total_steps % self.rounds.local_steps:
            raise ValueError(
                f"total_steps={self.total_steps} is not a multiple of rounds.local_steps={self.rounds.local_steps}: "
                "every method must train on the same tokens in whole rounds"
            )
        self.data.validate()
        self.inner.validate()
        self.rounds.validate()
        return self
