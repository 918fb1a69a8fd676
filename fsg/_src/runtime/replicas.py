"""Replica consistency checks (docs/resilience.md#replica-checks): every rank that holds the same
shard of a state leaf must hold the same bytes.

Silent data corruption (a flipped bit in HBM, a faulty SM) and fsg bugs that make replicas drift
apart show up nowhere else: the loss stays finite, and each rank trains its own diverging copy.
``check_replicas`` fingerprints every leaf's local shard on its device, gathers the fingerprints
with one ``all_gather`` over the world, and compares them on the host within each group of
ranks that hold the same shard, as the leaf's placements and the mesh coordinates say.

A fingerprint is exact, not statistical: the bytes of the shard, read as int32 words ``x_i``,
give ``sum(x_i)`` and ``sum(w_i * x_i)`` with odd position weights ``w_i``, both modulo 2**64.
Integer sums do not depend on the order of the reduction, and a change of any one word (one
ulp of one element) changes both (an odd weight is invertible modulo 2**64); the weighted sum
also catches two changes that cancel in the plain one, unless they land on positions whose
weights happen to align.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsg._src import tree
from fsg._src.errors import ReplicaMismatchError

_BLOCK = 1 << 20  # int32 words fingerprinted per kernel: bounds the scratch memory (8 MiB + 8 MiB)
_MIX = 0x9E3779B1  # odd (2**32 / golden ratio): spreads the position weights over 32 bits
# per device: (odd position weights below 2**31, an int64 scratch block); reusing the scratch
# avoids allocating (and on CPU page-faulting) a fresh int64 copy per block, 3x the cost
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _SCRATCH:
        index = torch.arange(_BLOCK, dtype=torch.int64, device=device)
        _SCRATCH[device] = (((2 * index + 1) * _MIX) % (1 << 31) | 1, torch.empty_like(index))
    return _SCRATCH[device]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as int32 words (one word per byte when they do not fill whole words)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int32) if raw.numel() % 4 == 0 else raw.to(torch.int32)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The two int64 fingerprints of a tensor's bytes, on its device (no host sync).

    Args:
      t: a plain tensor (for a ``DTensor``, pass its ``to_local()``).

    Returns:
      An int64 tensor ``[sum(x_i), sum(w_i * x_i)]`` over the int32 words ``x_i`` of ``t``.

    Example:
      >>> a = torch.ones(3)
      >>> b = torch.nextafter(a, torch.tensor(2.0))  # one ulp up
      >>> bool((fingerprint(a) != fingerprint(b)).all())
      True
    """
    words = _words(t)
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    weights, scratch = _scratch(t.device)
    for b, start in enumerate(range(0, words.numel(), _BLOCK)):
        block = words[start : start + _BLOCK]
        wide = scratch[: block.numel()].copy_(block)
        plain += wide.sum()
        # products stay below 2**62; only the sums wrap, and wrapping sums are exact mod 2**64
        weighted += wide.mul_(weights[: block.numel()]).sum() * (2 * b + 1)
    return torch.stack([plain, weighted])


def _coordinates(device_mesh: Any) -> dict[int, tuple[int, ...]]:
    grid = device_mesh.mesh
    return {int(grid[index]): index for index in _indices(tuple(grid.shape))}


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [(*prefix, i) for prefix in out for i in range(size)]
    return out


def _groups(leaf: Any, world: int, meshes: dict) -> list[list[int]]:
    """The ranks of the world grouped by the shard of ``leaf`` they hold: a ``DTensor``'s ranks
    agree on their coordinate along every mesh dim it is sharded (or partial) over; a plain
    tensor is taken as replicated over the whole world."""
    if not isinstance(leaf, DTensor):
        return [list(range(world))]
    keys: dict[tuple, list[int]] = {}
    mesh = leaf.device_mesh
    if id(mesh) not in meshes:
        meshes[id(mesh)] = _coordinates(mesh)
    for rank, coord in meshes[id(mesh)].items():
        key = tuple(-1 if p.is_replicate() else c for p, c in zip(leaf.placements, coord))
        keys.setdefault(key, []).append(rank)
    return [sorted(ranks) for ranks in keys.values()]


def _describe(leaf: Any) -> str:
    if isinstance(leaf, DTensor):
        names = leaf.device_mesh.mesh_dim_names or tuple(range(leaf.device_mesh.ndim))
        places = ", ".join(f"{p} on {n!r}" for p, n in zip(leaf.placements, names))
        return f"{leaf.dtype}{list(leaf.shape)} ({places})"
    return f"{leaf.dtype}{list(leaf.shape)} (a plain tensor, taken as replicated on every rank)"


def _layout_hash(leaves: list[Any], paths: list[str]) -> int:
    """What every rank must agree on before fingerprints can be compared: paths, shapes, dtypes,
    placements (a CRC, below 2**31 so it fits the int64 table)."""
    text = "|".join(f"{p}:{_describe(t)}" for p, t in zip(paths, leaves))
    return zlib.crc32(text.encode())


def check_replicas(state: Any, *, root: str = "state") -> int:
    """Checks that every rank holding the same shard of a leaf of ``state`` holds the same bytes.

    Collective: every rank of the default process group must call it, with a state of the same
    structure. Costs one fingerprint pass over the local shards (on their device), one
    ``all_gather`` of ``2 * (leaves + 1)`` int64 per rank, and a host comparison; nothing when
    ``torch.distributed`` is not initialized or the world is one process.

    Args:
      state: a pytree of tensors, usually a ``TrainState`` (on a mesh its leaves are DTensors;
        their placements say which ranks hold the same shard).
      root: how leaf paths start in the error message.

    Returns:
      How many leaves were compared across at least two ranks.

    Raises:
      ReplicaMismatchError: naming the first leaf (in flatten order) whose replicas differ,
        the ranks that agree and the ranks that differ, and how many leaves differ in all.

    Example:
      >>> state, metrics = step(state, batch)          # doctest: +SKIP
      >>> fsg.check_replicas(state)                    # doctest: +SKIP
    """
    leaves, _ = tree.flatten(state)
    tree.check_tensor_leaves(state, root)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1 or not leaves:
        return 0
    world, paths = dist.get_world_size(), tree.leaf_paths(state, root)
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in leaves]
    device = locals_[0].device
    header = torch.tensor([len(leaves), _layout_hash(leaves, paths)], dtype=torch.int64, device=device)
    table = torch.stack([header, *(fingerprint(t).to(device) for t in locals_)])
    gathered = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(gathered, table)  # the one collective of a check
    rows = torch.stack(gathered).cpu()  # [world, leaves + 1, 2]: the one host sync
    if not bool((rows[:, 0] == rows[0, 0]).all()):
        odd = [r for r in range(world) if not torch.equal(rows[r, 0], rows[0, 0])]
        raise ReplicaMismatchError(
            f"ranks {odd} hold a state whose leaves (paths, shapes, dtypes or placements) differ from rank 0's, "
            f"so their replicas cannot be compared. Pass every rank the state of the same step"
        )
    table_rows, meshes = rows.tolist(), {}
    compared, bad = 0, []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        groups = [ranks for ranks in _groups(leaf, world, meshes) if len(ranks) > 1]
        compared += bool(groups)
        for ranks in groups:
            prints = {r: tuple(table_rows[r][i + 1]) for r in ranks}
            if len(set(prints.values())) > 1:
                bad.append((path, leaf, ranks, prints))
    if bad:
        raise _mismatch(bad, len(leaves))
    return compared


def _mismatch(bad: list, num_leaves: int) -> ReplicaMismatchError:
    path, leaf, ranks, prints = bad[0]
    by_print: dict[tuple, list[int]] = {}
    for r in ranks:
        by_print.setdefault(prints[r], []).append(r)
    camps = sorted(by_print.values(), key=lambda rs: (-len(rs), rs))
    agree, differ = camps[0], sorted(r for camp in camps[1:] for r in camp)
    more = {p for p, *_ in bad} - {path}
    others = f" {len(more)} other leaves of {num_leaves} differ too." if more else ""
    return ReplicaMismatchError(
        f"{path}, {_describe(leaf)}: ranks {ranks} hold the same shard of it and must hold identical bytes, "
        f"but rank{'s' if len(differ) > 1 else ''} {differ} differ{'' if len(differ) > 1 else 's'} from "
        f"rank{'s' if len(agree) > 1 else ''} {agree}.{others} Replicas drifted apart: silent data corruption "
        f"(a faulty GPU: look at rank {differ[0]}'s device), a non-deterministic update, or a state changed "
        f"in place on some ranks only. Restore the last checkpoint that passed a check"
    )


class ReplicaCheck:
    """``compile_step(check_replicas=N)``: counts calls; every ``N``-th runs ``check_replicas``."""

    def __init__(self, every: int | None):
        self._every = every or 0
        self._calls = 0

    def after_step(self, state: Any) -> None:
        """Raises ``ReplicaMismatchError`` at every ``N``-th call whose state's replicas differ."""
        if not self._every:
            return
        self._calls += 1
        if self._calls % self._every == 0:
            check_replicas(state)
