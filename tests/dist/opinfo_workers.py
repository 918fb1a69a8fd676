"""The OpInfo corpus on a mesh: each case trained under data parallel and FSDP on every rank.

A case's first parameter with a dim the world divides is fed through a batch leaf sharded on
that dim (``p + shift``, ``shift`` zeros sharded over ``dp``, its dim 0 moved there): the op
then runs on an input sharded on that dim under DTensor's rule for it, and the parameter's
gradient is a sum over ranks.
The other parameters are replicated (data parallel) or sharded on dim 0 where it divides
(FSDP). The result must equal eager ``torch.optim.SGD`` as on one device
(``tests/corpus/opinfo_run.py``).

Only the cases whose sharding rules fsg trusts run here (``trusted``): every ATen op the
forward runs on tensors computed from the parameters has a registered DTensor rule and is not
one fsg distrusts; the others are decomposed
or run replicated on a mesh (``fsg/_src/sharding/op_support.py``), which the op corpus of
``tests/dist/op_corpus.py`` covers.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist

import fsg
import fsg.sharding
import fsg.testing
from fsg._src import _torch_private
from fsg._src.sharding import op_support
from tests.corpus import opinfo, opinfo_run

PRESETS = ("dp", "fsdp")
WORLD = 2


def sharded_leaf(case: opinfo.Case, world: int = WORLD) -> tuple[str, int] | None:
    """``(path, dim)`` of the parameter fed through the sharded batch, and the dim sharded: the
    first parameter with a dim ``world`` divides, its first such dim."""
    for path, t in case.params.items():
        for dim, size in enumerate(t.shape):
            if size % world == 0:
                return path, dim
    return None


def trusted(case: opinfo.Case) -> bool:
    """Whether the case runs on a mesh under rules fsg trusts (see the module docstring)."""
    aten = [op for op in case.aten if isinstance(op, _torch_private.OpOverload) and op.namespace == "aten"]
    rules = all(_torch_private.dtensor_has_rule(op) and op not in op_support.DISTRUSTED for op in aten)
    return rules and not case.random and sharded_leaf(case) is not None


def _make_step(preset: str, world: int) -> Callable[[Callable], Any]:
    rules = fsg.sharding.data_parallel() if preset == "dp" else fsg.sharding.fsdp("dp")

    def make(loss_fn: Callable) -> Any:
        return fsg.compile_step(
            loss_fn,
            fsg.testing.mesh({"dp": world}),
            optimizer=fsg.optim.sgd(opinfo.LR),
            param_sharding=rules,
            batch_sharding=fsg.P("dp"),
            backend="aot_eager",
        )

    return make


def run_case(case: opinfo.Case, preset: str, reference: tuple[dict, list]) -> str:
    """One case under one preset on this rank's world."""
    path, dim = sharded_leaf(case, dist.get_world_size())
    batch = {"shift": torch.zeros_like(case.params[path]).movedim(dim, 0).contiguous()}

    def loss_fn(params: dict, batch: dict) -> torch.Tensor:
        return case.loss_fn({**params, path: params[path] + batch["shift"].movedim(0, dim)}, {})

    trained = opinfo_run.train(case, _make_step(preset, dist.get_world_size()), batch=batch, loss_fn=loss_fn)
    return trained if isinstance(trained, str) else opinfo_run.compare(*trained, reference)


def run_cases(names: list[str]) -> dict[str, dict[str, str]]:
    """``{case: {preset: outcome}}`` for the named cases (run on every rank at once)."""
    results = {}
    for name in names:
        case = opinfo.by_name(name)
        reference = opinfo.train_eager(case)
        results[name] = {preset: run_case(case, preset, reference) for preset in PRESETS}
    return results


# CI runs 1 in MESH_ONE_IN of the trusted cases, chosen by a hash of the name (2 presets of
# ~0.9 s each a case on 2 cores); FSG_OPINFO=full runs them all.
MESH_ONE_IN = 5
CHUNK = 20  # cases per call on the ranks (a call's timeout bounds one chunk)


def mesh_cases(cases: list[opinfo.Case]) -> list[str]:
    """The names of the cases the mesh runs: the trusted ones, sampled unless ``FSG_OPINFO=full``."""
    full = os.environ.get("FSG_OPINFO") == "full"
    return [c.name for c in cases if trusted(c) and (full or zlib.crc32(c.name.encode()) % MESH_ONE_IN == 0)]


def run_on(ranks: Any, names: list[str]) -> dict[str, dict[str, str]]:
    """``run_cases`` of ``names`` on the pool ``ranks``, a chunk a call (rank 0's outcomes)."""
    results = {}
    for start in range(0, len(names), CHUNK):
        results.update(ranks.run(run_cases, names[start : start + CHUNK])[0])
    return results
