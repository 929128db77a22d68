"""Whole tensors in and out of a worker whose node shards the model (FSDP2).

On a node whose ranks shard the model (docs/algorithm.md, "Nodes of several ranks") each rank holds
a chunk of every parameter and of its optimizer state (`lordo_fed.optim.sharded`), while what a
worker exchanges with the server and saves is whole, the same as a one-rank node's (so any N
resumes from it). What comes in (θ, moments, E) is cut to this rank's chunk; what goes out (Δ, the
gradient, due moments, the saved state) is gathered whole, a collective: every rank calls these
functions in the same order. On a model that is not sharded each is the plain copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from lordo_fed.device import to_host
from lordo_fed.optim import LoRDO
from lordo_fed.optim.sharded import SHARDED_STATE, chunk_of, gather, is_sharded, local


@torch.no_grad()
def set_params(params: Mapping[str, Tensor], theta: Mapping[str, Tensor]) -> None:
    """θ ← `theta` (whole host tensors by name; a sharded parameter takes its chunk)."""
    for name, p in params.items():
        local(p).copy_(chunk_of(theta[name], p))


@torch.no_grad()
def add_to_params(params: Mapping[str, Tensor], change: Callable[[str], Tensor]) -> None:
    """θ ← θ + `change(name)` for every parameter (a whole host tensor, computed one parameter at a
    time; a sharded parameter adds its chunk)."""
    for name, p in params.items():
        local(p).add_(chunk_of(change(name), p).to(device=p.device, dtype=p.dtype))


def host_params(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ as whole fp32 host tensors that own their memory (gathered when sharded)."""
    return to_host({n: gather(local(p.detach()), p) for n, p in params.items()})


def host_grads(params: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """The gradients of the parameters `names` as whole fp32 host tensors (gathered when sharded)."""
    return to_host({n: gather(local(params[n].grad), params[n]) for n in names})


def chunk_state(whole: Tensor, param: Tensor, optimizer: torch.optim.Optimizer) -> Tensor:
    """This rank's chunk of a state tensor of `param` (`whole` when not sharded): a plain tensor
    for LoRDO, a DTensor for torch's own optimizers (AdamW keeps DTensor state)."""
    return chunk_of(whole, param, as_dtensor=not isinstance(optimizer, LoRDO))


def optimizer_state_dict(optimizer: torch.optim.Optimizer, sd: dict, cut: bool) -> dict:
    """A torch optimizer state dict of `optimizer` with the chunked entries (`SHARDED_STATE`) of
    sharded parameters gathered whole (`cut` False: what is saved) or cut to this rank's chunk
    (`cut` True: what is loaded); the same dict when no parameter is sharded."""
    groups = optimizer.param_groups
    if not any(is_sharded(p) for g in groups for p in g["params"]):
        return sd
    param_of = {pid: p for saved, g in zip(sd["param_groups"], groups) for pid, p in zip(saved["params"], g["params"])}
    state = {pid: {k: (chunk_state(v, param_of[pid], optimizer) if cut else gather(v, param_of[pid]))
                   if k in SHARDED_STATE else v
                   for k, v in st.items()} for pid, st in sd["state"].items()}
    return {**sd, "state": state}
