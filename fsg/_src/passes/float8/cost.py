"""``fsg.Float8(filter="auto")``: which linear layers the float8 pass rewrites, decided by a cost
model measured on the step's device.

Shapes: a matmul ``[M, K] @ [K, N]``; a cast of a tensor ``[R, D]`` (its rows along the
contracted dim). The layers ``S`` run in FP8 are those that maximize what FP8 saves the step:

    sum over L in S of  saved(L)  -  sum over the casts S's matmuls read of  cost(cast)
    saved(L) = sum over L's FP8 matmuls of  T_mm(M, K, N) - T_scaled_mm(M, K, N)

``T_mm`` and ``T_scaled_mm`` are measured on the device at each matmul's shape (the compute
dtype's ``mm``; ``_scaled_mm`` with the recipe's scales and the matmul's accumulation). A cast
costs its bytes at the device's measured copy bandwidth plus a measured launch per kernel:

- fused into the kernel that produces the tensor (``float8_fuse.fusable``: a layer norm, a GELU,
  its gradient, a concatenation, a bias gradient's column sums): the FP8 copy's write only,
  ``R * D + 4 * R`` bytes, no kernel of its own;
- a weight whose casts ``Fusions.fp8_weights`` puts in one op (``fsg::weight_fp8``, both
  layouts from what the weight is a cast of): half that op, ``(e_s + 1) R D`` bytes (``e_s``
  the element size of what it reads, the float32 master's 4) and one kernel;
- any other: two reads of the tensor (its maxima, then the cast) and the copy's write,
  ``(2 e + e + 1) R D`` bytes (``e`` its element size), two kernels.

This is what a per-GEMM benchmark cannot see (docs/precision.md#the-cost-model): the same GEMM
pays after a fused producer and not after cuDNN's attention output. A cast read by several
layers (the input of separate q, k and v projections) is paid once, so the layers are chosen
together: the set whose savings minus the costs of the casts it reads is largest, exactly
(``select``: a minimum cut). Measurements are cached per device and shape for the process; on
several ranks, rank 0's choice is every rank's (``agreed``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes.float8 import fuse as float8_fuse
from fsg._src.passes.float8 import weights as float8_weights
from fsg._src.passes.float8.quantize import E4M3, operands, peel
from fsg._src.passes.options import DEFAULT, Fusions

log = logging.getLogger("fsg")
WHY = "Float8(filter='auto'): its FP8 GEMMs would save less than its casts cost (the cost model, measured)"


class Timer(Protocol):
    """What the model measures, in seconds (``DeviceTimer`` on the step's device)."""

    def gemm(self, m: int, k: int, n: int, dtype: torch.dtype, fp8: bool, rowwise: bool, fast: bool) -> float: ...

    def bytes_per_second(self) -> float: ...

    def launch(self) -> float: ...


_MEASURED: dict[tuple, float] = {}  # (device, what, ...) -> seconds or bytes/s, for the process


class DeviceTimer:
    """Medians of ``reps`` timings on ``device`` (CUDA events; ``perf_counter`` on CPU), cached."""

    def __init__(self, device: torch.device, reps: int | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.reps = reps or (20 if self.cuda else 3)
        self.name = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def _cached(self, key: tuple, measure: Callable[[], float]) -> float:
        key = (self.name, str(self.device), *key)
        if key not in _MEASURED:
            _MEASURED[key] = measure()
        return _MEASURED[key]

    def _time(self, fn: Callable[[], Any]) -> float:
        fn()  # (the first call: cuBLAS's heuristics, allocations)
        times = []
        for _ in range(self.reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def gemm(self, m: int, k: int, n: int, dtype: torch.dtype, fp8: bool, rowwise: bool, fast: bool) -> float:
        def measure() -> float:
            a = torch.randn(m, k, device=self.device).to(E4M3 if fp8 else dtype)
            b = torch.randn(n, k, device=self.device).to(E4M3 if fp8 else dtype).t()  # (a weight's layout)
            if not fp8:
                return self._time(lambda: torch.mm(a, b))
            sa, sb = (torch.ones(m, 1), torch.ones(1, n)) if rowwise else (torch.ones(()), torch.ones(()))
            sa, sb = sa.to(self.device), sb.to(self.device)
            return self._time(lambda: _torch_private.scaled_mm(a, b, sa, sb, out_dtype=dtype, use_fast_accum=fast))

        return self._cached(("gemm", m, k, n, dtype, fp8, fp8 and rowwise, fp8 and fast), measure)

    def bytes_per_second(self) -> float:
        def measure() -> float:
            x = torch.empty(64 << 20 if self.cuda else 4 << 20, dtype=torch.uint8, device=self.device)
            y = torch.empty_like(x)
            return 2 * x.numel() / self._time(lambda: y.copy_(x))  # (a read and a write a byte)

        return self._cached(("copy",), measure)

    def launch(self) -> float:
        def measure() -> float:
            x = torch.zeros(16, device=self.device)
            return self._time(lambda: [x.add_(1) for _ in range(100)]) / 100

        return self._cached(("launch",), measure)


def timer_for(device: torch.device) -> Timer:
    """The measurements ``Float8(filter="auto")`` decides from (tests replace it with a table)."""
    return DeviceTimer(device)


class Matmul(NamedTuple):
    """One matmul the pass would run in FP8, as the cost model sees it."""

    node: fx.Node
    fast: bool  # its accumulation (Float8(fast_accum=...))


def _casts(mm: Matmul) -> list[tuple[fx.Node, bool]]:
    """The casts ``mm`` reads: ``(t, flip)`` as ``Quantizer.operand`` keys them (``flip``: the
    row-major copy of ``t``'s transpose)."""
    out = []
    for operand, second in zip(operands(mm.node)[:2], (False, True)):
        t, transposed = peel(operand)
        out.append((t, transposed != second))
    return out


def cast_cost(t: fx.Node, flip: bool, rowwise: bool, timer: Timer, fusions: Fusions = DEFAULT) -> float:
    """The seconds the FP8 copy ``(t, flip)`` adds to the step under ``fusions`` (the module
    docstring's bytes)."""
    val = t.meta["val"]
    rows, width = (val.shape[1], val.shape[0]) if flip else (val.shape[0], val.shape[1])
    if rowwise and not flip and float8_fuse.fusable(t, E4M3, fusions) is not None:
        return (rows * width + 4 * rows) / timer.bytes_per_second()
    if rowwise and fusions.fp8_weights and (found := float8_weights.source(t)) is not None:
        # half of fsg::weight_fp8's two launches: two reads of what it reads, both copies' writes
        return (found[0].meta["val"].element_size() + 1) * rows * width / timer.bytes_per_second() + timer.launch()
    e = val.element_size()
    return (3 * e + 1) * rows * width / timer.bytes_per_second() + 2 * timer.launch()


def saved(mm: Matmul, rowwise: bool, timer: Timer) -> float:
    """``T_mm - T_scaled_mm`` at ``mm``'s shape (negative where FP8 is slower)."""
    (m, n), k = mm.node.meta["val"].shape, operands(mm.node)[0].meta["val"].shape[1]
    dtype = mm.node.meta["val"].dtype
    return timer.gemm(m, k, n, dtype, False, rowwise, False) - timer.gemm(m, k, n, dtype, True, rowwise, mm.fast)


def choose(
    units: dict[Any, list[Matmul]], rowwise: bool, timer: Timer, fusions: Fusions = DEFAULT
) -> dict[Any, tuple[float, float]]:
    """The layers (keys of ``units``: each layer's FP8 matmuls, a matmul listed under every
    layer it belongs to, its saving split among them) the model keeps in the compute dtype,
    each with its ``(saved, cost)`` in seconds (its casts' costs split among their readers)."""
    gains = {layer: 0.0 for layer in units}
    casts: dict[Any, set[tuple[fx.Node, bool]]] = {layer: set() for layer in units}
    for layer, mms in units.items():
        for mm in mms:
            gains[layer] += saved(mm, rowwise, timer) / sum(mm in other for other in units.values())
            casts[layer].update(_casts(mm))
    costs = {key: cast_cost(*key, rowwise, timer, fusions) for keys in casts.values() for key in keys}
    readers = {key: sum(key in keys for keys in casts.values()) for key in costs}
    keep = select(gains, casts, costs)
    return {
        layer: (gains[layer], sum(costs[k] / readers[k] for k in casts[layer])) for layer in units if layer not in keep
    }


def select(gains: dict[Any, float], casts: dict[Any, set], costs: dict[Any, float]) -> set:
    """The layers ``S`` that maximize ``sum(gains[L] for L in S) - sum(costs[c] for c read by
    S)``, each layer reading ``casts[L]``: the project-selection problem (layers the projects,
    casts the tools they need), solved exactly as a minimum cut, source -> layer (its gain) ->
    each cast it reads (unbounded) -> sink (the cast's cost); ``S`` is what the source still
    reaches. A shared cast is paid once, by whichever of its readers pay for it together. Of
    equally good choices, the smallest (a tie stays in the compute dtype)."""
    src, sink = object(), object()
    cap: dict[Any, dict[Any, float]] = {src: {}, sink: {}}
    for layer, gain in gains.items():
        cap.setdefault(layer, {})
        if gain > 0:
            cap[src][layer] = gain
        for c in casts[layer]:
            cap[layer][c] = math.inf
            cap.setdefault(c, {})[sink] = costs[c]
    for u in list(cap):  # the residual edges back
        for v in list(cap[u]):
            cap[v].setdefault(u, 0.0)
    while (parent := _augmenting_path(cap, src, sink)) is not None:  # Edmonds-Karp
        path, v = [], sink
        while v is not src:
            path.append((parent[v], v))
            v = parent[v]
        push = min(cap[u][v] for u, v in path)
        for u, v in path:
            cap[u][v] -= push
            cap[v][u] += push
    reached = _augmenting_path(cap, src, None)
    return {layer for layer in gains if layer in reached}


def _augmenting_path(cap: dict, src: Any, sink: Any) -> dict | None:
    """Breadth first over edges with capacity left (``TOL``: a float's rounding is none): the
    parents of what ``src`` reaches, or ``None`` where ``sink`` is given and not reached."""
    parent, queue = {src: None}, [src]
    for u in queue:
        for v, c in cap[u].items():
            if c > TOL and v not in parent:
                parent[v] = u
                if v is sink:
                    return parent
                queue.append(v)
    return None if sink is not None else parent


TOL = 1e-12  # seconds: below any measured difference


def agreed(layers: list, dropped: dict[Any, tuple[float, float]]) -> dict[Any, tuple[float, float]]:
    """Rank 0's choice on every rank of the default process group: each rank measures its own
    device, and a step's graphs must agree across ranks (their collectives would not match
    otherwise). ``layers`` is in graph order, the same on every rank; all of them compile the
    step together, as they do whenever it runs on a mesh."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dropped
    choice = [[i for i, layer in enumerate(layers) if layer in dropped]]
    dist.broadcast_object_list(choice, src=0)
    return {layers[i]: dropped.get(layers[i], (math.nan, math.nan)) for i in choice[0]}


def auto_filter(
    units: dict[Any, list[Matmul]],
    names: dict[Any, str],
    rowwise: bool,
    device: torch.device,
    timer: Timer | None = None,
    fusions: Fusions = DEFAULT,
) -> dict[Any, str]:
    """``choose`` on ``device``'s measurements: the layers to keep in the compute dtype, each with
    ``WHY``; logs the decision (INFO: how many, DEBUG: each layer's figures)."""
    timer = timer or timer_for(device)
    t0 = time.perf_counter()
    dropped = agreed(list(units), choose(units, rowwise, timer, fusions))
    for layer, (s, c) in dropped.items():
        log.debug("fsg: float8: %s stays: its FP8 GEMMs save %.1f us, its casts cost %.1f us", names[layer],
                  s * 1e6, c * 1e6)  # fmt: skip
    log.info("fsg: float8: Float8(filter='auto') on %s: %d of %d linear layers in FP8 (measured in %.1f s)",
             getattr(timer, "name", device), len(units) - len(dropped), len(units), time.perf_counter() - t0)  # fmt: skip
    return {layer: WHY for layer in dropped}


def apply(
    matmuls: list[fx.Node], layers: dict, roles: dict, config: Any, why_not_op: Callable, fusions: Fusions = DEFAULT
) -> tuple[dict, dict]:
    """``passes/float8/matmuls.py``'s ``layers`` and ``roles`` with the layers the cost model keeps in the
    compute dtype marked so (their ``why_not``), given the matmuls each would run in FP8
    (``why_not_op(matmul)``: why a matmul cannot, whatever its layer)."""
    rowwise = config.recipe == "rowwise"
    units = {n: [] for n, layer in layers.items() if layer.why_not is None}
    for node in (n for n in matmuls if why_not_op(n) is None):
        if node in units:
            units[node].append(Matmul(node, "forward" in config.fast_accum))
        elif node in roles and not any(c.why_not for c in roles[node][0]):
            candidates, _, grad_weight = roles[node]
            if grad_weight and not config.fp8_grad_weight:
                continue
            fast = ("grad_weight" if grad_weight else "grad_input") in config.fast_accum
            for c in candidates:
                units[c.forward].append(Matmul(node, fast))
    if not units:
        return layers, roles
    device = next(iter(units)).meta["val"].device
    why = auto_filter(units, {n: layers[n].name for n in units}, rowwise, device, fusions=fusions)
    layers = {n: layer._replace(why_not=why.get(n, layer.why_not)) for n, layer in layers.items()}
    return layers, {n: ([layers[c.forward] for c in cs], grads, gw) for n, (cs, grads, gw) in roles.items()}
