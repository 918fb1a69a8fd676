"""``fsg.optim.multi_transform`` (parameter groups) against ``torch.optim``'s param groups."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from tests.helpers import steps_beside_eager

GROUPS = {  # label: (fsg's transformation, torch.optim's group settings), AdamW with its own lr and decay
    "head": (lambda: fsg.optim.adamw(3e-2, weight_decay=0.1), {"lr": 3e-2, "weight_decay": 0.1}),
    "body": (lambda: fsg.optim.adamw(1e-3, weight_decay=0.0), {"lr": 1e-3, "weight_decay": 0.0}),
    "norm": (lambda: fsg.optim.adamw(1e-2, b1=0.8, weight_decay=0.5), {"lr": 1e-2, "betas": (0.8, 0.999), "weight_decay": 0.5}),
}  # fmt: skip


def _model(widths):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.LayerNorm(b), torch.nn.Tanh()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(2, 8), min_size=2, max_size=4), st.data(), st.sampled_from([1, 2]),
       st.sampled_from(["eager", "inductor"]))  # fmt: skip
def test_param_groups_train_as_torch_optim_param_groups(widths, data, accum_steps, backend):
    """Any assignment of an MLP's parameters to groups with their own learning rate, betas and
    weight decay (some frozen, too), with or without accumulation: 3 steps equal
    ``torch.optim.AdamW`` given the same param groups, parameters and losses."""
    model = _model(widths)
    names = [n for n, _ in model.named_parameters()]
    labels = {n: data.draw(st.sampled_from(sorted(GROUPS)), label=n) for n in names}
    frozen = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names) - 1), label="frozen"))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    reference = copy.deepcopy(model)
    opt = fsg.optim.multi_transform({k: make() for k, (make, _) in GROUPS.items()}, labels)
    step = fsg.compile_step(lambda p, b: _loss(lambda x: fsg.apply(model, p, x), b), optimizer=opt,
                            accum_steps=accum_steps, backend=backend)  # fmt: skip
    state = step.init(fsg.params(model))
    before = copy.deepcopy(state)
    params = dict(reference.named_parameters())
    groups = [{"params": [params[n] for n in names if labels[n] == k and n not in frozen], **kw}
              for k, (_, kw) in GROUPS.items()]  # fmt: skip
    torch_opt = torch.optim.AdamW([g for g in groups if g["params"]])
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, widths[0], generator=g), "y": torch.randn(8, widths[-1], generator=g)} for _ in range(3)]
    state = steps_beside_eager(step, state, reference, torch_opt, batches, _loss)
    for name in names:
        if name in frozen:
            assert torch.equal(state.params[name], before.params[name]), name
        else:
            torch.testing.assert_close(state.params[name], params[name].detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_set_to_zero_freezes_a_group_and_the_state_holds_only_each_groups_moments():
    params = {"w": torch.ones(3, 2), "b": torch.zeros(2), "head": torch.ones(2)}
    opt = fsg.optim.multi_transform({"train": fsg.optim.adam(0.1), "freeze": fsg.optim.set_to_zero()},
                                    {"w": "freeze", "b": "train", "head": "train"})  # fmt: skip
    step = fsg.compile_step(lambda p, b: sum((v * b).sum() for v in p.values()), optimizer=opt, backend="eager")
    state = step.init(params)
    assert isinstance(state.opt_state["train"][0].mu["w"], fsg.optim.MaskedNode)  # no moment for a frozen group
    state, _ = step(state, torch.tensor(1.0))
    assert torch.equal(state.params["w"], params["w"])
    assert not torch.equal(state.params["b"], params["b"])


def test_a_param_groups_state_survives_a_checkpoint_round_trip(tmp_path):
    labels = {"w": "a", "b": "b"}
    opt = fsg.optim.multi_transform({"a": fsg.optim.adamw(0.1), "b": fsg.optim.sgd(0.1, momentum=0.9)}, labels)
    step = fsg.compile_step(lambda p, b: ((p["w"] @ b + p["b"]) ** 2).sum(), optimizer=opt, backend="eager")
    state, _ = step(step.init({"w": torch.randn(2, 3), "b": torch.randn(2)}), torch.randn(3))
    fsg.checkpoint.save(tmp_path / "ckpt", state)
    restored = fsg.checkpoint.restore(tmp_path / "ckpt", step.init({"w": torch.zeros(2, 3), "b": torch.zeros(2)}))
    for a, b in zip(fsg._src.tree.flatten(state)[0], fsg._src.tree.flatten(restored)[0]):
        assert torch.equal(a, b)


def test_bad_labels_are_named():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    opt = fsg.optim.multi_transform({"a": fsg.optim.sgd(0.1)}, {"w": "a", "b": "c"})
    with pytest.raises(fsg.ArgumentError, match=r"params\['b'\] is labelled 'c', but transforms has no 'c'"):
        opt.init(params)
    opt = fsg.optim.multi_transform({"a": fsg.optim.sgd(0.1)}, {"w": "a"})
    with pytest.raises(fsg.ArgumentError, match=r"shaped like the params.*missing \[\"params\['b'\]\"\]"):
        opt.init(params)
    with pytest.raises(fsg.ArgumentError, match="non-empty dict"):
        fsg.optim.multi_transform({}, {"w": "a"})
    with pytest.raises(fsg.ArgumentError, match=r"\['a'\].*GradientTransformation"):
        fsg.optim.multi_transform({"a": torch.optim.SGD}, {"w": "a"})


def test_a_mask_function_that_fails_on_masked_leaves_is_explained():
    decay_2d = lambda p: {k: v.ndim >= 2 for k, v in p.items()}  # noqa: E731 - fails on a MaskedNode
    opt = fsg.optim.multi_transform({"a": fsg.optim.adamw(0.1, mask=decay_2d), "b": fsg.optim.sgd(0.1)}, {"w": "a", "b": "b"})
    with pytest.raises(fsg.ArgumentError, match=r"add_decayed_weights\(mask=...\).*MaskedNode.*group of their own"):
        opt.init({"w": torch.ones(2, 2), "b": torch.ones(2)})


def test_a_parameter_frozen_mid_run_keeps_its_moments_inside_its_group():
    """``frozen.keep`` finds a group's moments (trees with other groups' leaves masked): a
    parameter frozen after a step keeps its Adam moment and its momentum bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    labels = {"0.weight": "a", "0.bias": "b", "1.weight": "a", "1.bias": "b"}
    opt = fsg.optim.multi_transform({"a": fsg.optim.adamw(0.1), "b": fsg.optim.sgd(0.1, momentum=0.9)}, labels)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b).pow(2).mean(), optimizer=opt, backend="eager", donate=False)
    x = torch.randn(8, 4)
    state, _ = step(step.init(fsg.params(model)), x)
    model[0].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    with pytest.warns(fsg.RecompileWarning, match="requires_grad: True -> False"):
        after, _ = step(state, x)
    assert torch.equal(after.opt_state["a"][0].mu["0.weight"], state.opt_state["a"][0].mu["0.weight"])
    assert torch.equal(after.opt_state["b"][0].trace["1.bias"], state.opt_state["b"][0].trace["1.bias"])
    assert not torch.equal(after.opt_state["a"][0].mu["1.weight"], state.opt_state["a"][0].mu["1.weight"])
