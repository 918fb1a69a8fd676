"""One conformance suite that every optimizer in the registry passes."""

import pytest
import torch

import fsg

OPTIMIZERS = {
    "sgd": lambda: fsg.optim.sgd(0.1),
    "sgd_momentum": lambda: fsg.optim.sgd(0.05, momentum=0.9),
    "sgd_nesterov": lambda: fsg.optim.sgd(0.05, momentum=0.9, nesterov=True),
    "sgd_dampened_l2": lambda: fsg.optim.sgd(0.05, momentum=0.9, dampening=0.5, weight_decay=1e-3),
    "adam": lambda: fsg.optim.adam(0.05),
    "adamw": lambda: fsg.optim.adamw(0.05, weight_decay=0.01),
    "adamw_masked": lambda: fsg.optim.adamw(
        0.05, weight_decay=0.1, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}
    ),
    "adafactor": lambda: fsg.optim.adafactor(0.1),
    "rmsprop": lambda: fsg.optim.rmsprop(0.01, momentum=0.5),
    "adagrad": lambda: fsg.optim.adagrad(0.2),
    "lion": lambda: fsg.optim.lion(0.03, weight_decay=0.0),
    "adam_amsgrad_l2": lambda: fsg.optim.adam(0.05, weight_decay=1e-3, amsgrad=True),
    "nadam": lambda: fsg.optim.nadam(0.05),
    "radam": lambda: fsg.optim.radam(0.05, weight_decay=0.01, decoupled_weight_decay=True),
    "adamax": lambda: fsg.optim.adamax(0.05),
    "adadelta": lambda: fsg.optim.adadelta(5.0),
    "clipped_adamw_schedule": lambda: fsg.optim.chain(
        fsg.optim.clip_by_global_norm(1.0),
        fsg.optim.adamw(fsg.optim.warmup_cosine(0.05, warmup=5, total=200), weight_decay=0.0),
    ),
    "param_groups": lambda: fsg.optim.multi_transform(
        {"decay": fsg.optim.adamw(0.05, weight_decay=0.1), "no_decay": fsg.optim.sgd(0.1, momentum=0.5)},
        lambda p: {k: "decay" if v.ndim >= 2 else "no_decay" for k, v in p.items()},
    ),
    "muon_and_adam": lambda: fsg.optim.multi_transform(
        {"muon": fsg.optim.muon(0.05, weight_decay=0.0), "adam": fsg.optim.adam(0.05)},
        lambda p: {k: "muon" if v.ndim == 2 else "adam" for k, v in p.items()},
    ),
    "scale_by_schedule": lambda: fsg.optim.chain(
        fsg.optim.scale_by_adam(), fsg.optim.scale_by_schedule(fsg.optim.piecewise(-0.05, {100: 0.5}))
    ),
}


def quadratic_problem(dtype=torch.float32):
    target = {"w": torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=dtype), "b": torch.tensor([0.5, -1.0], dtype=dtype)}
    params = {"w": torch.zeros(2, 2, dtype=dtype), "b": torch.zeros(2, dtype=dtype)}

    def loss_fn(p, batch):
        return sum(((p[k].float() - target[k].float()) ** 2).sum() for k in p) * batch["scale"].mean()

    return params, loss_fn


@pytest.fixture(params=sorted(OPTIMIZERS))
def make_opt(request):
    return OPTIMIZERS[request.param]


def test_converges_on_a_quadratic(make_opt):
    opt = make_opt()
    params, loss_fn = quadratic_problem()
    batch = {"scale": torch.ones(1)}
    state = opt.init(params)
    first = loss_fn(params, batch)
    for _ in range(300):
        grads = torch.func.grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = fsg.optim.apply_updates(params, updates)
    assert loss_fn(params, batch) < 0.01 * first


def test_preserves_param_dtype(make_opt):
    opt = make_opt()
    params, loss_fn = quadratic_problem(torch.bfloat16)
    state = opt.init(params)
    new = params
    for _ in range(3):  # a warm-up schedule may start at 0
        grads = torch.func.grad(loss_fn)(new, {"scale": torch.ones(1)})
        updates, state = opt.update(grads, state, new)
        new = fsg.optim.apply_updates(new, updates)
    assert all(new[k].dtype == torch.bfloat16 for k in new)
    assert all(not torch.equal(new[k], params[k]) for k in new)


def test_compiles_once_and_replays(make_opt):
    params, loss_fn = quadratic_problem()
    step = fsg.compile_step(loss_fn, optimizer=make_opt(), backend="aot_eager")
    state = step.init(params)
    losses = []
    for _ in range(3):
        state, metrics = step(state, {"scale": torch.ones(1)})
        losses.append(float(metrics["loss"]))
    assert step.num_compiles == 1
    assert losses[-1] < losses[0]
    assert int(state.step) == 3


def test_state_survives_a_msgpack_checkpoint_round_trip(make_opt, tmp_path):
    opt = make_opt()
    params, loss_fn = quadratic_problem()
    state = opt.init(params)
    grads = torch.func.grad(loss_fn)(params, {"scale": torch.ones(1)})
    _, state = opt.update(grads, state, params)
    fsg.checkpoint.save(tmp_path / "opt", state)
    restored = fsg.checkpoint.restore(tmp_path / "opt", like=opt.init(params))
    leaves, leaves_back = fsg._src.tree.flatten(state)[0], fsg._src.tree.flatten(restored)[0]
    assert len(leaves) == len(leaves_back)
    for a, b in zip(leaves, leaves_back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fsg._src.tree.flatten(state)[1] == fsg._src.tree.flatten(restored)[1]
