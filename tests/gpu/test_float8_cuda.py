"""FP8 matmuls on CUDA (``Policy(matmul=fsg.Float8())``; skipped without a GPU): cuBLASLt's
``_scaled_mm`` under Inductor and CUDA-graph replay, against the same emulation and bf16
references as the CPU tests (tests/test_float8.py). On a GPU without FP8 tensor cores only
the refusal is tested."""

import math

import pytest
import torch

import fsg
from fsg._src.errors import UnsupportedError
from tests.test_float8 import (
    BF16,
    E4M3,
    E5M2,
    FP8,
    GPT,
    GPT_CFG,
    ROWWISE,
    _gpt_batches,
    _linear,
    emulated_mm,
    emulated_rowwise_mm,
    joint,
    leak_batches,
    nodes,
    rewrite,
    seen_loss,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
aten = torch.ops.aten


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores (compute capability 8.9+)")


def assert_fp8_cast(q, rows, inv):
    """``q`` is ``rows`` cast to e4m3 with the inverse scales ``inv``: every byte within one
    e4m3 step of ``rows / inv`` and nearly all bit for bit. The kernel multiplies by its own
    scale (``448 / amax``, Triton's float32 division) and ``inv`` is that scale's reciprocal,
    so ``rows / inv`` can land across a rounding boundary from ``rows * scale`` (measured on
    the H200: the scales match torch's to 1 ulp, 1.3e-7; 0.05-0.11% of the bytes differ, the
    most at 3 pieces of [4500, 2048])."""
    want = (rows / inv).clamp(-448, 448)
    assert q.dtype == E4M3 and q.shape == want.shape
    exact = q == want.to(E4M3)
    assert float(exact.float().mean()) > 0.998, f"{int((~exact).sum())} of {exact.numel()} bytes differ"
    assert bool(((q.float() - want).abs() <= want.abs() * 2**-3 + 2**-9).all())  # one step: 3 mantissa bits


def _gpt(policy, backend="inductor", fusions=None):
    torch.manual_seed(0)
    model = GPT(GPT_CFG).cuda()
    step = fsg.compile_step(
        lambda p, b: fsg.apply(model, p, b["x"], b["y"]),
        optimizer=fsg.optim.adamw(3e-3),
        precision=policy,
        backend=backend,
        fusions=fusions,
    )
    return step, step.init(fsg.params(model))


def _cuda(batches):
    return [{k: v.cuda() for k, v in b.items()} for b in batches]


def fused_and_unfused_losses(field: str, op: str, count: int, steps: int = 6) -> dict[bool, list[float]]:
    """The rowwise GPT step's losses under Inductor and graph replay with the float8 fusion
    ``field`` of ``Fusions`` on, then off; the lowered graph holds ``fsg::<op>`` ``count`` times
    with it, never without."""
    from fsg._src.passes.options import Fusions

    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
    batches = _cuda(_gpt_batches(steps))
    runs = {}
    for fuse in (True, False):
        step, state = _gpt(policy, fusions=Fusions(**{field: fuse}))
        assert step.lower(state, batches[0]).as_text().count(f"fsg.{op}.default(") == (count if fuse else 0)
        runs[fuse] = []
        for b in batches:
            state, m = step(state, b)
            runs[fuse].append(float(m["loss"]))
    return runs


@pytest.mark.skipif(_fp8_gpu() or not torch.cuda.is_available(), reason="this GPU has FP8 tensor cores")
def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused():
    step, state = _gpt(FP8, backend="aot_eager")
    with pytest.raises(UnsupportedError, match="needs FP8 tensor cores"):
        step(state, _cuda(_gpt_batches(1))[0])


@needs_fp8
def test_a_linear_layer_on_cuda_matches_the_emulation():
    x, w, c = (t.cuda() for t in (torch.randn(256, 512), torch.randn(768, 512), torch.randn(256, 768)))
    x, w, c = x.bfloat16(), w.bfloat16(), c.bfloat16()
    gm = joint(_linear, x, w, c, grad_of=(0, 1))
    assert rewrite(gm, {1: "w"}) == "3 of 3 matmuls in FP8"
    assert len(nodes(gm, aten._scaled_mm.default)) == 3
    _, y, gx, gw = gm(x, w, c)
    for got, want in (
        (y, emulated_mm(x, w.t(), E4M3, E4M3)),  # fast accumulation: a looser bound
        (gx, emulated_mm(c, w, E5M2, E4M3)),
        (gw, emulated_mm(c.t(), x, E5M2, E4M3)),
    ):
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


@needs_fp8
def test_a_rowwise_linear_layer_on_cuda_matches_the_emulation():
    """The rowwise rewrite through torch's rowwise kernel (a [M, 1] and a [1, N] scale) against
    the rowwise emulation; the grad-weight stays bf16."""
    x, w, c = (t.cuda().bfloat16() for t in (torch.randn(256, 512), torch.randn(768, 512), torch.randn(256, 768)))
    gm = joint(_linear, x, w, c, grad_of=(0, 1))
    assert rewrite(gm, {1: "w"}, ROWWISE) == "2 of 3 matmuls in FP8"
    _, y, gx, gw = gm(x, w, c)
    for got, want in ((y, emulated_rowwise_mm(x, w.t())), (gx, emulated_rowwise_mm(c, w))):
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(gw, c.t() @ x)


ALL_FAST = ("forward", "grad_input", "grad_weight")


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fast_accumulation_in_every_matmul_on_cuda_matches_the_emulation(recipe):
    """``Float8(fast_accum=...)`` naming all three matmuls: each ``_scaled_mm`` accumulates
    fast, within the forward's bound of the emulation (K = 512 here)."""
    x, w, c = (t.cuda().bfloat16() for t in (torch.randn(256, 512), torch.randn(768, 512), torch.randn(256, 768)))
    gm = joint(_linear, x, w, c, grad_of=(0, 1))
    config = fsg.Float8(recipe, keep_output_head=False, grad_weight="fp8", fast_accum=ALL_FAST)
    assert rewrite(gm, {1: "w"}, config) == "3 of 3 matmuls in FP8"
    assert all(n.kwargs["use_fast_accum"] for n in nodes(gm, aten._scaled_mm.default))
    _, y, gx, gw = gm(x, w, c)
    grad = E4M3 if recipe == "rowwise" else E5M2
    for got, a, b, dtype in ((y, x, w.t(), E4M3), (gx, c, w, grad), (gw, c.t(), x, grad)):
        want = emulated_rowwise_mm(a, b) if recipe == "rowwise" else emulated_mm(a, b, dtype, E4M3)
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


@needs_fp8
@pytest.mark.parametrize("config, fp8_mms", [
    (fsg.Float8(), 24),
    (fsg.Float8(recipe="rowwise"), 16),
    (fsg.Float8(recipe="rowwise", grad_weight="fp8", fast_accum=ALL_FAST), 24),
], ids=["tensorwise", "rowwise", "rowwise-gw-fastall"])  # fmt: skip
def test_gpt_fp8_step_under_inductor_tracks_bf16_and_learns(config, fp8_mms):
    batches = _cuda(_gpt_batches(20))
    losses = {}
    fp8_policy = fsg.Policy(compute=torch.bfloat16, matmul=config)
    for name, policy in (("bf16", BF16), ("fp8", fp8_policy)):
        step, state = _gpt(policy)
        losses[name] = []
        for b in batches:
            state, metrics = step(state, b)
            losses[name].append(float(metrics["loss"]))
        assert step.num_compiles == 1
    assert step.lower(state, batches[0]).op_counts()["aten._scaled_mm"] == fp8_mms
    fp8, ref = losses["fp8"], losses["bf16"]
    assert all(math.isfinite(v) for v in fp8) and fp8[-1] < 0.6 * fp8[0]
    assert max(abs(a - b) for a, b in zip(fp8, ref)) < 0.05, (fp8, ref)


@needs_fp8
@pytest.mark.parametrize("autocast", [False, True])
def test_gpt_fp8_step_with_autocast_or_casts_and_fp16(autocast):
    policy = fsg.Policy(compute=torch.bfloat16, autocast=autocast, matmul=fsg.Float8())
    for p in (policy, fsg.Policy(compute=torch.float16, matmul=fsg.Float8())):
        step, state = _gpt(p)
        for b in _cuda(_gpt_batches(5)):
            state, metrics = step(state, b)
        assert math.isfinite(float(metrics["loss"]))


@needs_fp8
def test_the_rowwise_step_under_inductor_stays_causal():
    """The CPU property (tests/test_float8.py) through Inductor, cuBLASLt's and the rowwise
    kernel's scale layouts: tokens the loss does not see leave it bit for bit unchanged. A scale
    read with the wrong layout (a row's scale applied to a column) would leak other tokens'
    amaxes into the output, and show here as a different loss."""
    a, b = leak_batches()
    rowwise = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
    for policy in (BF16, rowwise):
        assert torch.equal(seen_loss(policy, a, "cuda", "inductor"), seen_loss(policy, b, "cuda", "inductor"))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(16, 1024, 3072), (3, 100, 200), (2048, 8192)])
def test_fused_gelu_backward_fp8_kernel_matches_the_unfused_ops(shape, approximate):
    """The Triton kernel (kernels/fp8/cast.py) on bf16: ``g`` to aten's ``gelu_backward``
    within a bf16 step (its exp/erf may differ in the last bit), the FP8 copy bit for bit the
    cast of the kernel's own ``g`` with its own scales, the scales and column sums to the
    reference's."""
    from fsg._src.kernels.fp8 import cast as K

    g_ = torch.Generator(device="cuda").manual_seed(0)
    dy = (torch.randn(shape, generator=g_, device="cuda") * 1e-3).bfloat16()
    h = (torch.randn(shape, generator=g_, device="cuda") * 2).bfloat16()
    g, q, inv, colsum, colamax = K.gelu_backward_fp8(dy, h, approximate, True)
    g_ref, _, inv_ref, colsum_ref, _ = K.gelu_backward_fp8_reference(dy, h, approximate)
    # where gelu' crosses zero (h near -0.75) g is tiny and erf's last bit is a large relative
    # error (measured: 2.8% at |g| 1e-10, the H200): atol at bf16's resolution of the largest |g|
    torch.testing.assert_close(g, g_ref, rtol=2**-7, atol=2**-8 * float(g_ref.abs().max()) * 2**-8)
    g_MN = g.reshape(q.shape).float()
    assert_fp8_cast(q, g_MN, inv)
    torch.testing.assert_close(inv, g_MN.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(colsum, g_MN.sum(0), rtol=1e-4, atol=1e-4 * float(g_MN.abs().sum(0).max()))
    assert torch.equal(colamax, g_MN.abs().amax(0))  # the column maxima of the kernel's own g, exactly
    torch.testing.assert_close(inv, inv_ref, rtol=2**-7, atol=0)
    torch.testing.assert_close(colsum, colsum_ref, rtol=1e-2, atol=1e-2 * float(colsum_ref.abs().max()))


@needs_fp8
def test_rowwise_gpt_step_with_the_fused_kernel_equals_the_unfused_step():
    """Inductor + graph replay: the step with ``fsg::gelu_backward_fp8`` tracks the one whose
    casts the pass builds op by op (Inductor's kernels) to rounding."""
    from fsg._src.passes.options import Fusions

    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
    batches = _cuda(_gpt_batches(6))
    runs = {}
    for fuse in (True, False):
        # the concatenation this test fuses is there only when attention's backward does not write
        # the packed qkv gradient itself (tests/gpu/test_attention_grads_cuda.py covers that case)
        producers = Fusions().fp8_producers if fuse else frozenset()
        step, state = _gpt(policy, fusions=Fusions(pack_attention_grads=False, fp8_producers=producers))
        text = step.lower(state, batches[0]).as_text()
        for op in ("gelu_backward_fp8", "gelu_fp8", "cat_rowwise_fp8"):
            assert text.count(f"fsg.{op}.default(") == (2 if fuse else 0), op
        runs[fuse] = []
        for b in batches:
            state, m = step(state, b)
            runs[fuse].append(float(m["loss"]))
    assert max(abs(a - b) for a, b in zip(runs[True], runs[False])) < 0.02, runs


@pytest.mark.parametrize("shape", [(16, 1024, 1024), (3, 100, 200), (2048, 3072), (5000, 2048)])
def test_rowwise_fp8_kernel_matches_the_unfused_ops(shape):
    """``fsg::rowwise_fp8`` on bf16: the FP8 copy bit for bit torch's cast with the reference's
    scales, the scales and column sums to the reference's."""
    from fsg._src.kernels.fp8 import cast as K

    x = (torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda") * 3).bfloat16()
    q, inv, colsum, colamax = K.rowwise_fp8(x, True)
    q_ref, inv_ref, colsum_ref, colamax_ref = K.rowwise_fp8_reference(x, True)
    assert torch.equal(colamax, colamax_ref)
    torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
    assert_fp8_cast(q, x.reshape(q.shape).float(), inv)
    torch.testing.assert_close(colsum, colsum_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(16, 1024, 4096), (3, 100, 200), (2049, 8192)])
def test_fused_gelu_fp8_kernel_matches_the_unfused_ops(shape, approximate):
    """``fsg::gelu_fp8`` on bf16: the activation to aten's ``gelu`` (last-bit differences of
    erf/tanh), the FP8 copy bit for bit the cast of the kernel's own activation with its own
    scales, the scales to the reference's."""
    from fsg._src.kernels.fp8 import cast as K

    h = (torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda") * 2).bfloat16()
    a, q, inv, colamax = K.gelu_fp8(h, approximate, True)
    a_ref, _, inv_ref, _ = K.gelu_fp8_reference(h, approximate)
    assert torch.equal(colamax, a.reshape(q.shape).float().abs().amax(0))
    torch.testing.assert_close(a, a_ref, rtol=2**-7, atol=1e-6)
    a_MN = a.reshape(q.shape).float()
    assert_fp8_cast(q, a_MN, inv)
    torch.testing.assert_close(inv, inv_ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize("shape", [(16, 1024, 16, 64), (3, 100, 2, 40), (3, 1500, 16, 128)])
def test_fused_cat_kernel_reads_attention_gradients_in_place(shape, pieces):
    """``fsg::cat_rowwise_fp8`` on pieces laid out as attention's gradients come ([B, T, H, D]
    read as [B, T, C] rows) and on transposed pieces ([B, H, T, D], copied to rows first): the
    concatenation bit for bit, the FP8 copy the cast of it with the kernel's scales, scales
    and column sums to the reference's."""
    from fsg._src.kernels.fp8 import cast as K

    B, T, H, D = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    as_rows = [torch.randn(shape, generator=gen, device="cuda").bfloat16().view(B, T, H * D) for _ in range(pieces)]
    transposed = [
        torch.randn(B, H, T, D, generator=gen, device="cuda").bfloat16().transpose(1, 2) for _ in range(pieces)
    ]
    for xs in (as_rows, [x.reshape(B, T, H * D) for x in transposed]):
        g, q, inv, colsum, colamax = K.cat_rowwise_fp8(xs, True)
        g_ref, _, inv_ref, colsum_ref, colamax_ref = K.cat_rowwise_fp8_reference(xs, True)
        assert torch.equal(g, g_ref) and torch.equal(colamax, colamax_ref)
        assert_fp8_cast(q, g.reshape(q.shape).float(), inv)
        torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(colsum, colsum_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(16, 1024, 1024), (3, 100, 200), (2048, 2048), (5000, 768)])
def test_layer_norm_fp8_kernel_matches_the_unfused_ops(shape, affine):
    """``fsg::layer_norm_fp8`` on bf16: ``y`` to aten's layer norm within bf16's rounding (the
    sums' order differs), the statistics as aten returns them (float32, ``[..., 1]``) to
    float32 rounding, the FP8 copy the cast of the kernel's own ``y`` with its own scales."""
    from fsg._src.kernels.fp8 import layer_norm as L

    g_ = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=g_, device="cuda") * 2 + 0.5).bfloat16()
    N = shape[-1]
    w, b = ((torch.randn(N, generator=g_, device="cuda") * 0.5 + 1).bfloat16(),
            (torch.randn(N, generator=g_, device="cuda") * 0.1).bfloat16()) if affine else (None, None)  # fmt: skip
    y, mean, rstd, q, inv = L.layer_norm_fp8(x, w, b, 1e-5)
    y_ref, mean_ref, rstd_ref, _, inv_ref = L.layer_norm_fp8_reference(x, w, b, 1e-5)
    assert (mean.dtype, rstd.dtype, mean.shape) == (mean_ref.dtype, rstd_ref.dtype, mean_ref.shape)
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-4, atol=0)
    y_MN = y.reshape(q.shape).float()
    assert_fp8_cast(q, y_MN, inv)
    torch.testing.assert_close(inv, y_MN.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(inv, inv_ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("shape", [(16, 1024, 1024), (3, 100, 200)])
def test_add_layer_norm_fp8_writes_the_bf16_sum_and_normalizes_it(shape):
    """``fsg::add_layer_norm_fp8``: the sum bit for bit the bf16 add's, the rest as
    ``fsg::layer_norm_fp8`` of that sum."""
    from fsg._src.kernels.fp8 import layer_norm as L

    g_ = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(shape, generator=g_, device="cuda").bfloat16() for _ in range(2))
    w, b = torch.ones(shape[-1], device="cuda").bfloat16(), torch.zeros(shape[-1], device="cuda").bfloat16()
    s, y, mean, rstd, q, inv = L.add_layer_norm_fp8(x, r, w, b, 1e-5)
    assert torch.equal(s, x + r)
    y_ref, mean_ref, rstd_ref, q_ref, inv_ref = L.layer_norm_fp8(x + r, w, b, 1e-5)
    assert torch.equal(y, y_ref) and torch.equal(inv, inv_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_fp8
def test_rowwise_gpt_step_with_fused_layer_norms_equals_the_unfused_step():
    """Inductor + graph replay: the step whose layer norms cast their outputs in
    ``fsg::layer_norm_fp8`` (and ``fsg::add_layer_norm_fp8``, the residual add inside) tracks
    the one where Inductor fuses those casts itself."""
    from fsg._src.passes.options import Fusions

    policy = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
    batches = _cuda(_gpt_batches(6))
    runs = {}
    for fuse, adds in ((True, True), (True, False), (False, False)):
        step, state = _gpt(policy, fusions=Fusions(fp8_layer_norms=fuse, fp8_residual_adds=adds))
        text = step.lower(state, batches[0]).as_text()
        with_add = text.count("fsg.add_layer_norm_fp8.default(")
        assert with_add == (2 * GPT_CFG.n_layer - 1 if adds else 0)
        assert text.count("fsg.layer_norm_fp8.default(") + with_add == (2 * GPT_CFG.n_layer if fuse else 0)
        runs[(fuse, adds)] = []
        for b in batches:
            state, m = step(state, b)
            runs[(fuse, adds)].append(float(m["loss"]))
    for fused in ((True, True), (True, False)):
        assert max(abs(a - b) for a, b in zip(runs[fused], runs[(False, False)])) < 0.02, runs


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("producer", ["identity", "gelu_backward:tanh", "gelu:tanh", "cat", "layer_norm", "add_layer_norm"])
def test_a_pipelined_row_loop_writes_what_the_plain_loop_writes(producer, stages):
    """``RowTiling(stages=)`` (``tl.range(num_stages=)``: the next rows' loads in flight) changes
    no output bit of the cast and layer-norm kernels, at a shape whose programs walk several
    rows and end in a partial iteration."""
    from fsg._src.kernels._common import RowTiling
    from fsg._src.kernels.fp8 import cast as K
    from fsg._src.kernels.fp8 import layer_norm as LN

    M, C = 3001, 1024
    g_ = torch.Generator(device="cuda").manual_seed(stages)
    x, h, r = ((torch.randn(M, C, generator=g_, device="cuda") * 2).bfloat16() for _ in range(3))
    w, b = (torch.randn(C, generator=g_, device="cuda").bfloat16() for _ in range(2))

    def run(st):
        t = RowTiling(M, C, rows=1, iters=7, num_warps=8, stages=st)
        f32 = {"dtype": torch.float32, "device": "cuda"}
        N = 3 * C if producer == "cat" else C
        q, inv = torch.full((M, N), 7.0, **f32).to(E4M3), torch.full((M, 1), float("nan"), **f32)
        if producer.endswith("layer_norm"):
            y = torch.full_like(x, float("nan"))
            mean, rstd = torch.full((M,), float("nan"), **f32), torch.full((M,), float("nan"), **f32)
            s = torch.full_like(x, float("nan")) if producer == "add_layer_norm" else None
            LN.launch(x, w, b, y, mean, rstd, q, inv, 1e-5, t, r_MN=None if s is None else r, s_MN=s)
            return [q.view(torch.uint8), inv, y, mean, rstd] + ([] if s is None else [s])
        g = None if producer == "identity" else torch.full((M, N), float("nan"), device="cuda").bfloat16()
        part = None if producer.startswith("gelu:") else torch.full((t.programs, N), float("nan"), **f32)
        amax = torch.zeros((4, N), **f32)
        K.launch([x, h, r] if producer == "cat" else [x], h if producer.startswith("gelu_backward") else None, g, q,
                 inv, part, "identity" if producer == "cat" else producer, t, amax)  # fmt: skip
        return [q.view(torch.uint8), inv, amax] + [v for v in (g, part) if v is not None]

    for got, want in zip(run(stages), run(1), strict=True):
        assert not got.float().isnan().any()
        assert torch.equal(got, want)


@needs_fp8
def test_auto_filter_measured_on_the_gpu_equals_the_explicit_filter_it_chose(caplog):
    """``Float8(filter="auto")`` under Inductor: what it measured on this GPU picks the layers
    (logged), and the step equals, loss for loss, the one an explicit filter naming the same
    layers compiles (the choice only selects; tests/test_float8_cost.py checks the choosing)."""
    import logging
    import re

    batches = _cuda(_gpt_batches(3))
    auto = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise", filter="auto"))
    step, state = _gpt(auto)
    with caplog.at_level(logging.DEBUG, logger="fsg"):
        step.lower(state, batches[0])
    said = [r.getMessage() for r in caplog.records if "filter='auto') on" in r.getMessage()]
    assert len(said) == 1 and torch.cuda.get_device_name() in said[0], said
    stays = {m.group(1) for r in caplog.records if (m := re.search(r"float8: (\S+) stays: its FP8", r.getMessage()))}
    other, other_state = _gpt(fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise",
                                                                                    filter=lambda n: n not in stays)))  # fmt: skip
    for b in batches:
        state, metrics = step(state, b)
        other_state, other_metrics = other(other_state, b)
        assert torch.equal(metrics["loss"], other_metrics["loss"])
