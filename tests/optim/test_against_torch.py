"""compile_step with fsg.optim matches torch.optim step for step (float32)."""

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err


def run_torch(model, make_torch_opt, batches):
    opt = make_torch_opt(model.parameters())
    for batch in batches:
        opt.zero_grad()
        out = model(batch["x"])
        ((out - batch["y"]) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def run_fsg(model, fsg_opt, batches, backend="aot_eager"):
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg_opt, backend=backend)
    state = step.init(fsg.params(model))
    for batch in batches:
        state, _ = step(state, batch)
    return state


CASES = {
    "adamw": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        lambda: fsg.optim.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
    ),
    "adam": (
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda: fsg.optim.adam(1e-2),
    ),
    "sgd_momentum": (
        lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9),
        lambda: fsg.optim.sgd(5e-2, momentum=0.9),
    ),
    "sgd_nesterov": (
        lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True),
        lambda: fsg.optim.sgd(5e-2, momentum=0.9, nesterov=True),
    ),
    "sgd_l2_dampening": (
        lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, dampening=0.3, weight_decay=5e-3),
        lambda: fsg.optim.sgd(5e-2, momentum=0.9, dampening=0.3, weight_decay=5e-3),
    ),
    "sgd_nesterov_l2": (
        lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=5e-3),
        lambda: fsg.optim.sgd(5e-2, momentum=0.9, nesterov=True, weight_decay=5e-3),
    ),
    "rmsprop": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
        lambda: fsg.optim.rmsprop(1e-3),
    ),
    "rmsprop_centered_momentum_decay": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, momentum=0.9, centered=True, weight_decay=0.01),
        lambda: fsg.optim.rmsprop(1e-3, alpha=0.9, momentum=0.9, centered=True, weight_decay=0.01),
    ),
    "adafactor": (
        lambda p: torch.optim.Adafactor(p, lr=1e-2),
        lambda: fsg.optim.adafactor(1e-2),
    ),
    "adafactor_options": (
        lambda p: torch.optim.Adafactor(p, lr=5e-2, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=2.0, weight_decay=0.01),
        lambda: fsg.optim.adafactor(5e-2, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=2.0, weight_decay=0.01),
    ),
    "adagrad": (
        lambda p: torch.optim.Adagrad(p, lr=5e-2),
        lambda: fsg.optim.adagrad(5e-2),
    ),
    "adam_l2_amsgrad": (
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, amsgrad=True),
        lambda: fsg.optim.adam(1e-2, weight_decay=0.05, amsgrad=True),
    ),
    "adamw_amsgrad": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True),
        lambda: fsg.optim.adamw(1e-2, b1=0.8, b2=0.9, weight_decay=0.1, amsgrad=True),
    ),
    "nadam": (
        lambda p: torch.optim.NAdam(p, lr=1e-2),
        lambda: fsg.optim.nadam(1e-2),
    ),
    "nadam_decoupled_decay": (
        lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1, momentum_decay=0.01, decoupled_weight_decay=True),
        lambda: fsg.optim.nadam(1e-2, weight_decay=0.1, momentum_decay=0.01, decoupled_weight_decay=True),
    ),
    "radam": (  # rectified from step 6 on (rho_t > 5): both branches within the 20 steps
        lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.05),
        lambda: fsg.optim.radam(1e-2, weight_decay=0.05),
    ),
    "radam_decoupled_decay": (
        lambda p: torch.optim.RAdam(p, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, decoupled_weight_decay=True),
        lambda: fsg.optim.radam(1e-2, b2=0.99, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "adamax": (
        lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.05),
        lambda: fsg.optim.adamax(1e-2, weight_decay=0.05),
    ),
    "adadelta": (
        lambda p: torch.optim.Adadelta(p),
        lambda: fsg.optim.adadelta(),
    ),
    "adadelta_options": (
        lambda p: torch.optim.Adadelta(p, lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.05),
        lambda: fsg.optim.adadelta(0.5, rho=0.8, eps=1e-5, weight_decay=0.05),
    ),
    "adagrad_lr_decay_initial_decay": (
        lambda p: torch.optim.Adagrad(p, lr=5e-2, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
        lambda: fsg.optim.adagrad(5e-2, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_twenty_steps_match_torch_optim(name):
    make_torch_opt, make_fsg_opt = CASES[name]
    batches = [regression_batch(seed=i) for i in range(20)]
    reference = run_torch(mlp(seed=3), make_torch_opt, batches)
    state = run_fsg(mlp(seed=3), make_fsg_opt(), batches)
    assert int(state.step) == 20
    for k, ref in reference.items():
        assert rel_err(state.params[k], ref) < 1e-5, k
        assert not torch.equal(ref, mlp(seed=3).state_dict()[k])  # it trained


def test_adamw_matches_torch_optim_with_a_schedule():
    """The learning rate changes every step inside the graph; torch's changes via param_groups."""
    schedule = fsg.optim.warmup_cosine(1e-2, warmup=5, total=20)
    batches = [regression_batch(seed=i) for i in range(20)]
    model = mlp(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=float(schedule(0)), weight_decay=0.05)
    for i, batch in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = float(schedule(i))
        opt.zero_grad()
        ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
    state = run_fsg(mlp(seed=4), fsg.optim.adamw(schedule, weight_decay=0.05), batches)
    for k, p in model.named_parameters():
        assert rel_err(state.params[k], p.detach()) < 1e-5, k


@pytest.mark.parametrize("name", sorted(CASES))
def test_twenty_steps_match_torch_optim_in_float64(name):
    """float64 params: bias corrections, constant learning rates and norms in float64, as
    torch.optim computes them (in Python floats), so the steps agree to float64's rounding."""
    make_torch_opt, make_fsg_opt = CASES[name]
    batches = [{k: v.double() for k, v in regression_batch(seed=i).items()} for i in range(20)]
    reference = run_torch(mlp(seed=3).double(), make_torch_opt, batches)
    step = fsg.compile_step(mse_loss_fn(mlp(seed=3).double()), optimizer=make_fsg_opt(), backend="aot_eager",
                            precision=fsg.Policy(param=torch.float64, compute=torch.float64))  # fmt: skip
    state = step.init(fsg.params(mlp(seed=3).double()))
    for batch in batches:
        state, _ = step(state, batch)
    for k, ref in reference.items():
        assert state.params[k].dtype == torch.float64
        assert rel_err(state.params[k], ref) < 1e-12, k


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["nadam_decoupled_decay", "radam"])
def test_scheduled_scalars_match_torch_optim_under_inductor(name):
    """NAdam's momentum schedule and RAdam's rectification (float64 scalars in a float32
    step) through Inductor's fused kernels."""
    make_torch_opt, make_fsg_opt = CASES[name]
    batches = [regression_batch(seed=i) for i in range(20)]
    reference = run_torch(mlp(seed=3), make_torch_opt, batches)
    state = run_fsg(mlp(seed=3), make_fsg_opt(), batches, backend="inductor")
    for k, ref in reference.items():
        assert rel_err(state.params[k], ref) < 1e-5, k
