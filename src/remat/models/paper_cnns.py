"""The image classifiers the Checkmate paper evaluated, rebuilt in torch.nn, and the registry of
all its benchmark networks (the segmentation ones live in ``paper_segmentation``).

The paper traced Keras models: ``tf.keras.applications`` VGG16, VGG19, ResNet50 and MobileNet
at 224x224 with 1000 classes, and three ``keras_segmentation`` networks at 416x608 with 19
classes. These rebuilds follow the Keras layer lists (paddings, strides, biases, batch-norm
constants), so their parameter counts, activation shapes and layer graphs are the ones the
paper scheduled. Weights keep torch's default initialisation (Keras uses Glorot-uniform): a
memory planner needs the shapes and the graph, not trained values.

Every model builds on the meta device and has no value-dependent control flow, so a training
step at the paper's batch sizes can be traced with ``make_fx`` without allocating memory:

>>> with torch.device("meta"):
...     logits = vgg16()(torch.empty(256, 3, 224, 224))
>>> tuple(logits.shape)
(256, 1000)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# Keras's BatchNormalization keeps `moving = 0.99 * moving + 0.01 * batch`; torch's momentum is
# the weight of the new batch, so the same update is momentum 0.01.
KERAS_BN_MOMENTUM = 0.01
KERAS_BN_EPSILON = 1e-3  # Keras's default, used by MobileNet and keras_segmentation
RESNET_BN_EPSILON = 1.001e-5  # what keras_applications' resnet_common.py passes explicitly

IMAGENET_CLASSES = 1000
IMAGENET_SHAPE = (3, 224, 224)

# (output channels, convolutions) per VGG stage; each stage ends in a 2x2 max pool.
VGG16_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))
VGG19_STAGES = ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4))
VGG_FC_WIDTH = 4096

# (bottleneck width, blocks, stride of the stage's first block) for ResNet50's four stages.
RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
RESNET_EXPANSION = 4

# (pointwise output channels, depthwise stride) for MobileNet v1's 13 separable blocks.
MOBILENET_BLOCKS = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
)  # fmt: skip
MOBILENET_STEM_CHANNELS = 32
MOBILENET_DROPOUT = 1e-3  # keras_applications' default `dropout` argument


def conv(in_ch: int, out_ch: int, kernel: int, *, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    """A convolution with Keras's ``padding='same'`` for stride 1 (odd kernels pad symmetrically)
    and ``'valid'`` otherwise; strided Keras layers in these models are always 'valid'.

    >>> conv(3, 8, 3).padding
    (1, 1)
    """
    padding = kernel // 2 if stride == 1 else 0
    return nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=bias)


def batch_norm(channels: int, *, eps: float = KERAS_BN_EPSILON) -> nn.BatchNorm2d:
    """Keras's ``BatchNormalization()`` over channels, with its epsilon and momentum.

    >>> batch_norm(4).momentum
    0.01
    """
    return nn.BatchNorm2d(channels, eps=eps, momentum=KERAS_BN_MOMENTUM)


def vgg_stages(stages: Sequence[tuple[int, int]], in_ch: int = 3) -> list[nn.Sequential]:
    """VGG's convolution stages: 3x3 conv + ReLU ``n`` times, then a 2x2 max pool; one
    ``nn.Sequential`` per stage so encoders can tap each stage's output.

    >>> [len(s) for s in vgg_stages(VGG16_STAGES[:2])]
    [5, 5]
    """
    built = []
    for out_ch, convs in stages:
        layers: list[nn.Module] = []
        for _ in range(convs):
            layers += [conv(in_ch, out_ch, 3), nn.ReLU()]
            in_ch = out_ch
        built.append(nn.Sequential(*layers, nn.MaxPool2d(2)))
    return built


def _vgg(stages: Sequence[tuple[int, int]], num_classes: int, image_side: int) -> nn.Sequential:
    # Keras flattens channels-last (H, W, C); torch flattens (C, H, W). That permutes fc1's
    # inputs, which changes neither the shapes, the parameter count nor the graph.
    side = image_side // 2 ** len(stages)
    return nn.Sequential(
        *vgg_stages(stages),
        nn.Flatten(),
        nn.Linear(stages[-1][0] * side * side, VGG_FC_WIDTH),
        nn.ReLU(),
        nn.Linear(VGG_FC_WIDTH, VGG_FC_WIDTH),
        nn.ReLU(),
        nn.Linear(VGG_FC_WIDTH, num_classes),
    )


def vgg16(num_classes: int = IMAGENET_CLASSES, *, image_side: int = IMAGENET_SHAPE[1]) -> nn.Sequential:
    """Keras VGG16: 13 convolutions in 5 stages, fc 4096-4096-classes, no batch norm and no
    dropout (unlike torchvision's); returns logits (softmax omitted). Takes square images of
    side ``image_side`` (a multiple of 32), which sizes fc1 as Keras's ``input_shape`` does.

    >>> with torch.device("meta"):
    ...     sum(p.numel() for p in vgg16().parameters())
    138357544
    """
    return _vgg(VGG16_STAGES, num_classes, image_side)


def vgg19(num_classes: int = IMAGENET_CLASSES, *, image_side: int = IMAGENET_SHAPE[1]) -> nn.Sequential:
    """Keras VGG19: VGG16 with a fourth convolution in stages 3 to 5.

    >>> with torch.device("meta"):
    ...     sum(p.numel() for p in vgg19().parameters())
    143667240
    """
    return _vgg(VGG19_STAGES, num_classes, image_side)


class Bottleneck(nn.Module):
    """ResNet v1 bottleneck as Keras builds it: 1x1 (carrying the stride) - 3x3 - 1x1, every
    convolution with a bias, batch norm after each, and a projected shortcut in a stage's first
    block.

    >>> Bottleneck(64, 64, stride=1, project=True)(torch.zeros(1, 64, 8, 8)).shape
    torch.Size([1, 256, 8, 8])
    """

    def __init__(self, in_ch: int, width: int, *, stride: int, project: bool) -> None:
        super().__init__()
        out_ch = RESNET_EXPANSION * width
        self.residual = nn.Sequential(
            conv(in_ch, width, 1, stride=stride),
            batch_norm(width, eps=RESNET_BN_EPSILON),
            nn.ReLU(),
            conv(width, width, 3),
            batch_norm(width, eps=RESNET_BN_EPSILON),
            nn.ReLU(),
            conv(width, out_ch, 1),
            batch_norm(out_ch, eps=RESNET_BN_EPSILON),
        )
        self.shortcut: nn.Module = nn.Identity()
        if project:
            self.shortcut = nn.Sequential(
                conv(in_ch, out_ch, 1, stride=stride), batch_norm(out_ch, eps=RESNET_BN_EPSILON)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.shortcut(x) + self.residual(x))


def resnet50(num_classes: int = IMAGENET_CLASSES) -> nn.Sequential:
    """Keras ResNet50 (v1): 7x7/2 stem, 3x3/2 max pool, bottleneck stages of 3-4-6-3 blocks,
    global average pool, dense classifier; returns logits.

    It differs from torchvision's ResNet50 (v1.5) in two ways that matter to a memory planner:
    the stride sits in each stage's first 1x1 convolution rather than its 3x3, and every
    convolution has a bias (53 of them: 26,560 parameters torchvision does not have).

    >>> with torch.device("meta"):
    ...     sum(p.numel() for p in resnet50().parameters())
    25583592
    """
    layers: list[nn.Module] = [
        # Keras zero-pads by 3, then convolves 7x7/2 'valid': one padded convolution in torch.
        nn.Conv2d(3, 64, 7, stride=2, padding=3),
        batch_norm(64, eps=RESNET_BN_EPSILON),
        nn.ReLU(),
        # Keras zero-pads by 1 before pooling; the inputs are ReLU outputs (>= 0), so torch's
        # -inf padding picks the same maxima.
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    in_ch = 64
    for width, blocks, stride in RESNET50_STAGES:
        for block in range(blocks):
            first = block == 0
            layers.append(Bottleneck(in_ch, width, stride=stride if first else 1, project=first))
            in_ch = RESNET_EXPANSION * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


def _keras_pad_for_stride_2() -> nn.ZeroPad2d:
    # keras_applications pads strided MobileNet convolutions by one pixel at the bottom and
    # right only (then convolves 'valid'), which a symmetric torch padding cannot express.
    return nn.ZeroPad2d((0, 1, 0, 1))


def _separable(in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
    pad = [_keras_pad_for_stride_2()] if stride == 2 else []
    return nn.Sequential(
        *pad,
        nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=1 if stride == 1 else 0, groups=in_ch, bias=False),
        batch_norm(in_ch),
        nn.ReLU6(),
        conv(in_ch, out_ch, 1, bias=False),
        batch_norm(out_ch),
        nn.ReLU6(),
    )


def mobilenet(num_classes: int = IMAGENET_CLASSES) -> nn.Sequential:
    """Keras MobileNet v1 (alpha 1, depth multiplier 1): a 3x3/2 stem and 13 depthwise-separable
    blocks, each conv followed by batch norm and ReLU6; global average pool, dropout 1e-3 and a
    1x1 convolution as the classifier; returns logits.

    >>> with torch.device("meta"):
    ...     mobilenet()(torch.empty(2, 3, 224, 224)).shape
    torch.Size([2, 1000])
    """
    layers: list[nn.Module] = [
        _keras_pad_for_stride_2(),
        conv(3, MOBILENET_STEM_CHANNELS, 3, stride=2, bias=False),
        batch_norm(MOBILENET_STEM_CHANNELS),
        nn.ReLU6(),
    ]
    in_ch = MOBILENET_STEM_CHANNELS
    for out_ch, stride in MOBILENET_BLOCKS:
        layers.append(_separable(in_ch, out_ch, stride))
        in_ch = out_ch
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Dropout(MOBILENET_DROPOUT),
        conv(in_ch, num_classes, 1),
        nn.Flatten(),
    ]
    return nn.Sequential(*layers)


def keras_param_count(model: nn.Module) -> int:
    """The "Total params" Keras's ``model.summary()`` would print for ``model``: torch parameters
    plus batch norm's running mean and variance, which Keras counts as (non-trainable) weights
    and torch keeps as buffers. ``num_batches_tracked`` has no Keras counterpart.

    >>> keras_param_count(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    32
    """
    params = sum(p.numel() for p in model.parameters())
    stats = sum(
        m.running_mean.numel() + m.running_var.numel()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    )
    return params + stats


def cross_entropy_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss for every paper model, in the ``loss_fn(model, *batch)`` form workloads
    use: cross-entropy of the logits against integer labels, shape (N,) for classifiers and
    per pixel, shape (N, H', W') at the model's output resolution, for segmentation.

    >>> model = nn.Conv2d(3, 5, 1)
    >>> cross_entropy_loss(model, torch.zeros(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long)).shape
    torch.Size([])
    """
    return F.cross_entropy(model(images), labels)


class PaperModel(NamedTuple):
    """A benchmark network: its factory (paper's class count by default), the (C, H, W) input
    the paper used, and the batch size where the paper states one (else None)."""

    factory: Callable[[], nn.Module]
    input_shape: tuple[int, int, int]
    batch_size: int | None


@functools.cache
def paper_models() -> Mapping[str, PaperModel]:
    """The paper's benchmark networks by name (read-only); also ``PAPER_MODELS``.

    >>> paper_models()["unet"].batch_size
    32
    """
    # Imported on first use, not at import time: paper_segmentation builds on this module.
    from remat.models import paper_segmentation as seg

    return MappingProxyType(
        {
            "vgg16": PaperModel(vgg16, IMAGENET_SHAPE, 256),
            "vgg19": PaperModel(vgg19, IMAGENET_SHAPE, None),
            "resnet50": PaperModel(resnet50, IMAGENET_SHAPE, None),
            "mobilenet": PaperModel(mobilenet, IMAGENET_SHAPE, 512),
            "unet": PaperModel(seg.vgg_unet, seg.SEGMENTATION_SHAPE, 32),
            "fcn8": PaperModel(seg.fcn8_vgg, seg.SEGMENTATION_SHAPE, None),
            "segnet": PaperModel(seg.segnet, seg.SEGMENTATION_SHAPE, None),
        }
    )


def __getattr__(name: str) -> object:
    # PAPER_MODELS is a lazily built module attribute (PEP 562) for the same import-cycle reason.
    if name == "PAPER_MODELS":
        return paper_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def example_batch(
    name: str, batch_size: int, *, device: torch.device | str = "meta"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and integer labels for ``PAPER_MODELS[name]``, labels shaped like the
    model's output (one per image, or one per output pixel). Defaults to the meta device, where
    paper-sized batches cost no memory.

    >>> images, labels = example_batch("segnet", 32)
    >>> tuple(images.shape), tuple(labels.shape)
    ((32, 3, 416, 608), (32, 208, 304))
    """
    models = paper_models()
    if name not in models:
        raise ValueError(f"unknown paper model {name!r}; use one of {', '.join(models)}")
    entry = models[name]
    with torch.device("meta"):
        logits_shape = entry.factory()(torch.empty(1, *entry.input_shape)).shape
    classes, label_spatial = logits_shape[1], tuple(logits_shape[2:])
    images = torch.randn(batch_size, *entry.input_shape, device=device)
    labels = torch.randint(0, classes, (batch_size, *label_spatial), device=device)
    return images, labels

