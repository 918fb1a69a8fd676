"""Stage 1: a FlexAttention block mask the step builds from constants alone is computed once,
when the step is traced, and read as a constant.

``create_block_mask`` called inside a loss traces into the step: a Hugging Face model with
``attn_implementation="flex_attention"`` builds its causal mask in every forward, dozens of ops
over the ``[B, H, Q, KV]`` grid and an ``argsort`` a step, for tensors that depend on nothing the
step is given. ``fold`` evaluates them once, on the graph's device, and each FlexAttention call
(forward and backward) reads the results as constants, as it would a mask built outside the
loss. Where every sequence's mask is the same (a causal mask built with ``B`` = the batch size),
the first is kept alone (``B=1``: the kernels broadcast it over the batch, the same mask;
``mask_mod`` still sees each sequence's index in the blocks it evaluates), which on a mesh
lets stage 2 keep a batch-sharded attention local (``sharding/flex_attention.py``).

A mask that depends on anything the step is given (a padding mask from the batch, a mask from a
parameter) stays in the step, as does one whose ops are not all ATen ops free of random draws
and collectives, or that something outside them writes into. Why beyond the saved work: on
CUDA fsg's Inductor step computed wrong gradients with a mask built in the step for each
sequence, and right ones with a shared mask read as a constant (``backend/flex_attention.py``
refuses the former; RESULTS.md, 2026-12-06).
"""

from __future__ import annotations

import operator
from typing import Iterator

import torch
from torch import fx

from fsg._src import _torch_private, graph_facts

FLEX_OPS = {"flex_attention": 4, "flex_attention_backward": 9}  # the BlockMask's tuple among each operator's args


def block_mask_args(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, int, list[fx.Node]]]:
    """Each FlexAttention call (forward and backward) of ``gm``, the index of its block-mask
    argument, and that tuple's tensor nodes."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, _torch_private.HigherOrderOperator):
            continue
        index = FLEX_OPS.get(node.target.name())
        if index is not None and len(node.args) > index:
            mask = node.args[index]
            yield node, index, [a for a in mask if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _cone(tensors: list[fx.Node]) -> set[fx.Node] | None:
    """The nodes ``tensors`` are computed from, or ``None`` if any is an input or an op other
    than an ATen op (or ``getitem`` of one) that draws no random numbers and calls no
    collective, or if an op outside them writes into one of them (an evaluation graph keeps
    in-place ops): what cannot be computed once, here."""
    cone, todo = set(), list(tensors)
    while todo:
        n = todo.pop()
        if n in cone:
            continue
        if n.op == "placeholder":
            return None
        if n.op == "call_function" and n.target is not operator.getitem:
            aten_op = isinstance(n.target, _torch_private.OpOverload)
            if not aten_op or _torch_private.draws_random(n.target) or _torch_private.is_collective(n.target):
                return None
        elif n.op not in ("call_function", "get_attr"):
            return None
        cone.add(n)
        todo.extend(n.all_input_nodes)
    aliases, todo = set(), list(cone)  # the cone's tensors and every view of them
    while todo:
        n = todo.pop()
        if n not in aliases:
            aliases.add(n)
            todo.extend(u for u in n.users if u not in cone and graph_facts.is_view(u))
    for n in aliases:  # a write into one from outside the cone would be missed by the evaluation
        if any(u not in cone and _writes(u, n) for u in n.users):
            return None
    return cone


def _writes(node: fx.Node, target: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, _torch_private.OpOverload):
        return False
    return any(i < len(node.args) and node.args[i] is target for i in _torch_private.mutated_args(node.target))


def _evaluate(gm: fx.GraphModule, cone: set[fx.Node]) -> dict[fx.Node, object]:
    """The values of ``cone``'s nodes, computed in graph order on real tensors."""
    env: dict[fx.Node, object] = {}
    for n in gm.graph.nodes:
        if n not in cone:
            continue
        if n.op == "get_attr":
            env[n] = _attr(gm, n.target)
        else:
            args = fx.node.map_arg(n.args, env.__getitem__)
            env[n] = n.target(*args, **fx.node.map_arg(n.kwargs, env.__getitem__))
    return env


def _attr(gm: fx.GraphModule, target: str) -> object:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _one_for_all(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` (a mask's tensors, batch first) as one mask for every sequence where each
    sequence's is the same: ``[:1]`` of each."""
    if not values or any(v.dim() == 0 or v.shape[0] != values[0].shape[0] for v in values) or values[0].shape[0] < 2:
        return values
    if all(bool((v == v[:1]).all()) for v in values):
        return [v[:1].clone() for v in values]
    return values


def fold(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` in place (module docstring); returns how many FlexAttention calls now
    read a folded mask."""
    graph, constants, cones, rewritten = gm.graph, {}, [], 0  # constants: a mask's tensors -> {tensor: constant}
    calls = list(block_mask_args(gm))
    if not calls:  # (most graphs: one walk over the nodes)
        return 0
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node, index, tensors in calls:
        key = tuple(tensors)
        if key not in constants:
            cone = _cone(tensors) if any(t.op == "call_function" for t in tensors) else None
            constants[key] = {} if cone is None else _constants(gm, first, cone, tensors, len(cones))
            cones += [cone] if cone is not None else []
        if constants[key]:
            mask = tuple(constants[key].get(a, a) if isinstance(a, fx.Node) else a for a in node.args[index])
            node.args = (*node.args[:index], mask, *node.args[index + 1 :])
            rewritten += 1
    if rewritten:
        _erase_unread(graph, set().union(*cones))
        gm.recompile()
    return rewritten


def _constants(gm: fx.GraphModule, first: fx.Node, cone: set[fx.Node], tensors: list[fx.Node], i: int) -> dict:
    """``tensors``' values (``_one_for_all``) as constants of ``gm``, read by ``get_attr`` nodes
    placed before ``first``: ``{tensor node: its constant's node}``."""
    env = _evaluate(gm, cone)
    out = {}
    for j, (t, value) in enumerate(zip(tensors, _one_for_all([env[t] for t in tensors]))):
        name = f"_fsg_block_mask_{i}_{j}"
        setattr(gm, name, value)
        with gm.graph.inserting_before(first):  # (create_node: get_attr warns of a plain tensor attribute)
            out[t] = gm.graph.create_node("get_attr", name)
        out[t].meta["val"] = _torch_private.fake_mode().from_tensor(value)
    return out


def _erase_unread(graph: fx.Graph, cone: set[fx.Node]) -> None:
    """Erases the nodes of ``cone`` that nothing outside it reads any more, with the in-place
    writes into them (an evaluation graph keeps those: ``eliminate_dead_code`` keeps them as
    impure, and with them the whole mask)."""
    live, stack = set(), [n for n in cone if any(u not in cone for u in n.users)]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(i for i in n.all_input_nodes if i in cone)
        for u in n.users:  # the writes into a live tensor, and into its views, stay
            if u in cone and (_writes(u, n) or (graph_facts.is_view(u) and any(_writes(w, u) for w in u.users))):
                stack.append(u)
    for n in reversed(list(graph.nodes)):
        if n in cone and n not in live:
            graph.erase_node(n)
