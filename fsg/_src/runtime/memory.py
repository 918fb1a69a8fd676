"""``Lowered.memory()``: the bytes one step holds, read from the graph without running it.

The graph is walked in its own order (the order the ``"eager"`` backend runs it in). Every node
whose result is a new tensor *allocates* its storage when it runs; views and in-place results
share their base's storage (``graph_facts.py`` derives that from the ops' schemas), so a
storage is counted once, and it is *freed* after the last node that reads any alias of it. The
graph's outputs stay alive to the end. In-place writes into an input allocate nothing.

Two ops return their input's storage although their schemas say "new tensor":
``aten._unsafe_view`` (a reshape that autograd does not track as a view) and
``_c10d_functional.wait_tensor`` (the result of the collective it waits for); both are
followed like views here.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src import graph_facts as facts

_HIDDEN_ALIASES = (torch.ops.aten._unsafe_view.default, _torch_private.WAIT_TENSOR)
_ONES_LIKE, _FULL_LIKE = torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default


class Memory(NamedTuple):
    """A static estimate of the memory one step needs, in bytes (per rank on a mesh).

    Read from the graph that gets compiled (``Lowered.graph_module``) and the shapes and dtypes
    its nodes carry, in the graph's own order; nothing is allocated. See
    ``docs/compiling.md#memory``.

    Attributes:
      state: the state inputs: parameters, optimizer state, step counters, RNG, buffers.
      batch: the batch inputs.
      activations: the forward's values still alive where the backward starts (at autograd's
        seed, ``ones_like(loss)``): what the backward reads of the forward, and the loss; with
        ``accum_steps`` > 1 the largest over the microbatches. Not the inputs. On a mesh,
        parameters gathered in the forward and still alive then count too.
      temporaries_peak: the most bytes of non-input tensors alive at once, anywhere in the
        step: activations, gradients, the update's temporaries, and the new state leaves (each
        computed, then copied into the old leaf by donation, or returned without it).
      peak: ``state + batch + temporaries_peak``.

    Not counted: the allocator's caching, rounding and fragmentation (what
    ``torch.cuda.memory_reserved`` adds); scratch a kernel allocates inside itself (a fused
    ``fsg.nn.linear_cross_entropy``'s chunk of logits, up to 1 GiB; cuBLAS and collective
    buffers); tensors the graph holds as constants. The compiled step runs another schedule:
    Inductor fuses element-wise chains, whose temporaries then never exist, and writes the
    donated state in place, so it usually needs less than ``peak`` (0.6-0.8 of
    ``temporaries_peak`` on GPT-2 124M), but not always. Read ``peak`` as the graph as
    written, run op by op: the ``"eager"`` backend holds ``temporaries_peak`` above the
    inputs (to the byte on CPU, within 0.2% on an H200).
    """

    state: int
    batch: int
    activations: int
    temporaries_peak: int
    peak: int


def _bytes(value: Any) -> int:
    """The bytes of a tensor's storage (0 for anything that is not a tensor)."""
    if not isinstance(value, torch.Tensor):
        return 0
    try:
        return int(value.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # a tensor without a storage to ask
        return value.numel() * value.element_size()


def _input_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _values(graph_module: fx.GraphModule, example_inputs: list[torch.Tensor] | None) -> dict[fx.Node, Any]:
    """Each node's value as a fake tensor: its ``meta["val"]`` from tracing, or, when a graph
    pass made nodes without one, found by running the graph on fake copies of the inputs."""
    values: dict[fx.Node, Any] = {}
    missing = False
    for n in graph_module.graph.nodes:
        if "val" in n.meta:
            values[n] = n.meta["val"]
        elif n.target is operator.getitem and isinstance(parent := values.get(n.args[0]), (tuple, list)):
            values[n] = parent[n.args[1]]  # make_fx gives no "val" to an unread None output
        else:
            values[n] = None
            missing |= n.op == "call_function"
    if example_inputs is None or not missing:
        return values
    mode = _torch_private.fake_mode()

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            values[node] = result = super().run_node(node)
            return result

    with mode:
        fakes = [mode.from_tensor(t) for t in example_inputs]
        Recorder(graph_module).run(*fakes)
    return values


def _owner(node: fx.Node) -> fx.Node:
    """The node whose storage ``node``'s result lives in: ``facts.storage_of``, also through
    the ops whose schemas hide that they return their input (``_HIDDEN_ALIASES``)."""
    while True:
        if node.op == "call_function" and node.target in _HIDDEN_ALIASES:
            node = node.args[0]
            continue
        base = facts.aliased_input(node)
        if base is None:
            return node
        node = base


class _Storage(NamedTuple):
    born: int  # position of the node that allocates it
    nbytes: int


def _allocations(
    nodes: list[fx.Node], position: dict[fx.Node, int], values: dict[fx.Node, Any]
) -> tuple[dict[fx.Node, _Storage], list[int]]:
    """The storages the graph allocates (keyed by their owner node, with where and how big),
    and the bytes each node allocates only for the length of its own run (outputs of a
    multi-output op that nothing reads)."""
    storages: dict[fx.Node, _Storage] = {}
    transient = [0] * len(nodes)
    for node in nodes:
        if node.op != "call_function" or _owner(node) is not node:
            continue
        value = values[node]
        if node.target is operator.getitem:  # one output of a multi-output op, made by its parent
            parent = node.args[0]
            while parent.target is operator.getitem:
                parent = parent.args[0]
            storages[node] = _Storage(position[parent], _bytes(value))
        elif isinstance(value, torch.Tensor):
            storages[node] = _Storage(position[node], _bytes(value))
        elif isinstance(value, (tuple, list)):
            picked = {u.args[1] for u in node.users if u.target is operator.getitem}
            transient[position[node]] += sum(_bytes(v) for i, v in enumerate(value) if i not in picked)
    return storages, transient


def _last_uses(nodes: list[fx.Node], position: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """The position of the last node that reads or writes each storage (through any alias);
    the graph's outputs are read at the end."""
    last: dict[fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            last[_owner(arg)] = position[node]
    return last


def _feeds_state(nodes: list[fx.Node], state: list[fx.Node]) -> set[fx.Node]:
    """The nodes the new state is computed from: what a write into a state input (donation's
    ``copy_``, a fused update) reads, or, without donation, the graph's first ``len(state)``
    outputs (the new state leaves), and everything these read."""
    sinks = {n for n in nodes if not facts.writes(n).isdisjoint(state)}
    if not sinks:
        sinks = {a for a in nodes[-1].args[0][: len(state)] if isinstance(a, fx.Node)}
    feeds: set[fx.Node] = set()
    for node in reversed(nodes):
        if node in sinks or not feeds.isdisjoint(node.users):
            feeds.add(node)
    return feeds


def _seeds(
    nodes: list[fx.Node], values: dict[fx.Node, Any], state: list[fx.Node]
) -> tuple[list[fx.Node], set[fx.Node]]:
    """The backward's starting points, and the nodes computed from them.

    ``torch.autograd.grad`` starts each backward from ``ones_like(loss)`` (``full_like(loss,
    1)`` where stage 1 decomposes it) of a 0-d floating loss; gradient accumulation traces one
    per microbatch. Other such nodes are told apart by what else reads their input: the loss
    is read by the loss metric too, and feeds the new state only through the backward, whereas
    the gradient norm that clipping compares with ``ones_like(norm)`` scales the update, and a
    schedule's ``full_like(count, 1.0)`` is the only reader of its input. Of a seed that another
    is computed from (a ``ones_like`` inside the loss), the later one is kept.
    """
    feeds = _feeds_state(nodes, state)
    candidates = {
        n
        for n in nodes
        if n.op == "call_function"
        and (n.target is _ONES_LIKE or (n.target is _FULL_LIKE and n.args[1:2] == (1,)))
        and isinstance(v := values[n], torch.Tensor)
        and v.dim() == 0
        and v.is_floating_point()
        and isinstance(loss := n.args[0], fx.Node)
        and len(loss.users) > 1  # the loss metric reads it too
        and all(u is n or u not in feeds for u in loss.users)
    }
    reached: dict[fx.Node, frozenset[fx.Node]] = {}  # node -> the candidates it is computed from
    fed: set[fx.Node] = set()  # candidates that another candidate is computed from
    for node in nodes:
        sources = frozenset().union(*(reached.get(a, ()) for a in node.all_input_nodes))
        if node in candidates:
            fed |= sources
            sources |= {node}
        if sources:
            reached[node] = sources
    seeds = [c for c in nodes if c in candidates and c not in fed]
    backward = {n for n, sources in reached.items() if not sources.isdisjoint(seeds)}
    return seeds, backward


def step_memory(
    graph_module: fx.GraphModule, num_state_leaves: int, example_inputs: list[torch.Tensor] | None = None
) -> Memory:
    """The ``Memory`` of a step graph whose first ``num_state_leaves`` inputs are the state and
    the rest the batch. ``example_inputs`` (real or fake, only their shapes are read) give
    values to nodes that a graph pass made without ``meta["val"]``."""
    values = _values(graph_module, example_inputs)
    nodes = list(graph_module.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    state = sum(_input_bytes(values[n]) for n in inputs[:num_state_leaves])
    batch = sum(_input_bytes(values[n]) for n in inputs[num_state_leaves:])

    storages, transient = _allocations(nodes, position, values)
    last = _last_uses(nodes, position)
    end = {s: max(last.get(s, info.born), info.born) for s, info in storages.items()}
    delta = [0] * (len(nodes) + 1)
    for s, info in storages.items():
        delta[info.born] += info.nbytes
        delta[end[s] + 1] -= info.nbytes
    live, temporaries_peak = 0, 0
    for k in range(len(nodes)):
        live += delta[k]
        temporaries_peak = max(temporaries_peak, live + transient[k])

    seeds, backward = _seeds(nodes, values, inputs[:num_state_leaves])
    activations = 0
    for seed in seeds:
        at = position[seed]
        saved = sum(info.nbytes for s, info in storages.items() if info.born < at <= end[s] and s not in backward)
        activations = max(activations, saved)
    return Memory(state, batch, activations, temporaries_peak, state + batch + temporaries_peak)
