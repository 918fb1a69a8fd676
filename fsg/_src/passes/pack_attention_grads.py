"""Stage 3 graph pass: attention's backward writes the qkv projection's gradient in place.

A GPT's attention backward (torch's cuDNN kernel) returns ``dq, dk, dv [B, H, T, D]`` in three
buffers, and the joint graph of a fused qkv projection concatenates them::

    dq, dk, dv = _scaled_dot_product_cudnn_attention_backward(g, q, k, v, o, lse, ...)
    dqkv = cat([view(transpose(dq, 1, 2), [B, T, C]), <dk alike>, <dv alike>], -1)

``pack_attention_grads`` replaces the backward and the concatenation by one
``fsg::attention_backward_packed`` (``kernels/attention_grads.py``), whose cuDNN call writes the
three gradients into ``dqkv`` directly: the copy the ``cat`` made (a read and a write of the whole
gradient) is gone. It applies where the pattern stands exactly: the three gradients read only
by that concatenation, in ``q, k, v`` order along the last dim, equal shapes (no grouped-query
heads), no dropout, no mask other than causal, 16-bit, on CUDA with NVIDIA's ``cudnn`` package
(``Fusions(on_cpu={"pack_attention_grads"})`` extends it to CPU's flash backward, whose op then
runs the aten backward and the concatenation: how the CPU tests check the rewrite). The rewrite is local, so it also runs on
each rank's graph on a mesh. It runs before the float8 pass, which then casts the packed
gradient for its FP8 matmuls as it would any other operand.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from fsg._src import _torch_private
from fsg._src.kernels import attention_grads
from fsg._src.kernels._common import fused_ops_enabled
from fsg._src.passes.options import DEFAULT, Fusions
from fsg._src.passes.patterns import CAT, FLATTENS

aten = torch.ops.aten
CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
PACKED = torch.ops.fsg.attention_backward_packed.default
_TRANSPOSES = (aten.transpose.int, aten.permute.default)
_DTYPES = (torch.bfloat16, torch.float16)


def pack_attention_grads(gm: fx.GraphModule, fusions: Fusions = DEFAULT) -> int:
    """Rewrites each attention backward whose gradients only a qkv concatenation reads (see the
    module docstring; on CPU where ``fusions.on_cpu`` names the pass). Returns how many it rewrote."""
    if not fused_ops_enabled():
        return 0
    mode, packed = _torch_private.fake_mode(), 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (CUDNN_BACKWARD, CPU_BACKWARD):
            continue
        args = _packed_args(node, fusions)
        chain = _concatenation(node) if args is not None else None
        if chain is None:
            continue
        cat, dead = chain
        with gm.graph.inserting_before(node):
            op = gm.graph.call_function(PACKED, args)
        op.meta["val"] = _torch_private.fake_result(mode, PACKED, args)
        cat.replace_all_uses_with(op)
        for n in (cat, *dead, node):
            gm.graph.erase_node(n)
        packed += 1
    if packed:
        gm.graph.lint()
        gm.recompile()
    return packed


def _packed_args(node: fx.Node, fusions: Fusions) -> tuple | None:
    """The packed op's arguments for the backward ``node``, or ``None`` where it does not apply."""
    bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if bound is None:
        return None
    kw = {name: _none_if_empty(a) for name, a in bound.kwargs.items()}
    q, k, v, out, grad_out = (kw[n] for n in ("query", "key", "value", "out", "grad_out"))
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in (q, k, v, out, grad_out)]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return None
    dtype, device = vals[0].dtype, vals[0].device
    if (
        dtype not in _DTYPES or any(t.dtype != dtype or t.shape != vals[0].shape for t in vals) or vals[0].dim() != 4
        or kw.get("dropout_p", 0.0) != 0.0
        or any(kw.get(n) is not None for n in ("attn_bias", "cum_seq_q", "cum_seq_k", "attn_mask"))
    ):  # fmt: skip
        return None
    if node.target is CUDNN_BACKWARD:
        if not (device.type == "cuda" and attention_grads.available(device)):
            return None
        seeds = kw["philox_seed"], kw["philox_offset"]
    elif device.type == "cpu" and fusions.on("pack_attention_grads", "cpu"):
        seeds = None, None
    else:
        return None
    return (grad_out, q, k, v, out, kw["logsumexp"], *seeds, bool(kw["is_causal"]), kw.get("scale"))


def _none_if_empty(a):
    """``None`` for a node whose value is ``None`` (an undefined tensor the forward returned)."""
    return None if isinstance(a, fx.Node) and a.meta.get("val", 0) is None else a


def _swaps_heads_and_tokens(node: fx.Node) -> bool:
    """Whether ``node`` is ``transpose(x, 1, 2)`` (or the permute ``[0, 2, 1, 3]``) of a 4-D ``x``."""
    if node.target is aten.permute.default:
        return [d % 4 for d in node.args[1]] == [0, 2, 1, 3]
    return sorted(d % 4 for d in node.args[1:3]) == [1, 2]


def _concatenation(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(cat, the nodes between)`` where the backward's three gradients, each transposed to
    ``[B, T, H, D]`` and flattened to ``[B, T, C]``, are read only by one ``cat`` along the last
    dim in ``q, k, v`` order; ``None`` otherwise. The nodes between come users first."""
    getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(node.users) != 3 or sorted(getitems) != [0, 1, 2]:
        return None
    B, H, T, D = getitems[0].meta["val"].shape
    pieces, dead = [], []
    for i in range(3):
        chain = [getitems[i]]
        for allowed in (_TRANSPOSES, FLATTENS):
            users = list(chain[-1].users)
            if len(users) != 1 or users[0].op != "call_function" or users[0].target not in allowed:
                return None
            chain.append(users[0])
        transpose, flat = chain[1], chain[2]
        if not _swaps_heads_and_tokens(transpose) or tuple(flat.meta["val"].shape) != (B, T, H * D):
            return None
        pieces.append(flat)
        dead += reversed(chain)
    cats = {u for p in pieces for u in p.users}
    if len(cats) != 1 or any(len(p.users) != 1 for p in pieces):
        return None
    cat = cats.pop()
    if cat.target is not CAT or list(cat.args[0]) != pieces:
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in (2, -1):
        return None
    return cat, dead
