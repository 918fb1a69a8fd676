"""Train a ResNet-18 (BatchNorm and all) with fsg on generated images: no download.

    python examples/resnet.py --width 16 --steps 150     # CPU: 99% held-out accuracy, ~3.5 min
    python examples/resnet.py --device cuda                 # the full ResNet-18 (width 64)
    python examples/resnet.py --width 4 --image-size 16 --steps 30 --backend eager   # seconds
    torchrun --nproc-per-node=2 examples/resnet.py --mesh dp=2 --device cpu   # gloo ranks

The model is torchvision's `resnet18(num_classes=10)` when torchvision imports, else the same
layout written out below (the same parameter and buffer names; `--width` other than 64 always
uses it). The data: 10 classes of 32x32 RGB images, each class an oriented, coloured stripe
pattern at a random phase and contrast under noise: structure a small convnet learns in a few
hundred steps, generated from a seed. The train step (`fsg.compile_step`, AdamW) updates the
BatchNorm running statistics as state; `fsg.compile_eval` measures held-out accuracy with the
modules in eval mode (BatchNorm on those statistics) every `--eval-every` steps, without
recompiling the train step. Under `--mesh dp=2` the batch is split over the ranks and BatchNorm
normalizes by global-batch statistics, as `SyncBatchNorm` does.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import fsg

CLASSES = 10


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convs with BatchNorm, and a shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (names included), with a base ``width`` (64 there)."""

    def __init__(self, num_classes: int = CLASSES, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        inplanes = width
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(
                self, f"layer{i + 1}", nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes))
            )
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_model(width: int = 64, seed: int = 0) -> nn.Module:
    """torchvision's ResNet-18 when it imports and ``width`` is 64, else ``ResNet18(width)``."""
    torch.manual_seed(seed)
    if width == 64:
        try:
            from torchvision.models import resnet18
        except Exception:  # absent, or built for another torch (its C++ ops fail to register)
            pass
        else:
            return resnet18(num_classes=CLASSES)
    return ResNet18(CLASSES, width)


def make_images(n: int, size: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` labelled images ``[n, 3, size, size]``: class ``c`` is a stripe pattern at angle
    ``c * 18`` degrees, in the class's colour, at a random phase and contrast, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    colours = torch.rand(CLASSES, 3, generator=torch.Generator().manual_seed(1234)) * 2 - 1
    angle = y.float() * math.pi / CLASSES
    frequency = 2 * math.pi * 3 / size  # three stripes across the image
    coords = torch.arange(size, dtype=torch.float32)
    rows, cols = coords[:, None], coords[None, :]
    phase = torch.rand(n, generator=g) * 2 * math.pi
    along = torch.cos(angle)[:, None, None] * cols + torch.sin(angle)[:, None, None] * rows
    stripes = torch.sin(frequency * along + phase[:, None, None])  # [n, size, size]
    contrast = 0.5 + torch.rand(n, generator=g)
    x = contrast[:, None, None, None] * stripes[:, None] * colours[y][:, :, None, None]
    return {"x": x + 0.5 * torch.randn(n, 3, size, size, generator=g), "y": y}


def loss_fn(model: nn.Module):
    def loss(params, batch, buffers):
        logits = fsg.apply(model, params, batch["x"], buffers=buffers)
        return F.cross_entropy(logits, batch["y"])

    return loss


def eval_fn(model: nn.Module):
    def metrics(params, batch, buffers):
        logits = fsg.apply(model, params, batch["x"], buffers=buffers)
        correct = (logits.argmax(-1) == batch["y"]).float().mean()
        return {"loss": F.cross_entropy(logits, batch["y"]), "accuracy": correct}

    return metrics


def parse_mesh(text: str | None) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))} if text else {}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64, help="base width (torchvision's ResNet-18: 64)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-size", type=int, default=256, help="held-out images, evaluated in one batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--mesh", help="shard over a device mesh under torchrun, e.g. dp=2")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, list]:
    """Trains; returns ``{"loss": [per step], "eval": [(step, loss, accuracy), ...]}``."""
    args = parse_args(argv)
    mesh = None
    if args.mesh:
        info = fsg.distributed.initialize(backend="gloo" if args.device == "cpu" else None)
        mesh = fsg.Mesh(parse_mesh(args.mesh), device_type=info.device.type)
    device = torch.device(args.device if mesh is None else mesh.device_type)
    is_main = mesh is None or torch.distributed.get_rank() == 0
    model = make_model(args.width, args.seed).to(device)
    opt = fsg.optim.adamw(fsg.optim.warmup_cosine(args.lr, warmup=min(20, args.steps // 5), total=args.steps),
                          weight_decay=5e-4)  # fmt: skip
    step = fsg.compile_step(loss_fn(model), mesh, optimizer=opt, backend=args.backend)
    ev = fsg.compile_eval(eval_fn(model), mesh, backend=args.backend)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model), seed=args.seed)
    held_out = {
        k: v.to(device) for k, v in make_images(args.eval_size, args.image_size, seed=10_000 + args.seed).items()
    }
    if is_main:
        n = sum(p.numel() for p in model.parameters())
        print(f"{type(model).__name__}: {n / 1e6:.2f}M params, mesh {parse_mesh(args.mesh) or 'none'}; compiling...")
    history: dict[str, list] = {"loss": [], "eval": []}
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        # every rank makes the same global batch; the step keeps its rows of it
        batch = {
            k: v.to(device)
            for k, v in make_images(args.batch_size, args.image_size, seed=args.seed * 100_003 + i).items()
        }
        state, metrics = step(state, batch)
        history["loss"].append(float(metrics["loss"]))
        if i % args.eval_every == 0 or i == args.steps:
            m = ev(state, held_out)
            history["eval"].append((i, float(m["loss"]), float(m["accuracy"])))
            if is_main:
                print(f"step {i:5d}  train loss {history['loss'][-1]:.3f}  eval loss {float(m['loss']):.3f}  "
                      f"accuracy {float(m['accuracy']):.1%}  ({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    return history


if __name__ == "__main__":
    main()
