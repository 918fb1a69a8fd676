"""``Mesh`` (named device axes) and ``P`` (partition specs), and the rules that tie them.

A partition spec has one entry per tensor dim: an axis name, a tuple of axis names, or
``None``; missing trailing entries mean replicated. ``P("tp", None)`` shards dim 0 over the
``tp`` axis. On a ``Mesh({"dp": 2, "tp": 2})`` it becomes the DTensor placements
``[Replicate(), Shard(0)]`` (one placement per mesh axis).
"""

from __future__ import annotations

import math
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from fsg._src.errors import MeshError

SpecEntry = Union[str, tuple[str, ...], None]


class P(tuple):
    """A partition spec: how each dim of a tensor is laid out over the mesh axes.

    Example:
      >>> fsg.P("dp", None)
      P('dp', None)
      >>> fsg.P(("dp", "tp"))  # dim 0 sharded over both axes, dp-major
      P(('dp', 'tp'),)
    """

    def __new__(cls, *entries: SpecEntry) -> P:
        for i, entry in enumerate(entries):
            names = entry if isinstance(entry, tuple) else (entry,)
            if not all(n is None or isinstance(n, str) for n in names):
                raise MeshError(
                    f"P entries are axis names, tuples of axis names or None; entry {i} is "
                    f"{type(entry).__name__} {entry!r}. Write P('dp', None) or P(('dp', 'tp'))"
                )
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return f"P({', '.join(map(repr, self))}{',' if len(self) == 1 and isinstance(self[0], tuple) else ''})"

    def axes(self) -> list[str]:
        """Every mesh axis this spec names, in order."""
        out = []
        for entry in self:
            out.extend(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None)
        return out


class Mesh:
    """Named axes over the devices of the job, e.g. ``Mesh({"dp": 2, "tp": 2})``.

    The product of the axis sizes must equal the world size. A mesh of size 1 needs no
    ``torch.distributed`` set-up; larger meshes need ``fsg.distributed.initialize()`` (or an
    initialized default process group) first.

    Args:
      axes: ``{name: size}``, outermost axis first.
      device_type: ``"cuda"`` or ``"cpu"``; default: CUDA when available.
      ranks: the rank at each mesh coordinate, an int tensor of shape ``axes.values()`` holding
        every rank once; default row-major (``arange(world).view(sizes)``).
        ``Mesh.from_topology`` computes one from the cluster's topology.

    Example:
      >>> mesh = fsg.Mesh({"dp": 1})
      >>> mesh.size, mesh.axis_names
      (1, ('dp',))
    """

    def __init__(self, axes: dict[str, int], *, device_type: str | None = None, ranks: torch.Tensor | None = None):
        _check_axes(axes)
        if device_type is not None:
            _check_device_type(device_type)
        self.axis_names = tuple(axes)
        self.shape = tuple(axes.values())
        self.size = math.prod(self.shape)
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.size != world:
            hint = (
                "call fsg.distributed.initialize() first (and launch with torchrun --nproc-per-node=N)"
                if world == 1
                else f"make the axis sizes multiply to {world}"
            )
            raise MeshError(f"Mesh({axes}) has {self.size} devices but the world size is {world}; {hint}.")
        self._device_mesh: DeviceMesh | None = None
        if ranks is not None:
            ranks = torch.as_tensor(ranks, dtype=torch.int64)
            every_rank_once = torch.equal(ranks.flatten().sort().values, torch.arange(ranks.numel()))
            if tuple(ranks.shape) != self.shape or not every_rank_once:
                raise MeshError(
                    f"Mesh(ranks=...) is a tensor of shape {tuple(ranks.shape)}; it must have the mesh's shape "
                    f"{self.shape} and hold each rank 0..{self.size - 1} once"
                )
        if self.size > 1 and ranks is not None:
            self._device_mesh = DeviceMesh(self.device_type, ranks, mesh_dim_names=self.axis_names)
        elif self.size > 1:
            self._device_mesh = init_device_mesh(self.device_type, self.shape, mesh_dim_names=self.axis_names)

    @classmethod
    def from_topology(cls, axes: dict[str, int], topology, *, traffic: dict[str, float] | None = None,
                      within: dict[str, str] | None = None, device_type: str | None = None) -> Mesh:  # fmt: skip
        """A mesh whose axes sit on the cluster's links by traffic: the busiest axis (default
        ``tp``, then ``fsdp``/``cp``, then ``dp``) in the smallest domains (NVLink, node), the
        least busy across racks. The axes keep their names and order; only which rank sits at
        each coordinate changes (``fsg/_src/topology/placement.py``).

        Args:
          axes: ``{name: size}``, as for ``Mesh``.
          topology: an ``fsg.Topology`` (``Topology.from_job()`` in a running job).
          traffic: ``{axis: bytes per step}`` to order the axes by; default by name.
          within: ``{axis: level}`` each of whose groups must fit one domain of that level.

        Example:
          >>> from fsg.topology import Topology
          >>> topo = Topology.from_hostnames(["a"])
          >>> fsg.Mesh.from_topology({"dp": 1}, topo)
          Mesh({'dp': 1})
        """
        from fsg._src.topology.placement import place  # the topology package builds on this module

        placement = place(axes, topology, traffic=traffic, within=within)
        return cls(axes, device_type=device_type, ranks=torch.from_numpy(placement.ranks))

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.axis_names, self.shape))})"

    @property
    def device_mesh(self) -> DeviceMesh:
        """The underlying ``torch.distributed.device_mesh.DeviceMesh`` (size > 1 only)."""
        if self._device_mesh is None:
            raise MeshError(f"{self!r} spans one device and has no DeviceMesh")
        return self._device_mesh

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_names.index(name)]

    def validate(self, spec: P, shape: tuple[int, ...], where: str) -> None:
        """Raises ``MeshError`` unless ``spec`` fits a tensor of ``shape`` on this mesh.

        ``where`` names the tensor (its leaf path) in the message.
        """
        if len(spec) > len(shape):
            raise MeshError(
                f"{spec!r} has {len(spec)} entries but {where} has {len(shape)} dims {tuple(shape)}; "
                f"give at most one entry per dim"
            )
        seen: set[str] = set()
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            names = tuple(n for n in names if n is not None)
            for name in names:
                if name not in self.axis_names:
                    raise MeshError(
                        f"{spec!r} for {where} names axis {name!r}, which {self!r} does not have; "
                        f"use one of {self.axis_names}"
                    )
                if name in seen:
                    raise MeshError(f"{spec!r} for {where} uses axis {name!r} twice; an axis shards one dim")
                seen.add(name)
            order = [self.axis_names.index(n) for n in names]
            if order != sorted(order):
                raise MeshError(
                    f"{spec!r} for {where} shards dim {dim} over {names} out of mesh order; "
                    f"write them as {tuple(sorted(names, key=self.axis_names.index))}"
                )
            ways = math.prod(self.axis_size(n) for n in names)
            if shape[dim] % ways:
                raise MeshError(
                    f"{spec!r} shards dim {dim} of {where} (size {shape[dim]}) over {names} "
                    f"({ways} ways): {shape[dim]} is not divisible by {ways}; pad the dim or shard another one"
                )

    def placements(self, spec: P) -> list[Placement]:
        """DTensor placements (one per mesh axis) of a validated ``spec``."""
        out: list[Placement] = [Replicate() for _ in self.axis_names]
        for dim, entry in enumerate(spec):
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None:
                    out[self.axis_names.index(name)] = Shard(dim)
        return out


def _check_axes(axes: object) -> None:
    """Raises ``MeshError`` unless ``axes`` is a non-empty dict of distinct names to sizes >= 1."""
    if not isinstance(axes, dict):
        names = [a[0] for a in axes if isinstance(a, tuple) and a] if isinstance(axes, (list, tuple)) else []
        twice = sorted({n for n in names if names.count(n) > 1}, key=str)
        dup = f" (and names {', '.join(map(repr, twice))} more than once: each axis needs its own name)" if twice else ""
        raise MeshError(
            f"Mesh(axes) takes a dict {{name: size}}, got {type(axes).__name__} {axes!r:.60}{dup}; "
            f"write Mesh({{'dp': 2, 'tp': 2}})"
        )
    if not axes:
        raise MeshError("a Mesh needs at least one axis, e.g. Mesh({'dp': 2})")
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise MeshError(f"mesh axis names are non-empty strings; got {name!r} in {axes}; name it, e.g. 'dp'")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(
                f"mesh axis {name!r} has size {size!r}; axis sizes are ints >= 1 (their product is the "
                f"world size): give every axis a positive size"
            )


def _check_device_type(device_type: object) -> None:
    try:
        ok = isinstance(device_type, str) and torch.device(device_type).index is None
    except RuntimeError:
        ok = False
    if not ok:
        raise MeshError(
            f"Mesh(device_type=...) must be a device type such as 'cuda' or 'cpu' (no index: each rank "
            f"picks its own device), got {device_type!r}"
        )
