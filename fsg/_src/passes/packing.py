"""Packing collectives: many (collective, wait) pairs of one kind become one collective.

The gradient buckets (``buckets.py``: all-reduces, reduce-scatters) and the parameter gathers
(``prefetch.py``: all-gathers) all rewrite the same way (issue 15 had three copies of it):

    cat(each input, flattened) -> one collective -> one wait -> split_with_sizes -> each item's
    piece, in its own shape, in place of its old wait

``pack`` emits that and erases the old pairs; where the collective and the wait go is the
caller's decision. What differs between the kinds is only how an input is laid out in the
packed buffer and how a result is cut from it (``Layout``):

- **all_reduce** (elementwise): each input flattened, concatenated; the result is split as is.
- **reduce_scatter** over W ranks: each input seen as ``[W, n_i / W]`` (rank r's shard is row
  r), concatenated along dim 1, so the reduce-scatter hands rank r the concatenation of its
  shards ``[1, sum n_i / W]``, flattened, then split.
- **all_gather** over W ranks: each rank's shards flattened and concatenated; the gathered
  ``W * sum n_i`` buffer is ``[W, sum n_i]`` (row r: rank r's shards), each parameter a block
  of columns, made contiguous before its view.

Shapes in names: ``W`` the group's size, ``N`` the packed element count per rank.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes.moves import meta_value

_aten = torch.ops.aten


class Layout(NamedTuple):
    """How one kind of collective packs (see the module docstring)."""

    world: Callable[[tuple], int]  # the group size, from the arguments after the input
    share: Callable[[torch.Tensor, int], int]  # an input's element count in the waited result
    flatten: Callable[[fx.Graph, fx.Node, int], fx.Node]  # an input as it is concatenated
    cat_dim: int
    # the packed collective's value from (sizes, W, dtype); None: the node gets none (only the
    # gather's result had one when each pass had its own copy of this rewrite)
    result_value: Callable[[list[int], int, torch.dtype], torch.Tensor | None]
    split: Callable[[fx.Graph, fx.Node, list[int], int], tuple]  # the wait's node -> split's args
    shaped: Callable[[fx.Graph, fx.Node, torch.Tensor, fx.Node, int], fx.Node]  # a piece -> its result


def _flat(graph: fx.Graph, x: fx.Node, world: int) -> fx.Node:
    return graph.call_function(_aten.reshape.default, (x, [-1]))


def _rows(graph: fx.Graph, x: fx.Node, world: int) -> fx.Node:
    return graph.call_function(_aten.reshape.default, (x, [world, -1]))


def _as_input(graph: fx.Graph, piece: fx.Node, value: torch.Tensor, wait: fx.Node, world: int) -> fx.Node:
    shaped = graph.call_function(_aten.view.default, (piece, list(value.shape)))
    shaped.meta["val"] = value
    return shaped


def _as_shard(graph: fx.Graph, piece: fx.Node, value: torch.Tensor, wait: fx.Node, world: int) -> fx.Node:
    shape = [value.shape[0] // world, *value.shape[1:]]  # this rank's rows of the input
    shaped = graph.call_function(_aten.view.default, (piece, shape))
    shaped.meta["val"] = torch.empty(shape, dtype=value.dtype, device="meta")
    return shaped


def _as_gathered(graph: fx.Graph, piece: fx.Node, value: torch.Tensor, wait: fx.Node, world: int) -> fx.Node:
    out = meta_value(wait)  # a block of columns of [W, N]: made contiguous, then the gathered shape
    dense = graph.call_function(_aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
    shaped = graph.call_function(_aten.view.default, (dense, list(out.shape)))
    shaped.meta["val"] = out
    return shaped


def _no_value(sizes: list[int], world: int, dtype: torch.dtype) -> None:
    return None


LAYOUTS = {
    # args after the input: (reduce_op, group_name)
    _torch_private.ALL_REDUCE: Layout(
        world=lambda args: 1, share=lambda v, w: v.numel(), flatten=_flat, cat_dim=0, result_value=_no_value,
        split=lambda g, done, sizes, w: (done, sizes), shaped=_as_input,
    ),
    # (reduce_op, group_size, group_name): rank r gets [1, N] of the [W, N] rows, flattened
    _torch_private.REDUCE_SCATTER: Layout(
        world=lambda args: args[1], share=lambda v, w: v.numel() // w, flatten=_rows, cat_dim=1,
        result_value=_no_value,
        split=lambda g, done, sizes, w: (g.call_function(_aten.reshape.default, (done, [-1])), sizes),
        shaped=_as_shard,
    ),
    # (group_size, group_name): the gathered W * N elements are [W, N], split by columns
    _torch_private.ALL_GATHER: Layout(
        world=lambda args: args[0], share=lambda v, w: v.numel(), flatten=_flat, cat_dim=0,
        result_value=lambda sizes, w, dtype: torch.empty(w * sum(sizes), dtype=dtype, device="meta"),
        split=lambda g, done, sizes, w: (g.call_function(_aten.view.default, (done, [w, sum(sizes)])), sizes, 1),
        shaped=_as_gathered,
    ),
}  # fmt: skip


def pack(
    graph: fx.Graph, pairs: Sequence[tuple[fx.Node, fx.Node]], *, issue_before: fx.Node, wait_before: fx.Node
) -> fx.Node:
    """Replaces ``pairs``, (collective, wait) of one kind with the same arguments after the
    input and inputs of one dtype (``bucketing.key``), by one packed collective inserted before
    ``issue_before`` (after every input) and its wait with the split inserted before
    ``wait_before`` (before every use of a result); each old wait's uses read their piece,
    and the old pairs are erased. The caller invalidates its ``NodeOrder``.

    Args:
      graph: the graph holding ``pairs``.
      pairs: the collectives and their sole waits, in the order their pieces are packed.
      issue_before, wait_before: where the collective and the wait go.

    Returns:
      The packed collective's ``wait_tensor`` node.
    """
    first = pairs[0][0]
    target, args = first.target, tuple(first.args[1:])
    layout = LAYOUTS[target]
    world = layout.world(args)
    inputs = [collective.args[0] for collective, _ in pairs]
    values = [meta_value(x) for x in inputs]
    sizes = [layout.share(v, world) for v in values]
    dtype = values[0].dtype
    with graph.inserting_before(issue_before):
        parts = [layout.flatten(graph, x, world) for x in inputs]
        packed = graph.call_function(_aten.cat.default, (parts, layout.cat_dim) if layout.cat_dim else (parts,))
        shape = [sum(sizes)] if layout.cat_dim == 0 else [world, sum(sizes)]
        packed.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        result = graph.call_function(target, (packed, *args))
        value = layout.result_value(sizes, world, dtype)
        if value is not None:
            result.meta["val"] = value
    with graph.inserting_before(wait_before):
        done = graph.call_function(_torch_private.WAIT_TENSOR, (result,))
        if value is not None:
            done.meta["val"] = value
        pieces = graph.call_function(_aten.split_with_sizes.default, layout.split(graph, done, sizes, world))
        for k, ((_, wait), value_k) in enumerate(zip(pairs, values)):
            piece = graph.call_function(operator.getitem, (pieces, k))
            wait.replace_all_uses_with(layout.shaped(graph, piece, value_k, wait, world))
    for collective, wait in pairs:
        graph.erase_node(wait)
        graph.erase_node(collective)
    return done


def sole_wait(collective: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` that is ``collective``'s only user, or ``None`` (then it is not
    packed: its result is read some other way)."""
    users = list(collective.users)
    return users[0] if len(users) == 1 and users[0].target is _torch_private.WAIT_TENSOR else None
