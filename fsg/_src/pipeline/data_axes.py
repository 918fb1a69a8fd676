"""A pipeline's stages on the mesh's other axes (``pp x dp``): each stage graph expanded by
stage 2's rules over the data-parallel sub-mesh of its rank.

Every action graph (forward ``F``, input gradient ``B``, weight gradient ``W``) is traced at
the global microbatch's shapes, then re-run on ``DTensor`` inputs by stage 2's interpreter
(``sharding/spmd.py``) over the ``dp`` sub-mesh, so that a loss that reduces over the batch
(a mean, a sum, a normalisation by a count) gets the collectives that make it the global
microbatch's loss: no assumption that the loss is a mean of per-row terms. Placements:

- params: replicated over ``dp``; batch leaves: split on dim 0 (0-d ones replicated);
- activations ``F`` sends: as DTensor leaves them, a partial sum reduced (``Replicate``);
  the receiving stage takes them in those placements (every rank traces every stage's ``F``);
- input gradients ``B`` sends: the placements of the activations they are gradients of;
- the loss and aux: replicated (the same metric on every rank);
- parameter gradients ``W`` returns: a partial sum stays this rank's local contribution,
  summed over the microbatches and reduced over ``dp`` once per step (``reduce``), as DDP's
  ``no_sync`` accumulation does.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from fsg._src import _torch_private
from fsg._src.errors import BatchError
from fsg._src.mesh import Mesh
from fsg._src.sharding import spmd
from fsg._src.trace import libraries


class DataMesh:
    """The mesh's axes other than ``pp`` at this rank, as stage 2's interpreter takes a mesh."""

    def __init__(self, mesh: Mesh, axes: tuple[str, ...]):
        self.axis_names = axes
        self.shape = tuple(mesh.axis_size(a) for a in axes)
        self.size = math.prod(self.shape)
        self.device_mesh = mesh.device_mesh[axes if len(axes) > 1 else axes[0]]
        self.group = self.device_mesh.get_group() if len(axes) == 1 else None

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.axis_names, self.shape))})"


def batch_placements(leaves: Sequence[torch.Tensor], mesh: DataMesh, where: Sequence[str]) -> list[tuple[Placement]]:
    """Each microbatch leaf split on dim 0 over ``dp`` (0-d: replicated); ``BatchError`` where
    dim 0 does not divide."""
    out = []
    for leaf, name in zip(leaves, where):
        if leaf.dim() == 0:
            out.append((Replicate(),))
            continue
        if leaf.shape[0] % mesh.size:
            raise BatchError(
                f"{name}: a microbatch of {leaf.shape[0]} rows does not split over {mesh!r}; make the batch "
                f"a multiple of accum_steps x {mesh.size} rows"
            )
        out.append((Shard(0),))
    return out


def local_like(t: torch.Tensor, placements: tuple[Placement, ...], mesh: DataMesh) -> torch.Tensor:
    """An empty tensor of this rank's local shape of the global ``t``."""
    shape = list(t.shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            n, chunk = shape[p.dim], -(-shape[p.dim] // mesh.shape[axis])  # DTensor's torch.chunk pieces
            shape[p.dim] = max(0, min(n - mesh.device_mesh.get_coordinate()[axis] * chunk, chunk))
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def replicated(x: DTensor, mesh: DataMesh, kind: type = Partial) -> DTensor:
    """``x`` with every placement of ``kind`` (default: a partial sum, reduced) made
    ``Replicate``; other placements kept."""
    placements = tuple(Replicate() if isinstance(p, kind) else p for p in x.placements)
    return x if placements == tuple(x.placements) else x.redistribute(mesh.device_mesh, placements)


class Expanded(NamedTuple):
    graph: fx.GraphModule  # over the local pieces of the inputs
    placements: tuple[tuple[Placement, ...], ...]  # of each output
    local_outputs: tuple[torch.Tensor, ...]  # an empty tensor of each output's local shape


def expand(
    gm: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    placements: Sequence[tuple[Placement, ...]],
    mesh: DataMesh,
    place_output: Callable[[int, DTensor], DTensor],
) -> Expanded:
    """``gm`` (traced on global ``inputs``) as a graph of this rank's pieces in ``placements``;
    ``place_output(i, out)`` redistributes output ``i`` before it is made local."""
    local_inputs = [local_like(t, p, mesh) for t, p in zip(inputs, placements)]
    seen: list = []

    def local_fn(*locals_):
        dtensors = [
            DTensor.from_local(t, mesh.device_mesh, p, run_check=False, shape=g.shape, stride=g.stride())
            for t, p, g in zip(locals_, placements, inputs)
        ]
        outputs = spmd.run_global(gm, mesh, dtensors)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        result, seen[:] = [], []
        for i, out in enumerate(outputs):
            if not isinstance(out, DTensor):  # made inside the graph from constants alone
                out = DTensor.from_local(out, mesh.device_mesh, (Replicate(),) * len(mesh.shape), run_check=False)
            out = place_output(i, out)
            seen.append(tuple(out.placements))
            result.append(out.to_local())
        return tuple(result)

    with libraries.tracing():
        local = _torch_private.trace_fake(local_fn, *local_inputs)
    local.graph.eliminate_dead_code()
    local.recompile()
    outs = next(n for n in local.graph.nodes if n.op == "output").args[0]
    like = tuple(torch.empty(o.meta["val"].shape, dtype=o.meta["val"].dtype, device=inputs[0].device) for o in outs)
    return Expanded(local, tuple(seen), like)


def reduce_gradient(g: torch.Tensor, placement: tuple[Placement, ...], mesh: DataMesh) -> torch.Tensor:
    """A parameter gradient summed over microbatches, reduced over ``dp`` where it is a partial
    sum (the ``W`` graph left it local); replicated gradients are already whole."""
    (p,) = placement  # one data axis (dp)
    if not isinstance(p, Partial):
        return g
    dist.all_reduce(g, group=mesh.group)
    if p.reduce_op == "avg":
        g /= mesh.size
    return g
