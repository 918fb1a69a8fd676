"""Tensor constants inside FlexAttention's ``mask_mod`` and ``score_mod`` (trace/subgraph_constants.py):
a captured tensor indexed with a Python int (``lengths[0]``: FlexAttention turns the index into a
tensor constant) or a scalar made in the function (``torch.tensor(100)``) evaluates as eager under
every backend, the mask built outside the step or inside it; a constant with elements made in the
function is refused by name under Inductor (torch fails on it there) and runs under ``aot_eager``.
CPU FlexAttention has no backward: evaluation steps here, training in tests/gpu/test_flex_attention_cuda.py."""

import pytest
import torch

import fsg
from fsg._src.trace import subgraph_constants

flex = pytest.importorskip("torch.nn.attention.flex_attention")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

T, H, D = 128, 4, 16
LENGTHS, SLOPES = torch.tensor([100, 90]), torch.linspace(0.1, 0.5, H)
MASKS = {
    "int_index": lambda b, h, q, kv: (q >= kv) & (kv < LENGTHS[0]),
    "negative_index": lambda b, h, q, kv: (q >= kv) & (kv < LENGTHS[-1]),
    "scalar_made": lambda b, h, q, kv: (q >= kv) & (kv < torch.tensor(77)),
    "tensor_index": lambda b, h, q, kv: (q >= kv) & (kv < LENGTHS[b]),
}
SCORES = {
    "none": None,
    "int_index": lambda s, b, h, q, kv: s - SLOPES[0] * (q - kv),
    "scalar_made": lambda s, b, h, q, kv: s * torch.tensor(0.5),
}


def _attention(mask_mod, score_mod, inside: bool):
    """``(fn, params, x)``: ``fn(params, x)`` attends with ``mask_mod`` (its block mask built in
    ``fn`` when ``inside``, else once here) and ``score_mod``."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * H * D)
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def mask():
        return flex.create_block_mask(mask_mod, 2, None, T, T, device="cpu")

    outside = None if inside else mask()

    def fn(params, x):
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=outside or mask()).float()

    return fn, params, torch.randn(2, T, 64, generator=torch.Generator().manual_seed(1))


def _evaluate(fn, params, x, backend):
    ev = fsg.compile_eval(fn, backend=backend)
    state = fsg.compile_step(fn, optimizer=fsg.optim.sgd(0.1)).init(params)
    return ev, state, ev(state, x)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside"])
@pytest.mark.parametrize("mask, score", [(m, "none") for m in MASKS] + [("tensor_index", s) for s in SCORES if s != "none"])
def test_scalar_constants_in_mask_and_score_functions_evaluate_as_eager(backend, inside, mask, score):
    fn, params, x = _attention(MASKS[mask], SCORES[score], inside)
    ev, state, got = _evaluate(fn, params, x, backend)
    torch.testing.assert_close(got, fn(params, x), rtol=1e-4, atol=1e-5)
    traced = ev.lower(state, x).stages["traced"]
    assert subgraph_constants.constants_left(traced) == []
    lifted = [n for _, sub in traced.named_modules() if sub is not traced for n in sub.graph.nodes if n.op == "get_attr"]
    assert lifted == []  # each scalar became an op that makes it


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(index=st.integers(-2, 1), bound=st.integers(1, T), scale=st.floats(0.25, 4.0))
def test_any_int_index_and_scalar_evaluates_as_eager_under_inductor(index, bound, scale):
    mask_mod = lambda b, h, q, kv: (q >= kv) & (kv < LENGTHS[index]) & (kv < torch.tensor(bound))  # noqa: E731
    score_mod = lambda s, b, h, q, kv: s * torch.tensor(scale) - SLOPES[index] * (q - kv)  # noqa: E731
    fn, params, x = _attention(mask_mod, score_mod, inside=False)
    torch.testing.assert_close(_evaluate(fn, params, x, "inductor")[2], fn(params, x), rtol=1e-4, atol=1e-5)


def test_a_constant_with_elements_made_in_the_mask_function_is_refused_under_inductor_only():
    fn, params, x = _attention(lambda b, h, q, kv: (q >= kv) & (kv < torch.tensor([100, 90])[b]), None, False)
    with pytest.raises(fsg.UnsupportedError) as err:
        _evaluate(fn, params, x, "inductor")
    message = str(err.value)
    assert "mask_mod" in message and "torch.int64, shape [2]" in message
    assert "Make the tensor outside the function" in message and "backend='aot_eager'" in message
    torch.testing.assert_close(_evaluate(fn, params, x, "aot_eager")[2], fn(params, x))
