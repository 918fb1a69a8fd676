"""fsg.optim.from_torch: the transformation that steps as a torch.optim optimizer does, read
from the optimizer (its hyperparameters) or its class (torch's defaults)."""

import inspect

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err
from tests.optim.test_against_torch import CASES, run_fsg, run_torch

CLASSES = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
           torch.optim.Adamax, torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adafactor]  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_transformation_of_a_torch_optimizer_steps_as_it(name):
    """Every configuration held to torch.optim (tests/optim/test_against_torch.py), given as
    the torch optimizer itself: twenty steps within 1e-5."""
    make_torch_opt, _ = CASES[name]
    batches = [regression_batch(seed=i) for i in range(20)]
    reference = run_torch(mlp(seed=3), make_torch_opt, batches)
    state = run_fsg(mlp(seed=3), fsg.optim.from_torch(make_torch_opt(mlp(seed=3).parameters())), batches)
    for k, ref in reference.items():
        assert rel_err(state.params[k], ref) < 1e-5, k


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_class_gives_torch_defaults(cls):
    """A class is its defaults: the same transformation as an instance built with none, and
    five steps of it equal torch's."""
    from fsg._src.optim._from_torch import equivalent

    instance = cls(mlp(seed=3).parameters())
    assert equivalent(cls) == equivalent(instance) and equivalent(cls).startswith("fsg.optim.")
    batches = [regression_batch(seed=i) for i in range(5)]
    reference = run_torch(mlp(seed=3), cls, batches)
    state = run_fsg(mlp(seed=3), fsg.optim.from_torch(cls), batches)
    for k, ref in reference.items():
        assert rel_err(state.params[k], ref) < 1e-5, k


def test_an_optimizer_of_some_parameters_leaves_the_others_untrained():
    """torch's Muon takes matrices only: given the model, the biases it does not hold stay as
    they are (torch leaves them); the weights step as the Muon built by hand, bit for bit, and
    as torch's within bfloat16's reach (Newton-Schulz rounds the gradient to bfloat16, so
    float32 differences of 1e-7 in it reach 5e-4 relative after 4 steps)."""
    batches = [regression_batch(seed=i) for i in range(4)]

    def make(model):
        return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02, nesterov=False)

    torch_model, fsg_model = mlp(seed=3), mlp(seed=3)
    reference = run_torch(torch_model, lambda _: make(torch_model), batches)
    state = run_fsg(fsg_model, fsg.optim.from_torch(make(fsg_model), model=fsg_model), batches, backend="eager")
    labels = {k: "muon" if v.ndim == 2 else "frozen" for k, v in fsg.params(fsg_model).items()}
    by_hand = fsg.optim.multi_transform({"muon": fsg.optim.muon(0.02, nesterov=False), "frozen": fsg.optim.set_to_zero()},
                                        labels)  # fmt: skip
    want = run_fsg(mlp(seed=3), by_hand, batches, backend="eager")
    for k, ref in reference.items():
        assert torch.equal(state.params[k], want.params[k]), k
        assert rel_err(state.params[k], ref) < 2e-3, k
    assert torch.equal(state.params["0.bias"], mlp(seed=3).state_dict()["0.bias"])


def test_tensor_hyperparameters_and_adams_decoupled_decay():
    params = list(mlp(seed=3).parameters())
    opt = torch.optim.Adam(params, lr=torch.tensor(1e-2), betas=(torch.tensor(0.8), torch.tensor(0.99)), weight_decay=0.1,
                           decoupled_weight_decay=True)  # fmt: skip
    from fsg._src.optim._from_torch import equivalent

    assert equivalent(opt) == "fsg.optim.adamw(0.009999999776482582, b1=0.800000011920929, b2=0.9900000095367432, eps=1e-08, weight_decay=0.1)"


def test_parameter_groups_become_groups_of_a_multi_transform():
    """The usual no-decay group for biases, another learning rate for the last layer, and a
    parameter in no group (torch leaves it; so does fsg): twenty steps as torch's."""

    def make(parameters_of):
        model = dict(parameters_of.named_parameters())
        return torch.optim.AdamW([
            {"params": [model["0.weight"]], "weight_decay": 0.1},
            {"params": [model["0.bias"]], "weight_decay": 0.0},
            {"params": [model["2.weight"]], "lr": 3e-2, "betas": (0.8, 0.9)},
        ], lr=1e-2)  # fmt: skip

    batches = [regression_batch(seed=i) for i in range(20)]
    torch_model, fsg_model = mlp(seed=3), mlp(seed=3)
    reference = run_torch(torch_model, lambda _: make(torch_model), batches)
    state = run_fsg(fsg_model, fsg.optim.from_torch(make(fsg_model), model=fsg_model), batches)
    assert torch.equal(state.params["2.bias"], mlp(seed=3).state_dict()["2.bias"])  # in no group: not trained
    for k, ref in reference.items():
        assert rel_err(state.params[k], ref) < 1e-5, k


def test_what_cannot_be_translated_is_refused_with_the_fix():
    model = mlp(seed=3)
    groups = [{"params": [model[0].weight]}, {"params": [p for n, p in model.named_parameters() if n != "0.weight"]}]
    with pytest.raises(fsg.ArgumentError, match="several parameter groups.*model=model"):
        fsg.optim.from_torch(torch.optim.AdamW(groups, lr=1e-3))
    with pytest.raises(fsg.ArgumentError, match="not parameters of the model"):
        fsg.optim.from_torch(torch.optim.AdamW(groups, lr=1e-3), model=mlp(seed=4))
    with pytest.raises(fsg.ArgumentError, match="maximize=True.*Negate the loss"):
        fsg.optim.from_torch(torch.optim.SGD(model.parameters(), lr=0.1, maximize=True))
    with pytest.raises(fsg.ArgumentError, match="must be one of torch.optim's SGD, Adam"):
        fsg.optim.from_torch(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(fsg.ArgumentError, match="must be one of torch.optim's"):
        fsg.optim.from_torch(fsg.optim.adam(1e-3))


def test_compile_step_given_a_torch_optimizer_names_its_fsg_equivalent():
    model = mlp(seed=3)
    with pytest.raises(fsg.ArgumentError) as info:
        fsg.compile_step(mse_loss_fn(model), optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))
    message = str(info.value)
    assert "this one is fsg.optim.adamw(0.0003, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.1)" in message
    assert "fsg.optim.from_torch(optimizer)" in message
    assert list(inspect.signature(fsg.optim.from_torch).parameters) == ["optimizer", "model", "scheduler"]
