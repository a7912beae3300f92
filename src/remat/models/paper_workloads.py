"""The Checkmate paper's benchmark networks as workloads: ``factory(batch_size) -> Workload``
with the paper's input resolution, random images and labels shaped like the model's output,
and ``cross_entropy_loss``.

Model and batch go to the default device, so the paper's batch sizes build and trace without
allocating anything on the meta device:

>>> with torch.device("meta"):
...     w = paper_workload("vgg-unet", 32)
>>> w.batch[0].is_meta, tuple(w.batch[0].shape), tuple(w.batch[1].shape)
(True, (32, 3, 416, 608), (32, 208, 304))
"""

from __future__ import annotations

import torch

from remat.models import Workload
from remat.models import paper_cnns as cnns

#: Workload name -> key of ``paper_cnns.PAPER_MODELS``: classifiers at 224x224 with 1000
#: classes; segmentation networks (keras_segmentation's) at 416x608 with 19 classes.
PAPER_WORKLOADS = {
    "vgg16": "vgg16",
    "vgg19": "vgg19",
    "resnet50": "resnet50",
    "mobilenet": "mobilenet",
    "vgg-unet": "unet",
    "fcn8": "fcn8",
    "segnet": "segnet",
}


def paper_workload(name: str, batch_size: int) -> Workload:
    """The paper network ``name`` (a key of ``PAPER_WORKLOADS``) with a batch of
    ``batch_size`` random images and labels, in train mode, on the default device."""
    key = PAPER_WORKLOADS[name]
    model = cnns.paper_models()[key].factory()
    images, labels = cnns.example_batch(key, batch_size, device=torch.get_default_device())
    return Workload(name, model, (images, labels), cnns.cross_entropy_loss)
