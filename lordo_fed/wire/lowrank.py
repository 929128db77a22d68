"""Low-rank pseudo-gradients on the wire: a low-rank matrix's Δ as its coordinates in the round's
shared basis plus a compressed residual (the `lowrank+...` payload presets).

Under LoRDO-Global every worker trains a round in the same basis P (the server fitted it to the
last round's Δ̄ and sent it, `GlobalState.projections`), so the server already holds P and a
worker need only send what P cannot: the coordinates C of Δ in P (`lordo_fed.optim.projection.project`:
r x q for a left basis, p x r for a right one; r·max(p, q) numbers against p·q) and the part of
Δ outside it. The receiver rebuilds

    Δ̂ = P·Ĉ + R̂          (`join`)

from the decoded coordinates Ĉ and the decoded residual R̂. The residual is taken after the
coordinates are quantised, R = Δ − P·Ĉ (`split`), so the coordinates' rounding is not lost: it
goes with the residual, and what the residual's codec leaves out (top-k) is kept by the worker's
error feedback (`lordo_fed.wire.compress.ErrorFeedback.compress_lowrank`) and sent later. The
basis is orthonormal, so ‖P·C‖ = ‖C‖: the coordinates are as cheap to quantise as Δ itself.

The coordinates are what LoRDO's optimizer already computes every step for the gradient
(its low-rank moments live in them); sending them is the "aggregate low-rank pseudo-gradients"
of the paper's design made literal, with the residual carrying the full-rank quasi-hyperbolic
term that makes LoRDO's updates full-rank.
"""

from __future__ import annotations

from torch import Tensor

from lordo_fed.optim.projection import Side, project, project_back
from lordo_fed.wire.compress import CodecSpec, Encoded, decode, encode


def split(target: Tensor, basis: Tensor, side: Side, spec: CodecSpec) -> tuple[Encoded, Tensor]:
    """(the coordinates of `target` in `basis`, encoded per `spec`; the residual target − P·Ĉ,
    with Ĉ what the receiver decodes from them). fp32, on `target`'s device."""
    basis = basis.to(device=target.device, dtype=target.dtype)
    coords = encode(project(target, basis, side), spec)
    residual = target - lift(decode(coords, "coords").view(coords.shape).to(target.device), basis, side)
    return coords, residual


def lift(coords: Tensor, basis: Tensor, side: Side) -> Tensor:
    """P·C: the full-size matrix the coordinates stand for."""
    return project_back(coords.float(), basis.to(device=coords.device, dtype=coords.dtype), side)


def join(residual: Tensor, coords: Tensor, basis: Tensor, side: Side) -> Tensor:
    """Δ̂ = P·Ĉ + R̂ from the decoded coordinates and residual (what the server averages)."""
    return lift(coords, basis, side).add_(residual.float())
