"""The LoRDO inner optimizer: reductions to Adam/AdamW and GaLore, rotation, shapes, state, errors."""

import io
import warnings

import pytest
import torch

from lordo_fed.optim import LoRDO, rotate_moments
from lordo_fed.optim.projection import get_projection_method, project, project_back, projection_side

SHAPES = {"tall": (24, 10), "wide": (10, 24), "square": (16, 16), "bias": (16,)}


def make_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g)) for n, s in SHAPES.items()}


def clone_params(params):
    return {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}


def grads(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        for n, gr in grads(t).items():
            params[n].grad = gr.clone()
        opt.step()


def lowrank_groups(params, **kw):
    mats = [params[n] for n in ("tall", "wide", "square")]
    return [dict(params=mats, **kw), dict(params=[params["bias"]])]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_full_rank_equals_torch_adam_and_adamw(weight_decay):
    ours, ref = make_params(), make_params()
    opt = LoRDO(ours.values(), lr=1e-2, weight_decay=weight_decay, omega=1.0, error_feedback=False)
    cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    ref_opt = cls(ref.values(), lr=1e-2, weight_decay=weight_decay, foreach=False)
    for t in range(10):
        run(opt, ours, 1, start=t)
        run(ref_opt, ref, 1, start=t)
        for n in SHAPES:
            torch.testing.assert_close(ours[n], ref[n], rtol=0, atol=1e-6, msg=f"{n} step {t}")


def test_rank_at_least_min_dim_is_full_rank_adam():
    ours, ref = make_params(), make_params()
    # rank 64 >= min(p, q) for every matrix: no projection, plain AdamW.
    opt = LoRDO(lowrank_groups(ours, rank=64), lr=1e-2, weight_decay=0.1, omega=1.0)
    ref_opt = torch.optim.AdamW(ref.values(), lr=1e-2, weight_decay=0.1, foreach=False)
    run(opt, ours, 6)
    run(ref_opt, ref, 6)
    assert opt.low_rank_params() == []
    for n in SHAPES:
        torch.testing.assert_close(ours[n], ref[n], rtol=0, atol=1e-6)


def test_low_rank_without_error_feedback_and_rotation_equals_galore():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from galore_torch import GaLoreAdamW
    ours, ref = make_params(), make_params()
    rank, gap, lr = 4, 5, 1e-2
    # GaLore puts ε inside the bias correction (sqrt(v) + ε, then × sqrt(bc2)); a tiny ε makes
    # that placement immaterial. GaLore decays the post-update weight, so weight decay is 0 here.
    eps = 1e-12
    opt = LoRDO(
        lowrank_groups(ours, rank=rank), lr=lr, eps=eps, omega=1.0, error_feedback=False, rotate=False,
        projection_source="local", proj_interval=gap, proj_method="svd",
    )
    ref_opt = GaLoreAdamW(
        [dict(params=[ref[n] for n in ("tall", "wide", "square")], rank=rank, update_proj_gap=gap,
              scale=1.0, proj_type="std"), dict(params=[ref["bias"]])],
        lr=lr, eps=eps, weight_decay=0.0, no_deprecation_warning=True,
    )
    for t in range(12):  # crosses two projection refreshes (steps 5 and 10)
        run(opt, ours, 1, start=t)
        run(ref_opt, ref, 1, start=t)
        for n in SHAPES:
            torch.testing.assert_close(ours[n], ref[n], rtol=0, atol=1e-5, msg=f"{n} step {t}")


def test_rotation_by_identity_changes_nothing():
    params = make_params()
    opt = LoRDO(lowrank_groups(params, rank=3), lr=1e-2, omega=0.9, projection_source="local", proj_interval=100)
    run(opt, params, 4)
    for p, _ in opt.low_rank_params():
        st = opt.state[p]
        u, v = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
        basis = opt.basis(p)
        # Exact identity change of basis: the pure function returns the moments unchanged.
        side = projection_side(p.shape)
        eye_basis = torch.eye(basis.shape[0] if side == "right" else basis.shape[1])
        u2, v2 = rotate_moments(u, v, eye_basis, eye_basis, side, 4, (0.9, 0.999))
        assert torch.equal(u2, u) and torch.allclose(v2, v, rtol=1e-6, atol=0)
        # Handing the optimizer its own projection again (C = P Pᵀ ≈ I) changes nothing either.
        opt.set_projection(p, st["proj"].clone())
        torch.testing.assert_close(st["exp_avg"], u, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"], v, rtol=1e-5, atol=1e-9)


def test_rotation_by_a_permutation_permutes_the_moments():
    u = torch.randn(6, 4)
    v = u.square() + torch.rand(6, 4)
    old = torch.linalg.qr(torch.randn(9, 4))[0].T  # right-side basis, r×q
    perm = torch.tensor([2, 0, 3, 1])
    new = old[perm]  # the same vectors, reordered: C is a permutation matrix
    u2, v2 = rotate_moments(u, v, old, new, "right", step=3, betas=(0.9, 0.99))
    torch.testing.assert_close(u2, u[:, perm], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v2, v[:, perm], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tall", "wide", "square"])
@pytest.mark.parametrize("ef_dtype", ["fp32", "bf16"])
def test_low_rank_shapes_and_error_feedback(name, ef_dtype):
    params = make_params()
    opt = LoRDO(lowrank_groups(params, rank=3, ef_dtype=ef_dtype), lr=1e-2, omega=0.95,
                projection_source="local", proj_interval=2)
    p = params[name]
    before = p.detach().clone()
    g0 = grads(0)[name]
    run(opt, params, 1)
    st = opt.state[p]
    pq = p.shape
    side = projection_side(pq)
    assert st["exp_avg"].shape == ((pq[0], 3) if side == "right" else (3, pq[1]))
    assert st["ef"].shape == pq and st["ef"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[ef_dtype]
    # First step: E = G − back(proj(G)) with the basis fitted on G itself.
    basis = opt.basis(p)
    expected_ef = g0 - project_back(project(g0, basis, side), basis, side)
    tol = 1e-5 if ef_dtype == "fp32" else 1e-2
    torch.testing.assert_close(st["ef"].float(), expected_ef, rtol=tol, atol=tol)
    assert torch.isfinite(p).all() and not torch.equal(p, before)
    run(opt, params, 3, start=1)
    assert torch.isfinite(p).all()


def test_qh_term_keeps_the_update_full_rank():
    """ω < 1 "outside": the step leaves the rank-r subspace; ω = 1 or "inside": it stays in it."""
    ranks = {}
    for label, kw in {"outside": dict(omega=0.9), "omega1": dict(omega=1.0),
                      "inside": dict(omega=0.9, qh_placement="inside")}.items():
        params = make_params()
        opt = LoRDO(lowrank_groups(params, rank=2, error_feedback=False, **kw), lr=1e-2,
                    projection_source="local")
        before = params["tall"].detach().clone()
        run(opt, params, 1)
        ranks[label] = torch.linalg.matrix_rank(before - params["tall"].detach(), rtol=1e-4).item()
    assert ranks["outside"] == 10  # full rank of a 24×10 matrix
    assert ranks["omega1"] <= 2 and ranks["inside"] <= 2


def test_local_projection_refreshes_every_interval():
    params = make_params()
    opt = LoRDO(lowrank_groups(params, rank=3), lr=1e-2, projection_source="local", proj_interval=3)
    p = params["tall"]
    seen = []
    for t in range(7):
        run(opt, params, 1, start=t)
        seen.append(opt.state[p]["proj"].clone())
    changed = [not torch.equal(seen[i], seen[i - 1]) for i in range(1, 7)]
    # Refits at steps 0, 3, 6 (before the step count is incremented): changes seen at t = 3, 6.
    assert changed == [False, False, True, False, False, True]


def test_global_source_requires_a_projection_and_rotates_on_change():
    params = make_params()
    opt = LoRDO(lowrank_groups(params, rank=3), lr=1e-2, projection_source="global")
    params["tall"].grad = torch.randn(24, 10)
    with pytest.raises(RuntimeError, match="set_projection"):
        opt.step()
    svd = get_projection_method("svd")
    for p, _ in opt.low_rank_params():
        side = projection_side(p.shape)
        opt.set_projection(p, svd.initial(p.shape, 3, side, seed=0))
    run(opt, params, 2)
    p = params["tall"]
    u = opt.state[p]["exp_avg"].clone()
    old = opt.basis(p)
    new_stored = svd.initial(p.shape, 3, "right", seed=1)
    opt.set_projection(p, new_stored)
    c = old @ new_stored.T
    torch.testing.assert_close(opt.state[p]["exp_avg"], u @ c)
    with pytest.raises(ValueError, match="expected \\(3, 10\\)"):
        opt.set_projection(p, torch.eye(10)[:4])


@pytest.mark.parametrize("method", ["svd", "rsvd", "dct"])
def test_state_dict_round_trip_weights_only(method, tmp_path):
    kw = dict(rank=3, proj_method=method, ef_dtype="bf16", projection_source="local", proj_interval=2)
    a = make_params()
    opt_a = LoRDO(lowrank_groups(a, **kw), lr=1e-2, omega=0.9)
    run(opt_a, a, 3)
    path = tmp_path / "opt.pt"
    torch.save(opt_a.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    b = clone_params(a)
    opt_b = LoRDO(lowrank_groups(b, **kw), lr=1e-2, omega=0.9)
    opt_b.load_state_dict(loaded)
    # A loaded optimizer saves what it loaded: the groups gain no key (torch's own
    # `differentiable` included), so a resumed client's state equals an uninterrupted one's.
    assert opt_b.state_dict()["param_groups"] == loaded["param_groups"]
    st = opt_b.state[b["tall"]]
    assert st["ef"].dtype == torch.bfloat16 and st["exp_avg"].dtype == torch.float32
    if method == "dct":
        assert st["proj"].dtype == torch.int64
    run(opt_a, a, 4, start=3)
    run(opt_b, b, 4, start=3)
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rank=0), "rank=0"),
        (dict(rank=-2), "rank=-2"),
        (dict(omega=1.5), "omega=1.5.*\\[0, 1\\]"),
        (dict(omega=-0.1), "omega=-0.1"),
        (dict(ef_dtype="fp16"), "ef_dtype='fp16'"),
        (dict(qh_placement="middle"), "qh_placement='middle'"),
        (dict(projection_source="server"), "projection_source='server'"),
        (dict(proj_method="qr"), "proj_method='qr'"),
        (dict(proj_interval=0), "proj_interval=0"),
        (dict(betas=(0.9, 1.0)), "betas"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRDO(make_params().values(), **kwargs)


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="unknown LoRDO option.*'projector'"):
        LoRDO([dict(params=list(make_params().values()), projector="svd")])
    with pytest.raises(TypeError, match="gamma"):
        LoRDO(make_params().values(), gamma=0.5)


def test_state_dict_bytes_are_plain_tensors():
    params = make_params()
    opt = LoRDO(lowrank_groups(params, rank=3), projection_source="local")
    run(opt, params, 1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for st in sd["state"].values():
        assert all(isinstance(v, torch.Tensor) for v in st.values())
