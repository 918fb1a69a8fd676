"""``save`` and ``restore``: a state pytree to a checkpoint directory and back, on any mesh.

Format (``docs/checkpoint-format.md``): ``meta.msgpack`` describes every leaf (path, dtype,
global shape, placements) and where each piece of it lies (file, byte offset, size, crc32,
its box in the global tensor); ``shard-RANK.msgpack`` holds the pieces rank RANK wrote, as
msgpack ``bin`` records; ``COMMIT`` marks a complete checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsg._src import tree
from fsg._src.checkpoint import _io, _layout
from fsg._src.errors import CheckpointError
from fsg._src.version import __version__

FORMAT, VERSION = "fsg-checkpoint", 1
ROOT = "state"
_SCALARS = (bool, int, float, str, type(None))


def _rank_world(group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(group) -> None:
    if _rank_world(group)[1] > 1:
        dist.barrier(group=group)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _leaf_entry(path: str, leaf: Any) -> dict:
    if isinstance(leaf, torch.Tensor):
        return {
            "path": path,
            "kind": "tensor",
            "dtype": _dtype_name(leaf.dtype),
            "shape": list(leaf.shape),
            "placements": [str(p) for p in leaf.placements] if isinstance(leaf, DTensor) else None,
            "pieces": [],
        }
    return {"path": path, "kind": "scalar", "value": leaf}  # check_leaf let only scalars through


def check_leaf(path: str, leaf: Any) -> None:
    """Raises ``CheckpointError`` for a leaf a checkpoint cannot hold, before anything is written."""
    if isinstance(leaf, torch.Tensor):
        if _dtype_name(leaf.dtype) not in _io.DTYPES:
            raise CheckpointError(
                f"{path} is a {leaf.dtype} tensor; a checkpoint holds {sorted(_io.DTYPES)}. Save it as "
                f"another dtype (torch.view_as_real for complex) and convert it back after restoring"
            )
    elif not isinstance(leaf, _SCALARS):
        raise CheckpointError(
            f"{path} is a {type(leaf).__name__} ({leaf!r:.40}); a checkpoint holds tensors and Python scalars "
            f"(bool, int, float, str, None) only. Convert it (torch.as_tensor(...)) or keep it out of the saved tree"
        )


def local_items(state: Any, group=None) -> tuple[list[str], list[Any], list[tuple[int, _layout.Box, torch.Tensor]]]:
    """Leaf paths, leaves, and the pieces this rank writes: ``(leaf index, box, tensor)``. A plain
    tensor is replicated: equal on every rank of ``group`` (checked), written by rank 0."""
    leaves, _ = tree.flatten(state)
    paths = tree.leaf_paths(state, ROOT)
    for path, leaf in zip(paths, leaves):
        check_leaf(path, leaf)
    rank, world = _rank_world(group)
    _layout.check_plain_replicated(paths, leaves, world, group)
    items = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DTensor):
            piece = _layout.local_piece(leaf)
            if piece.writer:
                items.append((i, piece.box, leaf.to_local()))
        elif isinstance(leaf, torch.Tensor) and rank == 0:
            items.append((i, _layout.full_box(tuple(leaf.shape)), leaf))
    return paths, leaves, items


def write(
    path: Path,
    paths: list[str],
    leaves: list[Any],
    items: list[tuple[int, _layout.Box, torch.Tensor]],
    metadata: Any,
    group=None,
) -> None:
    """The collective write protocol: every rank writes its shard into ``NAME.tmp``, rank 0
    writes the metadata and commits. ``items`` may hold device tensors or host snapshots."""
    rank, world = _rank_world(group)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        if path.exists() and not _io.is_committed(path):
            _io.remove(path)  # renamed but never committed: left by a crashed save
        if path.exists():
            raise CheckpointError(
                f"{path} already exists; a checkpoint is never overwritten in place (a crash would lose "
                f"it). Save to a new path, or delete it first."
            )
        _io.remove(tmp)  # left by a crashed save
        tmp.mkdir(parents=True)
    _barrier(group)
    with open(tmp / _io.shard_name(rank), "wb") as f:
        records = _io.write_records(f, [((i, box), t) for i, box, t in items])
        _io.fsync_file(f)
    pieces = [(rank, i, box, offset, nbytes, crc) for (i, box), offset, nbytes, crc in records]
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(pieces, gathered, dst=0, group=group)
    else:
        gathered = [pieces]
    if rank == 0:
        entries = [_leaf_entry(p, leaf) for p, leaf in zip(paths, leaves)]
        for rank_pieces in gathered:
            for r, i, box, offset, nbytes, crc in rank_pieces:
                entries[i]["pieces"].append(
                    {
                        "file": _io.shard_name(r),
                        "offset": offset,
                        "nbytes": nbytes,
                        "crc32": crc,
                        "box": [list(b) for b in box],
                    }
                )
        mesh = next((leaf.device_mesh for leaf in leaves if isinstance(leaf, DTensor)), None)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "fsg_version": __version__,
            "torch_version": torch.__version__,
            "created": time.time(),
            "world_size": world,
            "mesh": None if mesh is None else {"shape": list(mesh.shape), "axes": list(mesh.mesh_dim_names or ())},
            "metadata": metadata,
            "leaves": entries,
        }
        with open(tmp / _io.META, "wb") as f:
            f.write(msgpack.packb(meta))
            _io.fsync_file(f)
        _io.commit(tmp, path)
    _barrier(group)


def save(path: str | Path, state: Any, *, metadata: Any = None) -> None:
    """Saves a state pytree to the directory ``path``, atomically; call it on every rank.

    Each rank writes only its own pieces (a replicated leaf is written once), streaming one
    tensor at a time through host memory. The directory appears complete or not at all: a
    crash at any point leaves earlier checkpoints untouched.

    Args:
      path: a directory that does not exist yet.
      state: a pytree of tensors (plain or DTensor) and Python scalars.
      metadata: anything msgpack can encode (dicts, lists, numbers, strings), stored as is.

    Example:
      >>> import tempfile, os
      >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> fsg.checkpoint.save(d, {"w": torch.arange(4.0)}, metadata={"step": 0})
      >>> fsg.checkpoint.restore(d, like={"w": torch.zeros(4)})["w"]
      tensor([0., 1., 2., 3.])
    """
    try:
        msgpack.packb(metadata)
    except TypeError as exc:
        raise CheckpointError(f"metadata must be msgpack-encodable (dicts, lists, numbers, strings): {exc}") from exc
    paths, leaves, items = local_items(state)
    write(Path(path), paths, leaves, items, metadata)


def read_meta(path: str | Path) -> dict:
    """The metadata of a complete checkpoint (``CheckpointError`` if missing or incomplete)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path} (no such directory); check the path (CheckpointManager(dir).all_steps() "
            f"lists the complete checkpoints of a run)"
        )
    if not _io.is_committed(path):
        raise CheckpointError(
            f"{path} is incomplete (no {_io.COMMIT} marker: its save did not finish) and is never restored; "
            f"restore an earlier checkpoint (CheckpointManager.latest() skips incomplete ones)"
        )
    try:
        meta = msgpack.unpackb((path / _io.META).read_bytes())
    except (OSError, ValueError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{path / _io.META} cannot be read: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / _io.META} is not an fsg checkpoint (format {meta.get('format')!r})")
    return meta


def _check_like(entry: dict, like: Any, where: str) -> None:
    if entry["kind"] == "scalar":
        if isinstance(like, torch.Tensor):
            raise CheckpointError(f"{where} is a Python scalar in the checkpoint but a tensor in like=")
        return
    if not isinstance(like, torch.Tensor):
        raise CheckpointError(f"{where} is a tensor in the checkpoint but a {type(like).__name__} in like=")
    if entry["dtype"] != _dtype_name(like.dtype) or list(like.shape) != entry["shape"]:
        raise CheckpointError(
            f"{where}: the checkpoint has {entry['dtype']}{entry['shape']} but like= has "
            f"{_dtype_name(like.dtype)}{list(like.shape)}; restore into a state of the saved shapes and "
            f"dtypes (cast after restoring if you need another)."
        )


def restore(path: str | Path, like: Any, *, select: str = ROOT) -> Any:
    """Restores a checkpoint into the structure, dtypes and placements of ``like``.

    ``like`` is a state of the same structure (its values are ignored), or an abstract one
    (tensors on the ``meta`` device restore to CPU). Its placements decide the layout: a
    checkpoint written on one mesh restores onto any other, each rank reading only the pieces
    that overlap its own shards. Call it on every rank.

    Args:
      path: a checkpoint directory.
      like: the target tree; on a mesh, DTensors placed as wanted.
      select: the subtree of the saved state to restore, as a leaf-path prefix: the default
        ``"state"`` is the whole tree; ``"state.params"`` restores only the params (give a
        ``like`` shaped like them), reading nothing else.

    Returns:
      A tree like ``like`` holding the saved values.

    Raises:
      CheckpointError: the checkpoint is missing, incomplete, corrupt or truncated, or does not
        match ``like`` (each message names the file and the leaf).
    """
    return restore_part(path, like, select=select, whole=True)


def restore_part(path: str | Path, like: Any, *, select: str = ROOT, whole: bool = False) -> Any:
    """``restore``; with ``whole=False`` the saved tree may hold more leaves than ``like``
    (a pipeline rank restores the parameters its stages hold: ``pipeline/checkpoints.py``)."""
    path = Path(path)
    if not isinstance(select, str) or not (select == ROOT or select.startswith((ROOT + ".", ROOT + "["))):
        raise CheckpointError(f"restore(select={select!r}): select is a leaf path from {ROOT!r}, e.g. 'state.params'")
    meta = read_meta(path)
    by_path = {entry["path"]: entry for entry in meta["leaves"]}
    like_leaves, treedef = tree.flatten(like)
    like_paths = tree.leaf_paths(like, select)
    missing = [p for p in like_paths if p not in by_path]
    extra = [p for p in by_path if p.startswith(select) and p not in set(like_paths)] if whole else []
    if missing or extra:
        raise CheckpointError(
            f"{path}: like= does not match the saved tree under {select!r}: the checkpoint lacks {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} and has {extra[:5]}{' ...' if len(extra) > 5 else ''} that "
            f"like= lacks. Pass a like= of the saved structure (or select= a subtree)."
        )
    reader = _io.PieceReader(path)
    try:
        leaves = []
        for p, like_leaf in zip(like_paths, like_leaves):
            entry = by_path[p]
            where = f"{p} (in {path})"
            _check_like(entry, like_leaf, where)
            leaves.append(
                entry["value"] if entry["kind"] == "scalar" else _layout.restore_leaf(entry, like_leaf, reader, p)
            )
    finally:
        reader.close()
    return tree.unflatten(treedef, leaves)
