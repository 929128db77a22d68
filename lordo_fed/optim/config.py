"""Inner-optimizer configuration, the optimizer factory and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lordo_fed.config import setting
from lordo_fed.optim.batched import BatchedLoRDO
from lordo_fed.optim.bias import MOMENT_BETA
from lordo_fed.optim.lordo import EF_DTYPES, FULL_RANK_TERMS, PROJECTION_SOURCES, QH_PLACEMENTS, LoRDO
from lordo_fed.optim.projection import PROJECTION_METHODS

INNER_OPTIMIZERS = ("lordo", "adamw")
INIT_PROJECTIONS = ("gradient", "random")
SCHEDULES = ("wsd", "cosine", "constant")
SWITCH_RESETS = ("moments", "all", "none")


@dataclass
class InnerConfig:
    """The optimizer every worker runs for its K local steps."""

    name: str = "lordo"
    """'lordo' (low-rank LoRDO step) or 'adamw' (torch.optim.AdamW, the DDP/DiLoCo baseline)."""
    lr: Optional[float] = setting("lr", None)
    """Peak learning rate η (None: the method's own, `lordo_fed.rounds.methods.METHOD_DEFAULTS`)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """(β1, β2) of the Adam moments."""
    eps: float = 1e-8
    """ε of the Adam denominator."""
    weight_decay: float = 0.0
    """Decoupled weight decay λ, applied to 2-D weights only (not to norms or biases)."""
    omega: float = setting("omega", 0.95)
    """Quasi-hyperbolic weight ω in [0, 1]; 1 drops the full-rank term (GaLore/Adam)."""
    rank: int = setting("rank", 8)
    """Rank r of the low-rank optimizer states (parameters matched by the model's low-rank pattern)."""
    error_feedback: bool = setting("error-feedback", True)
    """Keep the full-size buffer of what the projection dropped and feed it back next step."""
    ef_dtype: str = "fp32"
    """Storage dtype of the error-feedback buffer: 'fp32' or 'bf16'."""
    ef_density: float = setting("ef-density", 1.0)
    """Share of the error-feedback buffer kept: 1 keeps E whole; ρ < 1 keeps its top ⌈ρ·pq⌉ entries
    per matrix with int8 values (MicroAdam-style, lordo_fed.optim.ef_compress; ef_dtype then unused)."""
    ef_decay: Optional[float] = setting("ef-decay", None)
    """γ in V = G + γ E: how much of the error-feedback buffer is fed back each step (1 = the paper;
    None: the method's own, `lordo_fed.rounds.methods.METHOD_DEFAULTS`; docs/algorithm.md, "Defaults per method")."""
    ef_reset: bool = setting("ef-reset", False)
    """Zero the error-feedback buffer whenever the projection changes (every round under LoRDO-Global)."""
    full_rank_term: str = setting("full-rank-term", "error_fed")
    """Input of the full-rank QH term: 'error_fed' (V = G + E, the paper) or 'gradient' (G alone)."""
    qh_placement: str = "outside"
    """Full-rank QH term 'outside' the projection (the paper) or 'inside' it."""
    projection: str = "global"
    """'global' (LoRDO-Global: server refits P from the averaged pseudo-gradient) or 'local'."""
    init_projection: str = "gradient"
    """Round-1 basis of LoRDO-Global: 'gradient' (fitted to the workers' averaged gradient at θ0,
    one extra exchange before round 1) or 'random' (seeded random orthonormal basis)."""
    proj_method: str = setting("proj-method", "auto")
    """Projection fit: 'svd' (exact), 'rsvd' (randomized), 'dct' (DCT columns, sent as indices) or
    'auto': exact, except LoRDO-Local's refits on a CUDA device, which are randomized (an SVD per
    matrix inside the step; rsvd measured no worse: docs/results.md, section 2)."""
    proj_interval: int = 0
    """T_proj: local steps between projection refits for projection='local'; 0 means K."""
    rotate: bool = True
    """Rotate the moments into a new basis on projection change (LDAdam)."""
    bias_correction: bool = True
    """Divide the moments by (1 − β^k)."""
    batched: bool = True
    """Run LoRDO's step on stacks of same-shaped matrices (BatchedLoRDO); False: the per-parameter
    reference (LoRDO), the same mathematics one matrix at a time."""
    grad_clip: float = 1.0
    """Global gradient-norm clip ρ applied by the training loop (0 disables)."""
    schedule: str = "wsd"
    """Learning-rate schedule: 'wsd' (warmup-stable-decay), 'cosine' or 'constant' (after warmup)."""
    warmup_steps: int = setting("warmup-steps", 20)
    """Linear warmup length in steps."""
    decay_fraction: float = 0.2
    """Share of the run spent decaying (wsd) at the end."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (wsd, cosine)."""
    switch_step: int = setting("switch-step", 0)
    """The authors' two-phase recipe: the global step where phase 2 starts (0 = one phase)."""
    switch_fraction: Optional[float] = setting("switch-fraction", None)
    """The switch at this share of the run's steps instead (0 = `switch_step` rules; None: the method's own,
    `lordo_fed.rounds.methods.METHOD_DEFAULTS`: half the run for LoRDO-Local, its tuned best, 0 for the others
    and wherever `switch_step` is set; docs/algorithm.md, "Defaults per method")."""
    switch_betas: tuple[float, float] = (0.999, 0.999)
    """(β1, β2) from `switch_step` on (the authors' 720M runs: 0.999, 0.999)."""
    switch_omega: float = 0.98
    """ω from `switch_step` on (the authors' runs: 0.97-0.98)."""
    switch_reset: str = "moments"
    """At `switch_step`: 'moments' (zero u and v, keep the step count: the authors'), 'all' (zero u, v
    and the step count: a new Adam) or 'none'."""
    switch_lr_factor: float = 0.5
    """Learning-rate multiplier from `switch_step` on, schedule included (the authors': 0.5)."""

    def validate(self) -> "InnerConfig":
        """Raise ValueError naming the field, the value and what is allowed."""

        def bad(name: str, allowed: str) -> None:
            raise ValueError(f"inner.{name}={getattr(self, name)!r}: expected {allowed}")

        choices = {
            "name": INNER_OPTIMIZERS, "ef_dtype": tuple(EF_DTYPES), "qh_placement": QH_PLACEMENTS,
            "projection": PROJECTION_SOURCES, "proj_method": ("auto", *PROJECTION_METHODS), "schedule": SCHEDULES,
            "init_projection": INIT_PROJECTIONS, "full_rank_term": FULL_RANK_TERMS, "switch_reset": SWITCH_RESETS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(name, f"one of {allowed}")
        if self.lr is not None and not self.lr > 0:
            bad("lr", "a number > 0 (or None: the method's own)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "two numbers in [0, 1)")
        if not 0 <= self.omega <= 1:
            bad("omega", "a number in [0, 1]")
        if self.rank <= 0:
            bad("rank", "an integer > 0")
        if self.proj_interval < 0:
            bad("proj_interval", "an integer >= 0 (0 = K, the round length)")
        if self.grad_clip < 0:
            bad("grad_clip", "a number >= 0 (0 disables clipping)")
        if self.warmup_steps < 0:
            bad("warmup_steps", "an integer >= 0")
        if not 0 <= self.decay_fraction <= 1:
            bad("decay_fraction", "a number in [0, 1]")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", "a number in [0, 1]")
        if not 0 < self.ef_density <= 1:
            bad("ef_density", "a number in (0, 1] (1 = the whole buffer)")
        if self.ef_decay is not None and not 0 <= self.ef_decay <= 1:
            bad("ef_decay", "a number in [0, 1] (1 = the paper)")
        if self.switch_step < 0:
            bad("switch_step", "an integer >= 0 (0 = one phase)")
        if self.switch_fraction is not None and not 0 <= self.switch_fraction < 1:
            bad("switch_fraction", "a number in [0, 1) (0 = switch_step rules; None: the method's own)")
        if self.switch_fraction and self.switch_step:
            raise ValueError(f"inner.switch_fraction={self.switch_fraction!r} with inner.switch_step={self.switch_step}: "
                             "expected one of the two (the other 0)")
        if len(self.switch_betas) != 2 or not all(0 <= b < 1 for b in self.switch_betas):
            bad("switch_betas", "two numbers in [0, 1)")
        if not 0 <= self.switch_omega <= 1:
            bad("switch_omega", "a number in [0, 1]")
        if not self.switch_lr_factor > 0:
            bad("switch_lr_factor", "a number > 0")
        if self.eps <= 0 or self.weight_decay < 0:
            bad("eps" if self.eps <= 0 else "weight_decay", "eps > 0 and weight_decay >= 0")
        return self


def build_inner_optimizer(model: nn.Module, cfg: InnerConfig, lowrank_names: list[str], seed: int = 0,
                          local_steps: int = 32) -> torch.optim.Optimizer:
    """Param groups: low-rank matrices (LoRDO only), other 2-D weights (decayed), the rest (not).

    `local_steps` (K) is the projection refit interval when `cfg.proj_interval` is 0. `cfg` is a
    method's (`resolve_method` fills in the method's own defaults)."""
    require_resolved(cfg)
    lowrank = set(lowrank_names)
    named = list(model.named_parameters())
    unknown = lowrank - {n for n, _ in named}
    if unknown:
        raise ValueError(f"low-rank parameter names not in the model: {sorted(unknown)}")
    lr_params = [p for n, p in named if n in lowrank]
    decay = [p for n, p in named if n not in lowrank and p.ndim >= 2]
    no_decay = [p for n, p in named if n not in lowrank and p.ndim < 2]
    wd = cfg.weight_decay
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        groups = [dict(params=lr_params + decay, weight_decay=wd), dict(params=no_decay, weight_decay=0.0)]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=betas, eps=cfg.eps)
    groups = [
        dict(params=lr_params, rank=cfg.rank, weight_decay=wd),
        dict(params=decay, weight_decay=wd),
        dict(params=no_decay, weight_decay=0.0),
    ]
    cls = BatchedLoRDO if cfg.batched else LoRDO
    return cls(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=betas, eps=cfg.eps, omega=cfg.omega,
        error_feedback=cfg.error_feedback, ef_dtype=cfg.ef_dtype, ef_density=cfg.ef_density,
        ef_decay=cfg.ef_decay, ef_reset=cfg.ef_reset,
        full_rank_term=cfg.full_rank_term, qh_placement=cfg.qh_placement,
        projection_source=cfg.projection, proj_method=resolved_proj_method(cfg, named[0][1].device),
        proj_interval=cfg.proj_interval or local_steps,
        rotate=cfg.rotate, bias_correction=cfg.bias_correction, seed=seed,
    )


METHOD_FIELDS = ("lr", "ef_decay", "switch_fraction")
"""The fields whose None means "the method's own" (`lordo_fed.rounds.methods.METHOD_DEFAULTS`)."""


def require_resolved(cfg: InnerConfig, fields: tuple[str, ...] = METHOD_FIELDS) -> None:
    """Raise ValueError if a method's own default of `fields` was not filled in (`resolve_method` does)."""
    unset = [f for f in fields if getattr(cfg, f) is None]
    if unset:
        raise ValueError(f"inner.{unset[0]}=None: expected the method's settings (resolve_method fills in its "
                         "own defaults) or a value")


def resolved_proj_method(cfg: InnerConfig, device: torch.device) -> str:
    """`cfg.proj_method` with 'auto' resolved for parameters on `device` (see the field)."""
    if cfg.proj_method != "auto":
        return cfg.proj_method
    return "rsvd" if cfg.projection == "local" and device.type == "cuda" else "svd"


def switch_at(cfg: InnerConfig, total_steps: int) -> InnerConfig:
    """`cfg` with `switch_fraction` turned into the global step it names in a run of `total_steps` (rounded down,
    at least 1), so that every consumer of the recipe reads `switch_step` alone; unchanged without a fraction."""
    if not cfg.switch_fraction:
        return cfg
    return dataclasses.replace(cfg, switch_step=max(1, int(cfg.switch_fraction * total_steps)), switch_fraction=0.0)


def in_phase_two(step: int, cfg: InnerConfig) -> bool:
    """Whether 0-based global `step` belongs to the second phase of the two-phase recipe."""
    return 0 < cfg.switch_step <= step


def phase_betas(step: int, cfg: InnerConfig) -> tuple[float, float]:
    """(β1, β2) in force at 0-based global `step`."""
    return tuple(cfg.switch_betas) if in_phase_two(step, cfg) else tuple(cfg.betas)


def apply_phase(optimizer: torch.optim.Optimizer, cfg: InnerConfig, step: int, reset: bool = True) -> None:
    """The two-phase recipe of the authors' runs: from global `step` = `switch_step` on, every param
    group takes `switch_betas` and (LoRDO) `switch_omega`; the step that starts phase 2 first resets
    the moments as `switch_reset` says (`reset=False`: the hyperparameters only). The learning-rate
    factor is `lr_at`'s. A pure function of the global step, so a worker that joins late or
    restarts is in the right phase; nothing happens without a switch."""
    if cfg.switch_step <= 0:
        return
    betas = phase_betas(step, cfg)
    omega = cfg.switch_omega if in_phase_two(step, cfg) else cfg.omega
    for group in optimizer.param_groups:
        group["betas"] = betas
        if "omega" in group:
            group["omega"] = omega
    if reset and step == cfg.switch_step and cfg.switch_reset != "none":
        for st in optimizer.state.values():
            for key in MOMENT_BETA:
                if key in st:
                    st[key].zero_()
            if cfg.switch_reset == "all" and "step" in st:
                st["step"].zero_()


def lr_at(step: int, total_steps: int, cfg: InnerConfig) -> float:
    """Learning rate for 0-based `step` of `total_steps`: a pure function of the global step, so a
    worker that joins late or restarts needs no scheduler state. The two-phase recipe multiplies
    it by `switch_lr_factor` from `switch_step` on."""
    return _schedule(step, total_steps, cfg) * (cfg.switch_lr_factor if in_phase_two(step, cfg) else 1.0)


def _schedule(step: int, total_steps: int, cfg: InnerConfig) -> float:
    require_resolved(cfg, ("lr",))
    peak = cfg.lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    floor = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
    decay_steps = int(round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return peak
    t = min(1.0, (step - decay_start + 1) / decay_steps)
    return peak + (floor - peak) * t  # linear decay to the floor (WSD, Hu et al. 2024)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
