"""Which rows of the global batch a process reads: its index among the data-parallel ranks.

The batch spec's entry for dim 0 names the data axes (``P("dp")``, ``P(("dp", "fsdp"))``);
a rank's data index is its mesh coordinate over those axes, first axis major, which is the
block of rows ``Shard(0)`` on those axes gives it. Ranks that differ only along other axes
(``tp``) read the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

from torch.distributed.tensor import Placement

from fsg._src.errors import DataError, MeshError
from fsg._src.mesh import Mesh, P


class DataRank(NamedTuple):
    """This process's data index ``rank`` of ``num_ranks``, and the DTensor placements of the
    global batch (``None`` off a mesh)."""

    rank: int
    num_ranks: int
    placements: tuple[Placement, ...] | None


def default_spec(mesh: Mesh | None) -> P:
    """``compile_step``'s default batch spec: ``P("dp")`` when the mesh has a ``dp`` axis."""
    return P("dp") if mesh is not None and "dp" in mesh.axis_names else P()


def _data_axes(spec: P) -> tuple[str, ...]:
    if any(entry is not None for entry in spec[1:]):
        raise MeshError(
            f"fsg.data.Loader(batch_sharding={spec!r}) shards a dim other than the batch (dim 0) of "
            f"the [B, T + 1] token block; the loader shards rows only: write P({spec[0]!r})"
        )
    if not spec or spec[0] is None:
        return ()
    return spec[0] if isinstance(spec[0], tuple) else (spec[0],)


def data_rank(mesh: Mesh | None, spec: P | None, *, batch_size: int, seq_len: int, name: str,
              rank: int | None = None, num_ranks: int | None = None) -> DataRank:  # fmt: skip
    """The ``DataRank`` of this process for a global batch of ``batch_size`` rows.

    Off a mesh (or on a mesh of one device), ``rank`` / ``num_ranks`` may name a data rank to
    read as (default 0 of 1): this is how one process reads another rank's rows.

    Raises:
      DataError: ``batch_size`` does not divide over the data ranks.
      MeshError: the spec names an unknown axis or shards a dim other than 0.
    """
    on_mesh = mesh is not None and mesh.size > 1
    if on_mesh and (rank is not None or num_ranks is not None):
        raise MeshError(
            f"fsg.data.Loader({name}): rank= and num_ranks= are for use without a mesh; on {mesh!r} they come from the mesh"
        )
    if not on_mesh:
        num_ranks = 1 if num_ranks is None else num_ranks
        rank = 0 if rank is None else rank
        if not 0 <= rank < num_ranks:
            raise MeshError(f"fsg.data.Loader({name}): rank={rank} is not in [0, num_ranks={num_ranks})")
        _check_divides(name, batch_size, num_ranks, f"{num_ranks} data ranks")
        return DataRank(rank, num_ranks, None)
    spec = default_spec(mesh) if spec is None else spec
    axes = _data_axes(spec)
    for axis in axes:
        if axis not in mesh.axis_names:
            raise MeshError(
                f"fsg.data.Loader(batch_sharding={spec!r}) names axis {axis!r}, which {mesh!r} does not have; "
                f"use one of {mesh.axis_names}"
            )
    num_ranks, index = 1, 0
    coordinate = mesh.device_mesh.get_coordinate()
    for axis in axes:
        dim = mesh.axis_names.index(axis)
        num_ranks *= mesh.shape[dim]
        index = index * mesh.shape[dim] + coordinate[dim]
    _check_divides(name, batch_size, num_ranks, f"the data axes {axes} of {mesh!r}")
    mesh.validate(spec, (batch_size, seq_len + 1), "the loader's token block")
    return DataRank(index, num_ranks, tuple(mesh.placements(spec)))


def _check_divides(name: str, batch_size: int, num_ranks: int, over: str) -> None:
    if batch_size % num_ranks:
        raise DataError(
            f"fsg.data.Loader({name}): the global batch of {batch_size} rows does not divide over {over} "
            f"({num_ranks} ranks); use a batch_size that is a multiple of {num_ranks}"
        )
