"""Sharding rules: which partition spec each parameter gets, and the usual presets.

Rules map a parameter's leaf name (``"blocks.0.fc.weight"``) and shape to a ``P``. They live
apart from the model ("what to compute" vs "how it is distributed") and are applied by
``compile_step(..., param_sharding=...)``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Union

from fsg._src import checks, tree
from fsg._src.errors import ArgumentError
from fsg._src.mesh import Mesh, P

SpecOrFn = Union[P, Callable[[tuple[int, ...], Mesh], P]]
REPLICATED = P()


class Rules:
    """An ordered list of ``(regex, spec)`` rules; the first regex that matches a parameter's
    name (``re.fullmatch``) gives its spec, else ``default``. A spec may also be a function
    ``(shape, mesh) -> P`` for shape-dependent choices (FSDP picks a divisible dim)."""

    def __init__(self, rules: list[tuple[str, SpecOrFn]], default: SpecOrFn = REPLICATED):
        checks.instance("sharding.rules(rules)", rules, (list, tuple), what="a list of (regex, spec) pairs",
                        fix="E.g. [(r'.*\\.qkv\\.weight', fsg.P('tp', None))]")  # fmt: skip
        self._rules = [_compile_rule(i, rule) for i, rule in enumerate(rules)]
        _check_spec("sharding.rules(default=...)", default)
        self._default = default

    def __repr__(self) -> str:
        return f"Rules({[(r.pattern, s) for r, s in self._rules]}, default={self._default!r})"

    def spec_for(self, name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
        """The spec of the parameter ``name`` with ``shape`` on ``mesh``."""
        for pattern, spec in self._rules:
            if pattern.fullmatch(name):
                return _call(spec, name, shape, mesh, f"the rule {pattern.pattern!r}")
        return _call(self._default, name, shape, mesh, "the default rule")

    def __add__(self, other: Rules) -> Rules:
        """Rules of ``self`` first, then ``other``'s; ``other``'s default."""
        checks.instance("Rules + other: other", other, Rules, what="fsg.sharding rules",
                        fix="Add rules to rules: fsg.sharding.tensor_parallel() + fsg.sharding.fsdp()")  # fmt: skip
        combined = Rules([], other._default)
        combined._rules = self._rules + other._rules
        return combined


def _check_spec(where: str, spec: object) -> None:
    if not isinstance(spec, P) and not callable(spec):
        raise checks.fail(where, "must be an fsg.P or a function (shape, mesh) -> fsg.P", spec,
                          "Wrap axis names in a spec: fsg.P('tp', None)")  # fmt: skip


def _compile_rule(i: int, rule: object) -> tuple[re.Pattern, SpecOrFn]:
    if not (isinstance(rule, tuple) and len(rule) == 2):
        raise checks.fail(f"sharding.rules: rule {i}", "must be a pair (regex, spec)", rule,
                          "E.g. (r'.*\\.fc\\.weight', fsg.P('tp', None))")  # fmt: skip
    pattern, spec = rule
    checks.instance(f"sharding.rules: the regex of rule {i}", pattern, str, what="a str")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ArgumentError(
            f"sharding.rules: rule {i} has the regex {pattern!r}, which does not compile ({exc}); "
            f"escape literal dots and brackets (r'blocks\\.0\\.fc\\.weight', re.escape(name))"
        ) from exc
    _check_spec(f"sharding.rules: the spec of rule {i} ({pattern!r})", spec)
    return compiled, spec


def _call(spec: SpecOrFn, name: str, shape: tuple[int, ...], mesh: Mesh, which: str) -> P:
    out = spec(shape, mesh) if callable(spec) else spec
    if not isinstance(out, P):
        raise checks.fail(f"{which}, for the parameter {name!r},", "must give an fsg.P", out,
                          "Return fsg.P(...) from the spec function")  # fmt: skip
    return out


def rules(rules: list[tuple[str, SpecOrFn]], default: SpecOrFn = REPLICATED) -> Rules:
    """Builds sharding rules from ``(regex, spec)`` pairs (first full match wins).

    Example:
      >>> r = fsg.sharding.rules([(r".*\\.qkv\\.weight", fsg.P("tp", None))])
      >>> r.spec_for("blocks.0.attn.qkv.weight", (384, 128), fsg.Mesh({"tp": 1}))
      P('tp', None)
    """
    return Rules(rules, default)


def data_parallel() -> Rules:
    """Every parameter replicated: pure data parallelism (gradients all-reduced).

    Example:
      >>> fsg.sharding.data_parallel().spec_for("w", (4, 4), fsg.Mesh({"dp": 1}))
      P()
    """
    return Rules([], P())


def _fsdp_spec(axis: str) -> Callable[[tuple[int, ...], Mesh], P]:
    def spec(shape: tuple[int, ...], mesh: Mesh) -> P:
        size = mesh.axis_size(axis)
        for dim, n in enumerate(shape):  # the first dim the axis divides
            if n % size == 0 and n >= size:
                return P(*([None] * dim), axis)
        return P()  # too small to shard: replicated

    return spec


def fsdp(axis: str = "dp") -> Rules:
    """Fully sharded data parallel (ZeRO-3) over ``axis``: each parameter is sharded on its
    first dim that the axis divides, gathered at use, its gradient reduce-scattered.

    Example:
      >>> fsg.sharding.fsdp("dp").spec_for("w", (8, 3), fsg.Mesh({"dp": 1}))
      P('dp')
    """
    return Rules([], _fsdp_spec(axis))


COLUMN = r"(.*\.)?(qkv|c_attn|q_proj|k_proj|v_proj|fc|c_fc|up_proj|gate_proj|w1|w3)"
ROW = r"(.*\.)?(proj|c_proj|o_proj|fc_proj|down_proj|w2)"


def tensor_parallel(axis: str = "tp", *, column: str = COLUMN, row: str = ROW) -> Rules:
    """Megatron-style tensor parallelism for linear layers (Shoeybi et al., 2019).

    Linear layers whose module name matches ``column`` are split by output features
    (weight ``P(axis, None)``, bias ``P(axis)``); those matching ``row`` by input features
    (weight ``P(None, axis)``, bias replicated). A column layer followed by a row layer needs
    one all-reduce forward and one backward. Other parameters are replicated.

    Example:
      >>> tp = fsg.sharding.tensor_parallel("tp")
      >>> tp.spec_for("blocks.0.fc.weight", (512, 128), fsg.Mesh({"tp": 1}))
      P('tp', None)
      >>> tp.spec_for("blocks.0.fc_proj.weight", (128, 512), fsg.Mesh({"tp": 1}))
      P(None, 'tp')
    """
    return Rules(
        [
            (rf"{column}\.weight", P(axis, None)),
            (rf"{column}\.bias", P(axis)),
            (rf"{row}\.weight", P(None, axis)),
        ],
        P(),
    )


def fsdp_tensor_parallel(dp: str = "dp", tp: str = "tp", *, column: str = COLUMN, row: str = ROW) -> Rules:
    """The 2-D combination: Megatron tensor parallelism over ``tp``, and FSDP over ``dp`` on
    the dim tensor parallelism leaves whole.

    Example:
      >>> r = fsg.sharding.fsdp_tensor_parallel()
      >>> r.spec_for("blocks.0.fc.weight", (512, 128), fsg.Mesh({"dp": 1, "tp": 1}))
      P('tp', 'dp')
    """

    def other_dim(spec_tp: P, dp_dim: int) -> Callable[[tuple[int, ...], Mesh], P]:
        def spec(shape, mesh):
            if shape[dp_dim] % mesh.axis_size(dp) == 0:
                entries = list(spec_tp) + [None] * (len(shape) - len(spec_tp))
                entries[dp_dim] = dp
                return P(*entries)
            return spec_tp

        return spec

    return Rules(
        [
            (rf"{column}\.weight", other_dim(P(tp, None), 1)),
            (rf"{column}\.bias", P(tp)),
            (rf"{row}\.weight", other_dim(P(None, tp), 0)),
        ],
        _fsdp_spec(dp),
    )


def param_names(params: Any) -> list[str]:
    """The names rules match against: dict keys for a flat dict, else leaf paths."""
    leaves, _ = tree.flatten(params)
    if isinstance(params, dict) and len(params) == len(leaves):
        return sorted(params)  # optree flattens dicts in sorted key order
    return tree.leaf_paths(params, "")
