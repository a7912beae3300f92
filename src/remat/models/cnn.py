"""A small convolutional classifier with batch norm (running statistics updated each step)."""

from __future__ import annotations

import torch
from torch import nn

from remat.models import Workload
from remat.models.mlp import _classification_loss

CHANNELS = (8, 16, 16)
IMAGE_SIDE = 16
CLASSES = 10


def cnn(batch_size: int) -> Workload:
    """Conv-BatchNorm-ReLU blocks with a max pool after each, then a linear classifier."""
    blocks: list[nn.Module] = []
    in_ch, side = 3, IMAGE_SIDE
    for out_ch in CHANNELS:
        blocks += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.BatchNorm2d(out_ch), nn.ReLU(), nn.MaxPool2d(2)]
        in_ch, side = out_ch, side // 2
    model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(in_ch * side * side, CLASSES))
    batch = (torch.randn(batch_size, 3, IMAGE_SIDE, IMAGE_SIDE), torch.randint(0, CLASSES, (batch_size,)))
    return Workload("cnn", model, batch, _classification_loss)
