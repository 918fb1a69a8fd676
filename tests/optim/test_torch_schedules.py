"""A torch.optim.lr_scheduler as fsg schedules (``fsg.optim.from_torch(..., scheduler=)``):
the learning rate at every step equals the one torch's scheduler sets, and training with it
equals torch's loop (``optimizer.step(); scheduler.step()``)."""

import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

import fsg
from fsg._src.optim._torch_schedules import schedules_of
from tests.helpers import mlp, regression_batch, rel_err
from tests.optim.test_against_torch import run_fsg

STEPS = 60


def _hugging_face(name, **kwargs):
    def make(optimizer):
        optimization = pytest.importorskip("transformers.optimization")
        return getattr(optimization, f"get_{name}_schedule_with_warmup")(optimizer, **kwargs)

    return make


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=7, gamma=0.5),
    "MultiStepLR, a milestone twice": lambda o: L.MultiStepLR(o, milestones=[10, 25, 25, 40], gamma=0.3),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.95),
    "CosineAnnealingLR, past T_max": lambda o: L.CosineAnnealingLR(o, T_max=25, eta_min=1e-4),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=20),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.25, total_iters=15),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=40, power=2.0),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=STEPS, cycle_momentum=False),
    "OneCycleLR, three phases, linear": lambda o: L.OneCycleLR(
        o, max_lr=0.05, total_steps=STEPS, pct_start=0.25, anneal_strategy="linear", three_phase=True,
        cycle_momentum=False),  # fmt: skip
    "SequentialLR: warm-up, cosine": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.01, total_iters=10), L.CosineAnnealingLR(o, T_max=50)], milestones=[10]),  # fmt: skip
    "transformers linear warm-up": _hugging_face("linear", num_warmup_steps=10, num_training_steps=50),
    "transformers cosine warm-up, 1.5 cycles": _hugging_face("cosine", num_warmup_steps=8, num_training_steps=55,
                                                             num_cycles=1.5),  # fmt: skip
    "transformers constant warm-up": _hugging_face("constant", num_warmup_steps=12),
    "transformers polynomial warm-up, past the end": _hugging_face(
        "polynomial_decay", num_warmup_steps=5, num_training_steps=40, lr_end=1e-4, power=2.0),  # fmt: skip
    "SequentialLR: constant, step, exponential": lambda o: L.SequentialLR(
        o, [L.ConstantLR(o, factor=0.5, total_iters=5), L.StepLR(o, 5, 0.5), L.ExponentialLR(o, 0.9)],
        milestones=[8, 30]),  # fmt: skip
}


def _two_groups():
    model = mlp(seed=3)
    return torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.02},
                            {"params": model[2].parameters()}], lr=0.05, momentum=0.9)  # fmt: skip


@pytest.mark.parametrize("name", SCHEDULERS)
def test_each_groups_learning_rate_equals_torchs_at_every_step(name):
    optimizer = _two_groups()
    scheduler = SCHEDULERS[name](optimizer)
    ours = schedules_of(scheduler, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() before optimizer.step()
        for t in range(STEPS):
            for group, schedule in zip(optimizer.param_groups, ours):
                assert float(schedule(torch.tensor(t, dtype=torch.int32))) == pytest.approx(group["lr"], rel=1e-6, abs=1e-12), t
            scheduler.step()


def test_training_with_a_translated_scheduler_equals_torchs_loop():
    """AdamW with a warm-up then cosine (SequentialLR) over two groups: 30 steps of
    ``optimizer.step(); scheduler.step()`` against the compiled step."""
    batches = [regression_batch(seed=i) for i in range(30)]

    def make(model):
        optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                                       {"params": model[2].parameters(), "weight_decay": 0.0}], lr=1e-2)  # fmt: skip
        warm, cos = L.LinearLR(optimizer, start_factor=0.1, total_iters=5), L.CosineAnnealingLR(optimizer, T_max=25)
        return optimizer, L.SequentialLR(optimizer, [warm, cos], milestones=[5])

    model = mlp(seed=3)
    optimizer, scheduler = make(model)
    for batch in batches:
        optimizer.zero_grad()
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        optimizer.step()
        scheduler.step()
    fsg_model = mlp(seed=3)
    optimizer, scheduler = make(fsg_model)
    state = run_fsg(fsg_model, fsg.optim.from_torch(optimizer, model=fsg_model, scheduler=scheduler), batches)
    for k, p in model.named_parameters():
        assert rel_err(state.params[k], p.detach()) < 1e-5, k


@pytest.mark.parametrize(
    "make, says",
    [(lambda o: L.LambdaLR(o, lambda step: min(1.0, step / 10)), "LambdaLR.*Python code.*Hugging Face"),
     (lambda o: L.ReduceLROnPlateau(o), "ReduceLROnPlateau.*reads the metric"),
     (lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=10), "cycle_momentum=False"),
     (lambda o: L.CyclicLR(o, 0.01, 0.1, cycle_momentum=False), "CyclicLR.*no closed form")],
)  # fmt: skip
def test_a_scheduler_without_a_closed_form_is_refused_by_name(make, says):
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(fsg.ArgumentError, match=says):
        fsg.optim.from_torch(optimizer, scheduler=make(optimizer))


def test_a_stepped_scheduler_or_another_optimizers_is_refused():
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    scheduler = L.StepLR(optimizer, 5)
    with pytest.raises(fsg.ArgumentError, match="scheduler of the optimizer given"):
        fsg.optim.from_torch(torch.optim.SGD(mlp().parameters(), lr=0.1), scheduler=scheduler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler.step()
    with pytest.raises(fsg.ArgumentError, match="must not have been stepped yet"):
        fsg.optim.from_torch(optimizer, scheduler=scheduler)
