"""Stage 3 graph pass: substitute the fused AdamW kernel for the traced optimizer update.

Stage 1 traces ``fsg.optim.adamw`` as plain tensor math (the reference). On CUDA this pass
finds, by dataflow, where that math starts (the ``fsg::grad`` markers) and where it ends (the
donation ``copy_`` of each new param, first and second moment into its state storage),
inserts one ``fsg::fused_adamw_`` node that updates those storages in place, and deletes the
copies; dead-code elimination then removes the traced math. The new update count and
learning rate stay in the graph (the kernel reads them on the device), so schedules and bias
correction need no host sync. A step that skips non-finite steps writes
``where(finite, new, old)``; the pass hands ``finite`` to the kernel, which then writes nothing
at a skipped step (docs/resilience.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import fx

from fsg._src import tree
from fsg._src.errors import UnsupportedError
from fsg._src.kernels import adamw as adamw_kernel  # noqa: F401 - registers fsg::fused_adamw_
from fsg._src.optim._base import AdamWSpec, EmptyState, GradientTransformation, chain
from fsg._src.optim._transforms import ScaleByAdamState, scale_by_adam, scale_by_learning_rate
from fsg._src.passes.narrow_reads import through_views, without_upcast
from fsg._src.passes.ordering import NodeOrder
from fsg._src.trace import markers

FUSED_ADAMW = torch.ops.fsg.fused_adamw_.default
_COPY = torch.ops.aten.copy_.default
_WHERE = torch.ops.aten.where.self
_FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adamw_spec(optimizer: Any) -> AdamWSpec | None:
    """The spec of an ``fsg.optim.adamw`` or ``adam`` optimizer; ``None`` for any other."""
    spec = getattr(optimizer, "spec", None)
    return spec if isinstance(spec, AdamWSpec) else None


class AdamWPlan(NamedTuple):
    """What the pass needs, as data: the optimizer's spec, where its tensors sit among the
    flat state leaves (stage 1's leaf layout) and each param's resolved weight decay."""

    spec: AdamWSpec
    params: list[int]
    mus: list[int]
    nus: list[int]
    count: int  # the Adam update count
    learning_rate: int  # the learning rate of the last update
    weight_decays: list[float]


def plan(optimizer: Any, state: Any, *, donate: bool) -> AdamWPlan | str:
    """The plan for replacing the traced update of ``optimizer`` on ``state`` by the fused
    kernel, or the reason it cannot be."""
    spec = adamw_spec(optimizer)
    if spec is None:
        return "the optimizer is not fsg.optim.adam or fsg.optim.adamw (a chain around one is traced as math)"
    if not donate:
        return "donate=False (the fused kernel updates the state in place)"
    leaves, state_def = tree.flatten(state)
    index = tree.unflatten(state_def, list(range(len(leaves))))
    adam, *_, lr_state = index.opt_state  # chain(scale_by_adam, [add_decayed_weights,] scale_by_lr)
    params, mus, nus = (tree.flatten(x)[0] for x in (index.params, adam.mu, adam.nu))
    names = tree.leaf_paths(state.params, "state.params")
    for name, i, m, v in zip(names, params, mus, nus):
        for t in (leaves[i], leaves[m], leaves[v]):
            if t.dtype not in _FUSABLE_DTYPES:
                return f"{name} has dtype {t.dtype} (the kernel takes float32, bfloat16, float16)"
            if not t.is_contiguous():
                return f"{name} (or its optimizer state) is not contiguous"
    flags = tree.flatten(spec.mask(state.params) if callable(spec.mask) else spec.mask)[0] if spec.mask else None
    decays = [spec.weight_decay if flags is None or flags[k] else 0.0 for k in range(len(params))]
    return AdamWPlan(spec, params, mus, nus, adam.count, lr_state.learning_rate, decays)


def why_not_fusable(optimizer: Any, state: Any, *, donate: bool) -> str | None:
    """Why the fused AdamW cannot replace the traced update of ``optimizer`` on ``state``
    (``None`` when it can)."""
    found = plan(optimizer, state, donate=donate)
    return found if isinstance(found, str) else None


def stand_in(spec: AdamWSpec) -> Any:
    """A transformation to trace in place of ``fsg.optim.adamw`` when ``fuse_adamw`` will
    replace its update: the same state structure and the same update count and learning rate
    (which the fused node reads), but new moments and params that are mere copies of the
    gradient, a few graph nodes per param instead of the ~15 of Adam's math. Tracing the real
    math only for the pass to delete it was a third of stage 1 for GPT-2. Its graph is only
    correct once ``fuse_adamw`` has rewritten it."""
    adam = scale_by_adam(b1=spec.b1, b2=spec.b2, eps=spec.eps)

    def adam_update(updates, state, params=None):
        moment = tree.tree_map(lambda m, g: g.to(m.dtype), state.mu, updates)
        return updates, ScaleByAdamState(state.count + 1, moment, moment)

    decay = [GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (u, s))] * spec.decay_state
    return chain(GradientTransformation(adam.init, adam_update), *decay, scale_by_learning_rate(spec.learning_rate))


def skip_flag(sources: list[fx.Node]) -> fx.Node | None:
    """The 0-d bool ``finite`` of the skip's ``where(finite, new, old)`` around every new value
    in ``sources``; ``None`` when no value has one. Raises ``UnsupportedError`` when only some
    do, or with different flags (the fused node writes all of them or none)."""
    flags = {s.args[0] if isinstance(s, fx.Node) and s.target is _WHERE else None for s in sources}
    flag = flags.pop() if len(flags) == 1 else "several"
    value = flag.meta.get("val") if isinstance(flag, fx.Node) else None
    if flag is not None and (value is None or value.dim() != 0 or value.dtype != torch.bool):
        raise UnsupportedError(f"fused AdamW: the new params and moments are not all kept by one skip flag ({flag})")
    return flag


def fuse_adamw(gm: fx.GraphModule, at: AdamWPlan) -> int:
    """Rewrites ``gm`` (a donated stage-1 graph that still has its ``fsg::grad`` markers) to
    update params and moments with one ``fsg::fused_adamw_`` node. Returns how many param
    leaves it covers; raises ``UnsupportedError`` if the graph does not have the expected
    shape (the traced math is then left as it was)."""
    spec = at.spec
    p_ids, mu_ids, nu_ids = at.params, at.mus, at.nus
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    copies = {}  # placeholder -> the copy_ that writes its new value
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _COPY:
            dst = through_views(n.args[0])
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
    grads = {k: without_upcast(g) for k, g in grads.items()}
    lr_copy = copies.get(placeholders[at.learning_rate])
    lr = lr_copy.args[1] if lr_copy is not None else placeholders[at.learning_rate]
    wds = at.weight_decays
    finite = skip_flag([copies[placeholders[i]].args[1] for i in (*p_ids, *mu_ids, *nu_ids)])
    first = NodeOrder(graph).first(copies[n] for n in needed)
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
                finite,
            ),
        )
    for i in (*p_ids, *mu_ids, *nu_ids):
        graph.erase_node(copies[placeholders[i]])
    graph.eliminate_dead_code()
    gm.recompile()
    return len(p_ids)
