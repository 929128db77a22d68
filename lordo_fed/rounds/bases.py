"""LoRDO-Global's shared bases: their shapes, the seeded bases of round 1, and the batched refit to
the round's pseudo-gradient, the averaged moments rotated into the new bases, and the diagnostic share of
Δ̄ inside them (docs/algorithm.md, "One round"; Jovanović et al., LoRDO, arXiv 2602.04396)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lordo_fed.metrics import stable_rank
from lordo_fed.optim.projection import ProjectionMethod, project, projection_side
from lordo_fed.optim.rotation import rotate_moments
from lordo_fed.wire.messages import MOMENT_KEYS, moment_key


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


def rotate_into(moments: dict[str, Tensor], shapes: dict[str, tuple[int, int]], method: ProjectionMethod,
                old: dict[str, Tensor], new: dict[str, Tensor], opt_step: int, betas: tuple[float, float],
                bias_correction: bool) -> dict[str, Tensor]:
    """The averaged low-rank moments moved from the `old` shared bases into the `new` ones (LDAdam's
    rule, Robert et al. 2024: lordo_fed.optim.rotation.rotate_moments), for every parameter of `new` that carries
    either moment; the rest as they are. `shapes`: each parameter's p×q (θ's)."""
    out = dict(moments)
    for name in new:
        u_key, v_key = (moment_key(k, name) for k in MOMENT_KEYS)
        if u_key not in moments and v_key not in moments:
            continue
        shape = shapes[name]
        side = projection_side(shape)
        u, v = rotate_moments(moments.get(u_key), moments.get(v_key), method.basis(old[name], shape, side),
                              method.basis(new[name], shape, side), side, opt_step, betas, bias_correction)
        if u is not None:
            out[u_key] = u
        if v is not None:
            out[v_key] = v
    return out


def subspace_diagnostics(delta: dict[str, Tensor], ranks: dict[str, int], method: ProjectionMethod | None,
                         projections: dict[str, Tensor]) -> dict[str, float]:
    """Mean stable rank of Δ̄ over the low-rank matrices and, with shared bases (`method` and
    `projections`), the share of ||Δ̄||² that lies in the round's shared subspace.

    Without the QH term (ω = 1) every low-rank update is P·(something), so the share tends to
    1 and the refit P' = top-r(Δ̄) spans the same subspace: LoRDO's stagnation pathology.
    """
    if not ranks:
        return {}
    out = {"delta_stable_rank": sum(stable_rank(delta[n]) for n in ranks) / len(ranks)}
    if method is not None and projections:
        inside = total = 0.0
        for n in ranks:
            d = delta[n].float().cpu()
            shape = tuple(d.shape)
            side = projection_side(shape)
            basis = method.basis(projections[n], shape, side).float().cpu()
            inside += float(project(d, basis, side).square().sum())
            total += float(d.square().sum())
        out["delta_in_subspace"] = inside / total if total > 0 else 0.0
    return out
