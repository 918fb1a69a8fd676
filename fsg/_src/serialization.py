"""Tensor pytrees to and from msgpack bytes, bit-exact for every dtype fsg uses.

Each leaf becomes ``{"dtype": str, "shape": [int], "data": bytes}`` keyed by its leaf path;
the structure comes from the ``like`` tree on the way back. The checkpoint format builds on
the same tensor encoding.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from fsg._src import tree
from fsg._src.errors import StructureMismatchError

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)}  # fmt: skip


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """The msgpack-ready record of one tensor (copied to host memory)."""
    host = t.detach().contiguous().cpu()
    data = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return {"dtype": str(host.dtype).removeprefix("torch."), "shape": list(host.shape), "data": data}


def decode_tensor(record: dict[str, Any], *, where: str) -> torch.Tensor:
    """The tensor of a record made by ``encode_tensor``; ``where`` names it in errors."""
    dtype = DTYPES.get(record["dtype"])
    if dtype is None:
        raise StructureMismatchError(f"{where}: unknown dtype {record['dtype']!r} (known: {sorted(DTYPES)})")
    shape = tuple(record["shape"])
    raw = (
        torch.frombuffer(bytearray(record["data"]), dtype=torch.uint8)
        if record["data"]
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(dtype).reshape(shape)


def to_msgpack(tree_: Any) -> bytes:
    """Serializes a pytree of tensors to msgpack bytes.

    Example:
      >>> from fsg._src.serialization import to_msgpack, from_msgpack
      >>> t = {"w": torch.arange(3.0)}
      >>> from_msgpack(t, to_msgpack(t))["w"]
      tensor([0., 1., 2.])
    """
    leaves, _ = tree.flatten(tree_)
    paths = tree.leaf_paths(tree_, "tree")
    return msgpack.packb({path: encode_tensor(leaf) for path, leaf in zip(paths, leaves)})


def from_msgpack(like: Any, data: bytes) -> Any:
    """Rebuilds a tree shaped like ``like`` from ``to_msgpack`` bytes, on ``like``'s devices."""
    records = msgpack.unpackb(data)
    like_leaves, treedef = tree.flatten(like)
    paths = tree.leaf_paths(like, "tree")
    if set(records) != set(paths):
        raise StructureMismatchError(
            f"serialized tree has leaves {sorted(set(records) - set(paths))} that like= lacks and "
            f"lacks {sorted(set(paths) - set(records))}; pass a like= tree of the same structure."
        )
    leaves = [decode_tensor(records[p], where=p).to(leaf.device) for p, leaf in zip(paths, like_leaves)]
    return tree.unflatten(treedef, leaves)
