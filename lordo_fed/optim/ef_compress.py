"""A compressed error-feedback buffer: the top-k entries of E, values in int8 (after MicroAdam).

MicroAdam (Modoranu et al. 2024, "MicroAdam: Accurate Adaptive Optimization with Low Space
Overhead and Provable Convergence") keeps its error-feedback buffer compressed instead of full
size. Here, with density ρ, a p×q buffer keeps its k = ⌈ρ·pq⌉ largest-magnitude entries: their
flat indices (int32), their values quantised to int8 against the largest kept magnitude, and
that one fp32 scale: 5k + 4 bytes instead of 4pq (fp32) or 2pq (bf16); ρ = 1/32 is 0.04x the
fp32 buffer. What compression drops, E − C(E), is not fed back: it is the buffer's own error,
and `compression_error` measures it (the share of ‖E‖² lost) for the diagnostics.

Tensors may carry leading batch dimensions ([..., p, q] → [..., k]): the batched step compresses
a stack of same-shaped buffers with the same calls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

EF_KEYS = ("ef_idx", "ef_val", "ef_scale")
"""The optimizer-state keys of a compressed buffer (a dense one is `ef`)."""


def kept_entries(shape: tuple[int, ...] | torch.Size, density: float) -> int:
    """k = ⌈density · p · q⌉ (at least 1) for a p×q buffer."""
    return max(1, math.ceil(density * shape[-2] * shape[-1]))


def empty_compressed(shape: tuple[int, ...] | torch.Size, density: float, device: torch.device | str
                     ) -> dict[str, Tensor]:
    """A compressed buffer that stands for E = 0."""
    k = kept_entries(shape, density)
    lead = tuple(shape[:-2])
    return {"ef_idx": torch.arange(k, dtype=torch.int32, device=device).expand(*lead, k).clone(),
            "ef_val": torch.zeros(*lead, k, dtype=torch.int8, device=device),
            "ef_scale": torch.zeros(*lead, 1, dtype=torch.float32, device=device)}


@torch.no_grad()
def compress(e: Tensor, density: float) -> dict[str, Tensor]:
    """C(E): the top-k entries by magnitude of each [p, q] matrix, int8 values, one scale each."""
    flat = e.float().flatten(-2)
    k = kept_entries(e.shape, density)
    mags, idx = torch.topk(flat.abs(), k, dim=-1, sorted=False)
    kept = torch.gather(flat, -1, idx)
    scale = mags.amax(dim=-1, keepdim=True) / 127.0
    val = torch.round(kept / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return {"ef_idx": idx.to(torch.int32), "ef_val": val, "ef_scale": scale}


def values(state: dict[str, Tensor]) -> Tensor:
    """The kept entries' fp32 values."""
    return state["ef_val"].float() * state["ef_scale"]


def ef_values(state: dict[str, Tensor]) -> Tensor:
    """The stored buffer's non-zero values in fp32, dense or compressed (for norms)."""
    return state["ef"].float() if "ef" in state else values(state)


@torch.no_grad()
def add_decompressed(out: Tensor, state: dict[str, Tensor], alpha: float = 1.0) -> Tensor:
    """out += alpha · C(E), in place on a [..., p, q] fp32 tensor (indices are distinct)."""
    flat = out.view(*out.shape[:-2], -1)
    flat.scatter_add_(-1, state["ef_idx"].long(), values(state).mul_(alpha))
    return out


def decompress(state: dict[str, Tensor], shape: tuple[int, ...] | torch.Size) -> Tensor:
    """C(E) as a dense fp32 [..., p, q] tensor."""
    out = torch.zeros(shape, dtype=torch.float32, device=state["ef_val"].device)
    return add_decompressed(out, state)


def compression_error(e: Tensor, state: dict[str, Tensor]) -> Tensor:
    """‖E − C(E)‖² / ‖E‖²: the share of the buffer's energy compression drops (a device scalar)."""
    total = e.float().square().sum()
    return (e.float() - decompress(state, e.shape)).square().sum() / total.clamp_min(1e-30)
