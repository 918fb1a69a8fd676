"""The float8 pass on a gated (SwiGLU) MLP, ``down(silu(gate(x)) * up(x))``: under rowwise
scaling the three tensors its FP8 matmuls read in rows (the product, the up-projection's
output gradient, the gate's) are each cast in the op that computes them
(``kernels/silu_fp8.py``), and the step equals the unfused one."""

import pytest
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.test_float8 import _fused_and_unfused, _states_close

MUL_FP8, BACKWARD_FP8 = "fsg.silu_mul_fp8.default(", "fsg.silu_backward_fp8.default("


class _GatedMLP(nn.Module):
    """``variant``: ``"plain"``; ``"swapped"`` (``up * silu(gate)``); ``"silu_read"`` (the SiLU
    read again: it stays in the graph for that reader); ``"product_read"`` (the product
    ``silu(gate) * up`` read again: its gradient is a sum, which both gradients below it
    read); ``"up_read"`` (the up-projection's output read again: its gradient is a sum, not a
    product through a SiLU, so its cast is not fused and the SiLU stays for it); ``"chunked"``
    (Phi-3: gate and up the halves of one projection, read in place; their gradients meet in
    a concatenation, which ``cat_rowwise_fp8`` casts, so only the product is a SiLU op's)."""

    def __init__(self, width, hidden, bias, variant):
        super().__init__()
        if variant == "chunked":
            self.gate_up = nn.Linear(width, 2 * hidden, bias=bias)
        else:
            self.gate, self.up = nn.Linear(width, hidden, bias=bias), nn.Linear(width, hidden, bias=bias)
        self.down, self.variant = nn.Linear(hidden, width, bias=bias), variant

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1) if self.variant == "chunked" else (self.gate(x), self.up(x))
        act = F.silu(gate)
        h = up * act if self.variant == "swapped" else act * up
        y = self.down(h)
        extra = {"silu_read": act, "product_read": h, "up_read": up}.get(self.variant)
        return y if extra is None else y + 0.1 * extra[..., : y.shape[-1]]


VARIANTS = ["plain", "swapped", "silu_read", "product_read", "up_read", "chunked"]
# (silu_mul_fp8, silu_backward_fp8, bias gradients' sums fused) per variant, with biases
FUSED = {"up_read": (1, 1, 1), "chunked": (1, 0, 1)}


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=3, deadline=None)
@example(False, (32,), (16, 64))  # Llama's MLP: no biases, a 2-D batch
@given(st.booleans(), st.sampled_from([(32,), (2, 16)]), st.sampled_from([(16, 64), (32, 32)]))
def test_fused_gated_mlp_step_equals_the_unfused_step(variant, bias, lead, dims):
    """Over MLP shapes, with and without biases, 2-D or 3-D activations and each variant's
    extra reader: the product and the up-projection's gradient (where it is one) become ``silu_mul_fp8``, the
    gate's gradient ``silu_backward_fp8`` (its product's factor fused where nothing else
    reads the product); no aten SiLU op is left that only they read; the loss is the unfused
    step's bit for bit and the parameters equal it to rounding."""
    width, hidden = dims
    (loss, state, text), (plain_loss, plain_state, plain_text) = _fused_and_unfused(
        lambda: _GatedMLP(width, hidden, bias, variant), width, lead
    )
    products, gate_grads, bias_sums = FUSED.get(variant, (2, 1, 2))
    assert text.count(MUL_FP8) == products and text.count(BACKWARD_FP8) == gate_grads
    assert MUL_FP8 not in plain_text and BACKWARD_FP8 not in plain_text
    assert text.count("aten.silu_backward") == 1 - gate_grads and plain_text.count("aten.silu_backward") == 1
    assert ("aten.silu.default(" in text) == (variant in ("silu_read", "up_read", "chunked"))  # else in the fused ops
    assert text.count("aten.mul.Tensor(") < plain_text.count("aten.mul.Tensor(")
    sums = [t.count("aten.sum.dim_IntList(") for t in (text, plain_text)]
    assert sums[0] == sums[1] - (bias_sums if bias else 0)  # the gate's and up-projection's bias gradients
    assert loss == plain_loss
    _states_close(state, plain_state, 1e-2)


def test_the_gates_gradient_keeps_a_product_another_op_reads():
    """The gate's gradient's factor ``dy * up`` fused only where nothing else reads it: here
    ``up``'s gradient reads it too (``h = silu(gate) * up`` and ``up`` reads ``h``'s gradient
    twice through ``h * h``), so it stays and ``silu_backward_fp8`` takes it whole."""

    class Squared(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = F.silu(self.gate(x)) * self.up(x)
            return self.down(h * h)

    (loss, state, text), (plain_loss, plain_state, _) = _fused_and_unfused(Squared, 32, (32,))
    assert BACKWARD_FP8 in text and loss == plain_loss
    _states_close(state, plain_state, 1e-2)
