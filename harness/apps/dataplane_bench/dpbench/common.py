"""The payloads both sides draw: a seed gives the same random fp32 tensor on the server and on a
node, so each side can check what arrived against its own draw (whole, or by `samples`)."""

import numpy as np
import torch

SAMPLE = 4


def draw(seed: int, n: int) -> torch.Tensor:
    """The random fp32 payload of a seed (a new draw per exchange and node)."""
    return torch.from_numpy(np.random.default_rng(seed).random(n, dtype=np.float32))


def samples(t: torch.Tensor) -> list:
    return [float(x) for x in torch.cat([t[:SAMPLE], t[-SAMPLE:]])]
