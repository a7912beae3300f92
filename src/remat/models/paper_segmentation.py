"""The segmentation networks the Checkmate paper evaluated, rebuilt in torch.nn from the
``keras_segmentation`` package (the fork at github.com/ajayjain/image-segmentation-keras, 2019,
that the paper's code installed): ``vgg_unet``, ``fcn_8_vgg`` and ``segnet``, 19 Cityscapes
classes, 416x608 inputs.

Each returns per-pixel logits (N, classes, H', W'): what the Keras model computes before it
reshapes to (N, H'*W', classes) and applies its softmax. keras_segmentation's models do not all
predict at the input resolution, and the labels it trains with are resized to the output, so
these keep its resolutions: U-Net and SegNet predict at half resolution (208x304), FCN-8 at
424x616 (its transposed convolutions overshoot the input by 8 pixels and are never cropped).

Keras builds a model from the layers its output depends on, so an encoder stage whose output
no decoder reads is not part of the model; these rebuilds omit such stages as well (VGG's fifth
stage in U-Net, the vanilla encoder's fifth stage in SegNet).

>>> with torch.device("meta"):
...     segnet()(torch.empty(2, *SEGMENTATION_SHAPE)).shape
torch.Size([2, 19, 208, 304])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.models.paper_cnns import VGG16_STAGES, batch_norm, conv, vgg_stages

CITYSCAPES_CLASSES = 19
SEGMENTATION_SHAPE = (3, 416, 608)

# keras_segmentation's "vanilla" encoder, which its plain `segnet` uses: (channels) per stage
# of pad-conv-BN-ReLU-pool; SegNet decodes from the fourth stage (encoder_level=3).
VANILLA_ENCODER_CHANNELS = (64, 128, 256, 256, 256)
SEGNET_ENCODER_STAGES = 4
# Decoder widths shared by keras_segmentation's U-Net and SegNet decoders.
DECODER_CHANNELS = (512, 256, 128, 64)
FCN_WIDTH = 4096
FCN_DROPOUT = 0.5


class Stages(nn.ModuleList):
    """Encoder stages run in sequence, returning every stage's output (the skip features).

    >>> [t.shape[-1] for t in Stages(vgg_stages(VGG16_STAGES[:2]))(torch.zeros(1, 3, 8, 8))]
    [4, 2]
    """

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        levels = []
        for stage in self:
            x = stage(x)
            levels.append(x)
        return levels


def _conv_bn(in_ch: int, out_ch: int) -> nn.Sequential:
    # keras_segmentation's decoders (in the paper's version) put no activation between a
    # decoder convolution and its batch norm, nor after it.
    return nn.Sequential(conv(in_ch, out_ch, 3), batch_norm(out_ch))


def _upsample(x: torch.Tensor) -> torch.Tensor:
    # Keras UpSampling2D((2, 2)) repeats pixels: nearest-neighbour interpolation.
    return F.interpolate(x, scale_factor=2, mode="nearest")


class VggUNet(nn.Module):
    """keras_segmentation's ``vgg_unet``: VGG16 stages 1-4 as the encoder; the decoder starts
    from stage 4 (stride 16), and three times upsamples, concatenates the encoder feature of the
    same resolution and applies conv + BN; a 3x3 convolution gives the class logits at stride 2.

    >>> VggUNet(19)(torch.zeros(1, 3, 32, 64)).shape
    torch.Size([1, 19, 16, 32])
    """

    def __init__(self, n_classes: int) -> None:
        super().__init__()
        self.encoder = Stages(vgg_stages(VGG16_STAGES[:4]))
        skip_ch = [out_ch for out_ch, _ in VGG16_STAGES[:3]]  # 64, 128, 256 (stages 1-3)
        self.center = _conv_bn(VGG16_STAGES[3][0], DECODER_CHANNELS[0])
        self.up = nn.ModuleList(
            _conv_bn(DECODER_CHANNELS[i] + skip_ch[-1 - i], DECODER_CHANNELS[i + 1]) for i in range(3)
        )
        self.classifier = conv(DECODER_CHANNELS[-1], n_classes, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *skips, x = self.encoder(x)
        x = self.center(x)
        for layer, skip in zip(self.up, reversed(skips), strict=True):
            x = layer(torch.cat([_upsample(x), skip], dim=1))
        return self.classifier(x)


def vgg_unet(n_classes: int = CITYSCAPES_CLASSES) -> VggUNet:
    """U-Net with a VGG16 encoder, as ``keras_segmentation.models.unet.vgg_unet``; logits at
    half the input resolution.

    >>> with torch.device("meta"):
    ...     vgg_unet()(torch.empty(2, *SEGMENTATION_SHAPE)).shape
    torch.Size([2, 19, 208, 304])
    """
    return VggUNet(n_classes)


def _crop_to_common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # keras_segmentation's fcn `crop` trims the larger map's bottom rows and right columns;
    # slicing both to the smaller size does exactly that. Shapes are static, so this traces.
    h, w = min(a.shape[-2], b.shape[-2]), min(a.shape[-1], b.shape[-1])
    return a[..., :h, :w], b[..., :h, :w]


class FCN8(nn.Module):
    """keras_segmentation's ``fcn_8`` on a VGG16 encoder: a 7x7 and a 1x1 convolution of width
    4096 (ReLU, dropout 0.5) and a 1x1 class scorer on stage 5, then three bias-free 'valid'
    transposed convolutions (x2, x2, x8) with the scored stage-4 and stage-3 features added
    after cropping; no crop after the last, so the output is 8 pixels larger than the input.

    >>> FCN8(19)(torch.zeros(1, 3, 64, 96)).shape
    torch.Size([1, 19, 72, 104])
    """

    def __init__(self, n_classes: int) -> None:
        super().__init__()
        self.encoder = Stages(vgg_stages(VGG16_STAGES))
        self.head = nn.Sequential(
            conv(VGG16_STAGES[4][0], FCN_WIDTH, 7),
            nn.ReLU(),
            nn.Dropout(FCN_DROPOUT),
            conv(FCN_WIDTH, FCN_WIDTH, 1),
            nn.ReLU(),
            nn.Dropout(FCN_DROPOUT),
            conv(FCN_WIDTH, n_classes, 1),
        )
        self.score_stage4 = conv(VGG16_STAGES[3][0], n_classes, 1)
        self.score_stage3 = conv(VGG16_STAGES[2][0], n_classes, 1)
        self.up2_a = nn.ConvTranspose2d(n_classes, n_classes, 4, stride=2, bias=False)
        self.up2_b = nn.ConvTranspose2d(n_classes, n_classes, 4, stride=2, bias=False)
        self.up8 = nn.ConvTranspose2d(n_classes, n_classes, 16, stride=8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, _, stage3, stage4, stage5 = self.encoder(x)
        o, skip = _crop_to_common(self.up2_a(self.head(stage5)), self.score_stage4(stage4))
        skip3, o = _crop_to_common(self.score_stage3(stage3), self.up2_b(o + skip))
        return self.up8(skip3 + o)


def fcn8_vgg(n_classes: int = CITYSCAPES_CLASSES) -> FCN8:
    """FCN-8s with a VGG16 encoder, as ``keras_segmentation.models.fcn.fcn_8_vgg``; logits at
    (H + 8) x (W + 8) for an H x W input.

    >>> with torch.device("meta"):
    ...     fcn8_vgg()(torch.empty(2, *SEGMENTATION_SHAPE)).shape
    torch.Size([2, 19, 424, 616])
    """
    return FCN8(n_classes)


def _vanilla_stage(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(conv(in_ch, out_ch, 3), batch_norm(out_ch), nn.ReLU(), nn.MaxPool2d(2))


def segnet(n_classes: int = CITYSCAPES_CLASSES) -> nn.Sequential:
    """keras_segmentation's plain ``segnet``: its "vanilla" encoder (not VGG) of conv-BN-ReLU-pool
    stages 64-128-256-256, then a decoder without skip connections: conv+BN 512, and three times
    upsample x2 then conv+BN (256, 128, 64), and a 3x3 class convolution; logits at half the
    input resolution.

    >>> with torch.device("meta"):
    ...     segnet()(torch.empty(2, *SEGMENTATION_SHAPE)).shape
    torch.Size([2, 19, 208, 304])
    """
    in_ch, layers = 3, []
    for out_ch in VANILLA_ENCODER_CHANNELS[:SEGNET_ENCODER_STAGES]:
        layers.append(_vanilla_stage(in_ch, out_ch))
        in_ch = out_ch
    for i, out_ch in enumerate(DECODER_CHANNELS):
        layers += ([nn.Upsample(scale_factor=2, mode="nearest")] if i else []) + [_conv_bn(in_ch, out_ch)]
        in_ch = out_ch
    layers.append(conv(in_ch, n_classes, 3))
    return nn.Sequential(*layers)
