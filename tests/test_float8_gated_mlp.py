"""The float8 pass on a gated MLP, ``down(act(gate(x)) * up(x))`` with a SiLU (SwiGLU) or a
GELU (GeGLU): under rowwise scaling the three tensors its FP8 matmuls read in rows (the
product, the up-projection's output gradient, the gate's) are each cast in the op that
computes them (``kernels/fp8/gated.py``), and the step equals the unfused one."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.test_float8 import _fused_and_unfused, _states_close

GATED, BACKWARD = "fsg.gated_fp8.default(", "fsg.gated_backward_fp8.default("
ACTIVATIONS = {  # name -> (the function, its aten op, its gradient's aten op)
    "silu": (F.silu, "aten.silu.default(", "aten.silu_backward"),
    "gelu": (F.gelu, "aten.gelu.default(", "aten.gelu_backward"),
    "gelu_tanh": (lambda v: F.gelu(v, approximate="tanh"), "aten.gelu.default(", "aten.gelu_backward"),
}


class _GatedMLP(nn.Module):
    """``variant``: ``"plain"``; ``"swapped"`` (``up * act(gate)``); ``"act_read"`` (the
    activation read again: it stays in the graph for that reader); ``"product_read"`` (the
    product ``act(gate) * up`` read again: its gradient is a sum, which both gradients below it
    read); ``"up_read"`` (the up-projection's output read again: its gradient is a sum, not a
    product through the activation, so its cast is not fused and the activation stays for it);
    ``"chunked"`` (Phi-3: gate and up the halves of one projection, read in place; their
    gradients meet in a concatenation, which ``cat_rowwise_fp8`` casts, so only the product is
    a gated op's)."""

    def __init__(self, width, hidden, bias, variant, activation):
        super().__init__()
        if variant == "chunked":
            self.gate_up = nn.Linear(width, 2 * hidden, bias=bias)
        else:
            self.gate, self.up = nn.Linear(width, hidden, bias=bias), nn.Linear(width, hidden, bias=bias)
        self.down, self.variant, self.act = nn.Linear(hidden, width, bias=bias), variant, ACTIVATIONS[activation][0]

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1) if self.variant == "chunked" else (self.gate(x), self.up(x))
        act = self.act(gate)
        h = up * act if self.variant == "swapped" else act * up
        y = self.down(h)
        extra = {"act_read": act, "product_read": h, "up_read": up}.get(self.variant)
        return y if extra is None else y + 0.1 * extra[..., : y.shape[-1]]


VARIANTS = ["plain", "swapped", "act_read", "product_read", "up_read", "chunked"]
# (gated_fp8, gated_backward_fp8, bias gradients' sums fused) per variant, with biases
FUSED = {"up_read": (1, 1, 1), "chunked": (1, 0, 1)}


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=4, deadline=None)
@example("silu", False, (32,), (16, 64))  # Llama's MLP: no biases, a 2-D batch
@example("gelu_tanh", False, (2, 16), (32, 32))  # Gemma's
@given(
    st.sampled_from(sorted(ACTIVATIONS)), st.booleans(), st.sampled_from([(32,), (2, 16)]),
    st.sampled_from([(16, 64), (32, 32)]),
)  # fmt: skip
def test_fused_gated_mlp_step_equals_the_unfused_step(variant, activation, bias, lead, dims):
    """Over activations, MLP shapes, with and without biases, 2-D or 3-D activations and each
    variant's extra reader: the product and the up-projection's gradient (where it is one)
    become ``gated_fp8``, the gate's gradient ``gated_backward_fp8`` (its product's factor
    fused where nothing else reads the product); no activation op is left that only they
    read; the loss is the unfused step's bit for bit and the parameters equal it to rounding."""
    width, hidden = dims
    _, act_op, backward_op = ACTIVATIONS[activation]
    (loss, state, text), (plain_loss, plain_state, plain_text) = _fused_and_unfused(
        lambda: _GatedMLP(width, hidden, bias, variant, activation), width, lead
    )
    products, gate_grads, bias_sums = FUSED.get(variant, (2, 1, 2))
    # where the activation is read again its gradient sums two terms, no product: a SiLU's is
    # then gated_backward_fp8 without a factor, a GELU's the plain GELU gradient's op
    gelu_grads = int(variant == "act_read" and activation != "silu")
    assert text.count(GATED) == products and text.count(BACKWARD) == gate_grads - gelu_grads
    assert text.count("fsg.gelu_backward_fp8.default(") == gelu_grads
    assert GATED not in plain_text and BACKWARD not in plain_text
    assert text.count(backward_op) == 1 - gate_grads and plain_text.count(backward_op) == 1
    assert (act_op in text) == (variant in ("act_read", "up_read", "chunked"))  # else in the fused ops
    assert text.count("aten.mul.Tensor(") < plain_text.count("aten.mul.Tensor(")
    sums = [t.count("aten.sum.dim_IntList(") for t in (text, plain_text)]
    assert sums[0] == sums[1] - (bias_sums if bias else 0)  # the gate's and up-projection's bias gradients
    assert loss == plain_loss
    _states_close(state, plain_state, 1e-2)


@pytest.mark.parametrize("shared", [False, True])
def test_a_product_another_op_reads_is_not_absorbed(shared):
    """``gelu_backward(p, h)`` with ``p = a * x`` (a gated GELU's gate gradient, written out):
    ``gated_backward_fp8`` computes the product itself only where nothing else reads ``p``;
    where another op does, ``p`` stays and the GELU gradient's own op takes it whole. Either
    way the step is the unfused one's."""

    class Explicit(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.lin = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            a = self.pre(x).detach()  # no gradient through p: nothing in the backward reads it
            p = a * x
            y = self.lin(torch.ops.aten.gelu_backward(p, a))
            return y + 0.1 * p if shared else y

    (loss, state, text), (plain_loss, plain_state, _) = _fused_and_unfused(Explicit, 32, (32,))
    assert text.count(BACKWARD) == (0 if shared else 1) and text.count("fsg.gelu_backward_fp8.default(") == shared
    assert loss == plain_loss
    _states_close(state, plain_state, 1e-2)
