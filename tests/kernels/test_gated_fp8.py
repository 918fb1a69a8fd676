"""The gated MLP's fused FP8 casts (``kernels/fp8/gated.py``: ``act(x) * h`` and the
activation's gradient with and without its product's factor, for a SiLU and both GELUs) under
Triton's CPU interpreter, against the eager references, which are the unfused graph's aten ops.

float32 inputs and a float32 buffer for the FP8 copy, as ``test_float8_cast.py`` explains (the
interpreter's bf16 and FP8 conversions are wrong); the bf16 kernels are checked on the GPU
(tests/gpu/test_gated_fp8_cuda.py).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fsg._src.kernels._common import RowTiling
from fsg._src.kernels.fp8 import gated as G
from fsg._src.kernels.fp8.cast_kernel import ACTIVATIONS, launch
from tests.kernels.common import KERNEL, needs_triton, rel

# (kernel producer, activation, takes the factor y): every gated producer the kernel has
PRODUCERS = [(f"gated:{a}", a, False) for a in ACTIVATIONS] + [("gated_backward:silu", "silu", False)] + [
    (f"gated_backward_mul:{a}", a, True) for a in ACTIVATIONS
]


def reference(producer, activation, x, h, y, column_amax=False):
    if producer.startswith("gated:"):
        return G.gated_fp8_reference(x, h, activation, True, column_amax)
    return G.gated_backward_fp8_reference(x, h, y, activation, True, column_amax)


@needs_triton
@KERNEL
@given(
    st.sampled_from(PRODUCERS), st.integers(1, 40), st.integers(1, 300), st.sampled_from([None, 1, 3]),
    st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_kernel_writes_every_output_and_matches_the_reference(producer, m, n, iters, rows, seed):
    """Each producer, over tilings that leave partly masked tiles: ``g``, its scaled rows, the
    inverse scales and the column sums equal the reference's; the column maxima are those of
    ``|g|`` as written, exactly; a row of zeros gets a finite scale and zeros."""
    producer, activation, with_y = producer
    g_ = torch.Generator().manual_seed(seed)
    # |h| <= 5: past -5 a GELU's derivative is float32's cancellation noise (test_float8_cast.py)
    x, h, y = torch.randn(m, n, generator=g_) * 3, (torch.randn(m, n, generator=g_) * 3).clamp(-5, 5), torch.randn(m, n)
    x[0] = 0.0
    h[0] = 0.0
    y = y if with_y else None
    t = RowTiling(m, n, rows=rows, iters=iters)
    g, q, inv = (torch.full(s, float("nan")) for s in ((m, n), (m, n), (m, 1)))
    part, amax_part = torch.full((t.programs, n), float("nan")), torch.zeros(1 + seed % 3, n)
    launch([x], h, g, q, inv, part, producer, t, amax_part, y_MC=y)
    g_ref, _, inv_ref, colsum_ref, _ = reference(producer, activation, x, h, y)
    assert not (g.isnan().any() or q.isnan().any() or inv.isnan().any())
    assert rel(g, g_ref) < 1e-5 and rel(inv, inv_ref) < 1e-5 and rel(part.sum(0), colsum_ref) < 1e-5
    assert rel(q, (g_ref / inv_ref).clamp(-448, 448)) < 1e-5 and not q[0].any()
    assert torch.equal(amax_part.amax(0), g.abs().amax(0))
    nonzero = g.abs().amax(1) > 0
    assert torch.allclose(q.abs().amax(1)[nonzero], torch.tensor(448.0), rtol=1e-6)


@needs_triton
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("column_sums, column_amax", [(False, False), (True, False), (False, True), (True, True)])
def test_the_ops_on_3d_inputs_launch_the_kernel(activation, column_sums, column_amax):
    """The registered ops flatten ``[B, T, N]`` to rows; column sums and maxima only when asked."""
    x, h, y = (torch.randn(3, 7, 48) * 3 for _ in range(3))
    cases = [(G.gated_fp8(x, h, activation, column_sums, column_amax), G.gated_fp8_reference(x, h, activation, True))]
    for factor in (y, None) if activation == "silu" else (y,):
        cases.append((
            G.gated_backward_fp8(x, h, factor, activation, column_sums, column_amax),
            G.gated_backward_fp8_reference(x, h, factor, activation, True),
        ))  # fmt: skip
    for (g, q, inv, colsum, colamax), ref in cases:
        assert g.shape == x.shape and q.shape == (21, 48) and q.dtype == torch.float8_e4m3fn and inv.shape == (21, 1)
        assert rel(g, ref[0]) < 1e-5 and rel(inv, ref[2]) < 1e-5
        assert colsum.shape == ((48,) if column_sums else (0,)) and colamax.shape == ((48,) if column_amax else (0,))
        if column_sums:
            assert rel(colsum, ref[3]) < 1e-5
        if column_amax:
            assert torch.equal(colamax, g.reshape(21, 48).abs().amax(0))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_references_are_the_gated_mlps_values_and_gradients(activation):
    """``gated`` is ``act(x) * h`` in the input dtype; ``act_backward(dy * y, h)`` is the
    gradient autograd gives the gate's output of ``act(gate) * y``; the casts are the
    unfused rowwise casts of the bf16 rows."""
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    gate, up, dy = (torch.randn(10, 64, dtype=torch.bfloat16) * 3 for _ in range(3))
    g, q, inv, colsum, colamax = G.gated_fp8_reference(gate, up, activation, True, True)
    assert g.dtype == torch.bfloat16 and torch.equal(g, act(gate) * up)
    scale = 448.0 / g.float().abs().amax(1, keepdim=True)
    assert torch.equal(q, (g.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert rel(inv, 1 / scale) < 1e-6 and rel(colsum, g.float().sum(0)) < 1e-6
    assert torch.equal(colamax, g.float().abs().amax(0))
    gate_ = gate.float().requires_grad_()
    (act(gate_) * up.float() * dy.float()).sum().backward()
    d_gate = G.gated_backward_fp8_reference(dy, gate, up, activation)[0]
    assert d_gate.dtype == torch.bfloat16 and rel(d_gate.float(), gate_.grad) < 1e-2
    assert torch.equal(G.activation_backward_reference(dy * up, gate, activation), d_gate)  # the product rounded first
    assert G.gated_fp8_reference(gate, up, activation)[3].shape == (0,)  # no column sums unless asked


def test_bad_activations_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="activation 'relu'"):
        G.gated_fp8(x, x, "relu")
    with pytest.raises(ValueError, match="SiLU only"):
        G.gated_backward_fp8(x, x, None, "gelu")


@pytest.mark.parametrize("column_sums", [False, True])
@pytest.mark.parametrize("column_amax", [False, True])
def test_fake_shapes_match_the_real_ops(column_sums, column_amax):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 5, 32)
    real = [G.gated_fp8(x, x, "silu", column_sums, column_amax), G.gated_backward_fp8(x, x, x, "gelu", column_sums, column_amax)]
    with FakeTensorMode() as mode:
        f = mode.from_tensor(x)
        fake = [G.gated_fp8(f, f, "silu", column_sums, column_amax), G.gated_backward_fp8(f, f, f, "gelu", column_sums, column_amax)]
    for r, fk in zip(real, fake):
        assert [(t.shape, t.dtype) for t in fk] == [(t.shape, t.dtype) for t in r]


@needs_triton
def test_the_halves_of_a_fused_gate_and_up_projection_are_read_in_place():
    """``silu(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)`` (Phi-3's MLP): the op reads
    both halves through their shared row stride, without copies, and writes the reference's
    values; inputs of different strides are copied to rows first, with the same result."""
    gate_up = torch.randn(3, 7, 96) * 3
    gate, up = gate_up.chunk(2, -1)
    views = G._rows(gate, up)
    assert [v.data_ptr() for v in views] == [gate.data_ptr(), up.data_ptr()] and views[0].stride() == (96, 1)
    ref = G.gated_fp8_reference(gate, up, "silu", True, True)
    for h in (up, up.contiguous()):  # shared strides; different strides (copied)
        g, q, inv, colsum, colamax = G.gated_fp8(gate, h, "silu", True, True)
        assert g.shape == (3, 7, 48) and g.is_contiguous() and rel(g, ref[0]) < 1e-5 and rel(inv, ref[2]) < 1e-5
        assert rel(colsum, ref[3]) < 1e-5 and torch.equal(colamax, g.reshape(21, 48).abs().amax(0))
