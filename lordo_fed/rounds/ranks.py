"""What a worker needs of a node's ranks, as a `typing.Protocol`.

A node may be N processes that train as one worker (docs/algorithm.md, "Nodes of several ranks").
The node layer builds them (`lordo_fed.node.ranks.LocalRanks`, which satisfies `NodeRanks`
structurally); the rounds layer sits below it and only names the four things a worker uses, so
it does not import the layer above.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn


class NodeRanks(Protocol):
    """A node's ranks as the worker sees them: each rank trains its rows of the node's batch of
    N x B windows, its gradients averaged across the ranks every step by the wrapper."""

    @property
    def world(self) -> int:
        """N, the node's ranks: the node's batch is N times a rank's (the tokens it reports)."""
        ...

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the local steps run forward through (the intra-node wrapper: DDP, or
        FSDP2, which shards `model` in place)."""
        ...

    def rows(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """This rank's rows of the node's batch (x, y)."""
        ...

    def mean(self, t: Tensor) -> Tensor:
        """The mean of `t` over the node's ranks (a collective: every rank calls it)."""
        ...
