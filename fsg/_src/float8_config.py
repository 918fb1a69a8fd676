"""``fsg.Float8``: which matmuls run in FP8 and how (the configuration ``Policy(matmul=...)`` takes;
the pass that applies it is ``passes/float8/matmuls.py``)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from fsg._src import checks


class _Float8Fields(NamedTuple):
    recipe: str
    filter: Callable[[str], bool] | str | None
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
      filter: ``None`` (every eligible linear layer), a callable ``filter(name) -> bool``
        deciding per layer, given its weight's name as ``fsg.params`` spells it
        (``"blocks.0.fc.weight"``; ``False`` keeps that layer in the compute dtype), or
        ``"auto"``: a cost model measured on the step's device when the step compiles keeps
        each layer whose FP8 GEMMs would save less than its casts cost, counting a cast fused
        into its producer at its write alone (docs/precision.md#the-cost-model).
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

    def __new__(cls, recipe: str = "tensorwise", filter: Callable[[str], bool] | str | None = None,
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
    if isinstance(cfg.filter, str) and cfg.filter != "auto":
        raise checks.fail("fsg.Float8(filter=...)", "must be None, 'auto' or a function of the weight's name",
                          cfg.filter, "E.g. filter='auto'")  # fmt: skip
    if cfg.filter is not None and cfg.filter != "auto":
        checks.function("fsg.Float8(filter=...)", cfg.filter, fix="Pass None, 'auto' or a function of the weight's name")
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
