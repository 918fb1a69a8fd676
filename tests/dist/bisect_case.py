"""Finds the first node of a corpus case's global graph whose sharded value differs from the
unsharded one (a debugging aid: ``python -m tests.dist.bisect_case NAME PRESET``)."""

from __future__ import annotations

import sys

import torch
from torch import fx
from torch.distributed.tensor import DTensor

import fsg
import fsg.testing
from fsg._src import tree
from fsg._src.sharding import spmd
from tests.dist import corpus_workers, op_corpus


def bisect(name: str, preset: str) -> list[str]:
    case = op_corpus.by_name(name)
    params, loss_fn, batch = case.build(op_corpus.Sizes(8, 6, 8, 4, 6), torch.Generator().manual_seed(0))
    axes, rules, batch_spec = corpus_workers.layout(preset, torch.distributed.get_world_size())
    step = fsg.compile_step(
        loss_fn, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), param_sharding=rules,
        batch_sharding=batch_spec, backend="eager", donate=False,
    )  # fmt: skip
    state = step.init(params)
    built = step._builder.build(state, batch)
    gm, plan = built.traced.graph_module, built.plan
    state_leaves = tree.flatten(state)[0]
    batch_leaves = tree.flatten(batch)[0]
    full_inputs = [t.full_tensor() for t in state_leaves] + batch_leaves
    want: dict[str, torch.Tensor] = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            want[n.name] = out
            return out

    Record(gm).run(*full_inputs)
    got: dict[str, object] = {}

    class Sharded(spmd._Expander):
        def run_node(self, n):
            out = super().run_node(n)
            got[n.name] = out
            return out

    batch_dt = [
        DTensor.from_local(local, plan.mesh.device_mesh, pl, run_check=False, shape=t.shape, stride=t.stride())
        for local, pl, t in zip(
            fsg._src.sharding.placement.local_batch(batch_leaves, plan.batch_placements, plan.mesh), plan.batch_placements,
            batch_leaves,
        )
    ]  # fmt: skip
    Sharded(gm, plan).run(*state_leaves, *batch_dt)
    lines = []
    for node in gm.graph.nodes:
        a, b = got.get(node.name), want.get(node.name)
        if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
            continue
        full = a.full_tensor() if isinstance(a, DTensor) else a
        if full.shape != b.shape or not torch.allclose(full.float(), b.float(), rtol=1e-4, atol=1e-5):
            args = [
                f"{x.name}:{tuple(got[x.name].placements) if isinstance(got.get(x.name), DTensor) else 'plain'}"
                for x in node.all_input_nodes
            ]
            where = tuple(a.placements) if isinstance(a, DTensor) else "plain"
            lines.append(f"{node.name} = {node.target}({', '.join(args)}) -> {where}")
            if len(lines) >= 4:
                break
    return lines


if __name__ == "__main__":
    with fsg.testing.MultiRank(2) as ranks:
        for line in ranks.run(bisect, sys.argv[1], sys.argv[2])[0]:
            print("DIFF", line)
