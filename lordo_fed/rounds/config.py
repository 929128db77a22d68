"""Settings shared by every way of running LoRDO (reference trainer, Flower app)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lordo_fed.rounds.async_rounds import AsyncConfig
from lordo_fed.data import DataConfig
from lordo_fed.device import DEVICE_CHOICES
from lordo_fed.model import ModelConfig, resolve_model_config
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig, build_outer_optimizer
from lordo_fed.wire.messages import RoundConfig
from lordo_fed.wire.payload import payload_codecs


@dataclass
class CommonConfig:
    """Model, data, optimizers and bookkeeping: the same fields in every entry point."""

    seed: int = 0
    """Seeds model init, data sampling and projections; identical for every method."""
    device: str = "auto"
    """'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'."""
    threads: int = 0
    """torch CPU threads (0 = torch's default)."""
    out_dir: str = "outputs/reference"
    """Where JSONL metrics, TensorBoard logs, plots, summaries (and checkpoints) go."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under out_dir/tb."""
    eval_every: int = 1
    """Rounds (K steps each) between validation passes."""
    eval_batches: int = 8
    """Validation batches per pass (fixed, sequential windows of the held-out split)."""
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
    payload_dtype: str = "fp32"
    """How tensors cross the wire: 'fp32', 'bf16' (bit-viewed), or a compressed preset 'int8', 'int4', 'topk2bit', 'lowrank+topk2bit', 'lowrank+topk2bit+rows' (lordo_fed.wire.payload)."""
    async_rounds: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous methods: worker speeds and local steps, staleness bound, reply order, HeLoCo's settings."""

    def validate(self) -> "CommonConfig":
        """Raise ValueError naming the key, the value and what is allowed."""
        for name in ("eval_every",):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer > 0")
        for name in ("eval_batches", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 0")
        if not isinstance(self.device, str) or not (
                self.device in DEVICE_CHOICES or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"device={self.device!r}: expected one of {DEVICE_CHOICES} or 'cuda:N'")
        self.data.validate()
        self.inner.validate()
        self.rounds.validate()
        self.async_rounds.validate()
        payload_codecs(self.payload_dtype)
        model = resolve_model_config(self.model)
        if model.hf_config_path is None and self.data.seq_len > model.max_seq_len:
            raise ValueError(f"DataConfig.seq_len={self.data.seq_len!r}: expected an int <= the model's max_seq_len="
                             f"{model.max_seq_len} (model preset {model.preset!r}; raise ModelConfig.max_seq_len "
                             f"or lower seq_len)")
        for name in ("outer", "diloco_outer"):
            try:
                build_outer_optimizer(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"{name}.{err}") from err
        return self
