"""Placing state and batches on a mesh: specs to DTensors, DTensors to local pieces."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from fsg._src import tree
from fsg._src.errors import MeshError
from fsg._src.mesh import Mesh, P
from fsg._src.rules import Rules, data_parallel, param_names
from fsg._src.sharding.spmd import ShardPlan, local_shard


def distribute_params(params: Any, mesh: Mesh, rules: Rules | None) -> Any:
    """Each parameter as a DTensor with the placements its rule gives (validated first)."""
    rules = rules or data_parallel()
    check_param_specs(params, mesh, rules)  # every spec, before any collective
    leaves, treedef = tree.flatten(params)
    placed = []
    for name, leaf in zip(param_names(params), leaves):
        spec = rules.spec_for(name, tuple(leaf.shape), mesh)
        # distribute_tensor takes rank 0's values, so all ranks start from the same params.
        placed.append(distribute_tensor(leaf.detach(), mesh.device_mesh, mesh.placements(spec)))
    return tree.unflatten(treedef, placed)


def check_param_specs(params: Any, mesh: Mesh, rules: Rules | None) -> None:
    """Validates each parameter's spec on ``mesh`` (any size) without placing anything."""
    rules = rules or data_parallel()
    leaves, _ = tree.flatten(params)
    for name, path, leaf in zip(param_names(params), tree.leaf_paths(params, "params"), leaves):
        mesh.validate(rules.spec_for(name, tuple(leaf.shape), mesh), tuple(leaf.shape), path)


def replicate_rest(tree_: Any, mesh: Mesh) -> Any:
    """Makes every plain-tensor leaf of ``tree_`` a replicated DTensor."""
    replicate = [Replicate()] * len(mesh.shape)

    def place(leaf):
        if isinstance(leaf, DTensor):
            return leaf
        return distribute_tensor(leaf, mesh.device_mesh, replicate)

    return tree.tree_map(place, tree_)


def batch_placements(batch_leaves: list, batch_paths: list[str], spec: P, mesh: Mesh) -> list[tuple[Placement, ...]]:
    """Placements of each batch leaf under ``spec`` (validated against each leaf's shape). A 0-d
    leaf (a loss weight, a temperature) has no dim to shard: it is replicated, as state scalars are."""
    out = []
    for path, leaf in zip(batch_paths, batch_leaves):
        if leaf.dim() == 0:
            out.append(tuple(mesh.placements(P())))
            continue
        mesh.validate(spec, tuple(leaf.shape), path)
        out.append(tuple(mesh.placements(spec)))
    return out


def make_plan(state: Any, batch: Any, batch_spec: P, mesh: Mesh) -> ShardPlan:
    """The ``ShardPlan`` of a placed state and a (global or DTensor) batch."""
    state_leaves, _ = tree.flatten(state)
    for path, leaf in zip(tree.leaf_paths(state, "state"), state_leaves):
        if not isinstance(leaf, DTensor):
            raise MeshError(
                f"{path} is a plain tensor, but on {mesh!r} every state leaf is a DTensor; build the "
                f"state with step.init(params) (or fsg.checkpoint.restore onto the mesh)"
            )
    n_before_params = len(tree.flatten(state.step)[0])
    n_params = len(tree.flatten(state.params)[0])
    batch_leaves, _ = tree.flatten(batch)
    return ShardPlan(
        mesh=mesh,
        state_placements=tuple(tuple(leaf.placements) for leaf in state_leaves),
        batch_placements=tuple(batch_placements(batch_leaves, tree.leaf_paths(batch, "batch"), batch_spec, mesh)),
        param_leaves=tuple(range(n_before_params, n_before_params + n_params)),
        data_axes=tuple(batch_spec.axes()),
    )


def local_batch(batch_leaves: list, placements: tuple, mesh: Mesh) -> list[torch.Tensor]:
    """This rank's piece of each batch leaf: a global tensor is sliced, a DTensor unwrapped."""
    out = []
    for leaf, pl in zip(batch_leaves, placements):
        # Contiguous, as the stand-ins stage 1 traced with: a view in the graph relies on it.
        out.append((leaf.to_local() if isinstance(leaf, DTensor) else local_shard(leaf, pl, mesh)).contiguous())
    return out


def wrap_local(new_local: list[torch.Tensor], like: list[DTensor], mesh: Mesh) -> list[DTensor]:
    """New local pieces as DTensors placed like the leaves of ``like``."""
    return [
        DTensor.from_local(
            t, mesh.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
        )
        for t, leaf in zip(new_local, like)
    ]
