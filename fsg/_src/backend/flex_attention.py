"""FlexAttention's operators in stage 4: what each backend needs of them.

- On CPU, query, key and value in buffers of their own before Inductor: torch 2.11's CPU
  lowering of ``flex_attention`` refuses query, key and value that are views of one buffer
  ("Unsupported for now if query, key, value are the same buffer", pytorch/pytorch#157612),
  which is what a fused qkv projection gives (``qkv.view(...).permute`` then ``q, k, v = ...``);
  torch 2.13 compiles it. Copying only the key and the value is not enough: the CPU template
  reads the query's buffer as ``[B, H, T, D]`` and fails on a view of a 2-D one (both
  versions). So each CPU call reads three copies of ``[B, H, T, D]`` (beside an attention that
  reads them T times over). On CUDA the graph is left as it is.
- On CPU, Inductor without epilogue fusion (``has_cpu_flex_attention``).
- Run op by op (``eager``, ``aot_eager``), the captured tensors whose gradients the graph reads
  require grad (``captured_grads_when_run_eagerly``).
- Under Inductor, a block mask the step computes from its inputs (a padding mask from the
  batch; masks from constants alone were computed once in stage 1, ``trace/block_masks.py``) is
  refused (``refuse_block_masks_built_in_graph``): on CUDA fsg's Inductor step computed wrong
  gradients with a mask built in the step for each sequence on an H100 (torch 2.11), while a
  mask read as a constant, one for all sequences, trains correctly; on CPU Inductor cannot
  lower it.
- On CUDA under Inductor, a block mask per sequence (``B > 1``) is refused too
  (``refuse_per_sequence_block_masks``): a Hugging Face Llama given one from outside the step
  took a step whose loss was 8e-4 off eager's on an H100 (torch 2.11), not yet root-caused.
- Under Inductor (any device), a tensor constant with elements made inside a ``mask_mod`` or
  ``score_mod`` is refused by name (``refuse_subgraph_tensor_constants``): Inductor's second
  trace of the subgraph fails inside torch on it. Scalar ones (``lengths[0]``) were made ops in
  stage 1 (``trace/subgraph_constants.py``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fsg._src import _torch_private, graph_facts
from fsg._src.errors import UnsupportedError
from fsg._src.trace import block_masks, purity, subgraph_constants

FLEX_ATTENTION = "flex_attention"


def has_cpu_flex_attention(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls FlexAttention on CPU tensors. Inductor then compiles it with no
    epilogue fusion: its scheduler fuses a same-index pointwise consumer (a copy into other
    strides, which the sharded graph writes after a replicated call) into the CPU FlexAttention
    template, whose code generation refuses any ("Unsupported for `epilogue_nodes` in
    CppFlexAttentionTemplate", torch 2.13)."""
    return any(_is_flex(n) and n.args[0].meta["val"].device.type == "cpu" for n in gm.graph.nodes)


def _is_flex(node: fx.Node, name: str = FLEX_ATTENTION) -> bool:
    return isinstance(node.target, _torch_private.HigherOrderOperator) and node.target.name() == name


def own_buffers_for_cpu_flex_attention(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` in place: each CPU ``flex_attention`` reads copies of its query, key and value.
    Returns how many calls were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not _is_flex(node) or node.args[0].meta["val"].device.type != "cpu":
            continue
        with gm.graph.inserting_before(node):
            copies = [gm.graph.call_function(torch.ops.aten.clone.default, (a,), {"memory_format": torch.contiguous_format})
                      for a in node.args[:3]]  # fmt: skip
        for copy, source in zip(copies, node.args[:3]):
            copy.meta = dict(source.meta)
        node.args = (*copies, *node.args[3:])
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


FLEX_ATTENTION_BACKWARD = "flex_attention_backward"
_BUFFERS_ARG, _BUFFER_GRADS_OUT = 12, 3  # score_mod_other_buffers; the output tuple of their gradients


def wanting_grad(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a leaf that requires grad: torch's eager ``flex_attention_backward`` computes the
    gradient of a tensor its score function captured only for a tensor that requires grad."""
    return t.detach().requires_grad_()


def captured_grads_when_run_eagerly(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` in place for running op by op: each ``flex_attention_backward`` whose graph
    reads the gradient of a captured tensor (a learned bias in ``score_mod``) gets that tensor as a
    leaf that requires grad. Traced, the gradient is there; run eagerly on tensors that require no
    grad, torch returns ``None`` for it ("Expected a proper Tensor but got None"). Inductor's
    lowering computes it either way. Returns how many tensors were marked."""
    marked = 0
    for node in list(gm.graph.nodes):
        if not _is_flex(node, FLEX_ATTENTION_BACKWARD) or len(node.args) <= _BUFFERS_ARG:
            continue
        grads = [u for u in node.users if u.target is operator.getitem and u.args[1] == _BUFFER_GRADS_OUT]
        read = {g.args[1] for out in grads for g in out.users if g.target is operator.getitem}
        buffers = list(node.args[_BUFFERS_ARG])
        for i in sorted(read):
            if isinstance(buffers[i], fx.Node):
                with gm.graph.inserting_before(node):
                    buffers[i] = gm.graph.call_function(wanting_grad, (buffers[i],))
                marked += 1
        node.args = (*node.args[:_BUFFERS_ARG], tuple(buffers), *node.args[_BUFFERS_ARG + 1 :])
    if marked:
        gm.recompile()
    return marked


_aten = torch.ops.aten
_COPIES = frozenset({_aten._to_copy.default, _aten.clone.default, _aten.detach.default, _aten.alias.default})


def _made_by(node: fx.Node) -> fx.Node:
    """The node whose values ``node`` holds: up through views and copies."""
    while node.op == "call_function" and (node.target in _COPIES or graph_facts.is_view(node)) and node.args:
        node = node.args[0]
    return node


def block_masks_built_in_graph(gm: fx.GraphModule) -> list[fx.Node]:
    """The FlexAttention calls (forward and backward) of ``gm`` whose block mask's tensors the
    graph computes (``create_block_mask`` traced with the step), rather than reads as constants
    or inputs (a ``BlockMask`` built outside the step and captured)."""
    return [
        node
        for node, _, tensors in block_masks.block_mask_args(gm)
        if any(_made_by(t).op == "call_function" for t in tensors)
    ]


# Refused under Inductor: a block mask the step computes. On CUDA its gradients were measured wrong
# (a Hugging Face Llama whose mask was built in each forward, on an H100 with torch 2.11); a copy of
# each mask tensor into a contiguous buffer of its own fixed that model but not masks computed from
# the batch per sequence (Inductor's lowering failed: "convert FlexibleLayout to FixedLayout
# first"), so it was removed and such masks stay refused (benchmarks/RESULTS.md). On CPU Inductor
# cannot lower it (torch 2.13: "NoValidChoicesError" from the CPU template).
_WHY = {
    "cuda": "its Inductor step computed wrong gradients with a mask built inside the step (torch 2.11, H100), and "
    "right ones with the mask built outside",
    "cpu": "torch's CPU Inductor cannot compile FlexAttention over a mask computed in the graph (NoValidChoicesError)",
}


def refuse_block_masks_built_in_graph(gm: fx.GraphModule, devices: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Raises ``UnsupportedError`` where a FlexAttention call on one of ``devices`` reads a block
    mask the step builds (``block_masks_built_in_graph``). On CUDA, fsg's Inductor step computed
    wrong gradients for such a mask (a Hugging Face Llama with ``attn_implementation=
    "flex_attention"`` on an H100, torch 2.11: the loss right or nearly, the gradients off by 60%
    to 2,400% of their norm, changing from run to run; ``aot_eager``, ``torch.compile`` of the
    same model, and fsg's Inductor step with the mask built outside it all right); on CPU
    Inductor fails to lower it."""
    found = [n for n in block_masks_built_in_graph(gm) if n.args[0].meta["val"].device.type in devices]
    if not found:
        return
    first = next((n for n in found if _is_flex(n)), found[0])
    device = first.args[0].meta["val"].device.type
    raise UnsupportedError(
        f"fsg: FlexAttention at {purity.user_frame_of_node(first)} reads a BlockMask built inside the step from its "
        "inputs (create_block_mask over a mask read from the batch or the parameters: a Hugging Face model given a "
        "padding attention_mask builds one; a mask built from constants alone is computed once and read as a "
        f"constant), on {device} under backend='inductor'. fsg refuses it: {_WHY.get(device, _WHY['cuda'])}. Pass "
        "backend='aot_eager' (correct, slower), or build the mask outside loss_fn and use it there (captured, or a "
        "Hugging Face model's attention_mask=create_block_mask(causal, None, None, T, T, device='cuda')) "
        "(docs/models.md#flexattention-and-other-higher-order-operators)."
    )


# Refused on CUDA under Inductor: a block mask per sequence (B > 1), built outside the step too. A
# Hugging Face Llama given one (packed documents split differently in two sequences) took a step
# whose loss was 8e-4 off its eager call's on an H100 (torch 2.11; tests/gpu/
# test_flex_attention_cuda.py), though a plain FlexAttention over a per-sequence length mask
# matched eager; on CPU the same model's evaluation equals eager. Not root-caused: refused, not run.


def per_sequence_block_masks(gm: fx.GraphModule) -> list[fx.Node]:
    """The FlexAttention calls of ``gm`` whose block mask has a batch dim (one mask a sequence:
    its first tensor, ``kv_num_blocks``, is ``[B, H, query blocks]`` with ``B > 1``)."""
    return [
        node for node, _, tensors in block_masks.block_mask_args(gm) if tensors and tensors[0].meta["val"].shape[0] > 1
    ]


def refuse_per_sequence_block_masks(gm: fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> None:
    """Raises ``UnsupportedError`` where a FlexAttention call on one of ``devices`` reads a block
    mask per sequence (see above)."""
    found = [n for n in per_sequence_block_masks(gm) if n.args[0].meta["val"].device.type in devices]
    if not found:
        return
    first = next((n for n in found if _is_flex(n)), found[0])
    raise UnsupportedError(
        f"fsg: FlexAttention at {purity.user_frame_of_node(first)} reads a BlockMask with one mask per sequence (B > 1 "
        f"in create_block_mask), on {first.args[0].meta['val'].device.type} under backend='inductor'. fsg refuses it: a "
        "Hugging Face model given such a mask took a step whose loss differed from eager's by 8e-4 (torch 2.11, H100; "
        "not yet root-caused). Pass backend='aot_eager' (correct, slower), or a mask the sequences share (B=None in "
        "create_block_mask) (docs/models.md#flexattention-and-other-higher-order-operators)."
    )


def refuse_subgraph_tensor_constants(gm: fx.GraphModule) -> None:
    """Raises ``UnsupportedError`` where a subgraph of ``gm`` (a FlexAttention ``mask_mod`` or
    ``score_mod``) makes a tensor constant with elements (``subgraph_constants.constants_left``):
    Inductor traces the subgraph again with functionalization and torch fails there
    ("Attempting to use FunctionalTensor on its own", torch 2.11 and 2.13)."""
    left = subgraph_constants.constants_left(gm)
    if not left:
        return
    name, value = left[0]
    readers = [n for n in gm.graph.nodes if any(a.op == "get_attr" and a.target == name for a in n.all_input_nodes)]
    where = purity.user_frame_of_node(readers[0]) if readers else f"the subgraph {name}"
    raise UnsupportedError(
        f"fsg: the {'mask_mod' if 'mask' in name else 'score_mod'} of the FlexAttention at {where} makes a tensor "
        f"constant ({value.dtype}, shape {list(value.shape)}) inside its body (torch.tensor(...) in the function): "
        "under backend='inductor' torch cannot trace it a second time. Make the tensor outside the function (in "
        "loss_fn, or once before it) and read it there, captured; or pass backend='aot_eager'."
    )
