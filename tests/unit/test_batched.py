"""BatchedLoRDO against its oracle, the per-parameter LoRDO: the same parameters and the same
state after every step, to fp32 rounding, for every option (error feedback fp32/bf16/off, γ,
reset, full-rank term, QH outside/inside, ω = 1, weight decay, no bias correction, svd/rsvd/dct,
rotation on a basis change, local refits, parameters that are not low-rank)."""

from __future__ import annotations

import copy

import pytest
import torch

from lordo_fed.optim import LoRDO
from lordo_fed.optim.batched import BatchedLoRDO
from lordo_fed.optim.projection import get_projection_method, projection_side

RANK = 6
SHAPES = [(48, 32), (48, 32), (48, 32), (32, 80), (32, 80), (64, 64), (5, 4), (16,)]
"""Three and two matrices of a shape (stacked), one alone, one with rank >= min(p, q) and a
vector (both full rank), on both projection sides."""

OPTIONS = [
    dict(),
    dict(ef_dtype="bf16"),
    dict(error_feedback=False),
    dict(ef_decay=0.9),
    dict(ef_reset=True),
    dict(full_rank_term="gradient"),
    dict(qh_placement="inside"),
    dict(omega=1.0),
    dict(weight_decay=0.0, bias_correction=False),
    dict(proj_method="rsvd"),
    dict(proj_method="dct"),
    dict(rotate=False),
    dict(projection_source="local", proj_interval=3),
    dict(projection_source="local", proj_interval=3, proj_method="rsvd", ef_reset=True),
    dict(proj_method="dct", ef_dtype="bf16", qh_placement="inside"),
    dict(full_rank_term="gradient", ef_decay=0.5, ef_dtype="bf16"),
    dict(ef_density=1 / 16),
    dict(ef_density=0.1, ef_decay=0.9, ef_reset=True, proj_method="rsvd"),
    dict(ef_density=0.1, projection_source="local", proj_interval=3),
    dict(param_dtype=torch.bfloat16),  # bf16 weights: the update in fp32, rounded once into them
    dict(param_dtype=torch.bfloat16, full_rank_term="gradient", qh_placement="inside"),
]


def gradient(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Noise plus, for a matrix, a strong rank-RANK part: real gradients have a decaying spectrum,
    and a clear gap after the rank keeps a local refit's subspace well conditioned (with pure
    noise, fp32 rounding alone rotates a refitted basis by ~1e-4)."""
    g = torch.randn(shape, generator=gen)
    if len(shape) == 2 and min(shape) > RANK:
        g += 3 * torch.randn(shape[0], RANK, generator=gen) @ torch.randn(RANK, shape[1], generator=gen)
    return g


def assert_state_close(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    """Equal to the rounding of the stored dtype, measured on the whole tensor: E is a residual with
    entries near 0, where an elementwise relative tolerance means nothing."""
    assert got.dtype == want.dtype and got.shape == want.shape, key
    if key == "ef_idx":  # which entries a compressed E keeps (order aside)
        assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values), key
        return
    if key == "ef_val":  # int8: one quantisation step at most, from fp32 rounding at a .5 boundary
        assert (got.int() - want.int()).abs().max() <= 1, key
        return
    tol = 2.0**-8 if want.dtype == torch.bfloat16 else 1e-5
    err = torch.linalg.vector_norm((got.float() - want.float()).flatten())
    assert err <= tol * torch.linalg.vector_norm(want.float().flatten()) + 1e-6, (key, float(err))


def run(cls, options: dict, steps: int = 9):
    torch.manual_seed(0)
    dtype = options.get("param_dtype", torch.float32)
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    kw = {"lr": 1e-2, "omega": 0.9, "weight_decay": 0.01, **{k: v for k, v in options.items() if k != "param_dtype"}}
    opt = cls([{"params": params[:7], "rank": RANK}, {"params": params[7:]}], **kw)
    method = get_projection_method(kw.get("proj_method", "svd"))
    gen = torch.Generator().manual_seed(1)

    def new_bases(seed: int) -> None:
        if kw.get("projection_source", "global") != "global":
            return
        for i, (p, group) in enumerate(opt.low_rank_params()):
            side = projection_side(p.shape)
            opt.set_projection(p, method.fit(torch.randn(p.shape, generator=gen), RANK, side, seed=seed + i))

    new_bases(0)
    for step in range(steps):
        if step == 4:
            new_bases(100)  # a new round's bases: moments rotated (or not), E reset (or not)
        for p in params:
            p.grad = gradient(p.shape, gen).to(dtype)
        opt.step()
    opt.sync_state()  # the state as the reference keeps it (BatchedLoRDO holds E lazily within a basis)
    return params, opt


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
def test_the_batched_step_equals_the_per_parameter_step(options):
    ref_params, ref = run(LoRDO, options)
    got_params, got = run(BatchedLoRDO, options)
    for a, b in zip(ref_params, got_params):
        if a.dtype == torch.bfloat16:  # one rounding of an fp32 update that may differ in its last bits
            assert (b != a).float().mean() <= 0.01, "bf16 parameters: more than 1% of the entries differ"
            assert (b.float() - a.float()).abs().max() <= 2.0**-7 * a.float().abs().max(), "bf16 parameters"
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_params, got_params):
        sa, sb = ref.state[a], got.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert_state_close(sb[key], sa[key], key)


def test_a_state_loaded_mid_run_continues_as_the_reference_does():
    """Load a state (views replaced by copies: the stacks are rebuilt), then step on: still equal."""
    ref_params, ref = run(LoRDO, {})
    got_params, got = run(BatchedLoRDO, {})
    got.load_state_dict(copy.deepcopy(ref.state_dict()))  # (torch keeps the step tensors it is given)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        grads = [gradient(p.shape, gen) for p in ref_params]
        for params, opt in ((ref_params, ref), (got_params, got)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    got.sync_state()
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_params, got_params):
        for key in ref.state[a]:
            assert_state_close(got.state[b][key], ref.state[a][key], key)


def test_state_entries_are_views_of_one_stack_per_shape():
    """The point of the class: one [n, ...] tensor per shape, not n tensors."""
    params, opt = run(BatchedLoRDO, {}, steps=2)
    same = [p for p in params if tuple(p.shape) == (48, 32)]
    for key in ("ef", "exp_avg", "exp_avg_sq", "step"):
        ptrs = [opt.state[p][key].untyped_storage().data_ptr() for p in same]
        assert len(set(ptrs)) == 1, key
    assert all(opt.state[p]["step"].item() == 2 and opt.state[p]["step"].device.type == "cpu" for p in params)


def test_its_state_dict_loads_into_the_reference_and_back():
    params, opt = run(BatchedLoRDO, {})
    ref = LoRDO([{"params": params[:7], "rank": RANK}, {"params": params[7:]}], lr=1e-2, omega=0.9, weight_decay=0.01)
    ref.load_state_dict(opt.state_dict())
    assert ref.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_a_parameter_without_a_gradient_is_skipped_and_its_state_kept():
    """Steps where one matrix of a stack has no gradient: the others step (as the reference's do),
    its state stays as it was, and no stale stack is kept once the set of parameters changes."""
    ref_params, ref = run(LoRDO, {}, steps=3)
    got_params, got = run(BatchedLoRDO, {}, steps=3)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        grads = [gradient(p.shape, gen) for p in ref_params]
        for params, opt in ((ref_params, ref), (got_params, got)):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if (i == 1 and step < 2) else g.clone()  # matrix 1 of the (48, 32) stack
            opt.step()
    got.sync_state()
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for key in ref.state[a]:
            assert_state_close(got.state[b][key], ref.state[a][key], key)
    ef_stacks = [k for k in got._stacks if k[0] == "ef"]
    members = [set(k[1]) for k in ef_stacks]
    assert all(not (a & b) for i, a in enumerate(members) for b in members[i + 1:])  # no overlapping stacks
