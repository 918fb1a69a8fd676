"""Small models and data shared by the tests."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import fsg


def mlp(d_in: int = 8, d_hidden: int = 32, d_out: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))


def regression_batch(n: int = 16, d_in: int = 8, d_out: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d_in, generator=g), "y": torch.randn(n, d_out, generator=g)}


def mse_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        return ((out - batch["y"]) ** 2).mean()

    return loss_fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gpt_bf16_steps(config: dict, rows: list[torch.Tensor], device: str = "cpu", policy=None, **compile_kw):
    """examples/gpt.py's GPT (``GPTConfig(**config)``, seed 0) trained by ``compile_step`` under
    ``policy`` (default ``Policy(compute=bfloat16)``) with AdamW(1e-3) and ``compile_kw``
    (``backend=``, ``accum_steps=``), one step per ``[B, T + 1]`` tensor of token ``rows``
    (inputs and their next tokens); returns the optimized graph's text, the losses and the
    final params."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(device)
    step = fsg.compile_step(
        lambda params, batch: fsg.apply(model, params, batch["x"], batch["y"]), None,
        optimizer=fsg.optim.adamw(1e-3), precision=policy or fsg.Policy(compute=torch.bfloat16), **compile_kw,
    )  # fmt: skip
    state = step.init(fsg.params(model))
    batches = [{"x": r[:, :-1].to(device), "y": r[:, 1:].to(device)} for r in rows]
    text = step.lower(state, batches[0]).as_text()
    losses = []
    for batch in batches:  # on CUDA: call 2 captures the step's graph, later calls replay it
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return text, losses, {k: v.clone() for k, v in state.params.items()}


TINY_GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt_run(cpu_passes: frozenset[str] = frozenset(), steps: int = 3, policy=None, **compile_kw):
    """Three steps (``steps``) of a tiny GPT (``TINY_GPT``) on one fixed batch of 2 x 16
    tokens, with the CUDA-only passes ``cpu_passes`` rewriting its CPU graph too
    (``Fusions(on_cpu=...)``): the tests that check a CUDA-only rewrite on CPU compare the step
    it rewrote with the plain one. Returns the graph's text, the last loss, the params."""
    from fsg._src.passes.options import Fusions

    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    fusions = Fusions(on_cpu=cpu_passes, **compile_kw.pop("fusions", {}))
    text, losses, params = gpt_bf16_steps(TINY_GPT, [x] * steps, policy=policy, fusions=fusions, **compile_kw)
    return text, losses[-1], params


def steps_beside_eager(step, state, reference: nn.Module, opt, batches, eager_loss, rtol=1e-5, atol=1e-6):
    """Runs the compiled ``step`` and eager PyTorch (``reference`` trained by the torch
    optimizer ``opt`` on ``eager_loss(reference, batch)``) side by side over ``batches``,
    holding their losses equal; returns the final state."""
    for batch in batches:
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = eager_loss(reference, batch)
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=rtol, atol=atol)
    return state


# "cpu", and "cuda" where there is a GPU (skipped elsewhere): for tests whose claim holds on both
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def import_torchvision():
    """``torchvision``, or ``None`` where it is not installed. Where its C++ library does not
    load (the PyPI wheel, built against CUDA torch, under the CPU build of torch), its import
    registers meta kernels for operators that do not exist and fails; the models use none of
    them, so it is imported again without those registrations."""
    try:
        import torchvision
    except ImportError:
        return None
    except RuntimeError:  # "operator torchvision::nms does not exist"
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision
