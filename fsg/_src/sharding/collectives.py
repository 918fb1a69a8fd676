"""The collectives of a local step graph, grouped by kind and mesh axis (``Lowered.collectives()``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.mesh import Mesh


class Collective(NamedTuple):
    """One kind of collective of a step: what ``Lowered.collectives()`` lists."""

    kind: str
    axis: str
    bytes: int
    count: int


def collectives(gm: fx.GraphModule, mesh: Mesh | None) -> list[Collective]:
    """The collectives of a local step graph, grouped by (kind, mesh axis)."""
    names = {}
    if mesh is not None and mesh.size > 1:
        for axis in mesh.axis_names:
            names[mesh.device_mesh.get_group(axis).group_name] = axis
    table: dict[tuple[str, str], list[int]] = {}
    for node in gm.graph.nodes:
        target = node.target
        if not _torch_private.is_collective(target) or target is _torch_private.WAIT_TENSOR:
            continue
        group = next((a for a in node.args if isinstance(a, str) and a in names), None)
        axis = names.get(group, "+".join(mesh.axis_names) if mesh is not None else "?")
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        nbytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        entry = table.setdefault((_torch_private.op_name(target).split(".")[-1], axis), [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    return [Collective(kind, axis, b, c) for (kind, axis), (b, c) in sorted(table.items())]
