"""A pipeline step's plan: the schedule, the stage graphs, which rank holds which parameter,
and this rank's compiled actions. Every rank builds the same plan from the same trace."""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.tensor import Replicate

from fsg._src import _torch_private, tree, watch
from fsg._src.errors import UnsupportedError
from fsg._src.optim import _base as optim_base
from fsg._src.optim._base import GradientTransformation
from fsg._src.pipeline import data_axes, forward, split, stage_fns
from fsg._src.pipeline.actions import Schedule
from fsg._src.pipeline.data_axes import DataMesh
from fsg._src.pipeline.options import Pipeline
from fsg._src.sharding import op_support
from fsg._src.trace import tracing

log = logging.getLogger("fsg")


class Plan(NamedTuple):
    """What every rank knows of the split, and this rank's compiled stages."""

    schedule: Schedule
    stages: tuple[split.StageGraph, ...]
    names: tuple[str, ...]  # every parameter, in the params' order
    holders: dict[str, tuple[int, ...]]  # parameter -> the pipeline indices whose stages read it (or index 0)
    kept: frozenset[str]  # the params the loss's gradient does not reach: not trained (frozen.py)
    like: dict[str, torch.Tensor]  # every parameter's shape and dtype (meta tensors)
    aux_names: tuple[str, ...]
    fns: dict[int, stage_fns.StageFns]  # this rank's stages
    batch_specs: Any  # the batch's abstract signature the plan was traced for
    data: DataMesh | None  # the mesh's other (data) axes at this rank, if any
    batch_placements: tuple | None  # on them: each flat batch leaf's, then the two keys'
    random_calls: int  # the keyed random calls of one microbatch (the key offsets' stride)
    norm_dtype: torch.dtype  # a global norm's (fsg.optim.scalar_dtype of all params)
    flags: tuple  # the modules' train/eval modes and requires_grad flags it was traced under (watch.py)


def build(
    loss_fn: Callable[..., Any],
    params: dict[str, torch.Tensor],
    batch: Any,
    schedule: Schedule,
    options: Pipeline,
    me: int,
    backend: str,
    data: DataMesh | None = None,
    flags: watch.Flags | None = None,
) -> Plan:
    """Traces one microbatch's forward and loss, splits it into ``schedule.num_stages`` stages,
    and compiles the actions of the stages pipeline index ``me`` runs (on a data mesh, each
    expanded over it: ``data_axes``). ``flags`` records the modules the trace runs."""
    tracing.check_accumulation(batch, schedule.num_microbatches)
    microbatch = next(tracing.microbatches(batch, schedule.num_microbatches))
    decompositions = None if data is None else op_support.mesh_decompositions()
    flags = watch.Flags() if flags is None else flags
    gm, aux_names, random_calls, reached = forward.trace_forward(loss_fn, params, microbatch, decompositions, flags)
    stages = split.split(gm, schedule.num_stages, options.split_points, len(params))
    names = tuple(params)
    readers: dict[str, set[int]] = {n: set() for n in names}
    for k, stage in enumerate(stages):
        for i in stage.params:
            readers[names[i]].add(schedule.rank_of(k))
    for n in names:  # a parameter no stage reads (an unused pooler): kept on the first stage's rank
        readers[n] = readers[n] or {schedule.rank_of(0)}
    kept = frozenset(n for i, n in enumerate(names) if i not in reached)
    if kept:
        shown = ", ".join(sorted(kept)[:8]) + (" ..." if len(kept) > 8 else "")
        log.info("fsg: %d parameter(s) frozen or not reached by the loss, not trained: %s", len(kept), shown)
    leaves = list(params.values())
    mb_leaves = tree.flatten(microbatch)[0]
    batch_pl = None
    if data is not None:  # the keys (the last two "batch" leaves) are replicated
        real = data_axes.batch_placements(mb_leaves, data, tree.leaf_paths(microbatch, "batch"))
        batch_pl = (*real, *[(Replicate(),) * len(data.shape)] * 2)
    mb_leaves = [*mb_leaves, *forward.keys_like(leaves[0].device if leaves else mb_leaves[0].device)]
    fns, mine, acts_pl = {}, set(schedule.stages_of(me)), ()
    for k, stage in enumerate(stages):
        own, mb = [leaves[i] for i in stage.params], [mb_leaves[j] for j in stage.batch]
        placements = [] if batch_pl is None else [*(batch_pl[j] for j in stage.batch), *acts_pl]
        last = k == len(stages) - 1
        if data is None and k not in mine:
            continue
        fwd = stage_fns.forward(stage, own, mb, last, data, placements)
        acts_pl = fwd.placements or ()
        if k in mine:
            fns[k] = stage_fns.build(stage, own, mb, last, backend, fwd, data, placements)
    holders = {n: tuple(sorted(r)) for n, r in readers.items()}
    return Plan(
        schedule,
        tuple(stages),
        names,
        holders,
        kept,
        {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()},
        aux_names,
        fns,
        batch_signature(batch),
        data,
        batch_pl,
        random_calls,
        optim_base.scalar_dtype(params),
        flags.now(),
    )


def batch_signature(batch: Any) -> Any:
    leaves, treedef = tree.flatten(batch)
    return treedef, tree.leaf_specs(leaves)


# optimizers found to update each parameter from its own gradient, by (optimizer, params' signature):
# tracing the update costs seconds, and a run builds several steps with one optimizer
_PER_PARAMETER: set[tuple] = set()


def check_per_parameter(optimizer: GradientTransformation, params: dict[str, torch.Tensor]) -> None:
    """Raises ``UnsupportedError`` if the optimizer's update of a parameter reads another
    parameter's gradient other than through ``fsg.optim.global_norm`` (which the pipeline step
    reduces over its ranks, ``LeafSplit``): each pipeline rank updates only its own parameters,
    so any other reading across them would see a part of the gradients."""
    key = (optimizer, tuple((n, tuple(p.shape), p.dtype) for n, p in params.items()))
    if key in _PER_PARAMETER:
        return
    _check_per_parameter(optimizer, params)
    _PER_PARAMETER.add(key)


def _check_per_parameter(optimizer: GradientTransformation, params: dict[str, torch.Tensor]) -> None:
    names = list(params)
    n = len(names)

    def update(*flat):
        grads, current = dict(zip(names, flat[:n])), dict(zip(names, flat[n:]))
        updates, _ = optimizer.update(grads, optimizer.init(current), current)
        return tuple(updates[k] for k in names)

    # distinct stand-ins for the gradients and the params (one tensor twice would trace as one input)
    grads, current = ([torch.empty_like(p, device="meta") for p in params.values()] for _ in range(2))

    def norm(leaves):  # a reduction over every rank in the step: no dependence on this rank's leaves
        return torch.ones((), dtype=optim_base.scalar_dtype(leaves), device="meta")

    with optim_base.split_leaves(optim_base.LeafSplit(norm)):
        gm = _torch_private.trace_fake(update, *grads, *current)
    reads: dict[Any, frozenset[int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            reads[node] = frozenset({i}) if i < n else frozenset()
        else:
            reads[node] = frozenset().union(*(reads[a] for a in node.all_input_nodes))
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    for i, out in enumerate(outputs):
        others = sorted(reads.get(out, frozenset()) - {i}) if isinstance(out, torch.fx.Node) else []
        if others:
            raise UnsupportedError(
                f"the optimizer's update of params[{names[i]!r}] reads the gradient of params[{names[others[0]]!r}] "
                f"other than through fsg.optim.global_norm; a pipeline step updates each stage's parameters on "
                f"its own rank and reduces only fsg.optim.global_norm (clip_by_global_norm) across them. Write "
                f"the cross-parameter reduction with fsg.optim.global_norm, or drop it for a pp step"
            )
