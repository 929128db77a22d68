"""Projection methods: column-space recovery, orthonormality, stored forms."""

import pytest
import torch

from lordo_fed.optim.projection import (
    DCTProjection,
    dct_matrix,
    get_projection_method,
    project,
    project_back,
    projection_side,
)


def low_rank_matrix(p: int, q: int, r: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Well-separated spectrum: the top-r subspace is unambiguous.
    u, _ = torch.linalg.qr(torch.randn(p, r, generator=g))
    v, _ = torch.linalg.qr(torch.randn(q, r, generator=g))
    s = torch.linspace(10.0, 5.0, r)
    return u @ torch.diag(s) @ v.T


@pytest.mark.parametrize("method", ["svd", "rsvd"])
@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
def test_svd_methods_recover_column_space(method, shape):
    r = 5
    a = low_rank_matrix(*shape, r)
    side = projection_side(a.shape)
    m = get_projection_method(method)
    basis = m.basis(m.fit(a, r, side, seed=3), a.shape, side)
    assert basis.shape == ((r, shape[1]) if side == "right" else (shape[0], r))
    # An exact rank-r matrix is reproduced by projecting onto its top-r subspace.
    back = project_back(project(a, basis, side), basis, side)
    assert torch.allclose(back, a, atol=1e-4)
    gram = basis @ basis.T if side == "right" else basis.T @ basis
    assert torch.allclose(gram, torch.eye(r), atol=1e-5)


def test_rsvd_is_seeded():
    a = torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
    m = get_projection_method("rsvd")
    assert torch.equal(m.fit(a, 4, "right", seed=7), m.fit(a, 4, "right", seed=7))


@pytest.mark.parametrize("side,shape", [("right", (30, 24)), ("left", (24, 30))])
def test_dct_recovers_a_matrix_built_from_dct_columns(side, shape):
    n = shape[1] if side == "right" else shape[0]
    d = dct_matrix(n)
    cols = torch.tensor([1, 4, 9])
    coef = torch.randn(shape[0] if side == "right" else shape[1], 3, generator=torch.Generator().manual_seed(0))
    a = coef @ d[:, cols].T if side == "right" else d[:, cols] @ coef.T
    m = DCTProjection()
    stored = m.fit(a, 3, side)
    assert stored.dtype == torch.int64 and torch.equal(stored, cols)
    basis = m.basis(stored, a.shape, side)
    assert torch.allclose(project_back(project(a, basis, side), basis, side), a, atol=1e-5)


def test_dct_basis_is_orthonormal_and_stores_only_indices():
    d = dct_matrix(33)
    assert torch.allclose(d.T @ d, torch.eye(33), atol=1e-5)
    a = torch.randn(50, 33)
    stored = DCTProjection().fit(a, 6, "right")
    assert stored.shape == (6,) and stored.dtype == torch.int64
    init = DCTProjection().initial(a.shape, 6, "right", seed=1)
    assert init.shape == (6,) and init.dtype == torch.int64


def test_initial_projection_is_orthonormal_and_seeded():
    m = get_projection_method("svd")
    p1 = m.initial((20, 12), 4, "right", seed=5)
    assert p1.shape == (4, 12)
    assert torch.allclose(p1 @ p1.T, torch.eye(4), atol=1e-5)
    assert torch.equal(p1, m.initial((20, 12), 4, "right", seed=5))
    assert m.initial((12, 20), 4, "left", seed=5).shape == (12, 4)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="'qr'.*svd"):
        get_projection_method("qr")


def noisy_matrix(p: int, q: int, seed: int) -> torch.Tensor:
    """A decaying spectrum plus noise: a pseudo-gradient's shape, with a clear gap after rank 5."""
    return low_rank_matrix(p, q, 5, seed) + 0.01 * torch.randn(p, q, generator=torch.Generator().manual_seed(seed + 99))


def projector(method, stored: torch.Tensor, shape, side) -> torch.Tensor:
    """The orthogonal projector onto the fitted subspace: equal for equal subspaces, whatever the
    signs or the order of the basis vectors."""
    b = method.basis(stored, shape, side)
    return b.T @ b if side == "right" else b @ b.T


@pytest.mark.parametrize("name", ["svd", "rsvd", "dct"])
@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_fitting_a_stack_equals_fitting_each_matrix_alone(name, shape):
    """The batched fit (one SVD / randomized SVD over the stack) against the per-matrix fit, seed by seed."""
    m = get_projection_method(name)
    side = projection_side(shape)
    mats = [noisy_matrix(*shape, seed) for seed in range(4)]
    seeds = [11, 12, 13, 14]
    stacked = m.fit_stack(torch.stack(mats), 5, side, seeds)
    assert stacked.shape[0] == 4
    for a, s, got in zip(mats, seeds, stacked.unbind(0)):
        alone = m.fit(a, 5, side, seed=s)
        assert got.dtype == alone.dtype and got.shape == alone.shape
        if name == "dct":
            assert torch.equal(got, alone)  # indices
        else:
            torch.testing.assert_close(projector(m, got, shape, side), projector(m, alone, shape, side),
                                       rtol=0, atol=1e-5)


def test_fit_projections_groups_by_shape_and_keeps_each_parameters_seed():
    """The aggregator's refit: matrices of a shape fitted together, each as the per-name fit with its seed."""
    from lordo_fed.rounds.bases import fit_projections

    shapes = {"a": (48, 32), "b": (32, 48), "c": (48, 32), "d": (48, 32)}
    deltas = {n: noisy_matrix(*s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    ranks = {"a": 5, "b": 5, "c": 5, "d": 4}  # d: another rank, its own group
    m = get_projection_method("rsvd")
    got = fit_projections(deltas, ranks, m, seed=100)
    assert list(got) == sorted(ranks)
    for i, name in enumerate(sorted(ranks)):
        side = projection_side(shapes[name])
        alone = m.fit(deltas[name], ranks[name], side, seed=100 + i)
        assert got[name].shape == alone.shape and got[name].untyped_storage().nbytes() == alone.numel() * 4
        torch.testing.assert_close(projector(m, got[name], shapes[name], side),
                                   projector(m, alone, shapes[name], side), rtol=0, atol=1e-5)
