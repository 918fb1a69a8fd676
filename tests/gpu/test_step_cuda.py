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


@pytest.mark.parametrize("skip", [False, True])
def test_cuda_gpt_step_learns(skip):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=64)).cuda()

    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(3e-3), skip_nonfinite=skip)
    state = step.init(fsg.params(model))
    x = torch.randint(0, 64, (8, 33), device="cuda")
    batch = {"x": x[:, :-1], "y": x[:, 1:]}  # memorize one batch
    losses = []
    for _ in range(50):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    assert float(losses[-1]) < 0.5 * float(losses[0])
    assert step.num_compiles == 1


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_gpt_skips_a_nonfinite_step_and_keeps_its_state(compute):
    """The attention kernels' CPU RNG state once broke this step's kernels (backend/inductor.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=64)).cuda()

    def loss_fn(params, batch):
        return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"]) * batch["w"]

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(3e-3), skip_nonfinite=True,
                            precision=fsg.Policy(compute=compute))  # fmt: skip
    state = step.init(fsg.params(model))
    x = torch.randint(0, 64, (8, 33), device="cuda")
    batch = {"x": x[:, :-1], "y": x[:, 1:], "w": torch.ones((), device="cuda")}
    state, _ = step(state, batch)
    before = fsg._src.tree.tree_map(torch.clone, (state.params, state.opt_state))
    state, metrics = step(state, {**batch, "w": torch.full((), float("nan"), device="cuda")})
    assert int(metrics["skipped"]) == 1 and int(state.skips.consecutive) == 1
    after = (state.params, state.opt_state)
    assert all(torch.equal(a, b) for a, b in zip(fsg._src.tree.flatten(before)[0], fsg._src.tree.flatten(after)[0]))
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 1 and int(state.skips.consecutive) == 0 and torch.isfinite(metrics["loss"])
    assert step.num_compiles == 1


def _two_steps(**options):
    model = mlp(seed=3).cuda()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), **options)
    return step, step.init(fsg.params(model))


def test_cuda_graph_replay_matches_plain_step_and_recaptures_for_a_new_state():
    graphed, gstate = _two_steps()
    plain, pstate = _two_steps(cuda_graph=False)
    kept = []
    for i in range(6):
        batch = to_cuda(regression_batch(seed=i))
        gstate, gm = graphed(gstate, batch)
        pstate, pm = plain(pstate, batch)
        kept.append((gm["loss"], pm["loss"]))
    compiled = next(iter(graphed._cache.values())).fn
    assert compiled.captured
    # metrics are copies: a later replay did not overwrite the ones kept from earlier steps
    assert all(rel_err(g, p) < 1e-5 for g, p in kept) and len({float(g) for g, _ in kept}) == 6
    for a, b in zip(fsg._src.tree.flatten(gstate)[0], fsg._src.tree.flatten(pstate)[0]):
        assert rel_err(a, b) < 1e-5
    # a state in other storages (e.g. restored) is captured again, not silently ignored
    fresh, pfresh = graphed.init(fsg.params(mlp(seed=4).cuda())), plain.init(fsg.params(mlp(seed=4).cuda()))
    for i in range(3):
        batch = to_cuda(regression_batch(seed=10 + i))
        fresh, gm = graphed(fresh, batch)
        pfresh, pm = plain(pfresh, batch)
        assert rel_err(gm["loss"], pm["loss"]) < 1e-5


def test_release_all_drops_captured_graphs_and_the_step_captures_again():
    """``fsg.distributed.shutdown`` releases captured graphs before NCCL teardown
    (pytorch/pytorch#115388); a released step keeps working and captures anew."""
    from fsg._src.backend import cudagraph

    graphed, gstate = _two_steps()
    plain, pstate = _two_steps(cuda_graph=False)
    for i in range(3):
        batch = to_cuda(regression_batch(seed=i))
        gstate, _ = graphed(gstate, batch)
        pstate, _ = plain(pstate, batch)
    compiled = next(iter(graphed._cache.values())).fn
    assert compiled.captured
    assert cudagraph.release_all() >= 1
    assert not compiled.captured
    for i in range(3, 6):
        batch = to_cuda(regression_batch(seed=i))
        gstate, gm = graphed(gstate, batch)
        pstate, pm = plain(pstate, batch)
        assert rel_err(gm["loss"], pm["loss"]) < 1e-5
    assert compiled.captured


def test_capture_returns_the_warm_up_runs_cached_memory():
    """Before capture, the first call's and the warm-up's freed temporaries go back to the
    driver: the allocator's reserved high-water mark stays near the allocated one, not the
    ~1.9x of one step's memory that three runs' caches beside the graph's pool would hold."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = mlp(d_in=2048, d_hidden=4096, d_out=2048, seed=0).cuda()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-3), cuda_graph=True)
    state = step.init(fsg.params(model))
    batch = to_cuda(regression_batch(n=16384, d_in=2048, d_out=2048))  # activations dominate
    for _ in range(3):  # compile and run, warm up and capture, replay
        state, metrics = step(state, batch)
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    assert reserved < 1.3 * allocated, (reserved / 2**30, allocated / 2**30)
