"""Low-rank projections of a p×q matrix: which rank-r subspace the optimizer states live in.

Side follows GaLore's rule (Zhao et al. 2024, "GaLore", Alg. 1): if p ≥ q the projection acts on
the right (basis P is r×q, g = V Pᵀ, back(X) = X P), else on the left (P is p×r, g = Pᵀ V,
back(X) = P X). Either way the optimizer states are the smaller of the two low-rank shapes.

A method *fits* a projection to a matrix and returns its **stored form**: the tensor that lives
in optimizer state, in checkpoints and on the wire. For exact and randomized SVD that is the
orthonormal basis itself; for the DCT method (Modoranu et al.) it is r integer column indices
into a fixed DCT-II basis, so sending a projection costs r integers instead of r·q floats.
`basis()` turns a stored form back into the orthonormal matrix.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from typing import Literal

import torch
from torch import Tensor

Side = Literal["left", "right"]


def projection_side(shape: tuple[int, ...] | torch.Size) -> Side:
    """GaLore's rule: project on the right when the matrix is at least as tall as it is wide."""
    p, q = shape
    return "right" if p >= q else "left"


def basis_dim(shape: tuple[int, ...] | torch.Size, side: Side) -> int:
    """Length of the basis vectors: q for a right projection, p for a left one."""
    return shape[1] if side == "right" else shape[0]


def project(v: Tensor, basis: Tensor, side: Side) -> Tensor:
    """Full p×q matrix -> low-rank coordinates (p×r on the right, r×q on the left)."""
    return v @ basis.T if side == "right" else basis.T @ v


def project_back(low: Tensor, basis: Tensor, side: Side) -> Tensor:
    """Low-rank coordinates -> full p×q matrix in the subspace spanned by the basis."""
    return low @ basis if side == "right" else basis @ low


def _canonical(vectors: Tensor, side: Side) -> Tensor:
    """Basis vectors as rows (r×n) -> the canonical basis shape of that side."""
    return vectors if side == "right" else vectors.T.contiguous()


class ProjectionMethod(ABC):
    """Fits rank-r projections; stored forms are plain tensors (optimizer state, wire, checkpoints)."""

    name: str = ""

    def fit(self, matrix: Tensor, rank: int, side: Side, seed: int = 0) -> Tensor:
        """Stored form of the top-r subspace of `matrix` on `side` (rank already < min(p, q))."""
        return self.fit_stack(matrix[None], rank, side, [seed])[0]

    @abstractmethod
    def fit_stack(self, matrices: Tensor, rank: int, side: Side, seeds: list[int]) -> Tensor:
        """`fit` of each matrix of an [n, p, q] stack, as one batched computation on the stack's
        device (seeds[i] seeds matrix i's fit): a stack of n stored forms, each what `fit` of that
        matrix alone with that seed returns (to the rounding of the batched kernels)."""

    def basis(self, stored: Tensor, shape: tuple[int, ...] | torch.Size, side: Side) -> Tensor:
        """Orthonormal basis (r×q for right, p×r for left), fp32, from a stored form."""
        return stored

    def initial(self, shape: tuple[int, ...] | torch.Size, rank: int, side: Side, seed: int,
                device: torch.device | str = "cpu") -> Tensor:
        """A projection to start from before any pseudo-gradient exists (LoRDO-Global, round 1).

        Decision: a seeded random orthonormal basis (QR of a Gaussian), the same on every worker.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        n = basis_dim(shape, side)
        gauss = torch.randn(n, rank, generator=gen, dtype=torch.float32)
        q, _ = torch.linalg.qr(gauss)  # n×r, orthonormal columns
        return _canonical(q.T.contiguous(), side).to(device)


class SVDProjection(ProjectionMethod):
    """Exact truncated SVD in fp32 (GaLore's reference; `torch.linalg.svd`)."""

    name = "svd"

    def fit_stack(self, matrices: Tensor, rank: int, side: Side, seeds: list[int]) -> Tensor:
        u, _, vh = torch.linalg.svd(matrices.float(), full_matrices=False)
        return vh[:, :rank, :].contiguous() if side == "right" else u[:, :, :rank].contiguous()


class RandomizedSVDProjection(ProjectionMethod):
    """Randomized SVD with subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4).

    Costs O(pq(r + oversample)) per iteration instead of a full SVD; seeded, so every worker that
    fits the same matrix with the same seed gets the same basis.
    """

    name = "rsvd"

    def __init__(self, n_iter: int = 2, oversample: int = 8):
        if n_iter < 0:
            raise ValueError(f"n_iter={n_iter}: expected an integer >= 0")
        if oversample < 0:
            raise ValueError(f"oversample={oversample}: expected an integer >= 0")
        self.n_iter = n_iter
        self.oversample = oversample

    def fit_stack(self, matrices: Tensor, rank: int, side: Side, seeds: list[int]) -> Tensor:
        a = matrices.float()
        # Work on the orientation whose *row* space we want: right side = row space of A.
        if side == "left":
            a = a.mT
        p, q = a.shape[-2:]
        k = min(rank + self.oversample, p, q)
        # each matrix's test matrix from its own seed (CPU generator: the same on every machine)
        omega = torch.stack([torch.randn(q, k, generator=torch.Generator(device="cpu").manual_seed(s),
                                         dtype=torch.float32) for s in seeds]).to(a.device)
        y, _ = torch.linalg.qr(a @ omega)  # p×k: range of A
        for _ in range(self.n_iter):  # power iterations sharpen the spectrum; QR keeps it stable
            z, _ = torch.linalg.qr(a.mT @ y)
            y, _ = torch.linalg.qr(a @ z)
        _, _, vh = torch.linalg.svd(y.mT @ a, full_matrices=False)  # k×q
        rows = vh[:, :rank, :]  # top-r right singular vectors of (possibly transposed) A
        return rows.contiguous() if side == "right" else rows.mT.contiguous()


@functools.lru_cache(maxsize=64)
def _dct_matrix(n: int, device: str) -> Tensor:
    k = torch.arange(n, dtype=torch.float64)
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (i[:, None] + 0.5) * k[None, :] / n) * math.sqrt(2.0 / n)
    d[:, 0] /= math.sqrt(2.0)
    return d.float().to(device)


def dct_matrix(n: int, device: torch.device | str = "cpu") -> Tensor:
    """Orthonormal n×n DCT-II matrix (columns = basis vectors), cached per size and device so the
    local step never rebuilds or re-uploads it."""
    return _dct_matrix(n, str(torch.device(device)))


class DCTProjection(ProjectionMethod):
    """Fixed DCT-II basis with the r columns best aligned with the matrix (Modoranu et al.).

    Alignment of basis vector j is the norm of the matrix's component along it; the top-r indices
    are the stored form (sorted, int64), so a projection crosses the wire as r integers.
    """

    name = "dct"

    def fit_stack(self, matrices: Tensor, rank: int, side: Side, seeds: list[int]) -> Tensor:
        a = matrices.float()
        d = dct_matrix(basis_dim(a.shape[-2:], side), a.device)
        coords = a @ d if side == "right" else d.T @ a  # p×n or n×q: coordinates on each vector
        scores = coords.norm(dim=-2) if side == "right" else coords.norm(dim=-1)
        idx = torch.topk(scores, rank, dim=-1).indices
        return torch.sort(idx, dim=-1).values.to(torch.int64)

    def basis(self, stored: Tensor, shape: tuple[int, ...] | torch.Size, side: Side) -> Tensor:
        d = dct_matrix(basis_dim(shape, side), stored.device)
        return _canonical(d[:, stored].T.contiguous(), side)

    def initial(self, shape: tuple[int, ...] | torch.Size, rank: int, side: Side, seed: int,
                device: torch.device | str = "cpu") -> Tensor:
        """Decision: r seeded random frequencies, the same on every worker."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        idx = torch.randperm(basis_dim(shape, side), generator=gen)[:rank]
        return torch.sort(idx).values.to(device=device, dtype=torch.int64)


PROJECTION_METHODS = ("svd", "rsvd", "dct")


def get_projection_method(name: str, **kwargs) -> ProjectionMethod:
    """The projection method called `name` ('svd', 'rsvd' or 'dct')."""
    if name == "svd":
        return SVDProjection()
    if name == "rsvd":
        return RandomizedSVDProjection(**kwargs)
    if name == "dct":
        return DCTProjection()
    raise ValueError(f"projection method {name!r}: expected one of {PROJECTION_METHODS}")
