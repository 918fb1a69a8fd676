"""Stage 1's graph made functional: the only writes left are an epilogue of ``copy_``s.

torch's functionalization turns every in-place op of the traced step (a module's buffer
updates, ``relu_``, an in-place op of the optimizer) into its out-of-place form, and every
write to a step input into one ``copy_`` into it at the end. Passes can then rely on one fact
(``check``): a node reads the value its inputs had when the step began; only the epilogue
writes, each state input once, and nothing reads an input after its write.

A graph that already has that form (a step whose loss and optimizer write nothing in place,
the common case) is left as it is: re-tracing it through functionalization would give the same
graph and costs about half of the first trace.
"""

from __future__ import annotations

import torch
from torch import fx

from fsg._src import _torch_private, graph_facts
from fsg._src.errors import PassInvariantError


def functionalize(gm: fx.GraphModule, *, donate: bool, decompositions: dict | None = None) -> fx.GraphModule:
    """``gm`` with every write in its epilogue (functionalized by torch where needed, the ops
    that emits lowered by ``decompositions``), its epilogue copies folded, and (with
    donation) the copies of buffers never written dropped."""
    if first_stray_write(gm) is not None:
        gm = _torch_private.functionalize(gm, decompositions)
        _fold_copies(gm)
    if donate:
        _drop_unwritten_copies(gm)
    else:
        _drop_input_writes(gm)
    gm.recompile()
    check(gm)
    return gm


def first_stray_write(gm: fx.GraphModule) -> fx.Node | None:
    """The first node that breaks the epilogue form, or ``None`` when the graph has it: the
    only writes are ``copy_``s into placeholders whose results nothing uses, each placeholder
    written once, and no node (nor the output) reads a placeholder after its write."""
    written: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            read = {graph_facts.storage_of(n) for n in node.all_input_nodes}
            return node if read & written else None
        if graph_facts.reads(node) & written:
            return node
        targets = graph_facts.writes(node)
        if not targets:
            continue
        dst = node.args[0] if node.args else None
        if node.target is not torch.ops.aten.copy_.default or not isinstance(dst, fx.Node) or dst.op != "placeholder":
            return node
        if dst in written or node.users:
            return node
        written.add(dst)
    return None


def check(gm: fx.GraphModule) -> None:
    """Raises ``PassInvariantError`` naming the node if ``gm`` is not in epilogue form."""
    stray = first_stray_write(gm)
    if stray is not None:
        raise PassInvariantError(
            f"stage 1's graph writes outside its epilogue at node {stray.name} ({stray.format_node()}); "
            "functionalization should have removed every other write. Please report this with the model."
        )


def _fold_copies(gm: fx.GraphModule) -> None:
    """Functionalization writes an input as ``copy_(x, copy(x, value))``; the outer ``copy_``
    alone converts and broadcasts as the inner one did, so it becomes ``copy_(x, value)``."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            inner = node.args[1]
            if (
                isinstance(inner, fx.Node)
                and inner.target is torch.ops.aten.copy.default
                and inner.args[0] is node.args[0]
            ):
                node.args = (node.args[0], inner.args[1], *node.args[2:])
                if not inner.users:
                    gm.graph.erase_node(inner)


def _drop_input_writes(gm: fx.GraphModule) -> None:
    """Without donation the step returns every new state leaf, and its inputs must stay as they
    were: a write the loss made into an input (``nn.Embedding(max_norm=...)`` renormalizes its
    weight in place, as eager PyTorch does before the update) is already in the outputs, since
    the functional graph's later readers and outputs see the written value. Its epilogue copy
    into the input goes."""
    for node in list(gm.graph.nodes):
        is_copy = node.op == "call_function" and node.target is torch.ops.aten.copy_.default and not node.users
        if is_copy and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
            gm.graph.erase_node(node)


def _drop_unwritten_copies(gm: fx.GraphModule) -> None:
    """With donation, a buffer the step never writes needs no copy: ``copy_(x, clone(x))``
    goes, and the clone's readers read ``x`` (``train_step`` hands the loss copies of the
    buffers, since it cannot know before tracing which ones a module updates). With skipping
    the write is ``copy_(x, where(finite, clone(x), x))``, dropped alike. In a functional graph
    nothing writes the clone, so its value is ``x``'s for the whole step."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst, written = node.args[0], node.args[1]
        src = written
        if isinstance(src, fx.Node) and src.target is torch.ops.aten.where.self and src.args[2] is dst:
            src = src.args[1]
        is_copy = isinstance(src, fx.Node) and src.target is torch.ops.aten.clone.default and src.args[0] is dst
        if dst.op == "placeholder" and is_copy and not node.users and (written is src or len(written.users) == 1):
            gm.graph.erase_node(node)
            if written is not src:
                gm.graph.erase_node(written)
            src.replace_all_uses_with(dst)
            gm.graph.erase_node(src)
