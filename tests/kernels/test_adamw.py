"""Fused AdamW: the multi-tensor and per-tensor Triton kernels against the traced math, and
the stage-3 pass that puts the fused op into a compiled step (CPU: TRITON_INTERPRET=1)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.kernels import _multi_tensor as MT
from fsg._src.kernels import adamw as K
from fsg._src.kernels._common import capture_warmup
from fsg._src.passes import fuse_adamw as fusion
from tests.helpers import mlp, mse_loss_fn, regression_batch
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton


def _tensors(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    make = [lambda n: torch.randn(n, generator=g), lambda n: torch.randn(n, generator=g)]
    params = [make[0](n) for n in sizes]
    grads = [make[1](n) for n in sizes]
    mus = [torch.randn(n, generator=g) * 0.1 for n in sizes]
    nus = [torch.rand(n, generator=g) * 0.01 for n in sizes]
    return params, grads, mus, nus


@KERNEL
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=5),
    count=st.integers(1, 50),
    block=st.sampled_from([16, 128]),
    decay=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_multi_tensor_kernel_matches_reference(sizes, count, block, decay):
    wds = [0.1 if d else 0.0 for d in decay[: len(sizes)]]
    params, grads, mus, nus = _tensors(sizes, seed=len(sizes) + count)
    ref = [[t.clone() for t in group] for group in (params, grads, mus, nus)]
    c, lr = torch.tensor(count), torch.tensor(3e-3)
    K.adamw_reference(*ref, c, lr, 0.9, 0.95, 1e-8, wds)
    K.launch(params, grads, mus, nus, c, lr, 0.9, 0.95, 1e-8, wds, block=block)
    for got, want in zip((params, mus, nus), (ref[0], ref[2], ref[3])):
        for a, b in zip(got, want):
            assert rel(a, b) < 1e-6


def test_per_tensor_kernel_matches_multi_tensor():
    params, grads, mus, nus = _tensors([5, 123, 1000], seed=0)
    copies = [[t.clone() for t in group] for group in (params, grads, mus, nus)]
    args = (torch.tensor(3), torch.tensor(1e-3), 0.9, 0.999, 1e-8, [0.1, 0.0, 0.1])
    K.launch(params, grads, mus, nus, *args, block=64)
    K.launch_per_tensor(*copies, *args, block=64)
    for a, b in zip((*params, *mus, *nus), (*copies[0], *copies[2], *copies[3])):
        assert torch.equal(a, b)


def test_a_capture_warmup_launches_as_usual_and_sets_the_gradient_table_aside():
    """The warm-up before a CUDA-graph capture runs the multi-tensor launch (it builds the
    kernel the capture records) and sets aside, for the capture on the same state, the buffers
    that will carry the gradients' addresses (the capture itself is exercised in tests/gpu)."""
    params, grads, mus, nus = _tensors([5, 123, 77], seed=4)
    ref = [[t.clone() for t in group] for group in (params, grads, mus, nus)]
    args = (torch.tensor(2), torch.tensor(1e-2), 0.9, 0.95, 1e-8, [0.1, 0.0, 0.1])
    MT._FOR_CAPTURE.clear()
    with capture_warmup():
        K.launch(params, grads, mus, nus, *args, block=32)
    K.adamw_reference(*ref, *args)
    for got, want in zip((*params, *mus, *nus), (*ref[0], *ref[2], *ref[3])):
        assert rel(got, want) < 1e-6
    key = K._key(params, mus, nus, [0.1, 0.0, 0.1], 32)
    ((site, [captured]),) = MT._FOR_CAPTURE.items()
    assert site == ("adamw", key) and captured.held == (K._TABLES[key],)
    assert captured.fill(grads).tolist() == [g.data_ptr() for g in grads]
    MT._FOR_CAPTURE.clear()


def test_new_gradient_tensors_each_call_reuse_the_state_tables_and_stay_correct():
    """A step passes the same state storages every call but new gradient tensors (on a mesh,
    views of each bucket's reduced buffer): the cached tables must follow the gradients, and
    bf16 gradients (``Policy(reduce=torch.bfloat16)``) are read as they are."""
    params, _, mus, nus = _tensors([5, 300, 64], seed=5)
    ref = [[t.clone() for t in group] for group in (params, mus, nus)]
    K._TABLES.clear()
    for call in range(3):
        grads = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(call)) for p in params]
        grads = [g.to(torch.bfloat16) for g in grads] if call == 2 else grads
        c, lr = torch.tensor(call + 1), torch.tensor(1e-2)
        # the traced math reads the bf16 gradient cast back to float32 (exact), as the kernel does
        K.adamw_reference(ref[0], [g.float() for g in grads], ref[1], ref[2], c, lr, 0.9, 0.95, 1e-8, [0.1] * 3)
        K.launch(params, grads, mus, nus, c, lr, 0.9, 0.95, 1e-8, [0.1] * 3, block=64)
    assert len(K._TABLES) == 1  # one set of state tables; the gradient table follows the gradients
    for got, want in zip((*params, *mus, *nus), (*ref[0], *ref[1], *ref[2])):
        assert rel(got, want) < 1e-6


def test_every_element_is_written():
    """The update is in place, so poisoning outputs is not possible: with lr=1 every element
    of every param and moment must move, which a skipped block or a wrong offset would not."""
    params, grads, mus, nus = _tensors([5, 123, 77], seed=3)
    before = [t.clone() for t in (*params, *mus, *nus)]
    K.launch(params, grads, mus, nus, torch.tensor(1), torch.tensor(1.0), 0.9, 0.999, 1e-8, [0.0] * 3, block=32)
    for new, old in zip((*params, *mus, *nus), before):
        assert torch.isfinite(new).all() and (new != old).all()


def _step(fused, backend="aot_eager", **adamw):
    model = mlp()
    opt = fsg.optim.adamw(
        fsg.optim.warmup_cosine(1e-2, warmup=2, total=20),
        weight_decay=0.1,
        mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()},
        **adamw,
    )
    step = fsg.compile_step(mse_loss_fn(model), optimizer=opt, backend=backend, fused_optimizer=fused)
    return step, step.init(fsg.params(model))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_step_matches_traced_math(backend):
    fused_step, fused_state = _step(True, backend)
    plain_step, plain_state = _step(False)
    for i in range(5):
        batch = regression_batch(seed=i)
        fused_state, fm = fused_step(fused_state, batch)
        plain_state, pm = plain_step(plain_state, batch)
        assert rel(fm["loss"], pm["loss"]) < 1e-6
    for a, b in zip(fsg._src.tree.flatten(fused_state)[0], fsg._src.tree.flatten(plain_state)[0]):
        assert rel(a, b) < 1e-6


def test_lowered_step_shows_one_fused_node_and_no_traced_update():
    step, state = _step(True)
    lowered = step.lower(state, regression_batch())
    assert lowered.as_text().count("fsg.fused_adamw_") == 1
    plain, plain_state = _step(False)
    sqrts = {k: v for k, v in plain.lower(plain_state, regression_batch()).op_counts().items() if "sqrt" in k}
    # traced: one sqrt for the grad norm and one per param leaf; fused: the grad norm's only
    assert sum(sqrts.values()) == 1 + len(state.params)
    assert sum(v for k, v in lowered.op_counts().items() if "sqrt" in k) == 1


def test_fused_optimizer_true_explains_why_it_cannot():
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.lion(1e-3), fused_optimizer=True)
    with pytest.raises(fsg.UnsupportedError, match="not fsg.optim.adam or fsg.optim.adamw"):
        step(step.init(fsg.params(model)), regression_batch())
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-3), donate=False, fused_optimizer=True)
    with pytest.raises(fsg.UnsupportedError, match="donate=False"):
        step(step.init(fsg.params(model)), regression_batch())


@pytest.mark.parametrize(
    "w, precision, rule",
    [
        (torch.randn(4, 3).t(), None, r"state.params\['w'\] \(or its optimizer state\) is not contiguous"),
        (torch.randn(3, 4), fsg.Policy(torch.float64, torch.float64), r"state.params\['w'\] has dtype torch.float64"),
    ],
)
def test_fused_optimizer_true_names_the_leaf_it_cannot_take(w, precision, rule):
    step = fsg.compile_step(
        lambda p, b: (b["x"] @ p["w"]).sum(), optimizer=fsg.optim.adamw(1e-3), fused_optimizer=True,
        precision=precision, backend="aot_eager",
    )  # fmt: skip
    state = step.init({"w": w})
    x = torch.randn(2, w.shape[0], dtype=state.params["w"].dtype)
    with pytest.raises(fsg.UnsupportedError, match=rule):
        step(state, {"x": x})


def test_default_is_off_on_cpu():
    step, state = _step(None)
    assert fusion.why_not_fusable(step._optimizer, state, donate=True) is None
    assert "fused_adamw" not in step.lower(state, regression_batch()).as_text()


def test_a_failed_fusion_in_default_mode_traces_the_real_update(monkeypatch, caplog):
    """By default the step traces a stand-in for AdamW's math when the fused kernel will take
    over; if the fusion pass then refuses the graph, the log says why and the real math is
    traced again (the stand-in's graph alone would not train)."""

    def refuse(*args, **kwargs):
        raise fsg.UnsupportedError("fused AdamW: refused for this test")

    monkeypatch.setattr(fusion, "fuse_adamw", refuse)
    monkeypatch.setattr(
        fsg._src.runtime.build.Builder, "fusion_plan", lambda self, state: fusion.plan(self._optimizer, state, donate=True)
    )
    step, state = _step(None)
    plain, plain_state = _step(False)
    with caplog.at_level("WARNING", logger="fsg"):
        assert "fused_adamw" not in step.lower(state, regression_batch()).as_text()
    assert "the fused AdamW refused this step (fused AdamW: refused for this test)" in caplog.text
    for i in range(3):
        state, m = step(state, regression_batch(seed=i))
        plain_state, pm = plain(plain_state, regression_batch(seed=i))
    for a, b in zip(fsg._src.tree.flatten(state)[0], fsg._src.tree.flatten(plain_state)[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_adam_takes_the_fused_kernel_too(backend):
    """fsg.optim.adam is AdamW without decay (and without the decay's empty state)."""
    steps, states = {}, {}
    for fused in (True, False):
        model = mlp()
        opt = fsg.optim.adam(fsg.optim.warmup_cosine(1e-2, warmup=2, total=20), b2=0.95)
        steps[fused] = fsg.compile_step(mse_loss_fn(model), optimizer=opt, backend=backend, fused_optimizer=fused)
        states[fused] = steps[fused].init(fsg.params(model))
    assert steps[True].lower(states[True], regression_batch()).as_text().count("fsg.fused_adamw_") == 1
    for i in range(5):
        for fused in (True, False):
            states[fused], _ = steps[fused](states[fused], regression_batch(seed=i))
    for a, b in zip(fsg._src.tree.flatten(states[True])[0], fsg._src.tree.flatten(states[False])[0]):
        assert rel(a, b) < 1e-6


@pytest.mark.parametrize("options", [{"accum_steps": 2}, {"precision": fsg.Policy(compute=torch.bfloat16)}])
def test_fused_step_with_accumulation_or_mixed_precision_matches_traced_math(options):
    """The stand-in trace and the fusion pass see the same gradients whatever produced them."""
    states, steps = {}, {}
    for fused in (True, False):
        model = mlp()
        steps[fused] = fsg.compile_step(
            mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), backend="aot_eager",
            fused_optimizer=fused, **options,
        )  # fmt: skip
        states[fused] = steps[fused].init(fsg.params(model))
    if "precision" in options:  # the kernel reads the bf16 gradients, not float32 copies of them
        graph = steps[True].lower(states[True], regression_batch()).graph_module.graph
        (node,) = [n for n in graph.nodes if n.target is fusion.FUSED_ADAMW]
        assert {g.meta["val"].dtype for g in node.args[1]} == {torch.bfloat16}
    for i in range(3):
        for fused in (True, False):
            states[fused], _ = steps[fused](states[fused], regression_batch(seed=i))
    for a, b in zip(fsg._src.tree.flatten(states[True])[0], fsg._src.tree.flatten(states[False])[0]):
        assert rel(a, b) < 1e-6
