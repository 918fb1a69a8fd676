"""Stage 2 lets only functional collectives into the per-rank graph.

A DTensor rule may communicate through ``torch.distributed`` directly: torch's convolution
handlers exchange halo columns with ``dist.batch_isend_irecv`` (``convolution.py`` runs
convolutions without them); DTensor's ``aten.equal`` calls ``dist.all_reduce``. Traced, such a
call is a ``c10d`` op (``c10d.send``, ``c10d.allreduce_``) holding a process group as a
constant: AOTAutograd and Inductor refuse the graph (issue 60: "c10d::send() Expected a value
of type '__torch__.torch.classes.c10d.ProcessGroup'"; aot_eager: "'__eq__' is not implemented
for __torch__.torch.classes.c10d.ProcessGroup"), and run node by node its sends are never
waited. ``Guard``, active while DTensor runs an op, stops such an op before it is recorded with
``RawCollectiveError``, a ``RuntimeError``: the expander takes it as the rule failing on those
placements, so the op runs replicated on gathered inputs (functional all-gathers) with a
``ShardingFallbackWarning``, or is refused with a ``ShardingRuleError`` naming it and its line.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

from fsg._src import _torch_private

RAW_NAMESPACE = "c10d"  # torch.distributed's own ops; the traceable ones are "_c10d_functional"


class RawCollectiveError(RuntimeError):
    """A DTensor rule issued a ``torch.distributed`` op that a compiled step cannot hold."""


class Guard(_torch_private.TorchDispatchMode):
    """Raises ``RawCollectiveError`` at any ``c10d`` op dispatched under it; runs the rest."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's dispatch first, with this mode still on: a mode is off inside its own
            # handler, so forwarding the DTensor op from here would hide the ops its rule issues
            return NotImplemented
        if getattr(func, "namespace", None) == RAW_NAMESPACE:
            raise RawCollectiveError(
                f"DTensor's rule for it issues {_torch_private.op_name(func)}, a torch.distributed op "
                f"outside the functional collectives, which a compiled step cannot hold"
            )
        return func(*args, **(kwargs or {}))
