"""A multilayer perceptron classifier: the smallest real workload."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.models import Workload

IN_FEATURES = 32
HIDDEN = 64
CLASSES = 10
LAYERS = 4


def _classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def mlp(batch_size: int) -> Workload:
    """``LAYERS`` Linear+ReLU layers on random features, cross-entropy on random labels."""
    layers: list[nn.Module] = []
    width = IN_FEATURES
    for _ in range(LAYERS - 1):
        layers += [nn.Linear(width, HIDDEN), nn.ReLU()]
        width = HIDDEN
    layers.append(nn.Linear(width, CLASSES))
    model = nn.Sequential(*layers)
    batch = (torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,)))
    return Workload("mlp", model, batch, _classification_loss)
