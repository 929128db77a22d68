"""LoRDO-Global's shared bases: their shapes, the seeded bases of round 1, and the batched refit to
the round's pseudo-gradient (docs/algorithm.md, "One round"; Jovanović et al., LoRDO, arXiv 2602.04396)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lordo_fed.optim.projection import ProjectionMethod, projection_side


def low_rank_shape(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    """Shape of a low-rank moment of a p×q weight (GaLore's side rule)."""
    p, q = shape
    return (p, rank) if projection_side(shape) == "right" else (rank, q)


def fit_projections(deltas: dict[str, Tensor], ranks: dict[str, int], method: ProjectionMethod,
                    seed: int, device: torch.device | str | None = None) -> dict[str, Tensor]:
    """Stored-form projections (on the CPU) fitted to each low-rank parameter's pseudo-gradient.

    Matrices of one shape and rank are fitted as one stack (`ProjectionMethod.fit_stack`: one
    batched SVD or randomized SVD instead of a loop), on `device` (None: where the deltas are),
    e.g. the server's GPU. Parameter i in name order is seeded with seed + i, as `method.fit`
    of each matrix alone would be (the test oracle)."""
    seeds = {name: seed + i for i, name in enumerate(sorted(ranks))}
    groups: dict[tuple, list[str]] = {}
    for name in sorted(ranks):
        groups.setdefault((tuple(deltas[name].shape), ranks[name]), []).append(name)
    out: dict[str, Tensor] = {}
    for (shape, rank), names in groups.items():
        per_stack = max(1, _MAX_STACK_BYTES // (4 * math.prod(shape)))  # bounds the extra host memory
        for start in range(0, len(names), per_stack):
            chunk = names[start:start + per_stack]
            stack = torch.stack([deltas[n].float() for n in chunk])
            stack = stack.to(device, non_blocking=True) if device is not None else stack
            fitted = method.fit_stack(stack, rank, projection_side(shape), [seeds[n] for n in chunk]).cpu()
            out.update((n, f.clone()) for n, f in zip(chunk, fitted.unbind(0)))
    return {name: out[name] for name in sorted(ranks)}


_MAX_STACK_BYTES = 1 << 28
"""At most 256 MB of pseudo-gradients stacked at once by `fit_projections`."""



def initial_projections(shapes: dict[str, tuple[int, int]], ranks: dict[str, int], method: ProjectionMethod,
                        seed: int) -> dict[str, Tensor]:
    """The projections of round 1, before any pseudo-gradient exists (seeded, same everywhere)."""
    return {
        name: method.initial(shapes[name], rank, projection_side(shapes[name]), seed=seed + i)
        for i, (name, rank) in enumerate(sorted(ranks.items()))
    }
