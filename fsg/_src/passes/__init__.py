"""Stage 3: graph passes, each a function of the per-rank (or single-device) FX graph.

``run_pass`` runs one and, when ``FSG_CHECK_PASSES=1`` is set (the test suite sets it), checks
the invariants of ``invariants.py`` on the graph it leaves: a pass that reorders a read past a
write, loses a collective's wait or drops an output fails at once, naming itself.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from torch import fx

from fsg._src.passes import invariants

log = logging.getLogger("fsg")

CHECK_ENV = "FSG_CHECK_PASSES"


def checking() -> bool:
    """Whether ``run_pass`` checks the invariants (``FSG_CHECK_PASSES=1``), read at each call."""
    return os.environ.get(CHECK_ENV) == "1"


def run_pass(name: str, fn: Callable[..., Any], graph_module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn(graph_module, *args, **kwargs)`` (a pass that rewrites the graph in place) and
    returns what it returns; under ``FSG_CHECK_PASSES=1``, first snapshots the graph and then
    raises ``PassInvariantError`` naming ``name`` if the pass broke an invariant. A pass that
    raises (a fusion that refuses the graph) is not checked.

    >>> import torch
    >>> from torch import fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> _ = g.output((g.call_function(torch.ops.aten.relu.default, (x,)),))
    >>> run_pass("noop", lambda gm: 0, fx.GraphModule(torch.nn.Module(), g))
    0
    """
    if not checking():
        return fn(graph_module, *args, **kwargs)
    before = invariants.snapshot(graph_module.graph)
    result = fn(graph_module, *args, **kwargs)
    t0 = time.perf_counter()
    invariants.check(before, graph_module.graph, name)
    log.debug(
        "fsg: checked pass %s (%d nodes) in %.3f s", name, len(graph_module.graph.nodes), time.perf_counter() - t0
    )
    return result
