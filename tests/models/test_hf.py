"""Hugging Face models go through compile_step unchanged: 5 steps equal eager PyTorch with
torch.optim.AdamW (issue 21)."""

import copy

import pytest
import torch

import fsg

pytest.importorskip("transformers")

from tests.models import hf_models  # noqa: E402


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_five_steps_equal_eager_pytorch_with_adamw(kind):
    model = hf_models.make(kind)
    reference = copy.deepcopy(model)
    step = fsg.compile_step(
        hf_models.loss_fn(model), optimizer=fsg.optim.adamw(1e-3, b2=0.95, weight_decay=0.1), backend="eager"
    )
    state = step.init(fsg.params(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for i, batch in enumerate(hf_models.batches(5)):
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = reference(input_ids=batch["ids"], labels=batch["ids"]).loss
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i + 1}")
    named = dict(reference.named_parameters())  # tied weights appear once, as in fsg.params
    assert sorted(state.params) == sorted(named)
    for name, value in state.params.items():
        torch.testing.assert_close(value, named[name].detach(), rtol=1e-4, atol=1e-5, msg=name)
