"""The one composition root: what every entry point builds the same way from a run's settings.

The ServerApp (server/strategy.py), a node's runtime (lordo_fed/node/runtime.py) and the reference
trainer (lordo_fed/trainer/run.py) all start from `build_run(cfg, method)`: the method's settings,
θ0 from the run's seed, the parameters that take the low-rank step and their ranks, the payload
preset resolved into codecs, and the device. Because they build θ0 the same way, the server can
send a flag instead of θ0 (`GlobalState.params_from_seed`), and a simulation ends at the reference
trainer's θ bit for bit (docs/architecture.md, "One round").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lordo_fed.data import TokenShard
from lordo_fed.data.tokenizer import load_tokenizer
from lordo_fed.device import pick_device
from lordo_fed.model import build_model, lowrank_parameter_names
from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.config import CommonConfig
from lordo_fed.rounds.methods import MethodSettings, lowrank_ranks, make_aggregator, make_worker, resolve_method
from lordo_fed.rounds.methods import with_local_steps
from lordo_fed.rounds.worker import Worker
from lordo_fed.wire.codec import model_id
from lordo_fed.wire.payload import Payload, resolve_payload


@dataclass
class Run:
    """A run's components, built once per process."""

    cfg: CommonConfig
    """The settings it was built from."""
    settings: MethodSettings
    """The method's settings, after its overrides (`resolve_method`)."""
    model: nn.Module
    """θ0: the model initialised from `cfg.seed`, on `device`."""
    model_id: str
    """The model's identity on the wire (names, shapes, dtypes: lordo_fed.wire.codec.model_id)."""
    lowrank: list[str]
    """Parameters that take LoRDO's low-rank step ([] for AdamW methods)."""
    ranks: dict[str, int]
    """Low-rank parameter -> rank, for those whose rank is below both dimensions (the server's bases)."""
    payload: Payload
    """The payload preset, resolved into codecs."""
    device: torch.device
    """Where the model trains."""
    vocab_size: int
    """The tokenizer's vocabulary (the model's embedding rows)."""

    def worker(self, worker_id: int, shard: TokenShard, total_steps: int, local_steps: int | None = None,
               ranks=None) -> Worker:
        """A worker over this run's model (`local_steps`: its own K, asynchronous methods only;
        `ranks`: the node's ranks, lordo_fed.node.ranks.LocalRanks)."""
        settings = with_local_steps(self.settings, local_steps or self.settings.rounds.local_steps)
        data = self.cfg.data
        return make_worker(worker_id, self.model, settings, shard, self.lowrank, total_steps, data.batch_size,
                           data.seq_len, seed=data.seed, payload=self.payload, ranks=ranks)

    def aggregator(self, outlier_factor: float = 0.0) -> Aggregator:
        """The server side over this run's θ0."""
        return make_aggregator(self.model, self.settings, self.ranks, seed=self.cfg.seed,
                               outlier_factor=outlier_factor, payload=self.payload)

    def seeded_params(self) -> dict[str, torch.Tensor]:
        """θ0 built again on the CPU, as every process of the run builds it, under a forked RNG so
        that this process's random state is as if it had not been built (ValueError if its identity
        is not the run's)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            model = build_model(self.cfg.model, self.vocab_size)
        params = {n: p.detach() for n, p in model.named_parameters()}
        if model_id(params) != self.model_id:
            raise ValueError(f"θ0 built from the seed has model id {model_id(params)}, expected {self.model_id}")
        return params


def build_run(cfg: CommonConfig, method: str | MethodSettings, vocab_size: int | None = None,
              device: torch.device | None = None) -> Run:
    """Build run `cfg` of `method` (ValueError naming a bad setting): a method's name, resolved
    against `cfg` (`resolve_method`), or its settings already resolved (the reference trainer runs
    settings of its own). `vocab_size`: the dataset's, when the caller has loaded it (else the
    tokenizer's, `cfg.data.tokenizer`); `device`: the caller's, when it chose one (else `cfg.device`'s)."""
    total = getattr(cfg, "total_steps", None)  # AppConfig's and TrainConfig's: inner.switch_fraction needs it
    settings = (resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, total)
                if isinstance(method, str) else method)
    payload = resolve_payload(cfg.payload_dtype)
    device = pick_device(cfg.device) if device is None else device
    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size if vocab_size is None else vocab_size
    torch.manual_seed(cfg.seed)  # θ0: the same seeded init in every process of the run
    model = build_model(cfg.model, vocab).to(device)
    lordo = settings.inner.name == "lordo"
    lowrank = lowrank_parameter_names(model, cfg.model.lowrank_pattern) if lordo else []
    ranks = lowrank_ranks(model, cfg.model.lowrank_pattern, settings.inner.rank, settings.inner.name)
    return Run(cfg, settings, model, model_id(dict(model.named_parameters())), lowrank, ranks, payload, device, vocab)
