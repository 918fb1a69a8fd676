"""``from_torch``: the ``fsg.optim`` transformation that computes what a ``torch.optim``
optimizer computes, from the optimizer (its one parameter group's hyperparameters) or its
class (torch's defaults). A training script moves to fsg without re-deriving its settings."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from fsg._src import checks
from fsg._src.optim import _adafactor, _adam_variants, _alias, _classic, _muon
from fsg._src.optim._base import GradientTransformation
from fsg._src.optim._multi import multi_transform, set_to_zero
from fsg._src.optim._torch_schedules import schedules_of


def _betas(group: dict) -> dict:
    return {"b1": group["betas"][0], "b2": group["betas"][1]}


def _adam(group: dict) -> tuple[Callable, dict]:
    kwargs = {**_betas(group), "eps": group["eps"], "weight_decay": group["weight_decay"], "amsgrad": group["amsgrad"]}
    return (_alias.adamw if group.get("decoupled_weight_decay") else _alias.adam), kwargs


# torch.optim class name -> group -> (fsg builder, its keyword arguments besides the learning rate)
_RECIPES: dict[str, Callable[[dict], tuple[Callable, dict]]] = {
    "SGD": lambda g: (_alias.sgd, {"momentum": g["momentum"] or None, "nesterov": g["nesterov"],
                                   "weight_decay": g["weight_decay"], "dampening": g["dampening"]}),  # fmt: skip
    "Adam": _adam,
    "AdamW": lambda g: (_alias.adamw, {**_betas(g), "eps": g["eps"], "weight_decay": g["weight_decay"],
                                       "amsgrad": g["amsgrad"]}),  # fmt: skip
    "NAdam": lambda g: (_adam_variants.nadam, {**_betas(g), "eps": g["eps"], "weight_decay": g["weight_decay"],
                                               "momentum_decay": g["momentum_decay"],
                                               "decoupled_weight_decay": g["decoupled_weight_decay"]}),  # fmt: skip
    "RAdam": lambda g: (_adam_variants.radam, {**_betas(g), "eps": g["eps"], "weight_decay": g["weight_decay"],
                                               "decoupled_weight_decay": g["decoupled_weight_decay"]}),  # fmt: skip
    "Adamax": lambda g: (_adam_variants.adamax, {**_betas(g), "eps": g["eps"], "weight_decay": g["weight_decay"]}),
    "Adadelta": lambda g: (_adam_variants.adadelta, {"rho": g["rho"], "eps": g["eps"], "weight_decay": g["weight_decay"]}),
    "Adagrad": lambda g: (_classic.adagrad, {"lr_decay": g["lr_decay"], "weight_decay": g["weight_decay"], "eps": g["eps"],
                                             "initial_accumulator_value": g["initial_accumulator_value"]}),  # fmt: skip
    "RMSprop": lambda g: (_classic.rmsprop, {"alpha": g["alpha"], "eps": g["eps"], "weight_decay": g["weight_decay"],
                                             "momentum": g["momentum"], "centered": g["centered"]}),  # fmt: skip
    "Muon": lambda g: (_muon.muon, {"weight_decay": g["weight_decay"], "momentum": g["momentum"],
                                    "nesterov": g["nesterov"], "ns_coefficients": tuple(g["ns_coefficients"]),
                                    "ns_steps": g["ns_steps"], "eps": g["eps"], "adjust_lr_fn": g["adjust_lr_fn"]}),  # fmt: skip
    "Adafactor": lambda g: (_adafactor.adafactor, {"beta2_decay": g["beta2_decay"], "eps": tuple(g["eps"]), "d": g["d"],
                                                   "weight_decay": g["weight_decay"]}),  # fmt: skip
}


def from_torch(
    optimizer: torch.optim.Optimizer | type, model: torch.nn.Module | None = None, *, scheduler: Any = None
) -> GradientTransformation:
    """The ``fsg.optim`` transformation equal to a ``torch.optim`` optimizer.

    Args:
      optimizer: a ``torch.optim`` optimizer (its hyperparameters are read; its state is
        not), or a ``torch.optim`` class (torch's default hyperparameters). SGD, Adam, AdamW,
        NAdam, RAdam, Adamax, Adadelta, Adagrad, RMSprop, Adafactor and Muon.
      model: the module whose parameters ``optimizer`` holds, needed where it has several
        parameter groups (no decay for biases and norms, say) or holds only some of the
        model's parameters (Muon's matrices): each group becomes a group of
        ``fsg.optim.multi_transform`` labelled ``"group0"``, ``"group1"``...; a parameter in no
        group is not trained (``set_to_zero``), as torch leaves it.
      scheduler: a fresh ``torch.optim.lr_scheduler`` of ``optimizer``, stepped once per
        optimizer step: each group's learning rate follows it, in closed form in the graph
        (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR,
        PolynomialLR, OneCycleLR without momentum cycling, a SequentialLR of them, and
        Hugging Face's ``get_*_schedule_with_warmup``).

    Returns:
      The transformation (``fsg.optim.adamw(...)``, or a ``multi_transform`` of them), tested
      to step as the torch optimizer does.

    Raises:
      ArgumentError: another optimizer, several parameter groups without ``model`` (or
        holding a tensor that is not one of its parameters), or ``maximize=True``: each names
        what to do instead. (How torch runs its step, ``foreach``, ``fused``, ``capturable``,
        does not matter.)

    Example:
      >>> opt = fsg.optim.from_torch(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=3e-4))
    """
    groups = getattr(optimizer, "param_groups", [None]) if not isinstance(optimizer, type) else [None]
    rates = schedules_of(scheduler, optimizer) if scheduler is not None else [None] * len(groups)
    if isinstance(optimizer, type) or (len(groups) == 1 and model is None):  # a class: one group of all params
        return _with_rate(optimizer, rates[0])
    name = type(optimizer).__name__
    if model is None:
        raise checks.fail(f"fsg.optim.from_torch({name}(...))", "has several parameter groups, so it needs the model "
                          "whose parameters they hold", f"{len(groups)} groups", "Pass model=: "
                          "fsg.optim.from_torch(optimizer, model=model)")  # fmt: skip
    label_of = {id(p): f"group{i}" for i, group in enumerate(groups) for p in group["params"]}
    labels = {n: label_of.get(id(p), "frozen") for n, p in model.named_parameters()}  # fsg.params' names
    unknown = len(label_of) - len({id(p) for _, p in model.named_parameters()} & set(label_of))
    if unknown:
        raise checks.fail(f"fsg.optim.from_torch({name}(...), model=...)", "holds tensors that are not parameters of "
                          "the model", f"{unknown} such tensor(s)", "Pass the module the optimizer was built on")  # fmt: skip
    transforms = {f"group{i}": _with_rate(_Group(optimizer, i), rates[i]) for i in range(len(groups))}
    return multi_transform({**transforms, "frozen": set_to_zero()}, labels)


def equivalent(optimizer: Any) -> str | None:
    """``'fsg.optim.adamw(0.001, b1=0.9, ...)'`` for a torch optimizer or class, or None
    where ``from_torch`` would refuse it (for an error message's fix)."""
    try:
        builder, lr, kwargs = _recipe(optimizer)
    except Exception:
        return None
    defaults = {k: p.default for k, p in inspect.signature(builder).parameters.items()}
    unset = [k for k, v in kwargs.items() if (v is False or v is None) and defaults.get(k, "") is v]  # off by default
    shown = ", ".join([repr(lr)] + [f"{k}={v!r}" for k, v in kwargs.items() if k not in unset])
    return f"fsg.optim.{builder.__name__}({shown})"


def _recipe(optimizer: Any) -> tuple[Callable, Any, dict]:
    cls = optimizer if isinstance(optimizer, type) else getattr(optimizer, "cls", type(optimizer))
    name = cls.__name__
    if not issubclass(cls, torch.optim.Optimizer) or name not in _RECIPES or cls.__module__.split(".")[0] != "torch":
        raise checks.fail("fsg.optim.from_torch(optimizer)", f"must be one of torch.optim's {', '.join(_RECIPES)}",
                          optimizer, "Build the fsg.optim transformation by hand (docs/optimizers.md)")  # fmt: skip
    if isinstance(optimizer, type):
        group = {k: p.default for k, p in inspect.signature(cls).parameters.items() if k != "params"}
        if group.get("lr") is inspect.Parameter.empty:
            raise checks.fail(f"fsg.optim.from_torch({name})", "needs a learning rate (torch's has no default)",
                              name, f"Pass an instance: fsg.optim.from_torch(torch.optim.{name}(params, lr=...))")  # fmt: skip
    elif len(optimizer.param_groups) != 1:
        raise checks.fail(f"fsg.optim.from_torch({name}(...))", "is one transformation per parameter group",
                          f"{len(optimizer.param_groups)} groups", "Call fsg.optim.from_torch(optimizer, model=model)")  # fmt: skip
    else:
        group = optimizer.param_groups[0]
    group = {k: _plain(v) for k, v in group.items() if k != "params"}
    if group.get("maximize"):
        raise checks.fail(f"fsg.optim.from_torch({name}(...))", "has no counterpart of maximize=True", True,
                          "Negate the loss instead")  # fmt: skip
    builder, kwargs = _RECIPES[name](group)
    return builder, group["lr"], kwargs


def _with_rate(group: Any, rate: Any) -> GradientTransformation:
    builder, lr, kwargs = _recipe(group)
    return builder(rate or lr, **kwargs)


class _Group:
    """One parameter group of a torch optimizer, seen as an optimizer with that group alone."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int):
        self.param_groups = [optimizer.param_groups[index]]
        self.cls = type(optimizer)


def _plain(value: Any) -> Any:
    """A hyperparameter as a Python value (torch takes 0-d tensors for ``lr``, ``betas``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return tuple(_plain(v) for v in value) if isinstance(value, tuple) else value
