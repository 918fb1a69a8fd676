"""passes/batch_casts.py and kernels/cast_flat.py: the parameters' casts to the compute dtype
as views of one multi-tensor cast, bit for bit (CPU: the op's copy_ casts, and its Triton
kernel under TRITON_INTERPRET=1)."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fsg
from fsg._src.kernels import cast_flat as K
from fsg._src.kernels._common import cpu_interpreter
from fsg._src.passes import batch_casts as P
from fsg._src.passes import pipeline
from fsg._src.passes.options import Fusions
from tests.helpers import tiny_gpt_run
from tests.kernels.common import KERNEL, needs_triton

BF16, F16 = torch.bfloat16, torch.float16
_SHAPES = st.lists(
    st.one_of(st.tuples(st.integers(0, 300)), st.tuples(st.integers(1, 9), st.integers(1, 70))), min_size=1, max_size=5
)


ON_CPU = Fusions(on_cpu={"batch_casts"})


def _tensors(shapes, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 100).to(dtype) for s in shapes]


def _pieces(flat, tensors):
    starts, total = K.flat_offsets([t.numel() for t in tensors])
    assert flat.shape == (total,) and all(s % K.ALIGN == 0 for s in starts)
    return [flat[s : s + t.numel()].view(t.shape) for s, t in zip(starts, tensors)]


@given(shapes=_SHAPES, dtype=st.sampled_from([BF16, F16]), seed=st.integers(0, 99))
def test_cast_flat_holds_each_tensor_cast(shapes, dtype, seed):
    """Any sizes (empty ones too): each view of the flat buffer is ``t.to(dtype)``, bit for bit."""
    tensors = _tensors(shapes, seed)
    for piece, t in zip(_pieces(K.cast_flat(tensors, dtype), tensors), tensors):
        assert piece.dtype == dtype and torch.equal(piece, t.to(dtype))


@needs_triton
@KERNEL
@given(shapes=_SHAPES, dtype=st.sampled_from([BF16, F16]), seed=st.integers(0, 99))
def test_the_kernel_casts_each_tensor_into_its_place(shapes, dtype, seed):
    """The multi-tensor launch (Triton's interpreter on CPU), blocks never spanning two
    tensors: each element lands in its place, cast. Triton's CPU interpreter truncates where
    the GPU rounds to nearest even, so here each value is within one step of the 16-bit grid
    of its source; tests/gpu/test_batch_casts_cuda.py checks the bits against ``.to()``."""
    tensors = _tensors(shapes, seed)
    with cpu_interpreter():
        flat = K.cast_flat(tensors, dtype)
    step = 2.0**-7 if dtype == BF16 else 2.0**-10  # the grid's relative spacing
    for piece, t in zip(_pieces(flat, tensors), tensors):
        assert piece.dtype == dtype
        torch.testing.assert_close(piece.float(), t, rtol=step, atol=1e-6)


@needs_triton
def test_a_table_is_reused_only_for_the_same_tensors():
    """The launch's address table is cached by the sources; a transposed view of the same
    storage (same address and size, not contiguous) or another target dtype takes its own path."""
    a, b = torch.randn(6, 4), torch.randn(5)
    with cpu_interpreter():
        first = K.cast_flat([a, b], BF16)
        for tensors, dtype in (([a, b], BF16), ([a.t(), b], BF16), ([a, b], F16)):
            for piece, t in zip(_pieces(K.cast_flat(tensors, dtype), tensors), tensors):
                torch.testing.assert_close(piece.float(), t, rtol=2**-7, atol=1e-6)
        again = K.cast_flat([a, b], BF16)  # the cached table: the same bits
    assert all(torch.equal(x, y) for x, y in zip(_pieces(again, [a, b]), _pieces(first, [a, b])))


def test_what_the_kernel_does_not_take_is_cast_all_the_same():
    """A non-contiguous tensor, a float64 source, mixed dtypes: the op's copy_ casts; no
    tensor at all: a clear error."""
    with pytest.raises(ValueError, match="at least one tensor"):
        K.cast_flat([], BF16)
    tensors = [torch.randn(6, 4).t(), torch.randn(5), torch.randn(3, dtype=torch.float16)]
    with cpu_interpreter():
        for piece, t in zip(_pieces(K.cast_flat(tensors, BF16), tensors), tensors):
            assert torch.equal(piece, t.to(BF16))
        doubles = [torch.randn(3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
        for piece, t in zip(_pieces(K.cast_flat(doubles, BF16), doubles), doubles):
            assert torch.equal(piece, t.to(BF16))


def _graph(fn, *inputs):
    return make_fx(fn)(*inputs)


def test_casts_of_inputs_become_views_of_one_launch_and_others_stay():
    """Casts of inputs (directly, through detach, or through a view to the input's own shape,
    as stage 2 hands a rank its local tensor) to bf16 join one group; a cast of a computed
    value, of a view to another shape, a cast with a memory format, and a lone fp16 cast stay
    as they were."""

    def fn(a, b, c, d):
        return (
            a.detach().to(BF16).sum() + b.to(BF16).sum() + (c * 2).to(BF16).sum() + d.view(2, 2).detach().to(BF16).sum()
            + d.view(4).to(BF16).sum() + d.to(BF16, memory_format=torch.contiguous_format).sum() + c.to(F16).sum()
        )  # fmt: skip

    inputs = [torch.randn(3, 4), torch.randn(5), torch.randn(7), torch.randn(2, 2)]
    gm = _graph(fn, *inputs)
    want = gm(*inputs)
    assert P.batch_casts(gm, ON_CPU) == 3
    text = gm.code
    assert text.count("fsg.cast_flat.default(") == 1 and text.count("_to_copy.default(") == 4
    assert torch.equal(gm(*inputs), want)


def test_an_input_cast_twice_is_cast_once():
    """(Gradient accumulation casts each parameter once per micro-batch.) Both casts read one
    view; the buffer holds each input once."""

    def fn(a, b):
        return a.to(BF16).sum() + b.to(BF16).sum() + (a.to(BF16) * 2).sum()

    inputs = [torch.randn(3, 4), torch.randn(5)]
    gm = _graph(fn, *inputs)
    want = gm(*inputs)
    assert P.batch_casts(gm, ON_CPU) == 3
    [flat] = [n for n in gm.graph.nodes if n.target is P.CAST_FLAT]
    assert flat.args[0] == [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*inputs), want)


def test_cpu_graphs_unless_named_in_on_cpu_and_single_casts_are_left_alone():
    gm = _graph(lambda a, b: a.to(BF16).sum() + b.to(BF16).sum(), torch.randn(3), torch.randn(4))
    assert P.batch_casts(gm) == 0
    lone = _graph(lambda a: a.to(BF16).sum(), torch.randn(3))
    assert P.batch_casts(lone, ON_CPU) == 0


def test_the_pipeline_runs_it_last_of_the_rewrites_also_on_a_mesh():
    """On a mesh each rank's graph (tests/dist/test_precision.py), before the gathers are packed."""
    by_name = {p.name: p for p in pipeline.PASSES}
    assert by_name["batch_casts"].applies(pipeline.Options())
    assert by_name["batch_casts"].applies(pipeline.Options(on_mesh=True))
    names = [p.name for p in pipeline.order(list(pipeline.PASSES))]
    assert all(names.index(a) < names.index("batch_casts") for a in ("float8", "gemm_epilogues", "fuse_adamw"))
    assert names.index("batch_casts") < names.index("bucket_parameter_gathers")


def _gpt_run(forced: bool, backend: str, accum_steps=1, policy=None):
    cpu_passes = {"batch_casts"} if forced else frozenset()
    return tiny_gpt_run(cpu_passes, policy=policy, backend=backend, accum_steps=accum_steps)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_gpt_step_with_one_cast_launch(backend):
    """examples/gpt.py's GPT under bf16: every parameter cast comes from one ``cast_flat``.
    Run op by op (aot_eager), three steps end with the plain step's loss and parameters bit
    for bit. Inductor on CPU does not round a cast it fuses into its reader the way the
    graph says (its C++ kernels keep some in float32), so there the steps agree closely."""
    text, loss, params = _gpt_run(True, backend)
    text_plain, loss_plain, params_plain = _gpt_run(False, backend)
    assert text.count("fsg.cast_flat.default(") == 1 and "fsg.cast_flat" not in text_plain
    if backend == "aot_eager":
        assert loss == loss_plain and all(torch.equal(params[k], params_plain[k]) for k in params)
    else:
        assert abs(loss - loss_plain) < 1e-2  # (a gradient near 0 that flips sign moves a
        # parameter by 2 lr in Adam: 3 steps at lr 1e-3 bound the difference by 6e-3)
        assert all(torch.allclose(params[k], params_plain[k], atol=6e-3 + 1e-5) for k in params)


def test_an_accumulated_step_casts_each_parameter_once():
    """``accum_steps=2`` (the micro-batches' casts of one parameter share its view): the
    step equals the plain accumulated step bit for bit (op by op), and the buffer holds each
    parameter once."""
    text, loss, params = _gpt_run(True, "aot_eager", accum_steps=2)
    _, loss_plain, params_plain = _gpt_run(False, "aot_eager", accum_steps=2)
    assert text.count("fsg.cast_flat.default(") == 1
    assert loss == loss_plain and all(torch.equal(params[k], params_plain[k]) for k in params)


def test_a_cast_an_fp8_matmul_reads_stays_a_cast():
    """The bias of ``_scaled_mm`` (FP8 linear layers) stays its own cast: Inductor 2.11's
    ``_scaled_mm`` lowering fails its size check on a slice of the flat buffer there (seen in
    tests/gpu/test_float8_cuda.py); the other casts are still batched."""
    f8 = torch.float8_e4m3fn

    def fn(x, w, bias, a, b):
        one = torch.ones((), dtype=torch.float32)
        y = torch._scaled_mm(x.to(f8), w.to(f8).t(), one, one, bias=bias.to(BF16), out_dtype=BF16)
        return y.sum() + a.to(BF16).sum() + b.to(BF16).sum()

    inputs = [torch.randn(16, 32), torch.randn(16, 32), torch.randn(16), torch.randn(5), torch.randn(3, 4)]
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    assert P.batch_casts(gm, ON_CPU) == 2
    [flat] = [n for n in gm.graph.nodes if n.target is P.CAST_FLAT]
    assert [n.name for n in flat.args[0]] == ["a_1", "b_1"]
    [mm] = [n for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert mm.args[4].target is torch.ops.aten._to_copy.default  # the bias


def test_a_cast_an_all_gather_reads_stays_a_cast():
    """FSDP's shard, cast before its gather, stays a cast of its own: the gathers' bucketing
    packs its bucket from the casts (tests/dist/test_precision.py: an FSDP step keeps its
    one packed gather); the other casts are still batched."""
    from fsg._src import _torch_private

    def fn(a, b, c):
        gathered = _torch_private.WAIT_TENSOR(_torch_private.ALL_GATHER(a.to(BF16), 2, "group0"))
        return gathered.sum() + b.to(BF16).sum() + c.to(BF16).sum()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 8), torch.randn(5), torch.randn(3, 4))
    assert P.batch_casts(gm, ON_CPU) == 2
    [flat] = [n for n in gm.graph.nodes if n.target is P.CAST_FLAT]
    assert [n.name for n in flat.args[0]] == ["b_1", "c_1"]
    [gather] = [n for n in gm.graph.nodes if n.target is _torch_private.ALL_GATHER]
    assert gather.args[0].target is torch.ops.aten._to_copy.default


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_gpt_step_keeps_its_matmul_biases_as_casts(recipe):
    """GPT under ``Float8`` through the whole pipeline: the parameters the FP8 matmuls read as
    bias keep a cast each, the rest come from one ``cast_flat``, and the step trains as the one
    without the pass (op by op, bit for bit)."""
    policy = fsg.Policy(compute=BF16, matmul=fsg.Float8(recipe=recipe))
    text, loss, params = _gpt_run(True, "aot_eager", policy=policy)
    _, loss_plain, params_plain = _gpt_run(False, "aot_eager", policy=policy)
    assert text.count("fsg.cast_flat.default(") == 1
    biases = re.findall(r"_scaled_mm\.default\(.*?bias = (\w+)", text)
    assert any(b != "None" for b in biases)
    assert all(b == "None" or b.startswith("_to_copy") for b in biases), biases
    assert loss == loss_plain and all(torch.equal(params[k], params_plain[k]) for k in params)
