"""Outer optimizers: hand-computed rounds, equivalence with torch SGD, state round-trip, errors.

The hand-computed tests use lr/beta/nu/momentum = 0.5 and inputs that are sums of powers of two,
so every intermediate value is exact in fp32 and the expected values can be compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from lordo_fed.rounds.outer import (
    QHM,
    Average,
    Nesterov,
    OuterConfig,
    OuterOptimizer,
    build_outer_optimizer,
)


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def initial_params() -> dict[str, torch.Tensor]:
    return {"w": t(1.0, 2.0), "b": t([-1.0])}


# three rounds of averaged pseudo-gradients Δ̄
DELTAS = [
    {"w": t(0.5, -1.0), "b": t([2.0])},
    {"w": t(1.0, 1.0), "b": t([-2.0])},
    {"w": t(-0.5, 0.25), "b": t([0.0])},
]


def run_rounds(opt: OuterOptimizer) -> list[dict[str, torch.Tensor]]:
    params = initial_params()
    history = []
    for delta in DELTAS:
        opt.step(params, delta)
        history.append({k: v.clone() for k, v in params.items()})
    return history


def assert_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=0, atol=0, msg=f"key {k}")


# -----------------------------------------------------------------------------
# hand-computed rounds


def test_average_three_rounds_by_hand():
    # θ ← θ − 0.5 Δ̄
    history = run_rounds(Average(lr=0.5))
    # r1: w = [1 - 0.25, 2 + 0.5];      b = -1 - 1
    assert_exact(history[0], {"w": t(0.75, 2.5), "b": t([-2.0])})
    # r2: w = [0.75 - 0.5, 2.5 - 0.5];  b = -2 + 1
    assert_exact(history[1], {"w": t(0.25, 2.0), "b": t([-1.0])})
    # r3: w = [0.25 + 0.25, 2 - 0.125]; b = -1 - 0
    assert_exact(history[2], {"w": t(0.5, 1.875), "b": t([-1.0])})


def test_average_lr1_is_model_averaging():
    ref = {"w": t(1.0, 2.0, 3.0)}
    workers = [t(0.0, 2.0, 5.0), t(2.0, 4.0, 7.0)]  # mean = [1, 3, 6]
    delta = {"w": ref["w"] - (workers[0] + workers[1]) / 2}  # [0, -1, -3]
    Average().step(ref, delta)
    assert_exact(ref, {"w": t(1.0, 3.0, 6.0)})


def test_qhm_three_rounds_by_hand():
    # m ← 0.5 m + 0.5 Δ̄ ; θ ← θ − 0.5 (0.5 Δ̄ + 0.5 m)
    opt = QHM(lr=0.5, beta=0.5, nu=0.5)
    history = run_rounds(opt)
    # r1: m_w = [0.25, -0.5]; u_w = [0.25 + 0.125, -0.5 - 0.25] = [0.375, -0.75]
    #     w = [1 - 0.1875, 2 + 0.375]
    #     m_b = 1.0; u_b = 1.0 + 0.5 = 1.5; b = -1 - 0.75
    assert_exact(history[0], {"w": t(0.8125, 2.375), "b": t([-1.75])})
    # r2: m_w = [0.125 + 0.5, -0.25 + 0.5] = [0.625, 0.25]
    #     u_w = [0.5 + 0.3125, 0.5 + 0.125] = [0.8125, 0.625]; w = [0.8125 - 0.40625, 2.375 - 0.3125]
    #     m_b = 0.5 - 1 = -0.5; u_b = -1 - 0.25 = -1.25; b = -1.75 + 0.625
    assert_exact(history[1], {"w": t(0.40625, 2.0625), "b": t([-1.125])})
    # r3: m_w = [0.3125 - 0.25, 0.125 + 0.125] = [0.0625, 0.25]
    #     u_w = [-0.25 + 0.03125, 0.125 + 0.125] = [-0.21875, 0.25]; w = [0.40625 + 0.109375, 2.0625 - 0.125]
    #     m_b = -0.25 + 0 = -0.25; u_b = 0 - 0.125 = -0.125; b = -1.125 + 0.0625
    assert_exact(history[2], {"w": t(0.515625, 1.9375), "b": t([-1.0625])})
    assert_exact(opt.state_dict(), {"momentum.w": t(0.0625, 0.25), "momentum.b": t([-0.25])})


def test_nesterov_three_rounds_by_hand():
    # b ← 0.5 b + Δ̄ ; θ ← θ − 0.5 (Δ̄ + 0.5 b)
    opt = Nesterov(lr=0.5, momentum=0.5)
    history = run_rounds(opt)
    # r1: buf_w = [0.5, -1]; u_w = [0.5 + 0.25, -1 - 0.5] = [0.75, -1.5]; w = [1 - 0.375, 2 + 0.75]
    #     buf_b = 2; u_b = 2 + 1 = 3; b = -1 - 1.5
    assert_exact(history[0], {"w": t(0.625, 2.75), "b": t([-2.5])})
    # r2: buf_w = [0.25 + 1, -0.5 + 1] = [1.25, 0.5]; u_w = [1 + 0.625, 1 + 0.25] = [1.625, 1.25]
    #     w = [0.625 - 0.8125, 2.75 - 0.625]
    #     buf_b = 1 - 2 = -1; u_b = -2 - 0.5 = -2.5; b = -2.5 + 1.25
    assert_exact(history[1], {"w": t(-0.1875, 2.125), "b": t([-1.25])})
    # r3: buf_w = [0.625 - 0.5, 0.25 + 0.25] = [0.125, 0.5]; u_w = [-0.5 + 0.0625, 0.25 + 0.25] = [-0.4375, 0.5]
    #     w = [-0.1875 + 0.21875, 2.125 - 0.25]
    #     buf_b = -0.5 + 0 = -0.5; u_b = 0 - 0.25 = -0.25; b = -1.25 + 0.125
    assert_exact(history[2], {"w": t(0.03125, 1.875), "b": t([-1.125])})
    assert_exact(opt.state_dict(), {"momentum_buffer.w": t(0.125, 0.5), "momentum_buffer.b": t([-0.5])})


# -----------------------------------------------------------------------------
# equivalences


# torch SGD refuses nesterov=True with momentum 0, so no μ = 0 case here
@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.1)])
def test_nesterov_matches_torch_sgd(lr, momentum):
    gen = torch.Generator().manual_seed(0)
    shapes = {"emb": (5, 3), "w": (3, 4), "bias": (4,)}
    init = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    deltas = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(5)]

    ours = {k: v.clone() for k, v in init.items()}
    opt = Nesterov(lr=lr, momentum=momentum)

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=lr, momentum=momentum, nesterov=True, dampening=0.0)

    for delta in deltas:
        opt.step(ours, delta)
        for k, p in ref.items():
            p.grad = delta[k].clone()
        sgd.step()
        for k in shapes:
            torch.testing.assert_close(ours[k], ref[k].detach())


def test_qhm_nu0_lr1_equals_average():
    gen = torch.Generator().manual_seed(1)
    a = {"x": torch.randn(4, 4, generator=gen), "y": torch.randn(7, generator=gen)}
    q = {k: v.clone() for k, v in a.items()}
    avg, qhm = Average(lr=1.0), QHM(lr=1.0, beta=0.9, nu=0.0)
    for _ in range(4):
        delta = {k: torch.randn(v.shape, generator=gen) for k, v in a.items()}
        avg.step(a, delta)
        qhm.step(q, delta)
        assert_exact(q, a)


def test_step_is_in_place_and_leaves_delta_alone():
    params = initial_params()
    w_storage = params["w"].data_ptr()
    delta = {k: v.clone() for k, v in DELTAS[0].items()}
    QHM(lr=0.5, beta=0.5, nu=0.5).step(params, delta)
    assert params["w"].data_ptr() == w_storage
    assert_exact(delta, DELTAS[0])


def test_step_works_on_parameters_that_require_grad():
    w = torch.nn.Parameter(t(1.0, 2.0))
    Nesterov(lr=0.5, momentum=0.5).step({"w": w}, {"w": t(0.5, -1.0)})
    assert_exact({"w": w.detach()}, {"w": t(0.625, 2.75)})


# -----------------------------------------------------------------------------
# state dict


@pytest.mark.parametrize(
    "make", [lambda: QHM(lr=0.8, beta=0.7, nu=0.6), lambda: Nesterov(lr=0.7, momentum=0.9), lambda: Average(0.9)]
)
def test_state_dict_round_trip_through_safetensors(make, tmp_path):
    gen = torch.Generator().manual_seed(2)
    shapes = {"layers.0.weight": (3, 5), "layers.0.bias": (5,)}
    deltas = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(5)]
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}

    opt = make()
    for delta in deltas[:2]:
        opt.step(params, delta)

    path = tmp_path / "outer.safetensors"
    save_file(opt.state_dict(), str(path))
    resumed_opt = make()
    resumed_opt.load_state_dict(load_file(str(path)))
    resumed = {k: v.clone() for k, v in params.items()}

    for delta in deltas[2:]:
        opt.step(params, delta)
        resumed_opt.step(resumed, delta)
        assert_exact(resumed, params)
    assert_exact(resumed_opt.state_dict(), opt.state_dict())


def test_state_dict_is_a_copy():
    opt = QHM(lr=1.0, beta=0.5, nu=0.5)
    params = initial_params()
    opt.step(params, DELTAS[0])
    sd = opt.state_dict()
    opt.step(params, DELTAS[1])
    assert_exact(sd, {"momentum.w": t(0.25, -0.5), "momentum.b": t([1.0])})


def test_state_dict_empty_before_first_step():
    assert QHM().state_dict() == {}
    assert Nesterov().state_dict() == {}
    assert Average().state_dict() == {}


# -----------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Average(lr=0.0), r"lr=0\.0.*> 0"),
        (lambda: Average(lr=-1.0), r"lr=-1\.0.*> 0"),
        (lambda: QHM(lr=math.nan), r"lr=nan.*finite"),
        (lambda: QHM(beta=1.5), r"beta=1\.5.*\[0, 1\]"),
        (lambda: QHM(nu=-0.1), r"nu=-0\.1.*\[0, 1\]"),
        (lambda: Nesterov(momentum=2.0), r"momentum=2\.0.*\[0, 1\]"),
        (lambda: Nesterov(lr=0), r"lr=0.*> 0"),
    ],
)
def test_bad_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "cfg,match",
    [
        (OuterConfig(name="adam"), r"name='adam'.*\['average', 'qhm', 'nesterov', 'mla'\]"),
        (OuterConfig(name="qhm", lr=0.0), r"lr=0\.0.*> 0"),
        (OuterConfig(name="qhm", beta=-0.5), r"beta=-0\.5.*\[0, 1\]"),
        (OuterConfig(name="qhm", nu=1.01), r"nu=1\.01.*\[0, 1\]"),
        (OuterConfig(name="nesterov", momentum=1.2), r"momentum=1\.2.*\[0, 1\]"),
        (OuterConfig(name="average", momentum=-1.0), r"momentum=-1\.0"),  # unused fields checked too
    ],
)
def test_build_rejects_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_outer_optimizer(cfg)


def test_build_outer_optimizer():
    avg = build_outer_optimizer(OuterConfig())
    assert isinstance(avg, Average) and avg.lr == 1.0 and avg.name == "average"
    qhm = build_outer_optimizer(OuterConfig(name="qhm", lr=0.5, beta=0.8, nu=0.3))
    assert isinstance(qhm, QHM) and (qhm.lr, qhm.beta, qhm.nu) == (0.5, 0.8, 0.3)
    nes = build_outer_optimizer(OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    assert isinstance(nes, Nesterov) and (nes.lr, nes.momentum) == (0.7, 0.9)
    assert nes.name == "nesterov" and qhm.name == "qhm"


def test_outer_config_fields_have_docstrings():
    import inspect

    import lordo_fed.rounds.outer as outer

    src = inspect.getsource(outer.OuterConfig)
    for field in ("name", "lr", "beta", "nu", "momentum"):
        assert f'{field}: ' in src
    assert src.count('"""') >= 2 * 6  # class docstring + one per field


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        OuterOptimizer()  # type: ignore[abstract]


@pytest.mark.parametrize("make", [Average, QHM, Nesterov])
def test_mismatched_keys_are_listed(make):
    params = {"a": t(1.0), "b": t(2.0)}
    with pytest.raises(ValueError, match=r"missing from delta \['b'\], extra in delta \['c'\]"):
        make().step(params, {"a": t(0.0), "c": t(0.0)})
    assert_exact(params, {"a": t(1.0), "b": t(2.0)})  # nothing was touched


def test_mismatched_shapes():
    with pytest.raises(ValueError, match=r"delta\['w'\] has shape \(3,\), params\['w'\] has shape \(2,\)"):
        Average().step({"w": t(1.0, 2.0)}, {"w": t(1.0, 2.0, 3.0)})


def test_state_for_other_params_rejected_at_step():
    opt = QHM()
    opt.step({"a": t(1.0)}, {"a": t(1.0)})
    with pytest.raises(ValueError, match=r"no state for \['b'\], state for unknown params \['a'\]"):
        opt.step({"b": t(1.0)}, {"b": t(1.0)})


def test_load_state_dict_errors():
    opt = Nesterov()
    with pytest.raises(ValueError, match=r"'momentum_buffer\.<param name>'.*\['momentum\.w'\]"):
        opt.load_state_dict({"momentum.w": t(1.0)})  # a QHM state given to Nesterov
    with pytest.raises(ValueError, match=r"state_dict\['momentum_buffer\.w'\] is a float"):
        opt.load_state_dict({"momentum_buffer.w": 1.0})  # type: ignore[dict-item]

    opt.step({"w": t(1.0, 2.0)}, {"w": t(1.0, 1.0)})
    with pytest.raises(ValueError, match=r"missing \['momentum_buffer\.w'\], unexpected \['momentum_buffer\.v'\]"):
        opt.load_state_dict({"momentum_buffer.v": t(1.0, 2.0)})
    with pytest.raises(ValueError, match=r"state_dict\['momentum_buffer\.w'\] has shape \(3,\), expected \(2,\)"):
        opt.load_state_dict({"momentum_buffer.w": t(1.0, 2.0, 3.0)})

    with pytest.raises(ValueError, match=r"average is stateless.*\['momentum\.w'\]"):
        Average().load_state_dict({"momentum.w": t(1.0)})
    Average().load_state_dict({})  # an empty state is fine


def test_loaded_state_checked_against_params_at_step():
    opt = QHM()
    opt.load_state_dict({"momentum.w": t(1.0, 2.0, 3.0)})
    with pytest.raises(ValueError, match=r"momentum\.w has shape \(3,\), params\['w'\] has shape \(2,\)"):
        opt.step({"w": t(1.0, 2.0)}, {"w": t(0.0, 0.0)})
