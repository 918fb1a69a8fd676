"""The global norm's sum of squares over many tensors in one launch per dtype, against the
traced definition (CPU: TRITON_INTERPRET=1), and where a step uses it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.kernels import _multi_tensor as MT
from fsg._src.kernels import sum_squares as S
from fsg._src.kernels._common import capture_warmup, plain_math
from tests.helpers import mlp, mse_loss_fn, regression_batch
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tensors(shapes, dtypes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 3).to(d) for s, d in zip(shapes, dtypes)]


@KERNEL
@given(
    shapes=st.lists(
        st.one_of(st.integers(0, 700), st.tuples(st.integers(1, 9), st.integers(1, 90))), min_size=1, max_size=6
    ),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=6, max_size=6),
    block=st.sampled_from([16, 128]),
    seed=st.integers(0, 99),
)
def test_sum_squares_matches_the_traced_definition(shapes, dtypes, block, seed):
    """Any sizes (empty tensors, sizes not a multiple of the block), any mix of dtypes: the
    op (one launch per dtype), and one launch at a drawn block size."""
    tensors = _tensors(shapes, dtypes, seed)
    got, want = S.sum_squares(tensors), S.sum_squares_reference(tensors)
    assert got.dtype == torch.float32 and got.shape == ()
    assert rel(got, want) < 1e-6
    same = [t.to(dtypes[0]) for t in tensors if t.numel()]
    if same:
        assert rel(S.launch(same, block=block), S.sum_squares_reference(same)) < 1e-6


def test_non_contiguous_tensors_are_read_as_their_values():
    tensors = [torch.randn(30, 20).t(), torch.randn(5, 8, 3)[:, ::2]]
    assert rel(S.sum_squares(tensors), S.sum_squares_reference(tensors)) < 1e-6


def test_the_gradient_norm_of_a_step_is_one_op_and_a_mesh_traces_plain_math():
    """The ``grad_norm`` metric takes the op where fused ops run; inside ``plain_math()`` (a
    step on a mesh: DTensor shards torch ops) the traced reduction; the value is the same as
    ``fsg.optim.global_norm``'s (which clipping uses)."""
    grads = [torch.randn(40, 3), torch.randn(3).to(torch.bfloat16)]
    fused = S.global_norm(grads)
    with plain_math():
        plain = S.global_norm(grads)
    assert rel(fused, plain) < 1e-6 and rel(fused, fsg.optim.global_norm(grads)) < 1e-6
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
    state = step.init(fsg.params(model))
    assert step.lower(state, regression_batch()).as_text().count("fsg.sum_squares") == 1
    with plain_math():
        assert "fsg.sum_squares" not in step.lower(state, regression_batch()).as_text()


def test_a_capture_warmup_sets_the_table_aside_per_call():
    """Two norms of the same sizes in one step (clipping, then the metric) each get their own
    set-aside table, taken in call order by the capture."""
    tensors = _tensors([100, 7], [torch.float32] * 2, seed=0)
    MT._FOR_CAPTURE.clear()
    with capture_warmup():
        first, second = S.sum_squares(tensors), S.sum_squares([t * 2 for t in tensors])
    assert rel(second, 4 * first) < 1e-6
    ((site, waiting),) = MT._FOR_CAPTURE.items()
    assert site[0] == "sum_squares" and len(waiting) == 2
    MT._FOR_CAPTURE.clear()


@pytest.mark.parametrize("clip", [False, True])
def test_a_step_with_the_op_matches_the_traced_reduction(clip):
    """The grad-norm metric and clipping by it, through a compiled step."""
    results = []
    for fused in (True, False):
        model = mlp()
        opt = fsg.optim.adamw(1e-2)
        opt = fsg.optim.chain(fsg.optim.clip_by_global_norm(0.05), opt) if clip else opt
        step = fsg.compile_step(mse_loss_fn(model), optimizer=opt, backend="aot_eager")
        state = step.init(fsg.params(model))
        with plain_math() if not fused else torch.no_grad():
            for i in range(3):
                state, metrics = step(state, regression_batch(seed=i))
        results.append((state, metrics))
    (a, ma), (b, mb) = results
    assert rel(ma["grad_norm"], mb["grad_norm"]) < 1e-6
    for x, y in zip(fsg._src.tree.flatten(a)[0], fsg._src.tree.flatten(b)[0]):
        assert rel(x, y) < 1e-5


@pytest.mark.parametrize("fused_optimizer", [True, False])
def test_under_bf16_compute_the_norm_reads_the_bf16_gradients(fused_optimizer):
    """The gradients of parameters read in bf16 are float32 casts of bf16 tensors: the op reads
    the bf16 tensors (no float32 copy written per parameter), and the metric is unchanged."""
    metrics = {}
    for fused in (True, False):
        model = mlp()
        step = fsg.compile_step(
            mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend="aot_eager",
            precision=fsg.Policy(compute=torch.bfloat16), fused_optimizer=fused_optimizer,
        )  # fmt: skip
        state = step.init(fsg.params(model))
        with plain_math() if not fused else torch.no_grad():
            if fused:
                graph = step.lower(state, regression_batch()).graph_module.graph
                (node,) = [n for n in graph.nodes if n.target is torch.ops.fsg.sum_squares.default]
                assert {x.meta["val"].dtype for x in node.args[0]} == {torch.bfloat16}
            _, metrics[fused] = step(state, regression_batch())
    assert rel(metrics[True]["grad_norm"], metrics[False]["grad_norm"]) < 1e-6
