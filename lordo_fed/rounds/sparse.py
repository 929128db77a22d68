"""The sums and means of replies, dense or top-k (docs/algorithm.md, "Compressed payloads"): the weighted
sums, SparseLoCo's contributor mean, and how much of the round's support the workers share."""

from __future__ import annotations

from typing import Mapping

import numpy as np
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
    sent (0: the workers' top-k supports are disjoint, 1: they all chose the same indices), from the
    counts `add_sent` keeps (0, 1, 2 = more; a count of 2 is the one whose bit 1 is set)."""
    sent = sum(_above(s, 0) for s in senders.values())
    if not sent:
        return {}
    return {"sparse_support_shared": sum(_above(s, 1) for s in senders.values()) / sent}


def _above(counts: Tensor, n: int) -> int:
    """How many of `counts` exceed `n`: numpy's compare and count on a CPU tensor (3-4x torch's over a byte
    tensor of a 125m model's size), torch's elsewhere."""
    if counts.device.type == "cpu":
        a = counts.numpy()
        return int(np.count_nonzero(a > n if n else a))
    return int(torch.count_nonzero(counts > n if n else counts))


def add_sent(senders: dict[str, Tensor | None], support: dict[str, Tensor | None] | None, key: str,
             t: Tensor | SparseValues, weight: float) -> None:
    """One reply's indices (its non-zeros) into the round's counts: senders[key], how many replies sent
    each index (one byte, saturated at 2: all `support_overlap` reads is none, one, more), and, where
    `support` has the key (the contributor mean's normaliser), support[key] += weight at each. A top-k
    term stays sparse: the same counts and the same fp32 additions as its dense mask, on its positions."""
    if isinstance(t, SparseValues):
        # every kept position adds 1 if its value is not 0 and 0 if it is (x + 0 = x, as the dense mask adds):
        # no masked selection of the positions, which would cost a pass and a host sync
        device = t.values.device
        positions, sent = t.positions.to(device), t.values != 0
        if support is not None and key in support:
            add_weighted(support, key, SparseValues(positions, sent.float(), t.shape), weight)
        count = senders.get(key)
        if count is None:
            count = senders[key] = torch.zeros(tuple(t.shape), dtype=torch.uint8, device=device)
        flat = count.view(-1)
        flat.index_copy_(0, positions, flat.index_select(0, positions).add_(sent.to(torch.uint8)).clamp_max_(2))
        return
    sent = t != 0
    if support is not None and key in support:
        add_weighted(support, key, sent, weight)
    count = senders.get(key)
    senders[key] = sent.to(torch.uint8) if count is None else torch.clamp_max(count + sent, 2)


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
