"""LoRDO's state on parameters that FSDP2 (`fully_shard`) shards across a node's ranks.

FSDP2 makes every parameter a DTensor of which each rank holds one chunk along a dimension d. The
LoRDO step (`lordo.py`) is local to a chunk when d is the dimension its low-rank coordinates keep:
the rows of a tall matrix (a right projection: coordinates G Bᵀ are p×r, one row per row of G) and
the columns of a wide one (a left projection: Bᵀ G is r×q). The basis B, r×q or p×r, spans the
other dimension, is replicated on every rank, and then

    proj(G)[chunk] = proj(G[chunk]),   back(c)[chunk] = back(c[chunk]),

so projection, error feedback, moments, back-projection, the full-rank term and weight decay all
run on the chunk, with the same B on every rank, and every per-parameter tensor of the state
(E, both moments, the full-rank parameters' moments) is chunked along the same d as its parameter.
Two things are not local and take a collective of the node's group:
- the QH normaliser s = mean(d) over a matrix's whole coordinates: a sum per matrix, all-reduced;
- a LoRDO-Local refit (every `proj_interval` steps) fits B to the whole error-fed gradient V: it is
  gathered, and every rank fits the same B from it with the same seed.
`shard_placement` is the placement rule to give `fully_shard`; `check_placement` refuses others.
A plain tensor (no FSDP2) passes through every function here unchanged.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from lordo_fed.optim.projection import projection_side

_DTENSOR_MODULE = "torch.distributed.tensor"


def _dtensor() -> type | None:
    """The DTensor class if torch's DTensor module is loaded, else None: no DTensor can exist
    before it is (FSDP2 imports it). Importing it here would add ~0.6 s to every process that
    imports the optimizer (a ClientApp per message, a node worker), sharded or not."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return None if module is None else module.DTensor


def _dtensor_api():
    """(DTensor, Shard), importing them: for code that handles a DTensor, or makes one."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor, Shard

SHARDED_STATE = ("exp_avg", "exp_avg_sq", "ef")
"""Optimizer-state keys chunked like their parameter (the rest, `step` and `proj`, are replicated)."""


def shard_placement(param: Tensor):
    """Where FSDP2 cuts `param` (`fully_shard(shard_placement_fn=...)`, a `Shard`): a matrix along
    the dimension its low-rank coordinates keep (rows if tall, columns if wide); anything else along 0."""
    _, Shard = _dtensor_api()
    if param.ndim == 2 and projection_side(param.shape) == "left":
        return Shard(1)
    return Shard(0)


def is_sharded(t: Tensor) -> bool:
    """Whether `t` is a DTensor (a parameter, or a gradient, of a sharded module)."""
    cls = _dtensor()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """This rank's chunk of `t` (a view: writes reach the parameter), or `t` itself."""
    return t.to_local() if is_sharded(t) else t


def shard_dim(param: Tensor) -> int | None:
    """d, the dimension `param` is chunked along (None: not sharded)."""
    if not is_sharded(param):
        return None
    _, Shard = _dtensor_api()
    (placement,) = param.placements
    return placement.dim if isinstance(placement, Shard) else None


def check_placement(param: Tensor, low_rank: bool) -> None:
    """Refuse a sharded parameter whose chunks the LoRDO step cannot run on alone: a mesh of more
    than one dimension, or a low-rank matrix cut along the dimension its basis spans."""
    if not is_sharded(param):
        return
    if param.device_mesh.ndim != 1 or len(param.placements) != 1:
        raise ValueError(f"LoRDO on a DTensor of placements {param.placements}: expected one mesh dimension "
                         "(FSDP2 inside a node)")
    if low_rank:
        expected = shard_placement(param).dim
        if shard_dim(param) != expected:
            raise ValueError(
                f"LoRDO on a {tuple(param.shape)} matrix sharded as {param.placements}: expected Shard({expected}), "
                "the dimension its low-rank coordinates keep (fully_shard(..., shard_placement_fn=shard_placement))")


def _group(param: Tensor) -> dist.ProcessGroup:
    return param.device_mesh.get_group()


def coords_mean(denom: Tensor, param: Tensor) -> Tensor:
    """The mean of a matrix's low-rank `denom` over all its coordinates (the QH normaliser's
    mean(d)): `denom` of one matrix, or a [n, a, b] stack (then one mean per matrix, [n, 1, 1]),
    each chunked as `param`. One all-reduce of n sums when sharded; no host sync."""
    stacked = denom.ndim == 3
    dims = (1, 2) if stacked else (0, 1)
    if not is_sharded(param):
        return denom.mean(dim=dims, keepdim=True) if stacked else denom.mean()
    total = denom.sum(dim=dims, keepdim=stacked)
    dist.all_reduce(total, group=_group(param))
    d = shard_dim(param)
    shape = denom.shape[1:] if stacked else denom.shape
    others = math.prod(n for i, n in enumerate(shape) if i != d)  # the dimensions not cut: alike on every rank
    return total / (others * param.shape[d])


def gather(chunk: Tensor, param: Tensor) -> Tensor:
    """The whole tensor of which `chunk` is this rank's part, cut along `param`'s d (a state tensor
    of `param`, or `param`'s own chunk; or a DTensor, as torch's optimizers keep their state of a
    DTensor parameter), on every rank; `chunk` itself when not sharded."""
    if is_sharded(chunk):
        return chunk.full_tensor()
    d = shard_dim(param)
    if d is None:
        return chunk
    DTensor, Shard = _dtensor_api()
    shape = list(chunk.shape)
    shape[d] = param.shape[d]
    whole = DTensor.from_local(chunk, param.device_mesh, [Shard(d)], run_check=False, shape=torch.Size(shape),
                               stride=torch.empty(shape, device="meta").stride())
    return whole.full_tensor()


def chunk_of(whole: Tensor, param: Tensor, as_dtensor: bool = False) -> Tensor:
    """This rank's part of `whole` (shaped like `param`, or a state tensor of it), cut as FSDP2 cuts
    `param` (torch.chunk along d; the last ranks' chunks may be short or empty), as a DTensor if
    `as_dtensor` (the state of torch's own optimizers, e.g. DiLoCo's AdamW); `whole` itself when
    not sharded."""
    d = shard_dim(param)
    if d is None:
        return whole
    if as_dtensor:
        DTensor, Shard = _dtensor_api()
        return DTensor.from_local(chunk_of(whole, param), param.device_mesh, [Shard(d)], run_check=False,
                                  shape=whole.shape, stride=whole.stride())
    mesh = param.device_mesh
    chunks = list(torch.chunk(whole, mesh.size(), dim=d))
    rank = mesh.get_local_rank()
    if rank < len(chunks):
        return chunks[rank]
    shape = list(whole.shape)
    shape[d] = 0
    return whole.new_empty(shape)
