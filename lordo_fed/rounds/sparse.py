"""The mean of top-k replies (docs/algorithm.md, "Compressed payloads"): SparseLoCo's contributor
mean, and how much of the round's support the workers share."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor


def contributor_mean(total: Tensor, weight: Tensor | None) -> Tensor:
    """Σ_m w_m Δ_m / Σ_{m sent i} w_m at each index i, 0 where no worker sent one (SparseLoCo's
    aggregation, Sarfi et al. 2025: an index one of M workers chose is not shrunk to 1/M)."""
    if weight is None:  # no reply carried the tensor
        return total
    return torch.where(weight > 0, total / weight.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def support_overlap(senders: Mapping[str, Tensor]) -> dict[str, float]:
    """`sparse_support_shared`: the share of the indices sent this round that more than one worker
    sent (0: the workers' top-k supports are disjoint, 1: they all chose the same indices)."""
    sent = sum(int((s > 0).sum()) for s in senders.values())
    if not sent:
        return {}
    return {"sparse_support_shared": sum(int((s > 1).sum()) for s in senders.values()) / sent}
