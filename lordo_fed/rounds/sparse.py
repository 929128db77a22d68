"""The sums and means of replies, dense or top-k (docs/algorithm.md, "Compressed payloads"): the weighted
sums, SparseLoCo's contributor mean, and how much of the round's support the workers share."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from lordo_fed.wire.compress import SparseValues


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


def add_weighted(sums: dict[str, Tensor], key: str, t: Tensor | SparseValues, weight: float) -> None:
    """sums[key] += weight · t in fp32 (created as zeros on first use). Every average of the
    aggregator is a sequence of these additions, so its result depends only on the order of the
    terms, not on whether they were held in memory together, or a top-k term kept sparse
    (`SparseValues.add_to`: the same additions, bit for bit)."""
    acc = sums.get(key)
    if acc is None:
        device = t.values.device if isinstance(t, SparseValues) else t.device
        acc = sums[key] = torch.zeros(tuple(t.shape), dtype=torch.float32, device=device)
    elif tuple(acc.shape) != tuple(t.shape):
        raise ValueError(f"{key}: shape {tuple(t.shape)} added to a sum of shape {tuple(acc.shape)}")
    if isinstance(t, SparseValues):
        t.add_to(acc, weight)
    else:
        acc.add_(t.float(), alpha=weight)
