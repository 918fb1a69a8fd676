"""The Inductor and AOTAutograd entry points fsg compiles with, and the hooks stage 4 uses on
Inductor's generated wrapper code (``backend/column_sums.py``). Part of ``_torch_private``: each
name is re-exported there and pinned by ``tests/test_torch_private.py``."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch
from torch._ops import OpOverload


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """Compiles an aten FX graph with Inductor, specialized on ``example_inputs``' shapes,
    dtypes and strides, without Dynamo re-tracing it (``standalone_compile``, torch 2.8+), its
    on-disk caches on; ``options`` are ``compile_fx``'s keyword arguments (``config_patches``).
    Custom ops get Inductor's implicit fallback up front (``make_fallback``): torch 2.11 formats
    their arguments eagerly on its way there, exponentially along a chain of opaque ops."""
    from torch._inductor import config, decomposition, lowering

    for op in {n.target for n in gm.graph.nodes if isinstance(n.target, OpOverload)} - lowering.lowerings.keys():
        inductor_own = torch._library.utils.is_builtin(op) or op.name().split(".")[0] in lowering.FALLBACK_ALLOW_LIST
        if config.implicit_fallbacks and not inductor_own and op not in decomposition.decompositions:
            lowering.make_fallback(op, warn=False)
    return torch._inductor.standalone_compile(
        gm, list(example_inputs), dynamic_shapes="from_example_inputs", options=options
    )


def aot_eager_compile(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """``gm`` functionalized by AOTAutograd and run op by op (the ``aot_eager`` backend), without
    Dynamo re-tracing it; input mutations stay in the graph (``keep_input_mutations``)."""
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, list(example_inputs))


@contextlib.contextmanager
def wrapper_lines_rewritten(rewrite: Callable[[str, Any], str]):
    """Within: each line Inductor's ``PythonWrapperCodegen`` writes is ``rewrite(line, wrapper)`` first
    (``wrapper``: the codegen; its ``imports`` block an ``IndentedBuffer``). One compile at a time."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.writeline
    PythonWrapperCodegen.writeline = lambda self, line: original(
        self, rewrite(line, self) if isinstance(line, str) else line
    )
    try:
        yield
    finally:
        PythonWrapperCodegen.writeline = original


# Inductor's wrapper line of a mix-order reduction's final reduction (torch 2.11, 2.13):
# ``buf = workspace_0[a : b].view(n, C).sum(dim=0)`` (or ``amax``/``amin``/``prod``), then 2.13's
# ``.view([C])`` and a ``.to(dtype)`` where the buffer is not float32
_FINAL_REDUCTION = re.compile(r"^(\s*)(\w+) = (\w+\[[^\]]*\]\.view\(.*?\))\.(sum|amax|amin|prod)\(dim=0\)(.*)$")


def final_reduction_line(line: str) -> tuple[str, str, str, str, str] | None:  # (indent, buffer, partials, op, tail)
    m = _FINAL_REDUCTION.match(line)
    return None if m is None else m.groups()


def buffer_storage(name: str, wrapper: Any = None) -> str:
    """Where Inductor's buffer ``name`` (of the graph whose wrapper is being written) keeps its
    values: ``"own"``, ``"alias"`` (a slice of another buffer, ``NonOwningLayout``: a ``cat``
    input computed in place into the ``cat``'s output) or ``"other"`` (e.g. a mutated input).
    With ``wrapper`` (the wrapper codegen), an alias's allocation (base, then view) is emitted."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    buffer = V.graph.get_buffer(name)  # None: not a buffer Inductor knows; its line stands as written
    layout = None if buffer is None else buffer.get_output_spec()
    if isinstance(layout, ir.NonOwningLayout):
        if wrapper is not None:
            wrapper.codegen_allocation(buffer)
        return "alias"
    return "own" if layout is None or isinstance(layout, (ir.FixedLayout, ir.FlexibleLayout)) else "other"
