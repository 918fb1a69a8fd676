"""Hooks users put on modules and parameters run in a compiled step as in eager PyTorch: a
parameter's own gradient hook (``p.register_hook``: masking or scaling its gradient), tensor
hooks inside ``forward`` (gradient reversal), module forward, forward-pre and full backward
hooks, and pruning's forward-pre hook with its mask buffer."""

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import fsg
from fsg._src import _torch_private


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _param_hook_scale():
    model = _mlp()
    model[0].weight.register_hook(lambda g: g * 10)
    return model


def _param_hook_mask():  # train only some rows of an embedding: its gradient masked
    model = nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(24, 3))
    trainable = (torch.arange(10) >= 4).float()[:, None]
    model[0].weight.register_hook(lambda g: g * trainable)
    return model


class _GradientReversal(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x)
        if h.requires_grad:
            h.register_hook(lambda g: -0.5 * g)
        return self.head(torch.tanh(h))


def _module_hooks():
    model = _mlp()
    model[0].register_forward_hook(lambda m, i, o: o * 2)
    model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    model[2].register_full_backward_hook(lambda m, gi, go: tuple(None if g is None else 3 * g for g in gi))
    return model


def _pruned():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    return model


MODELS = {
    "p.register_hook scaling": (_param_hook_scale, lambda g: torch.randn(6, 6, generator=g)),
    "p.register_hook masking embedding rows": (_param_hook_mask, lambda g: torch.randint(0, 10, (6, 4), generator=g)),
    "a tensor hook in forward (gradient reversal)": (_GradientReversal, lambda g: torch.randn(6, 6, generator=g)),
    "forward, forward-pre and full backward hooks": (_module_hooks, lambda g: torch.randn(6, 6, generator=g)),
    "torch.nn.utils.prune (forward-pre hook, mask buffer)": (_pruned, lambda g: torch.randn(6, 6, generator=g)),
}


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_hooks_run_as_in_eager(name, accum_steps):
    make, draw = MODELS[name]
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    ref = make()  # (pruned modules cannot be deep-copied)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": draw(g), "y": torch.randn(6, 3, generator=g)} for _ in range(3)]

    def loss_fn(params, batch, buffers=None):
        return ((fsg.apply(model, params, batch["x"], buffers=buffers) - batch["y"]) ** 2).mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adam(1e-2), backend="aot_eager", accum_steps=accum_steps)
    state = step.init(fsg.params(model), buffers=fsg.buffers(model))
    opt = torch.optim.Adam(ref.parameters(), 1e-2)
    for batch in batches:
        state, metrics = step(state, batch)
        opt.zero_grad()
        for x, y in zip(batch["x"].chunk(accum_steps), batch["y"].chunk(accum_steps)):  # a backward per microbatch
            (((ref(x) - y) ** 2).mean() / accum_steps).backward()
        opt.step()
    for name_, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name_], p.detach(), rtol=1e-5, atol=1e-6, msg=name_)
    if name.startswith("p.register_hook masking"):  # the masked rows never moved
        assert torch.equal(state.params["0.weight"][:4], model[0].weight.detach()[:4])


def test_a_post_accumulate_grad_hook_is_refused():
    model = _mlp()
    model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).sum(), optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    with pytest.raises(fsg.UnsupportedError, match=r"'0.weight' of Sequential has a post-accumulate-grad hook"):
        step(step.init(fsg.params(model)), torch.randn(2, 6))


def test_apply_outside_a_step_leaves_the_callers_params_without_hooks():
    model = _param_hook_scale()
    params = {k: v.detach().clone().requires_grad_() for k, v in fsg.params(model).items()}
    x = torch.randn(2, 6)
    fsg.apply(model, params, x).sum().backward()
    reference = {k: v.detach().clone().requires_grad_() for k, v in fsg.params(model).items()}
    torch.func.functional_call(model, reference, (x,)).sum().backward()  # torch's own call: no hook
    assert _torch_private.grad_hooks(params["0.weight"]) == ([], False)  # the hook went on a view of it
    torch.testing.assert_close(params["0.weight"].grad, 10 * reference["0.weight"].grad)  # and ran, as in eager
