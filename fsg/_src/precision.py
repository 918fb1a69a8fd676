"""Mixed precision: the dtype parameters are stored in and the dtype the loss computes in."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch

from fsg._src import checks, tree


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


class _Float8Fields(NamedTuple):
    recipe: str
    filter: Callable[[str], bool] | None
    keep_output_head: bool
    grad_weight: str | None
    all_gather: str
    fast_accum: tuple[str, ...]


class Float8(_Float8Fields):
    """FP8 matmuls: ``fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8())`` runs the linear
    layers' matmuls (forward, grad-input, grad-weight) as ``torch._scaled_mm`` on FP8 operands,
    scaled in the graph (docs/precision.md#fp8).

    Attributes:
      recipe: ``"tensorwise"``: one scale per tensor, from its current absolute maximum (dynamic
        current scaling); activations and weights in ``float8_e4m3fn``, gradients in
        ``float8_e5m2``; all three matmuls of a layer in FP8. ``"rowwise"``: one scale per row
        of each operand along the contracted dim (each token's activation and gradient row,
        each output or input channel of the weight), everything in ``float8_e4m3fn``; the
        forward and grad-input matmuls in FP8, the grad-weight in the compute dtype unless
        ``grad_weight="fp8"``; needs ``compute=torch.bfloat16``.
      filter: ``None`` (every eligible linear layer) or a callable ``filter(name) -> bool``
        deciding per layer, given its weight's name as ``fsg.params`` spells it
        (``"blocks.0.fc.weight"``); ``False`` keeps that layer in the compute dtype.
      keep_output_head: keep the output head in the compute dtype: the matmul the loss is
        computed from through pointwise ops, views, reductions, softmax and losses only, found
        by data flow (docs/precision.md#which-matmuls).
      grad_weight: the grad-weight ``dW = dY^T @ X``: ``"fp8"`` or ``"compute"`` (the compute
        dtype); ``None``, the recipe's default: FP8 under tensorwise, the compute dtype under
        rowwise, whose grad-weight scales run along the tokens (a scale per column of ``dY``
        and of ``X``: each needs a transposed cast after a reduction over all rows, which pays
        at large widths only; docs/precision.md#fp8).
      all_gather: how FSDP gathers a weight that only FP8 matmuls read: ``"compute"`` (the
        default: the shard cast to the compute dtype, gathered, then cast to FP8) or ``"fp8"``
        (tensorwise only: each rank's amax all-reduced in one collective with the others, the
        shard cast to FP8 with the global scale, then gathered: half the bytes of a bf16
        gather, bit for bit the same operands and step). Nothing to do on one device or under
        plain data parallel, whose weights are not gathered.
      fast_accum: the matmuls whose FP8 products accumulate in the tensor cores' fast,
        reduced-precision accumulator (``_scaled_mm(use_fast_accum=True)``) instead of being
        promoted to float32 as they go: a tuple of ``"forward"``, ``"grad_input"`` and
        ``"grad_weight"``. The default ``("forward",)`` is torchao's; ``("forward",
        "grad_input")`` is faster on Hopper (the grad-input contracts over a layer's width, as
        the forward does; the grad-weight over every token of the batch) and is measured for
        convergence in docs/precision.md#fp8.

    Example:
      >>> cfg = fsg.Float8(filter=lambda name: not name.startswith("blocks.0."))
      >>> fsg.Policy(compute=torch.bfloat16, matmul=cfg).matmul.recipe
      'tensorwise'
    """

    __slots__ = ()

    def __new__(cls, recipe: str = "tensorwise", filter: Callable[[str], bool] | None = None,
                keep_output_head: bool = True, grad_weight: str | None = None,
                all_gather: str = "compute", fast_accum: tuple[str, ...] = ("forward",)) -> Float8:  # fmt: skip
        if isinstance(fast_accum, str):
            fast_accum = (fast_accum,)
        elif isinstance(fast_accum, (list, set, frozenset)):  # (a set's order is the roles' order below)
            fast_accum = tuple(r for r in FLOAT8_MATMULS if r in fast_accum) + tuple(
                r for r in fast_accum if r not in FLOAT8_MATMULS)  # fmt: skip
        fields = (recipe, filter, keep_output_head, grad_weight, all_gather, fast_accum)
        return check_float8(super().__new__(cls, *fields))

    @property
    def fp8_grad_weight(self) -> bool:
        """Whether the grad-weights run in FP8 (``grad_weight``, or the recipe's default)."""
        return self.recipe == "tensorwise" if self.grad_weight is None else self.grad_weight == "fp8"


FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_GRAD_WEIGHTS = (None, "fp8", "compute")
FLOAT8_ALL_GATHERS = ("compute", "fp8")
FLOAT8_MATMULS = ("forward", "grad_input", "grad_weight")  # a linear layer's matmuls, by role


def check_float8(cfg: Any) -> Float8:
    """``cfg`` if it is a valid ``Float8``; an ``ArgumentError`` naming the field otherwise."""
    checks.instance("fsg.Policy(matmul=...)", cfg, Float8, what="None or an fsg.Float8", fix="E.g. matmul=fsg.Float8()")
    if cfg.recipe not in FLOAT8_RECIPES:
        raise checks.fail("fsg.Float8(recipe=...)", f"must be one of {FLOAT8_RECIPES}", cfg.recipe,
                          "E.g. recipe='tensorwise'")  # fmt: skip
    if cfg.filter is not None:
        checks.function("fsg.Float8(filter=...)", cfg.filter, fix="Pass None or a function of the weight's name")
    checks.flag("fsg.Float8(keep_output_head=...)", cfg.keep_output_head)
    if cfg.grad_weight not in FLOAT8_GRAD_WEIGHTS:
        raise checks.fail("fsg.Float8(grad_weight=...)", f"must be one of {FLOAT8_GRAD_WEIGHTS}", cfg.grad_weight,
                          "E.g. grad_weight='fp8'")  # fmt: skip
    if cfg.all_gather not in FLOAT8_ALL_GATHERS:
        raise checks.fail("fsg.Float8(all_gather=...)", f"must be one of {FLOAT8_ALL_GATHERS}", cfg.all_gather,
                          "E.g. all_gather='fp8'")  # fmt: skip
    if not isinstance(cfg.fast_accum, tuple) or any(r not in FLOAT8_MATMULS for r in cfg.fast_accum):
        raise checks.fail("fsg.Float8(fast_accum=...)", f"must be a tuple of {FLOAT8_MATMULS}", cfg.fast_accum,
                          "E.g. fast_accum=('forward', 'grad_input')")  # fmt: skip
    if cfg.all_gather == "fp8" and cfg.recipe != "tensorwise":
        raise checks.fail("fsg.Float8(all_gather='fp8')", "needs recipe='tensorwise' (a rowwise weight is read in two "
                          "FP8 copies, scaled by row and by column: as many bytes as one gather in the compute dtype)",
                          cfg.recipe, "Use recipe='tensorwise', or all_gather='compute'")  # fmt: skip
    return cfg


class _PolicyFields(NamedTuple):
    param: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype | None
    loss_scale: DynamicLossScale | None
    autocast: bool
    matmul: Float8 | None


class Policy(_PolicyFields):
    """Which floating-point dtypes a step uses.

    Attributes:
      param: the dtype parameters and optimizer state are kept and updated in (default
        float32). ``step.init`` casts floating-point params to it, and the state's buffers
        of a dtype it changes (a bfloat16 model's running statistics become float32 with its
        weights; a float32 buffer of that model stays float32).
      compute: the dtype the loss runs in (default float32). Floating-point parameters are
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
        param: torch.dtype = torch.float32,
        compute: torch.dtype = torch.float32,
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
        if not self.autocast or self.compute == torch.float32:
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


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is a valid ``Policy``; an ``ArgumentError`` naming the field otherwise."""
    checks.instance("precision", policy, Policy, what="an fsg.Policy",
                    fix="E.g. precision=fsg.Policy(compute=torch.bfloat16)")  # fmt: skip
    for name in ("param", "compute", "reduce"):
        dtype = getattr(policy, name)
        if dtype is None and name == "reduce":
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
