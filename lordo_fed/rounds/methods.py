"""The training methods this framework runs, and how each one is assembled from the library.

Every method is the same machinery with different choices (docs/algorithm.md,
"Relatives run in the same framework"):

| method        | sync          | inner optimizer            | states averaged (K_u, K_v) | outer    |
|---------------|---------------|----------------------------|----------------------------|----------|
| ddp           | grads / step  | AdamW                      | -                          | -        |
| lowrank_ddp   | grads / step  | LoRDO (projection refit from the all-reduced gradient) | - | - |
| diloco        | Δ / K steps   | AdamW                      | never                      | Nesterov |
| local_adam    | Δ / K steps   | AdamW                      | every round                | average  |
| desloc        | Δ / K steps   | AdamW                      | K_u = 3, K_v = 6 rounds    | average  |
| lordo_global  | Δ / K steps   | LoRDO, server projections  | every round                | `outer`  |
| lordo_local   | Δ / K steps   | LoRDO, worker projections  | never (bases differ)       | `outer`  |
| async_diloco  | Δ on arrival  | AdamW                      | never                      | Nesterov, one step per arrival |
| async_lookahead | Δ on arrival | AdamW                     | never                      | momentum look-ahead; workers pull θ − ημm |
| heloco        | Δ on arrival  | AdamW                      | never                      | as async_lookahead, Δ corrected against m (lordo_fed.rounds.heloco) |
| async_lordo   | Δ on arrival  | LoRDO, server projections  | blended on arrival (rotated from the worker's basis) | momentum look-ahead |
| heloco_lordo  | Δ on arrival  | LoRDO, server projections  | as async_lordo             | as heloco |

The asynchronous methods (lordo_fed.rounds.async_rounds) take `diloco_outer`'s lr and momentum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.async_rounds import AsyncRule
from lordo_fed.data import TokenShard
from lordo_fed.model import lowrank_parameter_names
from lordo_fed.optim.config import InnerConfig, build_inner_optimizer, resolved_proj_method, switch_at
from lordo_fed.rounds.outer import OuterConfig, build_outer_optimizer
from lordo_fed.optim.projection import get_projection_method
from lordo_fed.rounds.config import EVERY_ROUND, RoundConfig
from lordo_fed.wire.payload import FP32, Payload
from lordo_fed.rounds.ranks import NodeRanks
from lordo_fed.rounds.worker import Worker


@dataclass(frozen=True)
class MethodSpec:
    """What makes a method: how workers sync and which of the shared settings it overrides."""

    loop: str
    """'ddp' (gradient all-reduce every step), 'rounds' (K local steps, then Δ) or 'async' (Δ applied on arrival)."""
    inner: dict = field(default_factory=dict)
    """Overrides of InnerConfig."""
    sync: tuple[int, int] | None = None
    """(K_u, K_v): the method's own moment-sync periods, used where the run sets none (None: `EVERY_ROUND`)."""
    diloco_outer: bool = False
    """Use the `diloco_outer` settings (Nesterov) instead of `outer`."""
    async_rule: AsyncRule | None = None
    """The server rule of an 'async' method; with look-ahead the outer step is `diloco_outer`'s lr and
    momentum as a momentum look-ahead step ('mla')."""


METHODS: dict[str, MethodSpec] = {
    "ddp": MethodSpec("ddp", {"name": "adamw"}),
    "lowrank_ddp": MethodSpec("ddp", {"name": "lordo", "projection": "local"}),
    "diloco": MethodSpec("rounds", {"name": "adamw"}, sync=(0, 0), diloco_outer=True),
    "local_adam": MethodSpec("rounds", {"name": "adamw"}, sync=(1, 1)),
    "desloc": MethodSpec("rounds", {"name": "adamw"}, sync=(3, 6)),
    "lordo_global": MethodSpec("rounds", {"name": "lordo", "projection": "global"}),
    "lordo_local": MethodSpec("rounds", {"name": "lordo", "projection": "local"}, sync=(0, 0)),
    "async_diloco": MethodSpec("async", {"name": "adamw"}, sync=(0, 0), diloco_outer=True,
                               async_rule=AsyncRule(look_ahead=False, correct=False)),
    "async_lookahead": MethodSpec("async", {"name": "adamw"}, sync=(0, 0), diloco_outer=True,
                                  async_rule=AsyncRule(look_ahead=True, correct=False)),
    "heloco": MethodSpec("async", {"name": "adamw"}, sync=(0, 0), diloco_outer=True,
                         async_rule=AsyncRule(look_ahead=True, correct=True)),
    "async_lordo": MethodSpec("async", {"name": "lordo", "projection": "global"}, diloco_outer=True,
                              async_rule=AsyncRule(look_ahead=True, correct=False)),
    "heloco_lordo": MethodSpec("async", {"name": "lordo", "projection": "global"}, diloco_outer=True,
                               async_rule=AsyncRule(look_ahead=True, correct=True)),
}


METHOD_DEFAULTS: dict[str, dict[str, float]] = {
    **{name: {"lr": 8e-3, "ef_decay": 0.9, "switch_fraction": 0.0} for name in METHODS},
    # the tuned five: each its best of five trials on three corpora (docs/algorithm.md, "Defaults per method")
    "ddp": {"lr": 2e-3, "ef_decay": 0.9, "switch_fraction": 0.0},  # γ unused: AdamW
    "lowrank_ddp": {"lr": 4e-3, "ef_decay": 0.9, "switch_fraction": 0.0},
    "diloco": {"lr": 4e-3, "ef_decay": 0.9, "switch_fraction": 0.0},  # the inner AdamW's lr; γ unused
    "lordo_global": {"lr": 4e-3, "ef_decay": 0.9, "switch_fraction": 0.0},
    # γ = 1 (the paper's E) beats 0.9 by 2.0%; the two-phase switch at half the run is its best trial
    "lordo_local": {"lr": 4e-3, "ef_decay": 1.0, "switch_fraction": 0.5},
}
"""Each method's own defaults of the InnerConfig fields a run leaves at None (`METHOD_FIELDS`: the peak
learning rate, the error-feedback decay γ and the share of the run where the two-phase switch comes), so
that every method runs at its own best setting, chosen by the mean over corpora (docs/algorithm.md,
"Defaults per method"): the tuned five (DDP, low-rank DDP, DiLoCo, LoRDO-Global, LoRDO-Local) by their best
of five trials on three corpora; the others keep lr 0.008, γ = 0.9 and one phase. A value the run sets wins,
for every method it runs; a run that sets `switch_step` has no method's own fraction."""


@dataclass
class MethodSettings:
    """The concrete settings of one method, after its overrides."""

    name: str
    loop: str
    inner: InnerConfig
    rounds: RoundConfig
    outer: OuterConfig
    async_rule: AsyncRule | None = None


def _sync_periods(name: str, spec: MethodSpec, rounds: RoundConfig) -> dict[str, int]:
    """The moment-sync periods (K_u, K_v) method `name` runs: those the run sets, else the method's own
    (`MethodSpec.sync`; `EVERY_ROUND` for one without). A method whose moments stay on each worker
    (DiLoCo, LoRDO-Local: bases that differ between workers; the asynchronous AdamW methods) refuses
    periods other than 0 rather than drop them."""
    own = spec.sync if spec.sync is not None else EVERY_ROUND
    given = {"sync_exp_avg_every": rounds.sync_exp_avg_every, "sync_exp_avg_sq_every": rounds.sync_exp_avg_sq_every}
    for key, value in given.items():
        if spec.sync == (0, 0) and value:
            raise ValueError(f"rounds.{key}={value!r} with method {name!r}: its moments stay on each worker (0 = "
                             "never averaged); expected 0 or unset (averaged moments: lordo_global, local_adam, desloc)")
    return {key: mine if value is None else value for (key, value), mine in zip(given.items(), own)}


def resolve_method(name: str, inner: InnerConfig, rounds: RoundConfig, outer: OuterConfig,
                   diloco_outer: OuterConfig | None = None, total_steps: int | None = None) -> MethodSettings:
    """Apply method `name`'s overrides to the shared settings and validate the result. `total_steps`: the run's
    length, which `inner.switch_fraction` needs (`switch_at`: the settings then name the step)."""
    if name not in METHODS:
        raise ValueError(f"method {name!r}: expected one of {sorted(METHODS)}")
    spec = METHODS[name]
    own = {k: v for k, v in METHOD_DEFAULTS[name].items() if getattr(inner, k) is None}
    if inner.switch_step and "switch_fraction" in own:  # the run named its step: no fraction of the method's own
        own["switch_fraction"] = 0.0
    inner = dataclasses.replace(inner, **own, **spec.inner).validate()
    if inner.switch_fraction:
        if total_steps is None:
            whose = f"{name}'s own " if "switch_fraction" in own else ""
            raise ValueError(f"inner.switch_fraction={inner.switch_fraction!r} ({whose}two-phase switch at that share of "
                             "the run) needs the run's total_steps (resolve_method(..., total_steps=...)), or "
                             "inner.switch_fraction=0.0 for one phase")
        inner = switch_at(inner, total_steps)
    rounds = dataclasses.replace(rounds, **_sync_periods(name, spec, rounds.validate())).validate()
    if rounds.sync_ef and inner.name == "lordo" and inner.error_feedback and inner.ef_density < 1.0:
        raise ValueError(f"rounds.sync_ef=True with inner.ef_density={inner.ef_density!r}: averaging E across "
                         "workers needs the whole buffer; expected ef_density=1.0 or sync_ef=False")
    if spec.loop == "async" and rounds.sync_ef:
        raise ValueError(f"rounds.sync_ef=True with the asynchronous method {name!r}: error feedback stays on the "
                         "workers in asynchronous rounds; expected sync_ef=False")
    if spec.loop == "async" and rounds.local_steps_ramp:
        raise ValueError(f"rounds.local_steps_ramp={list(rounds.local_steps_ramp)!r} with the asynchronous method "
                         f"{name!r}: its workers run their own K every round (async_rounds.local_steps); expected []")
    if spec.loop == "async" and rounds.late_local_steps:
        raise ValueError(f"rounds.late_local_steps={rounds.late_local_steps} with the asynchronous method {name!r}: its "
                         "workers run their own K every round (async_rounds.local_steps); expected 0")
    if spec.loop != "rounds" and rounds.overlap_delay:
        raise ValueError(f"rounds.overlap_delay={rounds.overlap_delay} with method {name!r}: overlap applies to "
                         "synchronous rounds (asynchronous rounds never wait for the others; DDP steps together); "
                         "expected overlap_delay=0")
    if spec.loop != "rounds" and rounds.clip_median:
        raise ValueError(f"rounds.clip_median=True with method {name!r}: the median is over one synchronous round's "
                         "replies (asynchronous replies arrive one at a time; DDP has no replies); expected "
                         "clip_median=False")
    if rounds.bases_from == "downlink":
        if not (inner.name == "lordo" and inner.projection == "global" and spec.loop == "rounds"):
            raise ValueError(f"rounds.bases_from='downlink' with method {name!r}: only LoRDO-Global's synchronous "
                             "rounds have shared bases to fit; expected bases_from='server'")
        if rounds.sync_exp_avg_every or rounds.sync_exp_avg_sq_every or rounds.sync_ef:
            raise ValueError(f"rounds.bases_from='downlink' with averaged states (sync_exp_avg_every="
                             f"{rounds.sync_exp_avg_every}, sync_exp_avg_sq_every={rounds.sync_exp_avg_sq_every}, "
                             f"sync_ef={rounds.sync_ef}): the server cannot move moments into bases it never fits; "
                             "expected 0, 0 and False (each worker keeps its own)")
    chosen = diloco_outer if (spec.diloco_outer and diloco_outer is not None) else outer
    if chosen.late_lr and (spec.loop == "async" or spec.loop == "rounds" and not rounds.late_from_step):
        why = (f"the asynchronous method {name!r} steps once per arrival, with no rounds to be late; expected 0"
               if spec.loop == "async" else "the late rounds start at rounds.late_from_step=0, that is never; expected "
               "the global step they start at (e.g. WSD's decay: 0.8 x the run's steps)")
        raise ValueError(f"{'diloco_outer' if chosen is diloco_outer else 'outer'}.late_lr={chosen.late_lr!r}: {why}")
    if spec.async_rule is not None and spec.async_rule.look_ahead:
        chosen = dataclasses.replace(chosen, name="mla")
    return MethodSettings(name, spec.loop, inner, rounds, chosen, spec.async_rule)


def lowrank_ranks(model: nn.Module, pattern: str, rank: int, inner_name: str) -> dict[str, int]:
    """Low-rank parameter name -> rank, for the parameters that actually take the low-rank step."""
    if inner_name != "lordo":
        return {}
    params = dict(model.named_parameters())
    return {n: rank for n in lowrank_parameter_names(model, pattern) if rank < min(params[n].shape)}


def make_worker(worker_id: int, model: nn.Module, settings: MethodSettings, shard: TokenShard, lowrank: list[str],
                total_steps: int, batch_size: int, seq_len: int, seed: int, payload: Payload = FP32,
                ranks: NodeRanks | None = None) -> Worker:
    """A worker with its own inner optimizer over (possibly shared) `model`; `payload` the run's
    `payload_dtype` (a compressed preset compresses what the worker sends: lordo_fed.wire.payload);
    `ranks` a node of several ranks (`NodeRanks`; None: one process)."""
    if ranks is not None:
        ranks.wrap(model)  # FSDP2 replaces the parameters by sharded ones: before the optimizer takes them
    optimizer = build_inner_optimizer(model, settings.inner, lowrank, seed=seed,
                                      local_steps=settings.rounds.local_steps)
    return Worker(worker_id, model, optimizer, shard, settings.inner, settings.rounds, total_steps,
                  batch_size, seq_len, data_seed=seed, payload=payload.codecs, ranks=ranks)


def with_local_steps(settings: MethodSettings, local_steps: int) -> MethodSettings:
    """`settings` for a worker that runs `local_steps` steps per round (asynchronous methods:
    `AsyncConfig.local_steps`, or a node's own `local-steps`)."""
    if local_steps == settings.rounds.local_steps:
        return settings
    return dataclasses.replace(settings, rounds=dataclasses.replace(settings.rounds, local_steps=local_steps).validate())


def make_aggregator(model: nn.Module, settings: MethodSettings, ranks: dict[str, int], seed: int,
                    outlier_factor: float = 0.0, payload: Payload = FP32) -> Aggregator:
    """The server side for `settings`: owns projections only under LoRDO-Global; with a
    compressed `payload` preset of a round-based method, sends the moments quantised and θ as the
    compressed change of the clients' copy (asynchronous methods keep none: each pull is the change from
    that worker's own copy, lordo_fed.rounds.async_rounds.NodeCopies)."""
    inner = settings.inner
    server_projections = inner.name == "lordo" and inner.projection == "global" and bool(ranks)
    payload.check_method(server_projections, asynchronous=settings.loop != "rounds")
    codecs = payload.codecs
    if settings.rounds.bases_from == "downlink" and (codecs is None or not codecs.tracks_copy or codecs.lowrank is not None):
        raise ValueError(f"rounds.bases_from='downlink' with payload_dtype={payload.name!r}: the workers fit the bases "
                         "to the compressed downlink's change of their copy θ_c, which needs a compressed preset without "
                         "low-rank Δ (that needs the server's bases); expected e.g. 'topk2bit-both-wide' or 'int8'")
    with torch.no_grad():
        params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    device = next(model.parameters()).device  # the model's device fits the projections (a GPU if any)
    return Aggregator(
        params, ranks, settings.rounds, build_outer_optimizer(settings.outer),
        get_projection_method(resolved_proj_method(inner, device)) if server_projections else None,
        seed=seed, outlier_factor=outlier_factor, betas=tuple(inner.betas), bias_correction=inner.bias_correction,
        rotate=inner.rotate, init_projection=inner.init_projection, switch_step=inner.switch_step,
        switch_betas=tuple(inner.switch_betas), fit_device=device if device.type != "cpu" else None,
        payload=payload.codecs if settings.loop == "rounds" else None, late_lr=settings.outer.late_lr,
    )
