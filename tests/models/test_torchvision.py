"""torchvision's own model code through compile_step, unchanged: in float64, three SGD steps
equal eager PyTorch + ``torch.optim.SGD``, parameters and BatchNorm running statistics alike,
and the evaluation step equals the eval-mode forward.

The families cover what torchvision's zoo is built of: residual and bottleneck blocks
(ResNet), dense concatenation (DenseNet), inverted residuals with squeeze-excitation and
Hardswish (MobileNetV3, EfficientNet with stochastic depth, MnasNet), grouped convolutions
(RegNet), channel shuffles (ShuffleNetV2), fire modules (SqueezeNet), inception branches
(GoogLeNet), layer scale and depthwise 7x7 convolutions (ConvNeXt), shifted-window attention
with relative position biases (Swin, Swin V2), the ViT encoder, and a segmentation head
(LR-ASPP). Float64, so that a difference is a bug and not rounding: all of torchvision's 80
classification builders under 60M parameters, its segmentation and video models, were swept
this way on 2026-12-06 (each within 1e-9 of eager at 64 pixels); CI runs these small
configurations. Where a network's last feature maps are 1x1 (MobileNet, EfficientNet, MnasNet,
RegNet and ShuffleNet at 32 pixels), BatchNorm over 4 values amplifies float64's own rounding
(1e-16) to 1e-9 in three steps and its eval forward overflows, so those run at 64 pixels; the
tolerances, 1e-7 (loss) and 1e-5 (parameters), are still 100x below what a wrong gradient gives
(float32 in place of float64 alone: 1e-4, the bug this test came with).
Dropout and stochastic depth are set to 0: fsg's random ops draw from the step's key, not
torch's generator (docs/compiling.md#randomness).

The CPU build of torch cannot load torchvision's C++ operators (the PyPI wheel is built
against CUDA torch), and torchvision registers their meta kernels on import; the models are
plain Python and use none of them, so on such a machine the registrations are skipped
(``tests.helpers.import_torchvision``). Such a torchvision would break transformers' import
in every other test, so CI installs it into a folder of its own and runs this file apart
(.ci/run); elsewhere the file runs where torchvision imports, and skips where it is absent.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsg
from tests.helpers import import_torchvision

tv = import_torchvision()
if tv is None:
    pytest.skip("torchvision is not installed (CI installs it apart: .ci/run)", allow_module_level=True)
M = tv.models


def _small_vit():
    return M.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                               num_classes=10)  # fmt: skip


def _small_swin(v2=False):
    block = {"block": M.swin_transformer.SwinTransformerBlockV2, "downsample_layer": M.swin_transformer.PatchMergingV2} if v2 else {}
    return M.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=[2, 2],
                             num_classes=10, **block)  # fmt: skip


def _small_convnext():
    cnb = M.convnext.CNBlockConfig
    return M.ConvNeXt([cnb(8, 16, 1), cnb(16, None, 1)], num_classes=10)


# name -> (builder, image size); the torchvision builders as users call them, or the classes
# they wrap at a small width where the default one is large
FAMILIES = {
    "resnet18": (lambda: M.resnet18(num_classes=10), 32),
    "resnext-bottleneck": (lambda: M.ResNet(M.resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, groups=2, width_per_group=8), 32),
    "densenet": (lambda: M.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=10), 32),
    "mobilenet_v3_small": (lambda: M.mobilenet_v3_small(num_classes=10), 64),
    "efficientnet_b0": (lambda: M.efficientnet_b0(num_classes=10), 64),
    "mnasnet0_5": (lambda: M.mnasnet0_5(num_classes=10), 64),
    "regnet_y_400mf": (lambda: M.regnet_y_400mf(num_classes=10), 64),
    "shufflenet_v2_x0_5": (lambda: M.shufflenet_v2_x0_5(num_classes=10), 64),
    "squeezenet1_1": (lambda: M.squeezenet1_1(num_classes=10), 32),
    "googlenet": (lambda: M.googlenet(num_classes=10, aux_logits=False, init_weights=True), 32),
    "convnext": (_small_convnext, 32),
    "swin": (_small_swin, 16),
    "swin_v2": (lambda: _small_swin(v2=True), 16),
    "vit": (_small_vit, 32),
    "lraspp": (lambda: M.segmentation.lraspp_mobilenet_v3_large(num_classes=4, weights_backbone=None), 32),
}  # fmt: skip


def _model(name):
    torch.manual_seed(0)
    build, size = FAMILIES[name]
    model = build().double().train()
    for m in model.modules():
        if isinstance(m, nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    return model, size


def _logits(out):
    return out["out"] if isinstance(out, dict) else out  # segmentation models return {"out": ...}


def _batches(name, size, n=3):
    g = torch.Generator().manual_seed(1)
    labels = (4, size, size) if name == "lraspp" else (4,)
    return [{"x": torch.randn(4, 3, size, size, generator=g, dtype=torch.float64),
             "y": torch.randint(0, 4, labels, generator=g)} for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_torchvision_models_train_as_eager_pytorch_in_float64(name):
    model, size = _model(name)
    reference = copy.deepcopy(model)
    buffers = fsg.buffers(model)

    def loss(params, batch, buffers=None):
        return F.cross_entropy(_logits(fsg.apply(model, params, batch["x"], buffers=buffers)), batch["y"])

    loss_fn = loss if buffers else (lambda params, batch: loss(params, batch))
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.01, momentum=0.9), backend="eager")
    state = step.init(fsg.params(model), buffers=buffers or None)
    opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    batches = _batches(name, size)
    for batch in batches:
        state, metrics = step(state, batch)
        opt.zero_grad()
        expected = F.cross_entropy(_logits(reference(batch["x"])), batch["y"])
        expected.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], expected.detach(), rtol=1e-7, atol=1e-9)
    assert state.params[next(iter(state.params))].dtype == torch.float64
    for key, value in reference.named_parameters():
        torch.testing.assert_close(state.params[key], value.detach(), rtol=1e-5, atol=1e-8, msg=key)
    for key, value in reference.named_buffers():
        torch.testing.assert_close(state.buffers[key], value, rtol=1e-5, atol=1e-8, msg=key)

    def metrics_fn(params, batch, buffers=None):
        return {"loss": loss(params, batch, buffers)}

    evaluate = fsg.compile_eval(metrics_fn if buffers else (lambda p, b: metrics_fn(p, b)), backend="eager")
    with torch.no_grad():
        expected = F.cross_entropy(_logits(reference.eval()(batches[0]["x"])), batches[0]["y"])
    torch.testing.assert_close(evaluate(state, batches[0])["loss"], expected, rtol=1e-7, atol=1e-9)
