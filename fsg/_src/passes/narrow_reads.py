"""Stage 3 graph pass: kernels that compute in float32 read bf16 and fp16 tensors as they are.

The fused AdamW and the global norm's sum of squares (``fsg::sum_squares``) load any float
dtype and compute in float32, so a float32 cast of their input (the gradient of a parameter
read in bf16 under ``Policy(compute=torch.bfloat16)``: ``_to_copy(g_bf16, dtype=float32)``)
changes nothing they compute, but as an input to an opaque op Inductor must write it out: one
kernel per parameter and twice the bytes (~0.2 ms a step at 125M on an H200, RESULTS.md).
``narrow_reads`` rewires such inputs to the tensor under the cast (through ``fsg::grad``
markers, identities on one device); ``fuse_adamw`` does the same for the node it inserts.
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src.kernels import sum_squares  # noqa: F401 - registers fsg::sum_squares
from fsg._src.trace import markers

SUM_SQUARES = torch.ops.fsg.sum_squares.default


_SAME_SHAPE_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default)


def through_views(node: fx.Node) -> fx.Node:
    """The node under a chain of shape-preserving views (stage 2 writes a donated leaf
    through ``view(placeholder)``, the local tensor of a ``DTensor.from_local``)."""
    while (
        node.op == "call_function"
        and node.target in _SAME_SHAPE_VIEWS
        and isinstance(node.args[0], fx.Node)
        and node.args[0].meta.get("val") is not None
        and node.meta.get("val") is not None
        and tuple(node.args[0].meta["val"].shape) == tuple(node.meta["val"].shape)
    ):
        node = node.args[0]
    return node


def _plain_cast(node: fx.Node, device: torch.device) -> bool:
    """Whether a ``_to_copy`` node changes nothing but the dtype: the backward of a parameter's
    cast to the compute dtype (``Policy(compute=...)``) spells out ``layout`` and ``device``;
    ``Policy(reduce=...)``'s cast back gives only ``dtype``."""
    extra = dict(node.kwargs)
    extra.pop("dtype", None)
    layout, on = extra.pop("layout", torch.strided), extra.pop("device", device)
    return not extra and layout == torch.strided and torch.device(on) == device


def without_upcast(grad: fx.Node) -> fx.Node:
    """The bf16 (or fp16) tensor under a cast of a gradient to float32 (the gradient of a
    parameter read in bf16 under ``Policy(compute=torch.bfloat16)``, or one reduced in
    ``Policy(reduce=torch.bfloat16)`` and cast back): the kernel reads any gradient dtype and
    computes in float32, so it gives the same update without materializing the float32 copy
    (a cast kernel per parameter and twice the bytes read: ~0.3 ms a step at 125M on an H200)."""
    node = through_views(grad)
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
        return grad
    source, value = node.args[0], node.meta.get("val")
    source_value = source.meta.get("val") if isinstance(source, fx.Node) else None
    if (
        len(node.args) == 1
        and value is not None
        and source_value is not None
        and _plain_cast(node, source_value.device)
        and value.dtype == torch.float32
        and source_value.dtype in (torch.bfloat16, torch.float16)
        and source_value.shape == value.shape
        and source_value.device == value.device
    ):
        return source
    return grad


def narrow_reads(gm: fx.GraphModule) -> int:
    """Rewires each input of the ``fsg::sum_squares`` nodes of ``gm`` that is an exact float32
    cast of a bf16/fp16 tensor (possibly behind an ``fsg::grad`` marker) to that tensor.
    Returns how many inputs it rewired."""
    rewired = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SUM_SQUARES:
            continue
        inputs = []
        for x in node.args[0]:
            under = x.args[0] if x.op == "call_function" and x.target is markers.GRAD else x
            narrow = without_upcast(under)
            rewired += narrow is not under
            inputs.append(narrow if narrow is not under else x)
        node.args = (inputs, *node.args[1:])
    if rewired:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewired
