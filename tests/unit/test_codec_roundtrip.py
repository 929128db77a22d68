"""Every codec judged by the value that comes back: decode(encode(x)) against x, on Gaussian and on
heavy-tailed (Student-t, 3 degrees of freedom) values. A codec that is right about its codes and
wrong about their values (the 2-bit decoder once returned a third of the value) fails here.

- gain ⟨x̂, x⟩ / ⟨x, x⟩ over the entries a codec keeps: near 1 (a decoder that shrinks or inflates
  the update changes the outer step's size);
- the error of each value within its bit width's bound."""

from __future__ import annotations

import pytest
import torch

from lordo_fed.wire.compress import CodecSpec, decode, encode


def sample(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=g)
    # Student-t(3) = N / sqrt(chi2_3 / 3), from three more normals: no torch.distributions RNG state
    z = torch.randn(4, n, generator=g)
    return z[0] / (z[1:].square().sum(0) / 3).sqrt()


def support(x: torch.Tensor, density: float = 0.03) -> torch.Tensor:
    """Where a top-k codec of chunks of 4096 keeps values: its 123 largest magnitudes per chunk."""
    idx = x.view(-1, 4096).abs().topk(round(density * 4096), dim=1).indices
    return torch.zeros(x.numel() // 4096, 4096, dtype=torch.bool).scatter_(1, idx, True).view(-1)


def gain(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x * y).sum() / (x * x).sum())


@pytest.mark.parametrize("kind", ["gauss", "t3"])
@pytest.mark.parametrize("bits,block", [(8, 64), (4, 32)])
def test_dense_quantisation_returns_the_value(kind, bits, block):
    x = sample(kind, 64 * 1024)
    y = decode(encode(x, CodecSpec("quant", bits=bits, block=block)))
    assert abs(gain(x, y) - 1) < (0.002 if bits == 8 else 0.02)
    level = {8: 127, 4: 7}[bits]
    absmax = x.view(-1, block).abs().amax(dim=1, keepdim=True)
    assert bool(((y - x).view(-1, block).abs() <= 0.5 * absmax / level * (1 + 1e-5)).all())


@pytest.mark.parametrize("kind", ["gauss", "t3"])
@pytest.mark.parametrize("bits", [0, 8, 4])
def test_topk_returns_the_kept_values(kind, bits):
    x = sample(kind, 16 * 4096)
    y = decode(encode(x, CodecSpec("topk", bits=bits, chunk=4096, density=0.03)))
    kept = support(x)
    assert int(kept.sum()) == 16 * 123 and not bool(y[~kept].any())
    g = gain(x[kept], y[kept])
    assert g == 1.0 if bits == 0 else abs(g - 1) < (0.002 if bits == 8 else 0.03)


def test_two_bit_grid_decodes_to_the_level_not_a_third_of_it():
    """The 2-bit grid's levels are ±s, ±3s with s = absmax / 3: [3, 1, −1, −3] comes back as itself."""
    x = torch.tensor([3.0, 1.0, -1.0, -3.0])
    assert torch.allclose(decode(encode(x, CodecSpec("quant", bits=2, block=4))), x)
    g = sample("gauss", 16 * 4096)
    y = decode(encode(g, CodecSpec("topk", bits=2, chunk=4096, density=0.03)))
    kept = support(g)
    assert 0.9 < gain(g[kept], y[kept]) < 1.1
    s = g.view(16, 4096).abs().amax(dim=1).repeat_interleave(123) / 3  # every kept value within one s
    assert bool(((y[kept] - g[kept]).abs() <= s * (1 + 1e-5)).all())
