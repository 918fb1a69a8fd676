"""Activation checkpointing (``torch.utils.checkpoint``) inside a compiled step: the forward that
runs again in the backward reads the step's parameters, so the step equals eager PyTorch's;
cases torch cannot trace, or that would be ambiguous, are refused by name
(``fsg/_src/recompute.py``)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import fsg
from tests.helpers import steps_beside_eager


class _Checkpointed(nn.Module):
    """Blocks of Linear + GELU (+ dropout-free residual), each run through ``checkpoint``
    (non-reentrant) when ``checkpointed``, by module or by a closure over its parameters."""

    def __init__(self, width, depth, checkpointed, closure):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 2)
        self.checkpointed, self.closure = checkpointed, closure

    def forward(self, x):
        for block in self.blocks:
            if not self.checkpointed:
                x = x + block(x)
            elif self.closure:  # the function reads the module's weight itself
                x = x + checkpoint(lambda h, b=block: torch.nn.functional.gelu(h @ b[0].weight.t() + b[0].bias), x,
                                   use_reentrant=False)  # fmt: skip
            else:
                x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _batches(n, width):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, width, generator=g), "y": torch.randn(8, 2, generator=g)} for _ in range(n)]


def _loss(model):
    return lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean()


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 3), st.sampled_from([4, 8]), st.booleans(), st.sampled_from([1, 2]))
def test_checkpointed_steps_equal_eager_pytorch(depth, width, closure, accum_steps):
    """Three AdamW steps: the second and later ones took their gradients at the initial weights
    before the fix (the rerun read the module's own parameters), so steps 2 and 3 differed."""
    torch.manual_seed(0)
    model = _Checkpointed(width, depth, True, closure)
    reference = copy.deepcopy(model)
    step = fsg.compile_step(_loss(model), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.01),
                            accum_steps=accum_steps, backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    eager_loss = lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean()  # noqa: E731
    state = steps_beside_eager(step, state, reference, opt, _batches(3, width), eager_loss)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_hugging_face_model_with_gradient_checkpointing_trains_as_eager_pytorch():
    T = pytest.importorskip("transformers")
    config = T.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    reference = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, **b).loss, optimizer=fsg.optim.adamw(1e-2), backend="eager")
    state = step.init(fsg.params(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (2, 16), generator=g)), "labels": ids} for _ in range(3)]
    state = steps_beside_eager(step, state, reference, opt, batches, lambda m, b: m(**b).loss)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-4, msg=name)


def test_reentrant_checkpointing_is_refused_with_the_fix():
    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU())

        def forward(self, x):
            return checkpoint(self.block, self.embed(x), use_reentrant=True).sum()

    model = Reentrant()
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b["x"]), optimizer=fsg.optim.sgd(0.1), backend="eager")
    with pytest.raises(fsg.UnsupportedError, match=r"use_reentrant=True.*Checkpoint with use_reentrant=False"):
        step(step.init(fsg.params(model)), {"x": torch.randn(3, 4)})


def test_one_module_with_two_parameter_sets_is_refused_only_where_it_reruns():
    """A teacher and a student sharing one module object: fine without checkpointing (each
    call reads its own set); with it, the rerun in the backward could read either: refused."""
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = _Checkpointed(4, 1, checkpointed, False)

        def loss_fn(params, batch):
            teacher = {k: v.detach() * 0.5 for k, v in params.items()}
            return ((fsg.apply(model, params, batch["x"]) - fsg.apply(model, teacher, batch["x"])) ** 2).mean()

        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
        state = step.init(fsg.params(model))
        if not checkpointed:
            step(state, _batches(1, 4)[0])
            continue
        with pytest.raises(fsg.UnsupportedError, match=r"runs again in the backward .* 2 different parameter sets"):
            step(state, _batches(1, 4)[0])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_a_checkpointed_block_with_dropout_reruns_the_forwards_masks(p):
    """torch.utils.checkpoint saves torch's CPU generator state before the checkpointed forward
    and restores it for the rerun; fsg's keyed dropout counts its calls in that generator
    (trace/random.py), so the rerun draws the forward's masks and the step equals the
    un-checkpointed one bit for bit (before: new masks, gradients ~1e-2 off)."""

    class Block(nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(6, 32), nn.Dropout(p), nn.GELU(), nn.Linear(32, 6), nn.Dropout(p))
            self.head, self.checkpointed = nn.Linear(6, 2), checkpointed

        def forward(self, x):
            return self.head(checkpoint(self.a, x, use_reentrant=False) if self.checkpointed else self.a(x))

    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Block(checkpointed).train()
        step = fsg.compile_step(_loss(model), optimizer=fsg.optim.adamw(1e-2), backend="eager")
        state = step.init(fsg.params(model), seed=3)
        for batch in _batches(2, 6):
            state, metrics = step(state, batch)
        runs.append((float(metrics["loss"]), state.params))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[0][1].items():
        assert torch.equal(value, runs[1][1][name]), name
