"""Run by tests/gpu/test_mesh_cuda.py in a process of its own: one process posing as rank 0 of
2 through torch's fake process group (collectives do nothing), so that an FSDP step's graph
is built with its tensors on CUDA, where the CUDA-only rewrites (batched casts, GELU
epilogues) apply. Prints, as JSON, each graph's collectives by kind and dtype and what the
``fsg`` logger said; the step is lowered, not run (its numbers would be meaningless)."""

import json
import logging
import sys
from io import StringIO
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # test-only: no public fake group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

import fsg  # noqa: E402


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    said = StringIO()
    logging.getLogger("fsg").addHandler(logging.StreamHandler(said))
    logging.getLogger("fsg").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=128)).cuda()
    x = torch.randint(0, 512, (4, 33), device="cuda")
    batch = {"x": x[:, :-1], "y": x[:, 1:]}
    out = {}
    for name, matmul in (("bf16", None), ("fp8-gather", fsg.Float8(all_gather="fp8"))):
        step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b["x"], b["y"]), fsg.Mesh({"dp": 2}, device_type="cuda"),
                                optimizer=fsg.optim.adamw(1e-3), param_sharding=fsg.sharding.fsdp("dp"),
                                batch_sharding=fsg.P("dp"), precision=fsg.Policy(compute=torch.bfloat16, matmul=matmul),
                                backend="aot_eager")  # fmt: skip
        graph = step.lower(step.init(fsg.params(model)), batch).graph_module.graph
        counts: dict[str, int] = {}
        for node in graph.nodes:
            if getattr(node.target, "namespace", None) == "_c10d_functional" and "wait" not in node.name:
                key = f"{node.target.__name__}:{getattr(node.meta.get('val'), 'dtype', None)}"
                counts[key] = counts.get(key, 0) + 1
        out[name] = {"collectives": counts, "cast_flat": sum(n.target is torch.ops.fsg.cast_flat.default for n in graph.nodes)}
    out["said"] = said.getvalue()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
