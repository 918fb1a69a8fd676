"""PyTorch's OpInfo database (``op_db``) as cases of a compiled train step (issue 60).

For each differentiable op with float64 samples on the CPU, a ``Case`` takes one OpInfo sample:
its tensors that require grad are the parameters (a flat ``{path: tensor}``), every other
argument is a constant of ``loss_fn``. The loss is ``sum((out * w).sum())`` over the op's
differentiable outputs, ``w`` fixed random weights drawn once per output (so that a wrong
gradient cannot hide behind a symmetric one). ``train_eager`` trains it with ``torch.optim.SGD``;
the runners (``tests/corpus/test_opinfo.py`` on one device, ``tests/dist/opinfo_workers.py``
on a mesh) train it through ``fsg.compile_step`` and compare.

torch's own verdicts are honoured: an op whose OpInfo skips or expects to fail the gradient or
eager-consistency tests for float64 on the CPU (``skips``/``decorators``) is ``torch_skip``,
with the test named, not run. Ops fsg is expected to refuse are listed, each with its reason,
in ``tests/corpus/opinfo_expected.py``.

Example (skipped by the doctest run: loading ``op_db`` takes seconds, the corpus tests run it):
  >>> case = by_name("sigmoid")  # doctest: +SKIP
  >>> sorted(case.params)  # doctest: +SKIP
  ['input']
  >>> params, losses = train_eager(case)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import unittest
import zlib
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DTYPE = torch.float64
LR = 0.05
STEPS = 2
INDUCTOR_ONE_IN = 40
# The tests that say whether an op's float64 gradient and eager variants work: an OpInfo that
# skips or xfails one of them on the CPU for float64 is not run (torch's own verdict).
TORCH_TESTS = (
    ("TestBwdGradients", "test_fn_grad"),
    ("TestCommon", "test_variant_consistency_eager"),
    ("TestOperators", "test_grad"),
)


class Case(NamedTuple):
    name: str  # the OpInfo's full name: "name" or "name.variant_test_name", plus "[0-d]" for a 0-d sample
    op_name: str  # the OpInfo's full name
    params: dict[str, torch.Tensor]  # the sample's differentiable tensors by pytree path
    loss_fn: Callable[[dict, dict], torch.Tensor]  # loss_fn(params, batch) -> 0-d float64
    random: bool  # the op draws random numbers: eager's generator and fsg's keys differ
    aten: frozenset  # the ATen ops its eager forward runs on tensors computed from the parameters


def full_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@functools.lru_cache(maxsize=1)
def op_db() -> tuple[Any, ...]:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return tuple(db)


def _is_skip(decorator: Any) -> bool:
    """Whether ``decorator`` keeps a test from passing: ``unittest.skip(...)`` or
    ``unittest.expectedFailure`` (``skipIf(False, ...)``, tolerances, ``slowTest`` do not)."""
    if decorator in (unittest.expectedFailure, unittest.skip):
        return True
    return getattr(decorator, "__qualname__", "").startswith("skip.<locals>")


def torch_skip(op: Any) -> str | None:
    """The OpInfo test torch skips or xfails for this op's float64 gradient on the CPU, if any."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    for info in (*op.skips, *op.decorators):
        if not isinstance(info, DecorateInfo) or not any(map(_is_skip, info.decorators)):
            continue
        for cls_name, test in TORCH_TESTS:
            if info.is_active(cls_name, test, "cpu", DTYPE, {}):
                return f"{cls_name}.{test}"
    return None


def selected_ops() -> list[Any]:
    """The ops of ``op_db`` with float64 gradients on the CPU, in ``op_db``'s order."""
    return [
        op
        for op in op_db()
        if op.supports_autograd and DTYPE in op.supported_backward_dtypes("cpu") and DTYPE in op.supported_dtypes("cpu")
    ]


def _grad_leaves(sample: Any) -> dict[str, torch.Tensor]:
    leaves, _ = pytree.tree_flatten_with_path((sample.input, sample.args, sample.kwargs))
    return {
        _path(path): leaf
        for path, leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.dtype == DTYPE
    }


def _path(path: tuple) -> str:
    """``(SequenceKey(0), ...)`` of ``(input, args, kwargs)`` as ``input``, ``args[1]``, ``kwargs['weight']``."""
    head, *rest = path
    return ("input", "args", "kwargs")[head.idx] + "".join(str(k) for k in rest)


def _call(op: Any, sample: Any, params: dict[str, torch.Tensor]) -> Any:
    """The op on ``sample`` with its differentiable tensors replaced by ``params``."""
    paths, spec = pytree.tree_flatten_with_path((sample.input, sample.args, sample.kwargs))
    leaves = [params.get(_path(path), leaf) if isinstance(leaf, torch.Tensor) else leaf for path, leaf in paths]
    inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
    out = op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs)
    return sample.output_process_fn_grad(out)


def _outputs(out: Any) -> list[torch.Tensor]:
    """The op's differentiable outputs, complex ones as their real views."""
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return [torch.view_as_real(t.resolve_conj()) if t.is_complex() else t for t in tensors]


def _build(op: Any, sample: Any, name: str) -> Case | None:
    """The case of one sample, or None where eager gives nothing to train (no differentiable
    output, a non-finite loss or gradient)."""
    grads = _grad_leaves(sample)
    if not grads:
        return None
    params = {path: t.detach().clone() for path, t in grads.items()}
    probe = {path: t.clone().requires_grad_() for path, t in params.items()}
    try:
        outs = _outputs(_call(op, sample, probe))
    except Exception:  # noqa: BLE001 - a sample eager cannot run is not a case
        return None
    if not outs:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = [torch.rand(o.shape, generator=gen, dtype=DTYPE) + 0.5 for o in outs]

    def loss_fn(p: dict, batch: dict) -> torch.Tensor:
        return sum((o * w).sum() for o, w in zip(_outputs(_call(op, sample, p)), weights))

    with _Record() as record:
        loss = loss_fn(probe, {})
    if not loss.requires_grad or not torch.isfinite(loss):
        return None
    grad = torch.autograd.grad(loss, list(probe.values()), allow_unused=True)
    if not all(g is None or torch.isfinite(g).all() for g in grad):
        return None
    random = any(torch.Tag.nondeterministic_seeded in op.tags for op in record.ops)
    return Case(name, full_name(op), params, loss_fn, random, frozenset(record.on_params))


class _Record(TorchDispatchMode):
    """Records the ATen ops a forward calls (``ops``), and those it calls on tensors computed
    from the parameters (``on_params``: the ops a sharded step runs on DTensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()
        self.on_params: set[Any] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves((args, kwargs))):
            self.on_params.add(func)
        return func(*args, **(kwargs or {}))


def cases_of(op: Any, *, max_samples: int = 40) -> list[Case]:
    """The op's cases: its first usable sample, and its first usable one with a 0-d parameter
    (0-d float64 leaves once trained silently wrong under ``aot_eager``: issue 60)."""
    first = None
    for index, sample in enumerate(op.sample_inputs("cpu", DTYPE, requires_grad=True)):
        if index == max_samples:
            break
        zero_d = any(t.dim() == 0 for t in _grad_leaves(sample).values())
        if first is None:
            first = _build(op, sample, full_name(op))
            if first is not None and zero_d:
                break
        elif zero_d:
            scalar = _build(op, sample, full_name(op) + "[0-d]")
            if scalar is not None:
                return [first, scalar]
    return [] if first is None else [first]


def cases() -> list[Case]:
    """Every case of every selected op not skipped by torch."""
    return inventory().cases


class Inventory(NamedTuple):
    cases: list[Case]
    torch_skipped: dict[str, str]  # {op: the OpInfo test torch skips or xfails}
    unusable: list[str]  # ops none of whose samples eager can train (no differentiable output, non-finite)


@functools.lru_cache(maxsize=1)
def inventory() -> Inventory:
    """The corpus, and the selected ops that are not in it, with why."""
    found, skipped, unusable = [], {}, []
    for op in selected_ops():
        if (test := torch_skip(op)) is not None:
            skipped[full_name(op)] = test
        elif of_op := cases_of(op):
            found.extend(of_op)
        else:
            unusable.append(full_name(op))
    return Inventory(found, skipped, unusable)


def by_name(name: str) -> Case:
    """The case called ``name`` (built from its op alone: cheap on a rank)."""
    op = next(op for op in selected_ops() if full_name(op) == name.removesuffix("[0-d]"))
    return next(case for case in cases_of(op) if case.name == name)


def in_inductor_sample(name: str) -> bool:
    """Whether the case is among those also compiled with Inductor: ~1 in 32, chosen by a hash
    of its name (the same cases on every run; an op added to ``op_db`` does not reshuffle them)."""
    return zlib.crc32(name.encode()) % INDUCTOR_ONE_IN == 0


def train_eager(
    case: Case, *, lr: float = LR, steps: int = STEPS
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """``torch.optim.SGD`` on the case: ``(params after the steps, loss of each step)``."""
    params = {k: v.clone().requires_grad_() for k, v in case.params.items()}
    opt = torch.optim.SGD(params.values(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = case.loss_fn(params, {})
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {k: v.detach() for k, v in params.items()}, losses
