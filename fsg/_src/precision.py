"""Mixed precision: the dtype parameters are stored in and the dtype the loss computes in."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from fsg._src import checks, tree
from fsg._src.float8_config import Float8, check_float8


class DynamicLossScale(NamedTuple):
    """Dynamic loss scaling for float16 compute (as ``torch.amp.GradScaler``), inside the graph.

    The loss is multiplied by the scale before the backward and the gradients divided by it
    after, so small float16 gradients do not flush to zero. A step whose loss or gradients
    are not finite is skipped and halves the scale (``backoff``, down to ``min_scale``);
    ``growth_interval`` finite steps in a row double it (``growth``). The scale lives in
    ``TrainState.loss_scale`` and is checkpointed with the state.

    Attributes:
      initial: the first scale. 2**15, not GradScaler's 2**16: 65536 is not a float16, so a
        loss computed in float16 would overflow at every first step.
      growth_interval: finite steps in a row after which the scale grows.
      growth: the factor it grows by.
      backoff: the factor it shrinks by at a non-finite step.
      min_scale: the floor the scale never goes below.

    Example:
      >>> policy = fsg.Policy(compute=torch.float16)  # DynamicLossScale() by default
      >>> policy.loss_scale.initial, policy.loss_scale.growth_interval
      (32768.0, 2000)
    """

    initial: float = 2.0**15
    growth_interval: int = 2000
    growth: float = 2.0
    backoff: float = 0.5
    min_scale: float = 1.0


class _PolicyFields(NamedTuple):
    param: torch.dtype | None
    compute: torch.dtype | None
    reduce: torch.dtype | None
    loss_scale: DynamicLossScale | None
    autocast: bool
    matmul: Float8 | None


class Policy(_PolicyFields):
    """Which floating-point dtypes a step uses.

    Attributes:
      param: the dtype parameters and optimizer state are kept and updated in. Left out
        (``None``), the model's own precision, at least float32: float64 when a floating-point
        or complex parameter is float64 or complex128 (a ``model.double()`` trains in float64,
        as in eager PyTorch), else float32 (a bfloat16 model gets float32 master weights).
        ``step.init`` casts floating-point params to it, and the state's buffers of a dtype it
        changes (a bfloat16 model's running statistics become float32 with its weights; a
        float32 buffer of that model stays float32).
      compute: the dtype the loss runs in; left out (``None``), the param dtype. Floating-point parameters are
        cast to it where the loss reads them (before an FSDP all-gather, so gathers move the
        smaller dtype) and floating-point batch leaves on entry; gradients come back in the
        ``param`` dtype through the cast's backward.
      reduce: on a mesh, the dtype gradients are summed across ranks in (all-reduce,
        reduce-scatter); ``None`` (default) reduces them in the dtype they come in (``param``).
        ``torch.bfloat16`` halves the bytes the reductions move (as FSDP2's
        ``MixedPrecisionPolicy(reduce_dtype=...)`` or DDP's ``bf16_compress_hook``); each
        rank's sum is then rounded to bf16 once before the reduction and the result cast back,
        so the update differs from the float32 reduction by about bf16's precision (3 digits).
      loss_scale: a ``DynamicLossScale``, or ``None``. Left out, float16 compute gets
        ``DynamicLossScale()`` and other dtypes none; ``False`` turns it off for float16.
      autocast: ``False`` (default): every floating-point parameter and batch leaf is cast to
        ``compute`` where the loss reads it, so every op runs in ``compute``. ``True``: the loss
        runs under ``torch.autocast(dtype=compute)`` instead and nothing is cast up front:
        matmuls and convolutions run in ``compute``, while the ops autocast keeps in float32
        (embedding, layer norm, softmax, losses, reductions) and their gradients stay in
        float32, as in a ``torch.compile`` + autocast baseline (the same numerics, op for op).
        On a mesh, FSDP then gathers parameters in ``param``'s dtype.
      matmul: ``None`` (default), or an ``fsg.Float8`` to run the linear layers' matmuls in FP8
        (a stage-3 pass; needs a bfloat16 or float16 ``compute``, one device or a
        data-parallel or FSDP mesh, and on CUDA a GPU with FP8 tensor cores). Evaluation steps (``compile_eval``) run them in ``compute``.

    Example:
      >>> policy = fsg.Policy(param=torch.float32, compute=torch.bfloat16)
      >>> policy.cast_compute({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})["x"].dtype
      torch.bfloat16
    """

    __slots__ = ()

    def __new__(
        cls,
        param: torch.dtype | None = None,
        compute: torch.dtype | None = None,
        reduce: torch.dtype | None = None,
        loss_scale: DynamicLossScale | bool | None = None,
        autocast: bool = False,
        matmul: Float8 | None = None,
    ) -> Policy:
        if loss_scale is None or loss_scale is True:
            loss_scale = DynamicLossScale() if compute == torch.float16 or loss_scale else None
        elif loss_scale is False:
            loss_scale = None
        policy = super().__new__(cls, param, compute, reduce, loss_scale, autocast, matmul)
        check_policy(policy)
        return policy

    def resolve(self, params: Any) -> Policy:
        """This policy with ``param`` and ``compute`` filled in where left out, from the
        parameter tree (or list of leaves) ``params``: the dtypes the step then uses."""
        if self.param is not None and self.compute is not None:
            return self
        wide = any(t.dtype in (torch.float64, torch.complex128) for t in tree.flatten(params)[0])
        param = self.param or (torch.float64 if wide else torch.float32)
        return self._replace(param=param, compute=self.compute or param)

    def cast_compute(self, tree_: Any) -> Any:
        """Floating-point leaves of ``tree_`` in the compute dtype (as they are under
        ``autocast``, which casts per op); other leaves unchanged."""
        if self.autocast:
            return tree_
        return tree.tree_map(lambda t: in_dtype(t, self.compute), tree_)

    def read_param(self, p: torch.Tensor) -> torch.Tensor:
        """A parameter as the loss reads it: in the compute dtype (``in_dtype``), or as it is
        under autocast."""
        return p if self.autocast else in_dtype(p, self.compute)

    def region(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Where the loss runs: under ``torch.autocast`` with ``autocast=True`` and a compute
        dtype other than float32, else no context."""
        if not self.autocast or self.compute in (None, torch.float32):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def cast_param(self, tree_: Any) -> Any:
        """Floating-point (and complex) leaves of ``tree_`` in the param dtype (``in_dtype``);
        other leaves unchanged."""
        return tree.tree_map(lambda t: in_dtype(t, self.param), tree_)

    def cast_buffers(self, buffers: Any, params: Any) -> Any:
        """``buffers`` whose dtype is one that ``cast_param`` changes in ``params`` (the model's
        own floating dtype) in the param dtype too: a module's buffers follow its parameters, as
        ``module.to(dtype)`` moves both (BatchNorm's running statistics must match the weight it
        normalizes with; a complex buffer follows complex parameters); buffers of any other
        dtype unchanged."""
        changed = {p.dtype for p in tree.flatten(params)[0] if dtype_in(p.dtype, self.param) != p.dtype}
        return tree.tree_map(lambda b: b.to(dtype_in(b.dtype, self.param)) if b.dtype in changed else b, buffers)


_COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating-point; a complex ``t`` in the complex dtype of
    ``dtype``'s precision (float32: complex64, float64: complex128), or as it is where there is
    none (bfloat16, float16: a complex parameter is not cast down); integer and bool ``t`` as
    it is."""
    return t.to(dtype_in(t.dtype, dtype))


def dtype_in(own: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``in_dtype`` gives a tensor of dtype ``own``."""
    if own.is_floating_point:
        return dtype
    return _COMPLEX_OF[dtype] if own.is_complex and dtype in _COMPLEX_OF else own


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` where it is float32 or wider (float64), else float32: the dtype of a metric."""
    return torch.promote_types(dtype, torch.float32)


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is a valid ``Policy``; an ``ArgumentError`` naming the field otherwise."""
    checks.instance("precision", policy, Policy, what="an fsg.Policy",
                    fix="E.g. precision=fsg.Policy(compute=torch.bfloat16)")  # fmt: skip
    for name in ("param", "compute", "reduce"):
        dtype = getattr(policy, name)
        if dtype is None:  # param, compute: from the params (Policy.resolve); reduce: as they come
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise checks.fail(f"fsg.Policy({name}=...)", "must be a floating-point torch.dtype", dtype,
                              "E.g. torch.float32 or torch.bfloat16 (integer leaves keep their dtype anyway)")  # fmt: skip
    checks.instance("fsg.Policy(autocast=...)", policy.autocast, bool, what="a bool", fix="autocast=True or False")
    if policy.matmul is not None:
        check_float8(policy.matmul)
        if policy.compute not in (torch.bfloat16, torch.float16):
            raise checks.fail("fsg.Policy(matmul=fsg.Float8(...))", "needs compute=torch.bfloat16 or torch.float16 "
                              "(FP8 replaces 16-bit matmuls)", policy.compute, "E.g. compute=torch.bfloat16")  # fmt: skip
        if policy.matmul.recipe == "rowwise" and policy.compute != torch.bfloat16:
            raise checks.fail("fsg.Policy(matmul=fsg.Float8(recipe='rowwise'))", "needs compute=torch.bfloat16 "
                              "(rowwise-scaled FP8 GEMMs write bfloat16)", policy.compute,
                              "Use compute=torch.bfloat16, or recipe='tensorwise' with float16")  # fmt: skip
    scale = policy.loss_scale
    if scale is not None:
        checks.instance("fsg.Policy(loss_scale=...)", scale, DynamicLossScale, what="an fsg.DynamicLossScale, a bool or None",
                        fix="E.g. loss_scale=fsg.DynamicLossScale(initial=2.0**15)")  # fmt: skip
        checks.real("DynamicLossScale(min_scale=...)", scale.min_scale, low=0.0, low_open=True, fix="E.g. 1.0")
        checks.real("DynamicLossScale(initial=...)", scale.initial, low=scale.min_scale, fix="Start at or above min_scale")
        checks.integer("DynamicLossScale(growth_interval=...)", scale.growth_interval, low=1, fix="E.g. 2000")
        checks.real("DynamicLossScale(growth=...)", scale.growth, low=1.0, fix="E.g. 2.0")
        checks.real("DynamicLossScale(backoff=...)", scale.backoff, low=0.0, high=1.0, low_open=True, fix="E.g. 0.5")
    return policy
