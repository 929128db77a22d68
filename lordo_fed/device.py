"""Where tensors live and at what precision the forward pass runs.

CUDA when present (bf16 autocast, fp32 master weights and optimizer states), CPU otherwise.
On CPU we flush denormals: without it the backward matmuls of a small transformer run ~20x
slower on the 2-core CPUs this project is tested on.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def pick_device(preference: str = "auto") -> torch.device:
    """Resolve a device preference ('auto', 'cpu', 'cuda', 'cuda:N') to a torch.device."""
    if preference not in DEVICE_CHOICES and not preference.startswith("cuda:"):
        raise ValueError(f"device={preference!r}: expected one of {DEVICE_CHOICES} or 'cuda:N'")
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={preference!r}: CUDA is not available on this machine")
    device = torch.device(preference)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    return device


def autocast(device: torch.device, enabled: bool = True) -> ContextManager:
    """bf16 autocast on CUDA; a no-op elsewhere (CPU bf16 matmuls are slower than fp32 here)."""
    if enabled and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of `tensors` that own their memory (what crosses the wire or is kept).

    From a GPU: one device-to-host copy per tensor into pinned memory (torch's caching host
    allocator reuses the blocks round after round), issued non-blocking and drained by one
    synchronize at the end, instead of a blocking copy from pageable memory per tensor. On the
    CPU: one clone (no second copy).
    """
    out: dict[str, torch.Tensor] = {}
    cuda = False
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type == "cuda":
            buf = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
            buf.copy_(t, non_blocking=True)  # casts to fp32 on the way
            out[name], cuda = buf, True
        else:
            out[name] = t.to(torch.float32, copy=True)
    if cuda:
        torch.cuda.synchronize()
    return out
