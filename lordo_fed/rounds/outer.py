"""Outer optimizers: how the server moves the global model with the averaged pseudo-gradient.

After each round of H local steps the server has the global model θ (the reference the workers
started from) and the token-weighted average of the workers' pseudo-gradients

    Δ̄ = θ_ref − mean_k(θ_k)                                              (pseudo-gradient)

It treats Δ̄ like a gradient and takes one step of an "outer" optimizer on θ. Three are provided:

- Average:  θ ← θ − η Δ̄             (η = 1 is plain model averaging, as in FedAvg / Local SGD)
- QHM:      quasi-hyperbolic momentum (Ma & Yarats 2019), the outer update LoRDO uses
- Nesterov: SGD with Nesterov momentum, the outer optimizer of DiLoCo
- MomentumLookAhead ("mla"): HeLoCo's outer step, one per arrival in asynchronous rounds

θ and Δ̄ are `dict[str, Tensor]` with the same keys and shapes (fp32). The optimizers update the
θ tensors in place under `torch.no_grad()` and keep their state as plain tensors, so that
`state_dict()` is a flat `dict[str, Tensor]` that safetensors can save as is.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from lordo_fed.config import setting

OUTER_NAMES = ("average", "qhm", "nesterov", "mla")


# -----------------------------------------------------------------------------
# argument checks


def _check_lr(lr: float) -> float:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr={lr!r}: the outer learning rate must be a finite number > 0")
    return float(lr)


def _check_unit(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r}: must be a number in [0, 1]")
    return float(value)


def _check_same_keys(params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
    """Keys and shapes of θ and Δ̄ must match exactly: a silent partial update would be a bug."""
    missing = sorted(set(params) - set(delta))
    extra = sorted(set(delta) - set(params))
    if missing or extra:
        raise ValueError(
            "delta keys do not match params keys: "
            f"missing from delta {missing}, extra in delta {extra}"
        )
    for name, p in params.items():
        if delta[name].shape != p.shape:
            raise ValueError(
                f"delta[{name!r}] has shape {tuple(delta[name].shape)}, "
                f"params[{name!r}] has shape {tuple(p.shape)}"
            )


# -----------------------------------------------------------------------------
# optimizers


class OuterOptimizer(ABC):
    """Base class: one `step` per round, state as named tensors.

    Subclasses that keep a per-parameter buffer name it with `_state_prefix`; the buffer for
    parameter `w` is stored as `"<prefix>.<w>"` in `state_dict()`. Buffers are created lazily
    at the first step, since the optimizer is built before the model's names are known.
    """

    name: str = "outer"
    _state_prefix: str | None = None  # None: the optimizer is stateless

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}  # parameter name -> buffer (fp32)

    @abstractmethod
    def _update(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        """Apply one outer step in place (keys/shapes already checked, inside no_grad)."""

    @torch.no_grad()
    def step(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        """Update `params` in place with the averaged pseudo-gradient `delta`
        (Δ̄ = θ_ref − mean θ_k)."""
        _check_same_keys(params, delta)
        if self._state_prefix is not None:
            self._ensure_buffers(params)
        self._update(params, delta)

    def _ensure_buffers(self, params: dict[str, Tensor]) -> None:
        """Create zero buffers on first use; afterwards insist they cover exactly `params`."""
        if not self._buffers:
            # fp32 state whatever the parameter dtype, as for the inner optimizer states
            self._buffers = {
                n: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                for n, p in params.items()
            }
            return
        missing = sorted(set(params) - set(self._buffers))
        extra = sorted(set(self._buffers) - set(params))
        if missing or extra:
            raise ValueError(
                f"{self.name} state does not match params: "
                f"no state for {missing}, state for unknown params {extra}"
            )
        for n, p in params.items():
            buf = self._buffers[n]
            if buf.shape != p.shape:
                raise ValueError(
                    f"{self.name} state {self._state_prefix}.{n} has shape {tuple(buf.shape)}, "
                    f"params[{n!r}] has shape {tuple(p.shape)}"
                )
            if buf.device != p.device:  # e.g. state loaded on CPU, model on GPU
                self._buffers[n] = buf.to(p.device)

    def state_dict(self) -> dict[str, Tensor]:
        """Flat `{"<prefix>.<param name>": tensor}` (copies), empty before the first step."""
        if self._state_prefix is None:
            return {}
        return {f"{self._state_prefix}.{n}": b.detach().clone() for n, b in self._buffers.items()}

    def load_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Restore buffers saved by `state_dict()`.

        Every key must be `"<prefix>.<param name>"` with a tensor value. If this optimizer already
        has state (it has stepped), the names and shapes must match it exactly; otherwise they
        are checked against the parameters at the next `step`.
        """
        if self._state_prefix is None:
            if state_dict:
                raise ValueError(
                    f"{self.name} is stateless, but state_dict has keys {sorted(state_dict)}"
                )
            return
        prefix = self._state_prefix + "."
        bad = sorted(k for k in state_dict if not k.startswith(prefix) or len(k) == len(prefix))
        if bad:
            raise ValueError(
                f"{self.name} state_dict keys must look like '{prefix}<param name>'; got {bad}"
            )
        loaded: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"state_dict[{key!r}] is a {type(value).__name__}, expected a Tensor")
            loaded[key[len(prefix):]] = value.detach().to(torch.float32).clone()
        if self._buffers:
            missing = sorted(set(self._buffers) - set(loaded))
            extra = sorted(set(loaded) - set(self._buffers))
            if missing or extra:
                raise ValueError(
                    f"{self.name} state_dict does not match the current state: "
                    f"missing {[prefix + n for n in missing]}, unexpected {[prefix + n for n in extra]}"
                )
            for n, b in self._buffers.items():
                if loaded[n].shape != b.shape:
                    raise ValueError(
                        f"state_dict[{prefix + n!r}] has shape {tuple(loaded[n].shape)}, "
                        f"expected {tuple(b.shape)}"
                    )
            loaded = {n: t.to(self._buffers[n].device) for n, t in loaded.items()}
        self._buffers = loaded

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._hparams()})"

    def _hparams(self) -> str:
        return ""


class Average(OuterOptimizer):
    """θ ← θ − η Δ̄.

    With η = 1 this is θ_ref − (θ_ref − mean θ_k) = mean θ_k: plain averaging of the workers'
    models. η ≠ 1 extrapolates (η > 1) or damps (η < 1) along the averaged update.
    """

    name = "average"

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__()
        self.lr = _check_lr(lr)

    def _update(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for n, p in params.items():
            p.add_(delta[n], alpha=-self.lr)

    def _hparams(self) -> str:
        return f"lr={self.lr}"


class QHM(OuterOptimizer):
    """Quasi-hyperbolic momentum (Ma & Yarats 2019, "Quasi-hyperbolic momentum and Adam for
    deep learning"), LoRDO's outer update:

        m ← β m + (1 − β) Δ̄                    (m starts at 0)
        θ ← θ − η ((1 − ν) Δ̄ + ν m)

    ν interpolates between the plain step (ν = 0: Average with lr η) and momentum SGD with an
    EMA buffer (ν = 1). The buffer is still updated when ν = 0, so ν can be raised later.
    """

    name = "qhm"
    _state_prefix = "momentum"

    def __init__(self, lr: float = 1.0, beta: float = 0.9, nu: float = 0.0) -> None:
        super().__init__()
        self.lr = _check_lr(lr)
        self.beta = _check_unit("beta", beta)
        self.nu = _check_unit("nu", nu)

    def _update(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for n, p in params.items():
            d, m = delta[n], self._buffers[n]
            m.mul_(self.beta).add_(d, alpha=1.0 - self.beta)
            # two in-place adds instead of building (1-ν)Δ̄ + νm: no temporary of the model's size
            if self.nu != 1.0:
                p.add_(d, alpha=-self.lr * (1.0 - self.nu))
            if self.nu != 0.0:  # skipped at ν = 0 so the result is bit-identical to Average
                p.add_(m, alpha=-self.lr * self.nu)

    def _hparams(self) -> str:
        return f"lr={self.lr}, beta={self.beta}, nu={self.nu}"


class Nesterov(OuterOptimizer):
    """SGD with Nesterov momentum, as DiLoCo's outer optimizer and
    `torch.optim.SGD(nesterov=True, dampening=0)` with Δ̄ as the gradient:

        b ← μ b + Δ̄                            (b starts at 0, so the first b = Δ̄)
        θ ← θ − η (Δ̄ + μ b)
    """

    name = "nesterov"
    _state_prefix = "momentum_buffer"  # torch.optim.SGD's name; differs from QHM's EMA buffer

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr = _check_lr(lr)
        self.momentum = _check_unit("momentum", momentum)

    def _update(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for n, p in params.items():
            d, b = delta[n], self._buffers[n]
            b.mul_(self.momentum).add_(d)
            p.add_(d.add(b, alpha=self.momentum), alpha=-self.lr)

    def _hparams(self) -> str:
        return f"lr={self.lr}, momentum={self.momentum}"


class MomentumLookAhead(OuterOptimizer):
    """HeLoCo's outer step (Al Asif et al., arXiv 2606.00271, Eqs. 18-19), applied once per
    arriving (corrected) pseudo-gradient G in asynchronous rounds:

        m ← μ m + (1 − μ) G                     (m starts at 0)
        θ ← θ − η (G + μ m)

    The same family as QHM (lr η(1 + μ), β = μ, ν = μ / (1 + μ)), written as its authors' code
    has it so that their settings carry over. Workers start from θ − ημm (`lordo_fed.rounds.heloco.
    look_ahead`); `momentum_buffers()` is what `lordo_fed.rounds.heloco.correct` compares an arrival with.
    """

    name = "mla"
    _state_prefix = "momentum"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr = _check_lr(lr)
        self.momentum = _check_unit("momentum", momentum)

    def momentum_buffers(self) -> dict[str, Tensor] | None:
        """The outer momentum m by parameter name (the live buffers: read, do not modify), None
        before the first step (HeLoCo's first arrival)."""
        return self._buffers or None

    def _update(self, params: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
        for n, p in params.items():
            g, m = delta[n], self._buffers[n]
            m.mul_(self.momentum).add_(g, alpha=1.0 - self.momentum)
            p.add_(g.add(m, alpha=self.momentum), alpha=-self.lr)

    def _hparams(self) -> str:
        return f"lr={self.lr}, momentum={self.momentum}"


# -----------------------------------------------------------------------------
# config


@dataclass
class OuterConfig:
    """Which outer optimizer the server runs, and its hyperparameters."""

    name: str = setting("outer", "average")
    """Outer optimizer: "average" | "qhm" | "nesterov" | "mla" (HeLoCo's momentum look-ahead)."""

    lr: float = setting("outer-lr", 1.0)
    """Outer learning rate η (> 0); 1.0 with "average" is plain model averaging."""

    late_lr: float = setting("outer-late-lr", 0.0)
    """η of the late rounds, from `rounds.late_from_step` on (e.g. about √M in WSD's decay; 0 = `lr` throughout)."""

    beta: float = 0.9
    """QHM momentum EMA coefficient β in [0, 1]."""

    nu: float = 0.0
    """QHM immediate-discount ν in [0, 1]: 0 is a plain step, 1 is pure momentum."""

    momentum: float = 0.9
    """Nesterov / momentum look-ahead μ in [0, 1] (DiLoCo and HeLoCo use 0.9, with lr 0.7)."""


def build_outer_optimizer(cfg: OuterConfig) -> OuterOptimizer:
    """Build the outer optimizer named by `cfg.name`.

    All numeric fields are checked, including those the chosen optimizer ignores, so a typo in a
    config fails loudly rather than surfacing when someone switches optimizers.
    """
    if cfg.name not in OUTER_NAMES:
        raise ValueError(f"name={cfg.name!r}: expected one of {list(OUTER_NAMES)} (the outer optimizer)")
    _check_lr(cfg.lr)
    if cfg.late_lr != 0:
        try:
            _check_lr(cfg.late_lr)
        except ValueError:
            raise ValueError(f"late_lr={cfg.late_lr!r}: the late rounds' outer learning rate must be a finite number "
                             "> 0, or 0 for `lr` throughout") from None
    _check_unit("beta", cfg.beta)
    _check_unit("nu", cfg.nu)
    _check_unit("momentum", cfg.momentum)
    if cfg.name == "average":
        return Average(lr=cfg.lr)
    if cfg.name == "qhm":
        return QHM(lr=cfg.lr, beta=cfg.beta, nu=cfg.nu)
    if cfg.name == "mla":
        return MomentumLookAhead(lr=cfg.lr, momentum=cfg.momentum)
    return Nesterov(lr=cfg.lr, momentum=cfg.momentum)
