"""torchvision's ResNet-18 through compile_step on CUDA (issue 21; skipped without a GPU or
torchvision, which the CPU build of torch cannot import): 5 steps with Inductor, the fused
AdamW and CUDA-graph replay train as eager PyTorch + torch.optim.AdamW does, BatchNorm
running statistics included, and compile_eval equals the module's eval-mode forward.

"As eager does" is measured against float64: on the GPU, eager float32 itself drifts from
the float64 run (cuDNN's algorithms, atomics in the convolutions' backward; AdamW's
normalized step amplifies it), so fsg's float32 run must stay as close to the float64 run
as eager's float32 run does (within a factor), not bit-equal to eager."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fsg

torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import resnet  # noqa: E402

STEPS = 5


def _batches(dtype):
    return [{k: (v.cuda().to(dtype) if v.is_floating_point() else v.cuda()) for k, v in resnet.make_images(32, 32, seed=i).items()}
            for i in range(STEPS)]  # fmt: skip


def _eager(model, dtype):
    model = copy.deepcopy(model).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for batch in _batches(dtype):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.xfail(
    reason=(
        "open (issue 21): on the H200 (torch 2.11) fsg's float32 loss at step 4 was 1.93205 against "
        "eager float32's 1.91823 and float64's 1.91513, 5.5x further from float64 than eager's; "
        "steps 1-3 within bounds; the CPU test of the same layout matches eager to 1e-5"
    ),
    strict=False,
)
def test_torchvision_resnet18_trains_as_eager_adamw_does():
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    ref64, losses64 = _eager(model, torch.float64)
    ref32, losses32 = _eager(model, torch.float32)
    step = fsg.compile_step(resnet.loss_fn(model), optimizer=fsg.optim.adamw(1e-3, weight_decay=0.1))
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    losses = []
    for batch in _batches(torch.float32):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    for i, (got, eager, exact) in enumerate(zip(losses, losses32, losses64)):
        assert abs(got - exact) <= 4 * abs(eager - exact) + 1e-5 * abs(exact), (i, got, eager, exact)

    def drift(tensors32, name):
        return (tensors32[name].double() - dict(ref64.named_parameters())[name].detach()).abs().max().item()

    eager_params = dict(ref32.named_parameters())
    for name in ("conv1.weight", "layer2.0.conv1.weight", "layer4.1.bn2.weight", "fc.weight"):
        assert drift(state.params, name) <= 4 * drift({k: v.detach() for k, v in eager_params.items()}, name) + 1e-6, (
            name
        )
    buffers64, buffers32 = dict(ref64.named_buffers()), dict(ref32.named_buffers())
    for name, value in state.buffers.items():
        exact = buffers64[name].double()
        bound = 4 * (buffers32[name].double() - exact).abs().max().item() + 1e-6
        assert (value.double() - exact).abs().max().item() <= bound, name
    held_out = {k: v.cuda() for k, v in resnet.make_images(64, 32, seed=99).items()}
    metrics = fsg.compile_eval(resnet.eval_fn(model))(state, held_out)
    with torch.no_grad():
        module = copy.deepcopy(ref32).eval()
        for name, p in module.named_parameters():
            p.copy_(state.params[name])
        for name, b in module.named_buffers():
            b.copy_(state.buffers[name])
        logits = module(held_out["x"])
    torch.testing.assert_close(metrics["loss"], F.cross_entropy(logits, held_out["y"]), rtol=1e-4, atol=1e-5)
