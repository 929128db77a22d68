"""Validation loss and perplexity of a model on fixed held-out batches."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lordo_fed.device import autocast
from lordo_fed.model import lm_loss


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> dict[str, float]:
    """Token-weighted mean cross-entropy over `batches`, and its perplexity exp(loss)."""
    if not batches:
        raise ValueError("evaluate: no validation batches (is data.val_fraction 0 or the corpus too small?)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device):
            total += lm_loss(model, x, y).item() * y.numel()
        count += y.numel()
    model.train(was_training)
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
