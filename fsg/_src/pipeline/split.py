"""Stage splitting: the traced forward and loss cut into pipeline stages at module boundaries.

A stage boundary sits before the first node of a module: one the user names
(``Pipeline(split_points=["layers.4"])``, as torchtitan's ``pipeline_parallel_split_points``),
or one an automatic split picks among the repeated blocks so that the most expensive stage
costs least (``cost``: the matmuls' FLOPs, as ``torch.utils.flop_counter`` counts them, plus
one per element of every node's output). Each stage's graph takes the parameters and batch
leaves its own nodes read, then the activations crossing its cut (every value an earlier stage
made that this or a later one reads: a value skipping stages is passed along), and returns the
activations crossing the next cut; the last returns the loss and the aux metrics. A parameter
read by several stages (tied embeddings) is an input of each.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fsg._src.errors import ArgumentError, UnsupportedError
from fsg._src.pipeline import modules


class StageGraph(NamedTuple):
    """One stage: ``graph(*params, *batch, *activations) -> activations`` (the last stage:
    ``(loss, *aux)``); ``params`` and ``batch`` index the step's param and batch leaves."""

    graph: fx.GraphModule
    params: tuple[int, ...]
    batch: tuple[int, ...]
    inputs: tuple[torch.Tensor, ...]  # fake values of the activations in
    outputs: tuple[torch.Tensor, ...]  # fake values of what it returns
    cost: float


def split(gm: fx.GraphModule, num_stages: int, split_points: Sequence[str] | None, num_params: int) -> list[StageGraph]:
    """Cuts ``gm`` (inputs: the param leaves, then the batch leaves; output: ``(loss, *aux)``,
    nodes annotated by ``modules.recording``) into ``num_stages`` stage graphs."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    anchors = [n for n in nodes if n.target is not operator.getitem]
    names = [modules.name_of(n) for n in anchors]
    cost = [node_cost(n) for n in anchors]
    if split_points is not None:
        cuts = _named_cuts(anchors, names, split_points, num_stages)
    else:
        cuts = _balanced_cuts(names, cost, num_stages)
    stage_of: dict[fx.Node, int] = {}
    bounds = [0, *cuts, len(anchors)]
    for k in range(num_stages):
        for n in anchors[bounds[k] : bounds[k + 1]]:
            stage_of[n] = k
    for n in nodes:  # a tuple's items stay with the op that made it
        if n.target is operator.getitem:
            stage_of[n] = stage_of[n.args[0]]
    _sink_weight_only(gm, stage_of, num_params, num_stages - 1)
    return _build(
        gm, stage_of, num_stages, num_params, [sum(cost[bounds[k] : bounds[k + 1]]) for k in range(num_stages)]
    )


def _sink_weight_only(gm: fx.GraphModule, stage_of: dict, num_params: int, last: int) -> None:
    """Ops that read only parameters and constants (a weight's transpose, a cast) move to the
    first stage that uses them, so that a stage does not send another one its weights."""
    params = {n for n in list(gm.graph.nodes)[:num_params] if n.op == "placeholder"}
    ordered = [n for n in gm.graph.nodes if n in stage_of]
    weight_only = set()
    for n in ordered:
        if all(a in params or a in weight_only or a.op == "get_attr" for a in n.all_input_nodes):
            weight_only.add(n)
    for n in reversed(ordered):  # users first
        if n in weight_only:
            stage_of[n] = min((last if u.op == "output" else stage_of[u] for u in n.users), default=stage_of[n])
            for item in (u for u in n.users if u.target is operator.getitem):
                stage_of[item] = stage_of[n]  # a tuple's items stay with the op that made it


def node_cost(node: fx.Node) -> float:
    """FLOPs of a matmul or convolution node, plus the elements it writes."""
    val = node.meta.get("val")
    out = sum(t.numel() for t in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(t, torch.Tensor))
    count = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if count is None:
        return float(out)

    def value(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args, kwargs = fx.node.map_aggregate(node.args, value), fx.node.map_aggregate(node.kwargs, value)
    return float(count(*args, **kwargs, out_val=val)) + out


def _named_cuts(anchors: list[fx.Node], names: list, split_points: Sequence[str], num_stages: int) -> list[int]:
    ran = [n for i, n in enumerate(names) if n and n not in names[:i]]
    shown = ", ".join(ran[:12]) + (" ..." if len(ran) > 12 else "")
    if len(split_points) != num_stages - 1:
        raise ArgumentError(
            f"Pipeline(split_points={list(split_points)}) gives {len(split_points)} split point(s) for {num_stages} "
            f"stages (pp x virtual_stages); give {num_stages - 1}, or split_points=None to balance them by cost"
        )
    cuts = []
    for point in split_points:
        at = next((i for i, n in enumerate(names) if modules.inside(n, point)), None)
        if at is None:
            raise ArgumentError(
                f"Pipeline split point {point!r} names no module the loss runs; the modules it runs: {shown}. "
                f"Name a module path as fsg.params spells it (e.g. 'layers.4')"
            )
        if at == 0 or (cuts and at <= cuts[-1]):
            where = "the first op of the step" if at == 0 else f"the module before it ({split_points[len(cuts) - 1]!r})"
            raise ArgumentError(
                f"Pipeline split point {point!r} starts at {where}, which leaves a stage empty; give split points "
                f"in the order the forward runs them, each after some op"
            )
        cuts.append(at)
    return cuts


def _balanced_cuts(names: list, cost: list[float], num_stages: int) -> list[int]:
    if num_stages == 1:
        return []
    blocks = modules.blocks(names)
    starts = sorted({next(i for i, n in enumerate(names) if modules.inside(n, b)) for b in blocks} - {0})
    if len(starts) < num_stages - 1:
        raise ArgumentError(
            f"a pipeline of {num_stages} stages needs {num_stages - 1} cuts, but the loss runs only "
            f"{len(starts) + 1} splittable block(s) ({', '.join(blocks) or 'none'}); use fewer stages (pp x "
            f"virtual_stages) or a model with more blocks"
        )
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    points = [0, *starts, len(cost)]
    # best[k][j]: the least possible maximum stage cost of k stages covering ops before points[j]
    inf = float("inf")
    best = [[inf] * len(points) for _ in range(num_stages + 1)]
    back = [[0] * len(points) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(1, len(points)):
            for i in range(j):
                value = max(best[k - 1][i], prefix[points[j]] - prefix[points[i]])
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    cuts, j = [], len(points) - 1
    for k in range(num_stages, 0, -1):
        j = back[k][j]
        cuts.append(points[j])
    return sorted(cuts[:-1])


def _build(
    gm: fx.GraphModule, stage_of: dict, num_stages: int, num_params: int, costs: list[float]
) -> list[StageGraph]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    last = num_stages - 1

    def stage_reading(user: fx.Node) -> int:
        return last if user.op == "output" else stage_of[user]

    def crossing(k: int) -> list[fx.Node]:  # made before stage k, read by stage k or later
        return [n for n in stage_of if stage_of[n] < k and any(stage_reading(u) >= k for u in n.users)]

    stages = []
    for k in range(num_stages):
        own = [n for n in gm.graph.nodes if stage_of.get(n) == k]
        read = {a for n in own for a in n.all_input_nodes} | (set(output.all_input_nodes) if k == last else set())
        graph, env, root = fx.Graph(), {}, {}
        used = [i for i, p in enumerate(placeholders) if p in read]
        arriving = crossing(k)
        for n in [placeholders[i] for i in used] + arriving:
            env[n] = graph.placeholder(n.name)
            env[n].meta["val"] = n.meta["val"]
            if not isinstance(n.meta["val"], torch.Tensor):
                raise UnsupportedError(
                    f"the value of node {n.name} ({n.target}) crosses a pipeline stage boundary but is not a tensor "
                    f"({type(n.meta['val']).__name__}); move the split point so that the op making it and its "
                    f"users sit in one stage"
                )
        for n in sorted(read - set(env) - set(own), key=list(gm.graph.nodes).index):
            if n.op == "get_attr":  # a constant: every stage that reads it holds it
                root[n.target] = getattr(gm, n.target)
                env[n] = graph.node_copy(n)
        for n in own:
            env[n] = graph.node_copy(n, lambda a: env[a])
        leaving = output.args[0] if k == last else crossing(k + 1)
        graph.output(tuple(env[n] for n in leaving))
        module = fx.GraphModule(root, graph)
        params = tuple(i for i in used if i < num_params)
        batch = tuple(i - num_params for i in used if i >= num_params)
        vals = tuple(n.meta["val"] for n in leaving)
        stages.append(StageGraph(module, params, batch, tuple(n.meta["val"] for n in arriving), vals, costs[k]))
    return stages
