"""Export of parameters to safetensors, for use outside fsg."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsg._src import tree
from fsg._src.checkpoint import _io
from fsg._src.checkpoint._checkpoint import _rank_world
from fsg._src.errors import CheckpointError
from fsg._src.rules import param_names

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.complex64: "C64",
}  # fmt: skip


def export_safetensors(path: str | Path, params: Any, *, metadata: dict[str, str] | None = None) -> None:
    """Writes ``params`` to a ``.safetensors`` file (full tensors; sharded ones are gathered).

    Names are the keys of a flat dict (as ``fsg.params`` returns) or the leaf paths. Call on
    every rank: gathering is collective; rank 0 writes, atomically (temporary file + rename).

    Example:
      >>> import tempfile, os
      >>> f = os.path.join(tempfile.mkdtemp(), "model.safetensors")
      >>> fsg.checkpoint.export_safetensors(f, {"w": torch.ones(2, 2)})
      >>> os.path.getsize(f) > 0
      True
    """
    leaves, _ = tree.flatten(params)
    for name, leaf in zip(param_names(params), leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dtype not in _CODES:
            what = f"a {leaf.dtype} tensor" if isinstance(leaf, torch.Tensor) else f"a {type(leaf).__name__}"
            raise CheckpointError(
                f"export_safetensors: {name!r} is {what}; safetensors holds tensors of "
                f"{sorted(str(d).removeprefix('torch.') for d in _CODES)}. "
                + ("Export it as complex64, or torch.view_as_real of it" if isinstance(leaf, torch.Tensor)
                   and leaf.is_complex() else "Export the params only (state.params)")
            )  # fmt: skip
    full = [leaf.full_tensor() if isinstance(leaf, DTensor) else leaf for leaf in leaves]
    if _rank_world()[0] != 0:
        return
    header: dict[str, Any] = {}
    offset = 0
    for name, t in zip(param_names(params), full):
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in full:
            f.write(_io.host_bytes(t))
        _io.fsync_file(f)
    os.replace(tmp, path)
