"""Stage 4: compile the step graph."""

from __future__ import annotations

import logging
import operator
import time
from typing import Any, Callable

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.backend import add_alpha, column_sums, flex_attention, index_put, views
from fsg._src.passes.options import DEFAULT, Fusions

BACKENDS = ("inductor", "aot_eager", "eager")

log = logging.getLogger("fsg")


def check_backend(backend: str) -> None:
    """Raises ``ValueError`` for a backend name fsg does not know."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def compile_graph(gm: fx.GraphModule, backend: str, fusions: Fusions = DEFAULT) -> Callable[..., tuple]:
    """Compiles the step graph with ``backend`` (Inductor's rewrites of its code as ``fusions`` says).

    ``"inductor"`` generates fused kernels (Triton on GPU, C++ on CPU); ``"aot_eager"`` runs
    the same functionalized graph op by op, which is fast to build and good for debugging;
    ``"eager"`` runs the traced FX graph as it is, with no compiler at all. Compilation itself
    happens on the first call.
    """
    check_backend(backend)
    if backend == "inductor":
        return InductorStep(gm, fusions)
    hops = sorted({n.target.name() for n in gm.graph.nodes if isinstance(n.target, _torch_private.HigherOrderOperator)})
    if backend == "eager" or hops:  # Dynamo cannot trace a traced flex_attention again ("too many values to unpack")
        if backend != "eager":
            log.info("fsg: aot_eager runs the step graph op by op as traced (it calls %s)", ", ".join(hops))
        if hops:
            gm = _torch_private.copy_graph_module(gm)  # the caller's graph stays as it was
            flex_attention.captured_grads_when_run_eagerly(gm)
        return gm
    return AotEagerStep(gm)


# The outputs through which torch's CUDA attention kernels return their RNG state.
RNG_STATE_RETURNS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused"})


def rng_state_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that take an RNG-state output of an op (``getitem(attention, i)``)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
            continue
        names, index = _torch_private.return_names(node.args[0].target), node.args[1]
        if isinstance(index, int) and index < len(names) and names[index] in RNG_STATE_RETURNS:
            found.append(node)
    return found


def keep_rng_state_alive(gm: fx.GraphModule) -> int | None:
    """Returns the RNG-state outputs of attention ops from ``gm`` (rewritten in place) after
    its own outputs; the number of its own outputs, or ``None`` when it has no such op.

    A torch bug (seen with torch 2.11 on the H200): ``_scaled_dot_product_efficient_attention``
    returns its RNG state as CPU tensors, while the meta function Inductor plans buffers with
    puts it on the GPU (2.13's is alike). The flash and cuDNN kernels returned theirs on the GPU;
    they are kept too, which costs nothing (a few bytes). Once the backward has read it, Inductor may reuse that buffer for a 0-d
    GPU result of the same dtype, and the kernel writing the result is launched with a CPU
    pointer: ``CUDA driver error: invalid argument`` (``Pointer argument cannot be accessed
    from Triton`` without the static launcher). The skipping step's int64 counters were such
    results (docs/resilience.md). A graph output is never freed, so its buffer is never reused.
    """
    extra = rng_state_nodes(gm)
    if not extra:
        return None
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    own = tuple(out.args[0]) if isinstance(out.args[0], (tuple, list)) else None
    if own is None:
        raise TypeError(f"the step graph returns {type(out.args[0]).__name__}, not a flat tuple of outputs")
    out.args = (own + tuple(extra),)
    gm.recompile()
    return len(own)


class _PerStrides:
    """A step graph compiled on its first call for each set of its inputs' strides, which the
    compilers specialize on (a transposed batch compiles once more, as ``torch.compile``'s
    guards would). Subclasses say how to compile (``_build``)."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, Callable[..., Any]] = {}
        self._last: tuple[tuple, Callable[..., Any]] | None = None

    def _build(self, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        raise NotImplementedError

    def _compiled_for(self, inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        key = tuple(t.stride() for t in inputs)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._build(list(inputs))
        self._last = (key, fn)
        return fn


class AotEagerStep(_PerStrides):
    """The step graph run by AOTAutograd's functionalized graph, op by op, built on its first call.

    The graph goes to AOTAutograd directly (``_torch_private.aot_eager_compile``), not through
    ``torch.compile``: Dynamo's ``_tensorify_python_scalars`` pass takes a 0-d float64 CPU input
    for a Python float it wrapped, restarts its analysis and drops the graph's ``copy_`` into it,
    so a donated 0-d float64 parameter never moved (torch 2.13; ``tests/test_zero_dim.py``).
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self._gm = gm

    def _build(self, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        return _torch_private.aot_eager_compile(self._gm, inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self._compiled_for(inputs)(*inputs)


class InductorStep(_PerStrides):
    """The step graph compiled by Inductor on its first call.

    The graph is already an aten graph, so it goes to Inductor directly
    (``_torch_private.inductor_compile``): Dynamo does not trace it a second time, which was
    about a third of a warm start on the VM. Once more for other strides (``_PerStrides``).
    """

    def __init__(self, gm: fx.GraphModule, fusions: Fusions = DEFAULT):
        super().__init__()
        self._fusions = fusions
        flex_attention.refuse_block_masks_built_in_graph(gm)
        flex_attention.refuse_per_sequence_block_masks(gm)
        flex_attention.refuse_subgraph_tensor_constants(gm)
        gm = _torch_private.copy_graph_module(gm)  # the caller's graph stays as it was
        self._num_outputs = keep_rng_state_alive(gm)
        views.views_as_reshapes(gm)
        if rewritten := add_alpha.scaled_adds_as_products(gm):
            log.info(
                "fsg: stage 4: %d add(x, y, alpha) as add(x, y * alpha) (an Inductor addmm-pattern miscompile)",
                rewritten,
            )
        if rewritten := index_put.scatter_accumulating_index_puts(gm):
            log.info(
                "fsg: stage 4: %d accumulating index_put(s) as scatter_add (an Inductor CPU miscompile)", rewritten
            )
        if rewritten := flex_attention.own_buffers_for_cpu_flex_attention(gm):
            log.info("fsg: stage 4: %d CPU flex_attention call(s) given own query, key and value buffers", rewritten)
        self._gm = gm
        # A step with collectives keeps its node order: the overlap pass placed each gradient
        # collective right after its last input, and Inductor's peak-memory reordering moved
        # them all after the backward on two H200s (no overlap; benchmarks/RESULTS.md).
        has_collectives = any(_torch_private.is_collective(n.target) for n in gm.graph.nodes)
        patches = {"reorder_for_peak_memory": False} if has_collectives else {}
        if flex_attention.has_cpu_flex_attention(gm):
            patches["epilogue_fusion"] = False
        self._options = {"config_patches": patches} if patches else None

    def _build(self, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        with column_sums.final_sums_as_kernels(self._fusions):
            fn = _torch_private.inductor_compile(self._gm, inputs, self._options)
        log.info("fsg: stage 4: Inductor compiled the step in %.1f s", time.perf_counter() - t0)
        return fn

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self._own(self._compiled_for(inputs)(*inputs))

    def _own(self, outputs: Any) -> Any:
        return outputs if self._num_outputs is None else outputs[: self._num_outputs]
