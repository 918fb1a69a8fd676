"""ResNet-18 (examples/resnet.py: torchvision's layout and names, BatchNorm) through
compile_step: 5 steps equal eager PyTorch with torch.optim.AdamW, running statistics included,
and compile_eval equals the module's eval-mode forward (issue 21)."""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fsg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import resnet  # noqa: E402


def test_layout_has_torchvision_names():
    names = fsg.params(resnet.ResNet18(width=4))
    assert {"conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
            "layer4.1.bn2.bias", "fc.weight", "fc.bias"} <= set(names)  # fmt: skip
    assert len(names) == 62  # torchvision's resnet18 has 62 parameter tensors
    assert "layer3.0.downsample.1.running_var" in fsg.buffers(resnet.ResNet18(width=4))


def test_five_steps_equal_eager_pytorch_with_adamw_buffers_included():
    model = resnet.make_model(width=8)
    reference = copy.deepcopy(model).train()
    step = fsg.compile_step(resnet.loss_fn(model), optimizer=fsg.optim.adamw(1e-3, weight_decay=0.1), backend="eager")
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    for i in range(5):
        batch = resnet.make_images(8, 16, seed=i)
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = F.cross_entropy(reference(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i + 1}")
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state.params[name], value.detach(), rtol=1e-4, atol=1e-5, msg=name)
    buffers = dict(reference.named_buffers())
    assert sorted(state.buffers) == sorted(buffers)
    for name, value in buffers.items():
        torch.testing.assert_close(state.buffers[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert state.buffers["bn1.num_batches_tracked"].item() == 5

    held_out = resnet.make_images(16, 16, seed=99)
    metrics = fsg.compile_eval(resnet.eval_fn(model), backend="eager")(state, held_out)
    with torch.no_grad():
        logits = reference.eval()(held_out["x"])
    torch.testing.assert_close(metrics["loss"], F.cross_entropy(logits, held_out["y"]), rtol=1e-4, atol=1e-5)
    assert metrics["accuracy"] == (logits.argmax(-1) == held_out["y"]).float().mean()
