"""Errors for what one static step graph cannot hold: a batch's list or tuple handed whole to a
torch op that takes a tensor, an op whose output shape depends on the data."""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.errors import BatchError, UnsupportedError

_NOT_A_TENSOR = re.compile(r"must be Tensor, not (list|tuple)")


def container_misuse(exc: TypeError, batch: Any) -> BatchError | None:
    """The ``BatchError`` for a torch op handed a list or tuple of the batch where it takes a
    tensor (``TypeError: linear(): argument 'input' ... must be Tensor, not list``): fsg keeps a
    batch's lists and tuples as containers, so ``loss_fn`` receives them as such. ``None`` when
    ``exc`` is another ``TypeError`` or the batch holds no such container."""
    found = _NOT_A_TENSOR.search(str(exc))
    if found is None:
        return None
    kind = found.group(1)
    paths = [f"{path} (a {kind} of {n} tensor{'s' if n != 1 else ''})" for path, n in _sequences(batch, "batch", kind)]
    if not paths:
        return None
    from fsg._src.trace.purity import user_frame  # purity raises these errors too

    where = user_frame(traceback.extract_tb(exc.__traceback__))
    return BatchError(
        f"loss_fn passed a {kind} where torch takes a Tensor at {where} ({exc}). The batch holds "
        f"{', '.join(paths)}: fsg keeps lists and tuples in a batch as containers of tensor leaves, so "
        f"loss_fn receives the {kind} itself. Stack it into one tensor before the step "
        f"(torch.stack(...) or torch.cat(...)), or index it inside loss_fn."
    )


def _sequences(node: Any, path: str, kind: str) -> Iterator[tuple[str, int]]:
    """The paths (and lengths) of the ``kind`` ("list"/"tuple") containers of tensors in ``node``."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _sequences(value, f"{path}[{key!r}]", kind)
    elif isinstance(node, (list, tuple)):
        if type(node).__name__ == kind and any(isinstance(x, torch.Tensor) for x in node):
            yield path, len(node)
        for i, value in enumerate(node):
            yield from _sequences(value, f"{path}[{i}]", kind)


def dynamic_shape_error(op: Any, where: str) -> UnsupportedError:
    return UnsupportedError(
        f"loss_fn calls {_torch_private.op_name(op)} at {where}, an op whose output shape torch cannot "
        f"know without the data, so a compiled step (one static graph) cannot hold it. fsg does not "
        f"support it yet; compute that loss another way (a mask multiplied in, torch.where, a fixed "
        f"number of indices), or outside the compiled step."
    )


def dynamic_shape_op(gm: fx.GraphModule) -> Any:
    """The first op of the graph whose output shape only its inputs' values give (``masked_select``,
    ``nonzero``, ``unique``, ``index`` by a bool mask...), or ``None``.

    Such an op reaches a traced graph only where its inputs are constants of ``loss_fn`` (a
    ``masked_select`` by a captured mask): tracing computes its shape from their values, but
    AOTAutograd and Inductor re-trace the graph on fakes of the constants and fail inside torch
    (``DynamicOutputShapeException``; ``u0 possible memo disaster``). Refused at stage 1, as the
    same op on a traced input is, on every backend. An op tagged ``dynamic_output_shape`` is
    tried on fakes of its inputs' shapes: ``index`` by integer indices has a shape all the same."""
    mode = _torch_private.fake_mode()

    def fake(a: Any) -> Any:
        value = getattr(gm, a.target) if a.op == "get_attr" else a.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)

    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, _torch_private.OpOverload):
            continue
        if torch.Tag.dynamic_output_shape not in node.target.tags:
            continue
        try:
            with mode:
                node.target(*fx.node.map_arg(node.args, fake), **fx.node.map_arg(node.kwargs, fake))
        except (_torch_private.DYNAMIC_SHAPE_ERROR, *_torch_private.DATA_DEPENDENT_ERRORS):
            return node.target
    return None
