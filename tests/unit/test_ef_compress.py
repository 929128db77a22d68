"""The compressed error-feedback buffer (lordo_fed.optim.ef_compress; MicroAdam-style top-k with
int8 values): what it keeps, what it costs, what it drops, and that LoRDO runs and resumes on it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lordo_fed.metrics import optimizer_state_bytes
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.optim import LoRDO
from lordo_fed.optim.config import InnerConfig
from lordo_fed.optim.ef_compress import compress, compression_error, decompress, kept_entries
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.optim.projection import get_projection_method, projection_side
from lordo_fed.rounds.config import RoundConfig


def test_it_keeps_the_largest_entries_to_int8_precision():
    torch.manual_seed(0)
    e = torch.randn(3, 40, 24)  # a stack of three buffers
    c = compress(e, density=0.1)
    k = kept_entries(e.shape, 0.1)
    assert k == 96 and c["ef_idx"].shape == (3, k) and c["ef_val"].dtype == torch.int8
    dense = decompress(c, e.shape)
    for i in range(3):
        top = e[i].flatten().abs().topk(k).indices
        assert set(c["ef_idx"][i].tolist()) == set(top.tolist())
        kept = dense[i].flatten()[top]
        # int8 against the largest kept magnitude: each value within half a step
        assert (kept - e[i].flatten()[top]).abs().max() <= c["ef_scale"][i] / 2 + 1e-7
        assert torch.count_nonzero(dense[i]) <= k
    # what it drops, measured: the share of ||E||^2 outside the kept entries (plus rounding)
    err = compression_error(e[0], compress(e[0], 0.1))
    dropped = 1 - e[0].flatten().abs().topk(k).values.square().sum() / e[0].square().sum()
    assert err == pytest.approx(float(dropped), abs=2e-3)
    assert float(compression_error(e[0], compress(e[0], 1.0))) < 1e-4  # density 1: only int8 rounding


def test_a_zero_buffer_stays_zero():
    c = compress(torch.zeros(8, 6), 0.5)
    assert float(c["ef_scale"]) == 0 and torch.count_nonzero(decompress(c, (8, 6))) == 0


def lordo(density: float, params):
    opt = LoRDO([{"params": params, "rank": 4}], lr=1e-2, omega=0.9, ef_density=density)
    method = get_projection_method("svd")
    for i, p in enumerate(params):
        opt.set_projection(p, method.fit(torch.randn(p.shape), 4, projection_side(p.shape), seed=i))
    return opt


def test_its_state_is_small_and_survives_a_state_dict_round_trip():
    torch.manual_seed(0)
    shapes = [(64, 32), (32, 96)]
    dense_p = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    packed_p = [torch.nn.Parameter(p.detach().clone()) for p in dense_p]
    dense, packed = lordo(1.0, dense_p), lordo(1 / 32, packed_p)
    for _ in range(3):
        for a, b in zip(dense_p, packed_p):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        dense.step()
        packed.step()
    st = packed.state[packed_p[0]]
    assert "ef" not in st and {"ef_idx", "ef_val", "ef_scale"} <= set(st)
    ef_dense = sum(4 * p.numel() for p in dense_p)
    ef_packed = sum(5 * kept_entries(p.shape, 1 / 32) + 4 for p in packed_p)
    assert optimizer_state_bytes(dense) - optimizer_state_bytes(packed) == ef_dense - ef_packed
    # a resumed optimizer holds the same buffer, dtypes included (torch's load would cast int8)
    again = lordo(1 / 32, packed_p)
    again.load_state_dict(packed.state_dict())
    for key in ("ef_idx", "ef_val", "ef_scale"):
        assert again.state[packed_p[0]][key].dtype == st[key].dtype
        assert torch.equal(again.state[packed_p[0]][key], st[key])


def test_averaging_a_compressed_buffer_across_workers_is_refused():
    inner = InnerConfig(ef_density=0.05)
    with pytest.raises(ValueError, match=r"sync_ef=True with inner.ef_density=0.05"):
        resolve_method("lordo_global", inner, dataclasses.replace(RoundConfig(), sync_ef=True), OuterConfig())
    resolve_method("lordo_global", inner, RoundConfig(), OuterConfig())  # without sync_ef: fine
