"""The stock app's model, small so that a round measures Flower rather than compute: the ServerApp
starts the run from `make_model()`'s weights, each ClientApp loads the round's weights into one;
`batch` is a node's fixed random batch (its seed: the node's partition id)."""

import torch


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (8, 32), generator=g)
    return x, torch.roll(x, -1, dims=1)
