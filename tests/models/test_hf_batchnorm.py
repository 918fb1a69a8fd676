"""Hugging Face convolutional vision models, BatchNorm ones among them, go through
compile_step unchanged with their buffers in the state: two steps equal eager PyTorch, the
parameters and the running statistics alike (docs/models.md#buffers).

The families: residual networks in both block types (ResNet), grouped convolutions with
squeeze-excitation (RegNet), depthwise-separable inverted residuals with ReLU6 (MobileNetV2),
convolutions mixed with transformer blocks (MobileViT), a BatchNorm transformer with
attention biases and Hardswish (LeViT), and channels-last LayerNorm with depthwise 7x7
convolutions and layer scales (ConvNeXt, ConvNeXt V2: no buffers). SGD: AdamW would turn the
rounding noise of gradients that are zero in exact arithmetic into full steps (see
test_hf.py). Two steps: BatchNorm over a few 1x1 feature maps (MobileNetV2 at 32 pixels) is
ill-conditioned, and float32 rounding differences (1e-7 after the first step) grow 10-100x a
step. In float64, with a learning rate exact in float32 (fsg's learning rate is a float32
scalar), MobileNetV2's and LeViT's first-step parameters equal eager's bit for bit.
"""

import copy

import pytest
import torch

import fsg

T = pytest.importorskip("transformers")

LR, STEPS, ROWS = 0.01, 2, 8


def _families():
    image = dict(num_channels=3, num_labels=10)
    resnet = dict(image, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
    return {
        "resnet": lambda: T.ResNetForImageClassification(T.ResNetConfig(**resnet, layer_type="basic")),
        "resnet_bottleneck": lambda: T.ResNetForImageClassification(
            T.ResNetConfig(**resnet, layer_type="bottleneck", downsample_in_bottleneck=True)
        ),
        "regnet": lambda: T.RegNetForImageClassification(T.RegNetConfig(**resnet, groups_width=8)),
        "mobilenet_v2": lambda: T.MobileNetV2ForImageClassification(
            T.MobileNetV2Config(**image, image_size=32, depth_multiplier=0.25, classifier_dropout_prob=0.0)
        ),
        "mobilevit": lambda: T.MobileViTForImageClassification(T.MobileViTConfig(
            **image, image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)),  # fmt: skip
        "levit": lambda: T.LevitForImageClassification(T.LevitConfig(
            **image, image_size=32, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depth=[1, 1, 1],
            key_dim=[8, 8, 8], drop_path_rate=0)),  # fmt: skip
        "convnext": lambda: T.ConvNextForImageClassification(
            T.ConvNextConfig(**image, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, drop_path_rate=0.0)
        ),
        "convnextv2": lambda: T.ConvNextV2ForImageClassification(
            T.ConvNextV2Config(**image, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, drop_path_rate=0.0)
        ),
    }


@pytest.mark.parametrize("kind", sorted(_families()))
def test_two_steps_equal_eager_pytorch_parameters_and_running_statistics(kind):
    torch.manual_seed(0)
    model = _families()[kind]().train()
    reference = copy.deepcopy(model)

    def loss_fn(params, batch, buffers=None):  # (without buffers, the step calls loss_fn(params, batch))
        return fsg.apply(model, params, **batch, buffers=buffers).loss

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(LR), backend="eager")
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    g = torch.Generator().manual_seed(0)
    for i in range(STEPS):
        batch = {"pixel_values": torch.randn(ROWS, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (ROWS,), generator=g)}
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i + 1}")
    named, buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    assert sorted(state.params) == sorted(named) and sorted(state.buffers) == sorted(buffers)
    for name, value in [*state.params.items(), *state.buffers.items()]:
        want = named[name] if name in named else buffers[name]
        torch.testing.assert_close(value, want.detach(), rtol=1e-4, atol=1e-5, msg=name)
