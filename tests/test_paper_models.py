"""The Checkmate paper's benchmark networks: parameter counts equal to the Keras models the paper
traced, output shapes at paper sizes (on the meta device, so nothing is allocated), a real small
training step with finite gradients, and a traceable joint forward+backward graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from remat.models import paper_cnns as cnns
from remat.models import paper_segmentation as seg

# "Total params" of Keras's model.summary(), which includes batch norm's moving mean and
# variance (non-trainable weights); torch keeps those as buffers, so the comparison is against
# cnns.keras_param_count (parameters + running_mean + running_var), and TORCH_PARAMS holds the
# trainable part alone (= torch parameters).
KERAS_TOTAL_PARAMS = {
    "vgg16": 138_357_544,  # keras.applications, no batch norm
    "vgg19": 143_667_240,
    # keras.applications: 25,583,592 trainable + 53,120 moving statistics. torchvision's ResNet50
    # has 25,557,032 parameters: it has no convolution biases (53 convolutions, 26,560 biases)
    # and puts each stage's stride in the 3x3 convolution (v1.5), which changes no count.
    "resnet50": 25_636_712,
    "mobilenet": 4_253_864,  # keras.applications: 4,231,976 trainable + 21,888 moving statistics
    # keras_segmentation vgg_unet (Keras keeps only layers the output depends on: no VGG stage 5).
    #   VGG stages 1-4, 3x3 convs with bias: 1,792 + 36,928 | 73,856 + 147,584
    #     | 295,168 + 2 * 590,080 | 1,180,160 + 2 * 2,359,808                       = 7,635,264
    #   decoder conv + BN(4 per channel): 512->512 2,359,808 + 2,048; 768->256 1,769,728 + 1,024;
    #     384->128 442,496 + 512; 192->64 110,656 + 256; classes 64->19 3x3 10,963 = 4,697,491
    "unet": 12_332_755,
    # keras_segmentation fcn_8_vgg: all 5 VGG16 stages 14,714,688; 7x7 512->4096 102,764,544;
    #   1x1 4096->4096 16,781,312; 1x1 4096->19 77,843; stage-4 and stage-3 scorers 9,747 + 4,883;
    #   bias-free transposed convs 19*19*(4*4 + 4*4 + 16*16) = 5,776 + 5,776 + 92,416
    "fcn8": 134_456_985,
    # keras_segmentation segnet (vanilla encoder, stages 1-4 used):
    #   conv+BN 3->64 1,792 + 256; 64->128 73,856 + 512; 128->256 295,168 + 1,024;
    #     256->256 590,080 + 1,024                                                     = 963,712
    #   decoder conv+BN 256->512 1,180,160 + 2,048; 512->256 1,179,904 + 1,024;
    #     256->128 295,040 + 512; 128->64 73,792 + 256; 64->19 3x3 10,963          = 2,743,699
    "segnet": 3_707_411,
}
TORCH_PARAMS = {"resnet50": 25_583_592, "mobilenet": 4_231_976, "unet": 12_330_835, "segnet": 3_704_083}
OUTPUT_SHAPES = {
    "vgg16": (2, 1000),
    "vgg19": (2, 1000),
    "resnet50": (2, 1000),
    "mobilenet": (2, 1000),
    "unet": (2, 19, 208, 304),  # keras_segmentation predicts at stride 2
    "segnet": (2, 19, 208, 304),
    "fcn8": (2, 19, 424, 616),  # (13-1)*2+4 -> crop 26 -> (26-1)*2+4 -> crop 52 -> (52-1)*8+16
}


@pytest.fixture(scope="module")
def meta_models() -> dict[str, nn.Module]:
    with torch.device("meta"):
        return {name: entry.factory() for name, entry in cnns.paper_models().items()}


def test_registry_lists_the_paper_models_with_their_sizes():
    models = cnns.PAPER_MODELS
    assert set(models) == set(KERAS_TOTAL_PARAMS)
    assert {name: entry.batch_size for name, entry in models.items() if entry.batch_size} == {
        "vgg16": 256,
        "mobilenet": 512,
        "unet": 32,
    }
    assert models["resnet50"].input_shape == (3, 224, 224)
    assert models["segnet"].input_shape == (3, 416, 608)
    assert models["unet"].factory is seg.vgg_unet


@pytest.mark.parametrize("name", sorted(KERAS_TOTAL_PARAMS))
def test_parameter_count_equals_keras(meta_models, name):
    model = meta_models[name]
    assert cnns.keras_param_count(model) == KERAS_TOTAL_PARAMS[name]
    torch_params = sum(p.numel() for p in model.parameters())
    assert torch_params == TORCH_PARAMS.get(name, KERAS_TOTAL_PARAMS[name])


def test_models_built_on_meta_allocate_nothing(meta_models):
    for model in meta_models.values():
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("name", sorted(OUTPUT_SHAPES))
def test_output_shape_at_paper_resolution(meta_models, name):
    shape = cnns.PAPER_MODELS[name].input_shape
    with torch.device("meta"):
        assert tuple(meta_models[name](torch.empty(2, *shape)).shape) == OUTPUT_SHAPES[name]


@pytest.mark.parametrize("height, width", [(64, 96), (416, 608), (224, 224)])
def test_fcn8_output_overshoots_every_input_by_eight_pixels(meta_models, height, width):
    with torch.device("meta"):
        out = meta_models["fcn8"](torch.empty(1, 3, height, width))
    assert tuple(out.shape[-2:]) == (height + 8, width + 8)


def test_resnet50_strides_in_1x1_convolutions_as_keras(meta_models):
    convs = [m for m in meta_models["resnet50"].modules() if isinstance(m, nn.Conv2d)]
    strided = [m for m in convs if m.stride == (2, 2)]
    # The stem, then per downsampling stage the first 1x1 conv and the shortcut's 1x1 conv.
    assert [m.kernel_size for m in strided] == [(7, 7)] + [(1, 1)] * 6


def test_mobilenet_pads_strided_convolutions_bottom_right_only(meta_models):
    pads = [m.padding for m in meta_models["mobilenet"].modules() if isinstance(m, nn.ZeroPad2d)]
    assert pads == [(0, 1, 0, 1)] * 5  # the stem and the four strided depthwise convolutions


def test_segmentation_decoders_have_no_activation_as_in_the_papers_keras_segmentation(meta_models):
    # The fork the paper installed (2019) had no ReLU in the U-Net/SegNet decoders; keras_segmentation
    # added them in 2020. Encoder ReLUs: U-Net's VGG stages 1-4 have 10 convs, SegNet's 4 stages 4.
    assert sum(isinstance(m, nn.ReLU) for m in meta_models["unet"].modules()) == 10
    assert sum(isinstance(m, nn.ReLU) for m in meta_models["segnet"].modules()) == 4


def _finite_training_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> None:
    loss = cnns.cross_entropy_loss(model, images, labels)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize(
    "build, input_hw",
    [
        (lambda: cnns.vgg16(10, image_side=64), (64, 64)),  # the VGG16 layer list with a small fc1
        (lambda: cnns.mobilenet(10), (64, 64)),
        (seg.segnet, (96, 128)),
    ],
    ids=["vgg16-64px", "mobilenet-64px", "segnet-96x128"],
)
def test_real_small_training_step_has_finite_gradients(build, input_hw):
    torch.manual_seed(0)
    model = build()
    images = torch.randn(1, 3, *input_hw)
    classes, *spatial = model(images).shape[1:]
    _finite_training_step(model, images, torch.randint(0, classes, (1, *spatial)))


@pytest.mark.parametrize("name", ["mobilenet", "unet", "fcn8"])
def test_training_step_traces_at_paper_batch_size_on_meta(meta_models, name):
    model = meta_models[name]
    params = list(model.parameters())
    images, labels = cnns.example_batch(name, cnns.PAPER_MODELS[name].batch_size or 8)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = cnns.cross_entropy_loss(model, x, y)
        return (loss, *torch.autograd.grad(loss, params))

    graph = make_fx(step)(images, labels)
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "aten.convolution_backward.default" in ops


def test_example_batch_labels_match_the_output_resolution():
    images, labels = cnns.example_batch("fcn8", 4)
    assert images.is_meta and tuple(images.shape) == (4, 3, 416, 608)
    assert tuple(labels.shape) == (4, 424, 616) and labels.dtype == torch.long
    _, class_labels = cnns.example_batch("mobilenet", 3, device="cpu")
    assert tuple(class_labels.shape) == (3,) and int(class_labels.max()) < 1000


def test_example_batch_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown paper model 'vgg'; use one of vgg16, vgg19"):
        cnns.example_batch("vgg", 1)


def test_keras_param_count_adds_batch_norm_moving_statistics_only():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4, track_running_stats=False))
    # conv 12 + 4; tracked BN 4 + 4 params + 4 + 4 statistics; untracked BN 4 + 4 params
    assert cnns.keras_param_count(model) == 40
