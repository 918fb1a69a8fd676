"""What ``Step.lower`` returns: the traced step graph, for inspection."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from fsg._src import _torch_private
from fsg._src.runtime import memory
from fsg._src.runtime.memory import Memory
from fsg._src.sharding import collectives as collectives_of


class Cost(NamedTuple):
    """A static estimate of one step's work.

    Attributes:
      flops: floating-point operations of the matrix products and convolutions (forward,
        backward and update together), as counted by ``torch.utils.flop_counter``.
      op_counts: how many nodes of each aten op the graph holds, e.g. ``{"aten.mm": 6}``.
    """

    flops: int
    op_counts: dict[str, int]


class Lowered:
    """The step graph for one abstract signature of state and batch.

    ``graph_module`` is what gets compiled (stage 3's output). ``stages`` holds each stage's
    graph by name: ``"traced"`` (stage 1, the global graph), ``"sharded"`` (stage 2's per-rank
    graph with its collectives, on a mesh) and ``"optimized"`` (after stage 3's passes, the
    same object as ``graph_module``). Inputs are the flat state leaves then the flat batch
    leaves (local pieces on a mesh); see ``docs/compiling.md`` for what each stage does.
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        example_inputs: list[torch.Tensor],
        *,
        global_graph: fx.GraphModule | None = None,
        mesh: Any = None,
        stages: dict[str, fx.GraphModule] | None = None,
    ):
        self.graph_module = graph_module
        self.global_graph = graph_module if global_graph is None else global_graph
        self.stages = dict(stages) if stages else {"traced": self.global_graph, "optimized": graph_module}
        self._example_inputs = example_inputs
        self._mesh = mesh

    def as_text(self, stage: str = "optimized") -> str:
        """A stage's graph (``"traced"``, ``"sharded"`` on a mesh, or ``"optimized"``: what
        gets compiled) as readable Python, one aten op per line, with shapes."""
        if stage not in self.stages:
            raise ValueError(f"no stage {stage!r} in this step; it has {list(self.stages)}")
        return self.stages[stage].print_readable(print_output=False)

    def collectives(self) -> list:
        """The step's collectives as rows ``(kind, axis, bytes, count)``, one per kind and
        mesh axis (empty on one device)."""
        return collectives_of.collectives(self.graph_module, self._mesh)

    def op_counts(self) -> dict[str, int]:
        """How many nodes of each op the graph holds, e.g. ``{"aten.mm": 6, ...}``."""
        counts = collections.Counter(_torch_private.op_name(n.target) for n in self.graph_module.graph.nodes if n.op == "call_function")
        return dict(sorted(counts.items()))

    def cost(self) -> Cost:
        """FLOPs and op counts of one step, found by running the graph on fake tensors."""
        mode = _torch_private.fake_mode()
        with mode:
            fakes = [mode.from_tensor(t) for t in self._example_inputs]
        counter = FlopCounterMode(display=False)
        with mode, counter:
            self.graph_module(*fakes)
        return Cost(counter.get_total_flops(), self.op_counts())

    def memory(self) -> Memory:
        """The bytes one step holds (per rank on a mesh), read from the graph's shapes and
        dtypes in its own order: state and batch inputs, the activations the forward leaves
        for the backward, the peak of temporaries, and their sum (``fsg.Memory`` says what
        each counts and what it does not)."""
        return memory.step_memory(self.graph_module, self.global_graph.meta["num_state_leaves"], self._example_inputs)
