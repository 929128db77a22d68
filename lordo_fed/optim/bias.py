"""Moving Adam moments from one step count to another without changing what they mean.

Adam divides its moments by (1 − β^k) (Kingma & Ba 2015, Alg. 1): after k steps from zero an EMA
holds only (1 − β^k) of its weight, and the division restores the scale. A moment and its step
count k therefore belong together: the optimizer uses û = u / (1 − β1^k), v̂ = v / (1 − β2^k).
Whenever a moment has to be used under another step count S (the server's shared count after a
skipped round; a reply averaged with replies of other counts; a parameter that joined late), it is
rescaled so that the bias-corrected value is unchanged:

    u_S = u_k · (1 − β1^S) / (1 − β1^k),     v_S = v_k · (1 − β2^S) / (1 − β2^k).

Forgetting this is the late-joiner bug: a moment that starts at zero but is given the shared
count S has v̂ ≈ 0, and û / (√v̂ + ε) explodes wherever the received u is non-zero.
"""

from __future__ import annotations

from typing import MutableMapping

import torch
from torch import Tensor

MOMENT_BETA = {"exp_avg": 0, "exp_avg_sq": 1}
"""Which of (β1, β2) discounts each moment (the optimizer-state key names of torch's Adam(W))."""


def restep_factor(beta: float, k_from: int, k_to: int) -> float:
    """(1 − β^k_to) / (1 − β^k_from): the factor that moves a moment from k_from steps to k_to."""
    if k_from == k_to:
        return 1.0
    if k_from <= 0:
        raise ValueError(f"restep_factor: a moment after k_from={k_from} steps is zero; it cannot be rescaled")
    return (1.0 - beta**k_to) / (1.0 - beta**k_from)


def restep(moment: Tensor, kind: str, k_from: int, k_to: int, betas: tuple[float, float],
           bias_correction: bool = True) -> Tensor:
    """`moment` (exp_avg or exp_avg_sq) after k_from steps, expressed at k_to steps (a new tensor
    only when the factor is not 1; without bias correction the count does not matter)."""
    if not bias_correction or k_from == k_to or k_from <= 0:  # k_from = 0: the moment is zero
        return moment
    return moment * restep_factor(betas[MOMENT_BETA[kind]], k_from, k_to)


@torch.no_grad()
def restep_state(state: MutableMapping[str, Tensor], k_to: int, betas: tuple[float, float],
                 bias_correction: bool = True) -> None:
    """Set one parameter's optimizer state (torch Adam(W) or LoRDO layout: `step`, `exp_avg`,
    `exp_avg_sq`) to step count `k_to`, rescaling its moments in place."""
    k_from = int(state["step"].item())
    if k_from == k_to:
        return
    if k_from > 0:
        for kind in MOMENT_BETA:
            if kind in state and bias_correction:
                state[kind].mul_(restep_factor(betas[MOMENT_BETA[kind]], k_from, k_to))
    else:  # no step taken: the moments are zero, and start afresh under any count
        for kind in MOMENT_BETA:
            if kind in state:
                state[kind].zero_()
        k_to = 0 if bias_correction else k_to
    state["step"].fill_(float(k_to))
