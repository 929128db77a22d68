"""HeLoCo's server-side rules (Al Asif et al., arXiv 2606.00271), for asynchronous rounds.

In asynchronous low-communication training each worker's pseudo-gradient Δ arrives on its own,
measured from a model that may be several outer steps old. HeLoCo applies every arrival as one
outer step of momentum look-ahead SGD (`lordo_fed.rounds.outer.MomentumLookAhead`), after correcting Δ,
tensor by tensor, against the outer momentum m as it stands just before that step (Algorithm 2,
Eqs. 7-15):

    c    = <Δ, m> / (max(‖Δ‖, ε) · max(‖m‖, ε))          cosine, not clamped
    conf = ‖Δ‖ / (‖Δ‖ + κ‖m‖ + ε)                        how much Δ can be trusted against m
    m̂    = m / max(‖m‖, ε),  Δ̂ = Δ / max(‖Δ‖, ε)

    keep      Δ                                       if c ≥ c_ok, or ‖Δ‖ < ε, or ‖m‖ < ε
    shrink    Δ − β · c · ‖Δ‖ · m̂,  β = min(k_s · (−c) · conf, β_max)          if c < 0
    blend     ‖Δ‖ · u / ‖u‖,  u = (1 − λ) Δ̂ + λ m̂,  λ = min(k_d · (1 − c) · conf, 1)  otherwise
              (Δ itself when ‖u‖ ≤ ε)

and the result, scaled by the arrival weight ρ (`rho`; lordo_fed.rounds.async_rounds scales every
asynchronous method's arrivals by it), is the G of the outer step. A tensor with no momentum yet
(the first arrival) gives ρΔ. Workers start each round from the look-ahead point
θ̄ = θ − η·μ·m (Eq. 5; `look_ahead`), not θ.

This follows the authors' code (PanocularAI/torchft, torchft/heloco.py at 0b0bae4; the same
mathematics in PanocularAI/panofabric-engine): ρ is a
constant (the paper suggests 1/√K for K concurrent workers; the code defaults to 1),
β is computed as above (an older variant, rcloyd/torchft, differs), the cosine is not clamped,
c = 0 blends, the blend mixes unit vectors and keeps ‖Δ‖, and the result takes Δ's dtype.
The arithmetic is in fp32. docs/algorithm.md ("Asynchronous rounds") says where this framework
departs from the code (a staleness bound, off by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class HeLoCoConfig:
    """The correction's settings; defaults are the authors'."""

    c_ok: float = 0.2
    """Cosine with the momentum at or above which Δ passes unchanged."""
    k_s: float = 0.5
    """Shrink strength k_s >= 0 for anti-aligned Δ (c < 0)."""
    k_d: float = 1.0
    """Blend strength k_d >= 0 toward the momentum for weakly aligned Δ (0 <= c < c_ok)."""
    kappa: float = 3.0
    """κ >= 0 in conf = ‖Δ‖ / (‖Δ‖ + κ‖m‖ + ε): a Δ small against m is corrected more."""
    beta_max: float = 0.5
    """Cap on the shrink coefficient β, in [0, 1]."""
    eps: float = 1e-8
    """Numerical floor ε > 0 for norms."""

    def validate(self) -> "HeLoCoConfig":
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"heloco.{name}={getattr(self, name)!r}: expected {expected}")

        for name in ("c_ok", "k_s", "k_d", "kappa", "beta_max", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "a finite number")
        if not -1.0 <= self.c_ok <= 1.0:
            raise bad("c_ok", "a cosine in [-1, 1]")
        for name in ("k_s", "k_d", "kappa"):
            if getattr(self, name) < 0:
                raise bad(name, "a number >= 0")
        if not 0.0 <= self.beta_max <= 1.0:
            raise bad("beta_max", "a number in [0, 1]")
        if self.eps <= 0:
            raise bad("eps", "a number > 0")
        return self


def correct_tensor(delta: Tensor, momentum: Tensor | None, cfg: HeLoCoConfig, rho: float = 1.0) -> Tensor:
    """One tensor's corrected, weighted pseudo-gradient ρ·Δ̂ (module docstring), in Δ's dtype.

    No value is read on the host: the case is chosen with `torch.where`, so on a GPU this is a
    handful of kernels and no sync."""
    if momentum is None:
        return (rho * delta).to(delta.dtype)
    if momentum.shape != delta.shape:
        raise ValueError(f"HeLoCo: momentum of shape {tuple(momentum.shape)} for a pseudo-gradient of shape "
                         f"{tuple(delta.shape)}")
    d, m, eps = delta.float(), momentum.float(), cfg.eps
    norm_d, norm_m = torch.linalg.vector_norm(d), torch.linalg.vector_norm(m)
    safe_d, safe_m = norm_d.clamp(min=eps), norm_m.clamp(min=eps)
    cos = torch.dot(d.flatten(), m.flatten()) / (safe_d * safe_m)                       # Eqs. 7-8
    conf = norm_d / (norm_d + cfg.kappa * norm_m + eps)                                  # Eq. 15
    m_hat = m / safe_m
    beta = torch.clamp(cfg.k_s * (-cos) * conf, max=cfg.beta_max)                        # Eq. 11
    shrunk = d - (beta * cos * norm_d) * m_hat                                           # Eq. 10
    lam = torch.clamp(cfg.k_d * (1.0 - cos) * conf, max=1.0)                             # Eq. 13
    mixed = (1.0 - lam) * (d / safe_d) + lam * m_hat                                     # Eq. 12
    norm_mix = torch.linalg.vector_norm(mixed)
    blended = torch.where(norm_mix > eps, norm_d * mixed / norm_mix.clamp(min=eps), d)  # Eq. 14
    keep = (norm_d < eps) | (norm_m < eps) | (cos >= cfg.c_ok)                           # Eq. 9
    out = torch.where(keep, d, torch.where(cos < 0.0, shrunk, blended))
    return (rho * out).to(delta.dtype)


def correct(deltas: dict[str, Tensor], momentum: dict[str, Tensor] | None, cfg: HeLoCoConfig,
            rho: float = 1.0) -> dict[str, Tensor]:
    """Every named tensor of one arrival corrected against the momentum of the same name (None,
    or a name it lacks: the first arrival, ρΔ) and weighted by ρ. Call it before the arrival's
    own outer step."""
    momentum = momentum or {}
    return {name: correct_tensor(d, momentum.get(name), cfg, rho) for name, d in deltas.items()}


@torch.no_grad()
def look_ahead(params: dict[str, Tensor], momentum: dict[str, Tensor] | None, lr: float,
               mu: float) -> dict[str, Tensor]:
    """θ̄ = θ − η·μ·m, the point a worker starts from (Eq. 5); θ itself (copies) while there is
    no momentum or μ = 0. New tensors in θ's dtype; θ is not changed."""
    momentum = momentum or {}
    out = {}
    for name, p in params.items():
        m = momentum.get(name)
        out[name] = p.detach().clone() if m is None or mu == 0 else (p.float() - (lr * mu) * m).to(p.dtype)
    return out
