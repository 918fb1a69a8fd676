"""A pipeline step's checkpoints: one checkpoint of the whole state, written by stage.

Every rank holds a part of the state (the parameters its stages read and their optimizer
state). ``save`` writes the tree the unsharded step's state has, ``TrainState(step, params of
every stage, optimizer.init(all of them), ...)``: each leaf once, by the first pipeline rank
holding it (at data-parallel index 0). So a pipeline checkpoint is an ordinary fsg checkpoint:
it restores onto another ``pp`` size, onto the unsharded step (``fsg.checkpoint.restore`` with
its state as ``like``), and a pipeline step restores an unsharded step's checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from fsg._src import tree
from fsg._src.checkpoint import _checkpoint, _layout
from fsg._src.errors import CheckpointError
from fsg._src.optim._base import GradientTransformation
from fsg._src.train_state import TrainState


def _abstract(state: TrainState, optimizer: GradientTransformation, params: dict[str, torch.Tensor]) -> TrainState:
    """The state of a rank holding ``params`` (meta tensors), built as the step's ``init`` builds it."""
    meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()}
    like = tree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), state)
    return like._replace(params=meta, opt_state=optimizer.init(meta))


def save(
    path: str | Path,
    state: TrainState,
    *,
    optimizer: GradientTransformation,
    every_param: dict[str, torch.Tensor],
    holders: dict[str, tuple[int, ...]],
    me: int,
    writes: bool,
    metadata: Any = None,
) -> None:
    """Writes the whole state from each rank's part; a collective over every rank.

    ``every_param``: each parameter's shape and dtype (meta tensors); ``holders``: the pipeline
    indices holding each; ``me``: this rank's; ``writes``: whether this rank writes its
    pipeline index's leaves (data-parallel index 0)."""
    try:
        msgpack.packb(metadata)
    except TypeError as exc:
        raise CheckpointError(f"metadata must be msgpack-encodable (dicts, lists, numbers, strings): {exc}") from exc
    whole = _abstract(state, optimizer, every_param)
    paths = tree.leaf_paths(whole, _checkpoint.ROOT)
    leaves = tree.flatten(whole)[0]
    mine = dict(zip(tree.leaf_paths(state, _checkpoint.ROOT), tree.flatten(state)[0]))
    for path_, leaf in mine.items():
        _checkpoint.check_leaf(path_, leaf)
    pp = max(i for h in holders.values() for i in h) + 1
    first: dict[str, int] = {}  # leaf path -> the first pipeline index whose state has it
    for r in range(pp):
        held = {n: p for n, p in every_param.items() if r in holders[n]}
        for p in tree.leaf_paths(_abstract(state, optimizer, held), _checkpoint.ROOT):
            first.setdefault(p, r)
    items = []
    for i, p in enumerate(paths):
        if writes and first.get(p) == me:
            items.append((i, _layout.full_box(tuple(leaves[i].shape)), mine[p]))
    _checkpoint.write(Path(path), paths, leaves, items, metadata)


def restore(path: str | Path, like: TrainState) -> TrainState:
    """This rank's part of a whole-state checkpoint (``save``'s, or an unsharded step's), in
    the structure of ``like`` (this rank's state); a collective only in that every rank reads."""
    out = _checkpoint.restore_part(path, like)
    if dist.is_initialized():
        dist.barrier()
    return out
