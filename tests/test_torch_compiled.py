"""Code the user compiled with ``torch.compile`` inside a step's loss (a decorated helper, a
compiled module, ``module.compile()``) is traced as the Python it wraps and trains as eager
PyTorch does; it used to fail with torch's "Detected that you are using FX to symbolically
trace a dynamo-optimized function"."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsg
from tests.helpers import steps_beside_eager


@torch.compile
def _scaled_gelu(x):
    return F.gelu(x) * 2


class _WithHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(_scaled_gelu(self.a(x)))


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _submodule_compiled():
    model = _mlp()
    model[0] = torch.compile(model[0])
    return model


def _compiled_in_place():
    model = _mlp()
    model.compile()
    return model


MODELS = {
    "decorated helper": _WithHelper,
    "torch.compile(model)": lambda: torch.compile(_mlp()),
    "a compiled submodule": _submodule_compiled,
    "model.compile()": _compiled_in_place,
}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_torch_compiled_code_in_the_loss_trains_as_eager_pytorch(kind, backend):
    torch.manual_seed(0)
    model = MODELS[kind]()
    reference = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(),
                            optimizer=fsg.optim.adamw(1e-2), backend=backend)  # fmt: skip
    state = step.init(fsg.params(model))
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 2, generator=g)} for _ in range(3)]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-4)
    state = steps_beside_eager(step, state, reference, opt, batches, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state.params[name], value.detach(), rtol=1e-4, atol=1e-5, msg=name)
