"""A node of N local ranks: data parallelism inside a node, one LoRDO worker across nodes.

A site is often a machine of several GPUs on a fast interconnect, where an all-reduce every step
is cheap; the WAN between sites is where LoRDO saves. So a node runs as N processes of one
`torch.distributed` group (`torchrun --nproc-per-node N`; NCCL on CUDA, gloo on CPU) that train as
a single worker whose batch is N times a rank's (the two-level scheme of torchft's replica groups
and of the authors' training code; docs/algorithm.md, "Nodes of several ranks"):

- every local step, rank i takes rows [i·B, (i+1)·B) of the node's batch of N·B windows, and the
  gradients are averaged across the ranks (the intra-node wrapper), so the node steps on the
  gradient of the whole node batch;
- the intra-node wrapper is a setting (`WRAPPERS`):
  - "ddp" (PyTorch DDP): every rank holds θ, the low-rank moments and the error-feedback buffer
    whole; everything after the all-reduced gradient is replicated (the same clipping, the same
    LoRDO step with the same projections and seeds), so they stay identical without being sent;
  - "fsdp" (FSDP2 `fully_shard`, for a model whose θ, E and gradients do not fit one device):
    each rank holds a 1/N chunk of every parameter, of its gradient (reduce-scattered) and of its
    optimizer state, cut along the dimension the low-rank coordinates keep, so LoRDO's step runs
    on the chunk with the basis every rank holds whole (`lordo_fed.optim.sharded`);
- only the lead rank (0) speaks on the WAN: it receives the round's state and hands it to the
  others over the group (`broadcast_bytes`), and it alone encodes, uploads and saves the node's
  state. With "fsdp" the ranks gather Δ, the due moments and the state to save whole (the lead's
  copy: one file per node, the same as a one-rank node's, so any N resumes from it) and cut what
  comes in to their chunks. The server sees one reply per node, weighted by its N·B·T tokens.

A node of one rank has no `LocalRanks` at all: the code paths are today's.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lordo_fed.wire.decode import adoptable

WRAPPERS = ("ddp", "fsdp")
"""Intra-node wrappers: PyTorch DDP (state replicated on every rank) and FSDP2 `fully_shard`
(θ, gradients and optimizer state sharded across the ranks; the bases replicated)."""


@dataclass
class LocalRanks:
    """This process's place in its node: rank, number of ranks, the intra-node wrapper."""

    rank: int
    """This process's rank inside the node (0 = the lead, which talks to the server)."""
    world: int
    """N: the node's ranks."""
    wrapper: str = "ddp"
    """How gradients are shared inside the node (`WRAPPERS`)."""
    control: object = field(default=None, repr=False)
    """The group the lead hands jobs and states on (gloo, host memory), apart from the gradients'
    group: a node worker's early steps (`overlap-delay`) all-reduce on a thread while the lead hands
    on the next job, and collectives of one group must not interleave across threads."""
    _wrapped: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"intra-node wrapper {self.wrapper!r}: expected one of {WRAPPERS}")
        if not (isinstance(self.world, int) and self.world >= 1 and 0 <= self.rank < self.world):
            raise ValueError(f"local ranks: rank={self.rank!r} of world={self.world!r}: expected 0 <= rank < world")

    @property
    def lead(self) -> bool:
        """Whether this rank talks to the server (downloads, uploads, saves)."""
        return self.rank == 0

    @classmethod
    def from_environment(cls, wrapper: str = "ddp", timeout: float = 1800.0) -> "LocalRanks | None":
        """The node's ranks as `torchrun` describes them (RANK, WORLD_SIZE and the rendezvous in the
        environment): joins the process group (NCCL when this rank has a CUDA device, else gloo;
        a collective that waits `timeout` seconds for a dead rank fails) and returns this rank's
        place; None for a node of one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not dist.is_initialized():
            return None
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        return cls(dist.get_rank(), dist.get_world_size(), wrapper, control)

    # ----------------------------------------------------------------------------- training
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module local steps run forward through. DDP averages the gradients across the ranks
        in its backward hooks (bucketed, overlapping the backward pass), and makes every rank start
        from rank 0's parameters. FSDP2 shards `model` in place (its parameters become DTensors:
        wrap before an optimizer takes them) and returns it. One wrapper per model (a node's
        workers share its model: a second wrapper would hook the same gradients twice)."""
        if self.wrapper == "fsdp":
            return self._fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel

        wrapped = self._wrapped.get(id(model))
        if wrapped is None or wrapped.module is not model:
            device = next(model.parameters()).device
            # the model's buffers are constants (RoPE tables): synced once at init, not before every forward
            # (torch 2.13 spells it forward_sync_buffers; older releases, e.g. a GPU image's 2.11, broadcast_buffers)
            import inspect

            no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel)
                       .parameters else "broadcast_buffers")
            wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              **{no_sync: False})
            self._wrapped = {id(model): wrapped}  # one model per process (the runtime's): drop older ones
        return wrapped

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over the node's ranks: each transformer block a unit of its own (its parameters
        gathered for its forward and backward only, its gradients reduce-scattered as the backward
        pass leaves it), then the rest (embedding, final norm) at the root; every parameter cut as
        `sharded.shard_placement` says. The ranks start from rank 0's θ (FSDP2 does not broadcast)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from lordo_fed.optim.sharded import shard_placement

        if isinstance(model, FSDPModule):
            return model
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (self.world,))
        blocks = getattr(model, "layers", None)
        for block in blocks if isinstance(blocks, nn.ModuleList) else []:
            fully_shard(block, mesh=mesh, shard_placement_fn=shard_placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=shard_placement)
        return model

    def rows(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """This rank's rows of the node's batch (x, y of N·B windows): rows [rank·B, (rank+1)·B)."""
        x, y = batch
        per_rank = x.shape[0] // self.world
        sl = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return x[sl], y[sl]

    def mean(self, t: Tensor) -> Tensor:
        """The mean of `t` over the node's ranks (one all-reduce; gloo has no AVG)."""
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world

    # ----------------------------------------------------------------------------- the lead's voice
    def broadcast_bytes(self, data: bytes | bytearray | memoryview | None) -> bytearray | memoryview:
        """The lead's `data` on every rank (the others pass None), on the control group: a job, or
        the encoded state of the round, sent once over the WAN to the lead and handed on inside
        the node. The lead gets its own bytes back (as a bytearray)."""
        size = torch.tensor([len(data) if self.lead else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        if not self.lead:
            buf = bytearray(int(size.item()))
        elif adoptable(data):
            buf = data  # the lead's own writable buffer (a download): sent from where it is
        else:
            buf = bytearray(data)
        if len(buf):
            dist.broadcast(torch.frombuffer(buf, dtype=torch.uint8), src=0, group=self.control)
        return buf


def exit_rank(code: int = 0) -> NoReturn:
    """End a process that joined a process group, skipping the interpreter's finalization.

    gloo's worker threads outlive `destroy_process_group` (ProcessGroupGloo's runloop threads and
    its TCP loop are still running after it and a gc.collect(): the groups stay referenced from
    C++), and each drops its last collective's work after the caller's `wait()` returned. When that
    work holds the last reference to a tensor made in Python, dropping it takes the GIL; during
    `Py_FinalizeEx` that terminates the thread (PyThread_exit_thread), whose unwinding through
    ~AsyncWork (noexcept) calls std::terminate: "terminate called without an active exception",
    SIGABRT, at the exit of a process that did everything right (a core dump of a rank of
    tests/integration/test_ranks.py's gloo tests; 3 of 140 spawns of two ranks on the loaded 2-core machine).
    With no finalization there is no such moment. Logs and stdio are flushed first; atexit handlers
    do not run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its pipe is gone
            pass
    os._exit(code)
