"""trace/block_masks.py: a FlexAttention block mask the step builds from constants alone is
computed once, when the step is traced, and read as a constant (one for every sequence where each sequence's is the same);
one that depends on the batch stays in the step. Steps and evaluations equal eager PyTorch."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from tests.dist.flex_workers import flex_op
from tests.test_flex_attention import flex_llama

flex = pytest.importorskip("torch.nn.attention.flex_attention")
T, H, D = 256, 4, 16


def _masks(gm):
    """Each FlexAttention call's block-mask tensors: ``(op of each, shape of the first)``."""
    from fsg._src.trace import block_masks

    return [([t.op for t in ts], tuple(ts[0].meta["val"].shape)) for _, _, ts in block_masks.block_mask_args(gm)]


def _step_and_graph(mask_of, backend="aot_eager"):
    """One SGD step of a FlexAttention block whose mask ``mask_of(x)`` builds inside the loss;
    the optimized graph, and the update against eager autograd's gradients."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * H * D)

    def loss_fn(params, x):
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex_op(q, k, v, None, mask_of(x)).square().mean()

    init = {k: v.detach() for k, v in lin.named_parameters()}
    x = torch.randn(2, T, 64)
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0), backend=backend)
    state = step.init(init)
    graph = step.lower(state, x).graph_module
    before = {k: v.clone() for k, v in state.params.items()}
    state, _ = step(state, x)
    params = {k: v.clone().requires_grad_() for k, v in init.items()}
    loss_fn(params, x).backward()
    for k, p in params.items():
        torch.testing.assert_close(before[k] - state.params[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
    return graph


def test_a_mask_built_in_the_step_for_each_sequence_alike_is_one_constant():
    graph = _step_and_graph(lambda x: flex.create_block_mask(lambda b, h, q, kv: q >= kv, 2, None, T, T, device="cpu"))
    masks = _masks(graph)
    assert len(masks) == 2  # the forward and the backward
    assert all(set(ops) == {"get_attr"} and shape[0] == 1 for ops, shape in masks)


def test_a_constant_mask_that_differs_by_sequence_keeps_its_batch_dim():
    lengths = torch.tensor([T, 100])  # the second's first key block is partial, the first's full
    graph = _step_and_graph(lambda x: flex.create_block_mask(
        lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, T, T, device="cpu"))  # fmt: skip
    assert all(set(ops) == {"get_attr"} and shape[0] == 2 for ops, shape in _masks(graph))


def test_a_mask_that_depends_on_the_batch_stays_in_the_step():
    """Evaluated (CPU FlexAttention has no backward outside the operator, whose direct call
    cannot capture a traced tensor in a mask function)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * H * D)

    def loss_fn(params, x):
        lengths = (x[:, :, 0] > 0).sum(1) + 8  # a mask from the batch's values
        mask = flex.create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, T, T, device="cpu")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex.flex_attention(q, k, v, block_mask=mask).square().mean()

    params = {k: v.detach() for k, v in lin.named_parameters()}
    x = torch.randn(2, T, 64)
    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(params)
    evaluation = fsg.compile_eval(loss_fn, backend="aot_eager")
    assert all("call_function" in ops for ops, _ in _masks(evaluation.lower(state, x).graph_module))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = loss_fn(params, x)
    torch.testing.assert_close(evaluation(state, x), want, rtol=1e-5, atol=1e-6)


def test_a_hugging_face_evaluation_reads_its_causal_mask_as_one_constant():
    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (2, 32))

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids).loss

    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(fsg.params(model))
    evaluation = fsg.compile_eval(loss_fn)
    lowered = evaluation.lower(state, ids)
    assert "argsort" not in lowered.as_text("traced")  # the mask's work is gone from the step
    assert all(set(ops) == {"get_attr"} and shape[0] == 1 for ops, shape in _masks(lowered.graph_module))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            want = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(evaluation(state, ids), want, rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["causal", "window", "documents", "lengths"]),
    batch=st.integers(1, 3),
    blocks=st.integers(1, 3),
    size=st.integers(1, 200),
)
def test_any_constant_mask_built_in_the_step_evaluates_as_eager(kind, batch, blocks, size):
    """Over mask functions (causal, a sliding window, packed documents, per-sequence lengths),
    batch sizes and lengths: the evaluation with the mask built in the loss (folded, read as
    a constant) equals eager PyTorch's, and the step keeps none of the mask's work."""
    n = 128 * blocks
    lengths = torch.tensor([max(1, (size * (i + 1)) % n) for i in range(batch)])
    document = torch.arange(n) // max(1, size)

    def keep(b, h, q, kv):
        if kind == "window":
            return (q >= kv) & (q - kv < size)
        if kind == "documents":
            return (q >= kv) & (document[q] == document[kv])
        if kind == "lengths":
            return (q >= kv) | (kv < lengths[b])
        return q >= kv

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 3 * 2 * 8)

    def loss_fn(params, x):
        mask = flex.create_block_mask(keep, batch, None, n, n, device="cpu")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(batch, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return flex.flex_attention(q, k, v, block_mask=mask).square().mean()

    params = {k: v.detach() for k, v in lin.named_parameters()}
    x = torch.randn(batch, n, 16)
    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(params)
    evaluation = fsg.compile_eval(loss_fn, backend="aot_eager")
    assert all(set(ops) == {"get_attr"} for ops, _ in _masks(evaluation.lower(state, x).graph_module))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = loss_fn(params, x)
    torch.testing.assert_close(evaluation(state, x), want, rtol=1e-5, atol=1e-6)
