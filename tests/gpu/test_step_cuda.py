"""compile_step on CUDA (skipped without a GPU): Inductor/Triton, donation, metrics on device."""

import pytest
import torch

import fsg
from tests.helpers import mlp, mse_loss_fn, regression_batch, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def to_cuda(batch):
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_step_matches_torch_adamw(backend):
    batches = [regression_batch(seed=i) for i in range(20)]
    ref_model = mlp(seed=5).cuda()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in map(to_cuda, batches):
        opt.zero_grad()
        ((ref_model(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
    model = mlp(seed=5).cuda()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), backend=backend)
    state = step.init(fsg.params(model))
    ptrs = [t.data_ptr() for t in fsg._src.tree.flatten(state)[0]]
    for batch in map(to_cuda, batches):
        state, metrics = step(state, batch)
    assert [t.data_ptr() for t in fsg._src.tree.flatten(state)[0]] == ptrs  # donated in place
    assert all(v.is_cuda and v.dim() == 0 for v in metrics.values())
    assert step.num_compiles == 1
    for k, p in ref_model.named_parameters():
        # float32 on both sides; 1e-5 as on CPU, cuBLAS may pick other reduction orders.
        assert rel_err(state.params[k], p.detach()) < 1e-5, k


def test_cuda_gpt_step_learns():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=64)).cuda()

    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(3e-3))
    state = step.init(fsg.params(model))
    x = torch.randint(0, 64, (8, 33), device="cuda")
    batch = {"x": x[:, :-1], "y": x[:, 1:]}  # memorize one batch
    losses = []
    for _ in range(50):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    assert float(losses[-1]) < 0.5 * float(losses[0])
    assert step.num_compiles == 1
