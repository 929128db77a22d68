"""Moving Adam moments from one low-rank basis to another (LDAdam's projection-aware rule).

Robert et al. 2024, "LDAdam: Adaptive Optimization from Low-Dimensional Gradient Statistics",
Alg. 1: with C the change of basis, the first moment is rotated linearly, u' = u C, and the
second moment is rebuilt from the variance and the rotated mean,
    v̂' = | (v̂ − m̂²) (C∘C) + (m̂ C)² |,   m̂ = u / (1−β1^k),  v̂ = v / (1−β2^k),
which is exact for the per-coordinate statistics of a gradient distribution whose coordinates
are independent. Right projection (bases r×q): C = P_old P_newᵀ, coordinates are rows.
Left projection (bases p×r): C = P_newᵀ P_old, applied from the left.

Deviation from the rule as docs/algorithm.md ("Projection refresh") states it, on purpose: it writes σ² = max(v̂ − m̂², 0) before the
absolute value. With β1 ≠ β2 an EMA can have m̂² > v̂, and the clamp then changes v even when
the basis does not change; LDAdam's own rule (no clamp, absolute value only) keeps rotation by
the identity exact, which this project requires.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lordo_fed.optim.projection import Side


def change_of_basis(old_basis: Tensor, new_basis: Tensor, side: Side) -> Tensor:
    """The r×r matrix C that re-expresses low-rank coordinates in the new basis."""
    return old_basis @ new_basis.T if side == "right" else new_basis.T @ old_basis


def _apply(x: Tensor, c: Tensor, side: Side) -> Tensor:
    return x @ c if side == "right" else c @ x


@torch.no_grad()
def rotate_moments(
    exp_avg: Tensor | None,
    exp_avg_sq: Tensor | None,
    old_basis: Tensor,
    new_basis: Tensor,
    side: Side,
    step: int,
    betas: tuple[float, float],
    bias_correction: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Rotate (u, v) from `old_basis` to `new_basis`; either moment may be None.

    Without the first moment (its sync is not due where the rotation happens) the mean term is
    taken as zero: v̂' = |v̂ (C∘C)|.
    """
    c = change_of_basis(old_basis.float(), new_basis.float(), side)
    beta1, beta2 = betas
    bc1 = 1.0 - beta1**step if (bias_correction and step > 0) else 1.0
    bc2 = 1.0 - beta2**step if (bias_correction and step > 0) else 1.0
    new_avg = _apply(exp_avg.float(), c, side) if exp_avg is not None else None
    new_avg_sq = None
    if exp_avg_sq is not None:
        v_hat = exp_avg_sq.float() / bc2
        if exp_avg is not None:
            m_hat = exp_avg.float() / bc1
            v_hat_new = _apply(v_hat - m_hat.square(), c * c, side) + _apply(m_hat, c, side).square()
        else:
            v_hat_new = _apply(v_hat, c * c, side)
        new_avg_sq = v_hat_new.abs_().mul_(bc2)
    return new_avg, new_avg_sq
