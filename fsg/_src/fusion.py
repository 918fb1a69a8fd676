"""Stage 3 graph pass: substitute the fused AdamW kernel for the traced optimizer update.

Stage 1 traces ``fsg.optim.adamw`` as plain tensor math (the reference). On CUDA this pass
finds, by dataflow, where that math starts (the ``fsg::grad`` markers) and where it ends (the
donation ``copy_`` of each new param, first and second moment into its state storage),
inserts one ``fsg::fused_adamw_`` node that updates those storages in place, and deletes the
copies; dead-code elimination then removes the traced math. The new update count and
learning rate stay in the graph (the kernel reads them on the device), so schedules and bias
correction need no host sync.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import fx

from fsg._src import markers, tree
from fsg._src.errors import UnsupportedError
from fsg._src.kernels import adamw as adamw_kernel  # noqa: F401 - registers fsg::fused_adamw_

FUSED_ADAMW = torch.ops.fsg.fused_adamw_.default
_COPY = torch.ops.aten.copy_.default
_FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AdamWSpec(NamedTuple):
    """The hyperparameters of an ``fsg.optim.adamw`` transformation."""

    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any
    learning_rate: Any  # a float or a schedule
    decay_state: bool = True  # adamw's chain has add_decayed_weights (EmptyState) in the middle


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_adamw(transformation: Any, spec: AdamWSpec) -> Any:
    """Marks ``transformation`` (built by ``fsg.optim.adamw`` or ``adam``) as fusable; returns it."""
    _SPECS[transformation.update] = spec
    return transformation


def adamw_spec(optimizer: Any) -> AdamWSpec | None:
    """The spec of an ``fsg.optim.adamw`` or ``adam`` optimizer; ``None`` for any other."""
    return _SPECS.get(optimizer.update)


class _AdamWLeaves(NamedTuple):
    """Where adamw's tensors sit among the flat state leaves."""

    leaves: list
    params: list[int]
    mus: list[int]
    nus: list[int]
    count: int  # the Adam update count
    learning_rate: int  # the learning rate of the last update


def _adamw_leaves(state: Any) -> _AdamWLeaves:
    leaves, state_def = tree.flatten(state)
    index = tree.unflatten(state_def, list(range(len(leaves))))
    adam, *_, lr_state = index.opt_state  # chain(scale_by_adam, [add_decayed_weights,] scale_by_lr)
    ids = (tree.flatten(x)[0] for x in (index.params, adam.mu, adam.nu))
    return _AdamWLeaves(leaves, *ids, adam.count, lr_state.learning_rate)


def stand_in(optimizer: Any) -> Any:
    """A transformation to trace in place of ``fsg.optim.adamw`` when ``fuse_adamw`` will
    replace its update: the same state structure and the same update count and learning rate
    (which the fused node reads), but new moments and params that are mere copies of the
    gradient, a few graph nodes per param instead of the ~15 of Adam's math. Tracing the real
    math only for the pass to delete it was a third of stage 1 for GPT-2. Its graph is only
    correct once ``fuse_adamw`` has rewritten it."""
    from fsg._src.optim._base import EmptyState, GradientTransformation, chain
    from fsg._src.optim._transforms import ScaleByAdamState, scale_by_adam, scale_by_learning_rate

    spec = adamw_spec(optimizer)
    adam = scale_by_adam(b1=spec.b1, b2=spec.b2, eps=spec.eps)

    def adam_update(updates, state, params=None):
        moment = tree.tree_map(lambda m, g: g.to(m.dtype), state.mu, updates)
        return updates, ScaleByAdamState(state.count + 1, moment, moment)

    decay = [GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (u, s))] * spec.decay_state
    return chain(GradientTransformation(adam.init, adam_update), *decay, scale_by_learning_rate(spec.learning_rate))


def why_not_fusable(optimizer: Any, state: Any, *, donate: bool) -> str | None:
    """Why the fused AdamW cannot replace the traced update of ``optimizer`` on ``state``
    (``None`` when it can)."""
    if adamw_spec(optimizer) is None:
        return "the optimizer is not fsg.optim.adam or fsg.optim.adamw (a chain around one is traced as math)"
    if not donate:
        return "donate=False (the fused kernel updates the state in place)"
    at = _adamw_leaves(state)
    names = tree.leaf_paths(state.params, "state.params")
    for name, i, m, v in zip(names, at.params, at.mus, at.nus):
        for t in (at.leaves[i], at.leaves[m], at.leaves[v]):
            if t.dtype not in _FUSABLE_DTYPES:
                return f"{name} has dtype {t.dtype} (the kernel takes float32, bfloat16, float16)"
            if not t.is_contiguous():
                return f"{name} (or its optimizer state) is not contiguous"
    return None


_SAME_SHAPE_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default)


def _through_views(node: fx.Node) -> fx.Node:
    """The node under a chain of shape-preserving views (stage 2 writes a donated leaf
    through ``view(placeholder)``, the local tensor of a ``DTensor.from_local``)."""
    while (
        node.op == "call_function"
        and node.target in _SAME_SHAPE_VIEWS
        and isinstance(node.args[0], fx.Node)
        and node.args[0].meta.get("val") is not None
        and node.meta.get("val") is not None
        and tuple(node.args[0].meta["val"].shape) == tuple(node.meta["val"].shape)
    ):
        node = node.args[0]
    return node


def fuse_adamw(gm: fx.GraphModule, state: Any, optimizer: Any) -> int:
    """Rewrites ``gm`` (a donated stage-1 graph that still has its ``fsg::grad`` markers) to
    update params and moments with one ``fsg::fused_adamw_`` node. Returns how many param
    leaves it covers; raises ``UnsupportedError`` if the graph does not have the expected
    shape (the traced math is then left as it was)."""
    spec = adamw_spec(optimizer)
    at = _adamw_leaves(state)
    p_ids, mu_ids, nu_ids = at.params, at.mus, at.nus
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    copies = {}  # placeholder -> the copy_ that writes its new value
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _COPY:
            dst = _through_views(n.args[0])
            if dst.op == "placeholder":
                copies[dst] = n
    grads = {n.args[1]: n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is markers.GRAD}
    needed = [placeholders[i] for i in (*p_ids, *mu_ids, *nu_ids, at.count)]
    missing = [n.name for n in needed if n not in copies]
    if missing or sorted(grads) != list(range(len(p_ids))):
        raise UnsupportedError(f"fused AdamW: the traced update does not write {missing or 'every gradient'}")
    for k, (i, m, v) in enumerate(zip(p_ids, mu_ids, nu_ids)):
        shapes = {tuple(n.meta["val"].shape) for n in (placeholders[i], placeholders[m], placeholders[v], grads[k])}
        if len(shapes) != 1:  # e.g. a moment sharded unlike its param on a mesh
            raise UnsupportedError(f"fused AdamW: param {k}, its gradient and moments have local shapes {shapes}")
    lr_copy = copies.get(placeholders[at.learning_rate])
    lr = lr_copy.args[1] if lr_copy is not None else placeholders[at.learning_rate]
    flags = tree.flatten(spec.mask(state.params) if callable(spec.mask) else spec.mask)[0] if spec.mask else None
    wds = [spec.weight_decay if flags is None or flags[k] else 0.0 for k in range(len(p_ids))]
    order = {n: k for k, n in enumerate(graph.nodes)}
    first = min((copies[n] for n in needed), key=order.__getitem__)
    with graph.inserting_before(first):
        graph.call_function(
            FUSED_ADAMW,
            (
                [placeholders[i] for i in p_ids],
                [grads[k] for k in range(len(p_ids))],
                [placeholders[i] for i in mu_ids],
                [placeholders[i] for i in nu_ids],
                copies[placeholders[at.count]].args[1],
                lr,
                spec.b1,
                spec.b2,
                spec.eps,
                wds,
            ),
        )
    for i in (*p_ids, *mu_ids, *nu_ids):
        graph.erase_node(copies[placeholders[i]])
    graph.eliminate_dead_code()
    gm.recompile()
    return len(p_ids)
