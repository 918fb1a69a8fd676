"""The float8 pass's fusion of a layer norm's backward, the residual stream's gradient add, the
rowwise cast of the sum and its column sums into one op (``fsg::layer_norm_backward_fp8``,
``passes/float8_norms.py``, ``FUSE_NORM_BACKWARDS``): where it applies, and that the step is
the unfused one (on CPU the op runs the unfused graph's aten ops: bit for bit)."""

import operator

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from fsg._src.passes import float8_fuse, float8_norms
from tests.test_float8 import (
    GPT_CFG,
    ROWWISE_POLICY,
    _fused_and_unfused,
    _gpt_batches,
    _gpt_step,
    _inductor_losses,
    _losses_and_state,
    _NormThenLinear,
    _states_equal,
)

aten = torch.ops.aten


def test_every_residual_gradient_of_a_gpt_is_one_fused_op_and_the_step_is_the_unfused_one(monkeypatch):
    """A GPT's residual-stream gradient at each block's ``proj`` and ``fc_proj`` (the sum of the
    next norm's backward and the stream's gradient; at the last block, ``ln_f``'s backward alone)
    comes out of ``fsg::layer_norm_backward_fp8`` with its cast and bias sums; only the first
    block's ``ln_1`` backward, which feeds no FP8 matmul, stays aten's. Losses and parameters
    equal the unfused step's bit for bit."""
    batches = _gpt_batches(3)
    runs = {}
    for fuse in (True, False):
        monkeypatch.setattr(float8_fuse, "FUSE_NORM_BACKWARDS", fuse)
        step, state = _gpt_step(ROWWISE_POLICY)
        counts = step.lower(state, batches[0]).op_counts()
        assert counts.get("fsg.layer_norm_backward_fp8", 0) == (2 * GPT_CFG.n_layer if fuse else 0)
        assert counts["aten.native_layer_norm_backward"] == (1 if fuse else 2 * GPT_CFG.n_layer + 1)
        assert counts.get("fsg.rowwise_fp8", 0) == (0 if fuse else 2 * GPT_CFG.n_layer)
        runs[fuse] = _losses_and_state(step, state, batches)
    assert runs[True][0] == runs[False][0]
    _states_equal(runs[True][1], runs[False][1])


@settings(max_examples=10, deadline=None)
@example(True, True, False, (2, 16), False, "add")  # GPT's pre-norm block
@example(False, False, True, (32,), False, "add")
@given(st.booleans(), st.booleans(), st.booleans(), st.sampled_from([(32,), (2, 16)]), st.booleans(),
       st.sampled_from([None, "add", "read first"]))  # fmt: skip
def test_norm_backward_fusion_equals_the_unfused_step_over_norms(affine, bias, reread, lead, over_two, residual):
    """Over layer norms with and without weight or bias, read by a second op or not, on 2-D or
    3-D activations, of a residual stream or not: the backward is fused where its ``dx`` (plus
    the stream's gradient) is an FP8 grad-input's operand and the norm is over the last dim
    (never over two), and the step is the unfused one."""
    over_two = over_two and len(lead) == 2
    (fused_loss, fused, fused_text), (plain_loss, plain, plain_text) = _fused_and_unfused(
        lambda: _NormThenLinear(32, lead, affine, bias, reread, over_two, residual), 32, lead, "FUSE_NORM_BACKWARDS"
    )
    count = fused_text.count("fsg.layer_norm_backward_fp8.default(")
    if residual == "add" and not over_two:  # the block's f reads x + f(x)'s gradient in FP8
        assert count == 1
    assert count <= (0 if over_two or residual is None else 1)
    assert "fsg.layer_norm_backward_fp8" not in plain_text
    assert fused_loss == plain_loss
    _states_equal(fused, plain)


def _norm_backward_graph(read_dw_early: bool, residual_late: bool, swap: bool):
    N = 16

    def f(dy, x, mean, rstd, w, b, r_in):
        r = r_in * 2.0 if not residual_late else None
        dx, dw, db = aten.native_layer_norm_backward.default(dy, x, [N], mean, rstd, w, b, [True, True, True])
        early = dw * 3.0 if read_dw_early else dw
        r = r_in * 2.0 if residual_late else r
        s = dx + r if swap else r + dx
        return s.view(-1, N), early, db

    x = torch.randn(2, 4, N, dtype=torch.bfloat16)
    w, b = torch.randn(N, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
    _, mean, rstd = aten.native_layer_norm.default(x, [N], w, b, 1e-5)
    gm = make_fx(f, tracing_mode="fake")(torch.randn_like(x), x, mean, rstd, w, b, torch.randn_like(x))
    return gm, [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]


@given(st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=8, deadline=None)
def test_the_match_takes_the_add_in_either_order_and_keeps_dw_readers_after_the_fused_op(early, late, swap):
    """``r + dx`` or ``dx + r`` both match; where the residual is computed after the backward,
    the fused op takes the add's place, so a reader of ``dw`` between the two refuses the
    match (it would read ``dw`` before the fused op computes it)."""
    gm, t = _norm_backward_graph(early, late, swap)
    match = float8_norms.norm_backward_match(t)
    if early and late:
        assert match is None
        return
    backward, add, residual, _ = match
    assert backward.target is aten.native_layer_norm_backward.default and add.target is aten.add.Tensor
    assert residual in add.args and operator.getitem not in (residual.target,)


@pytest.mark.inductor
def test_the_fused_op_under_inductor_tracks_the_unfused_step(monkeypatch):
    """Under Inductor the op is an opaque node (its fallback lowering registered up front,
    ``_torch_private.inductor_compile``; its list-of-bools argument included) that runs its
    reference on CPU, while the unfused step's backward is Inductor's own code: the losses
    agree to Inductor's rounding."""
    block = lambda: _NormThenLinear(32, (2, 16), True, True, False, False, "add")  # noqa: E731
    losses = _inductor_losses(monkeypatch, "FUSE_NORM_BACKWARDS", lambda: nn.Sequential(nn.Linear(32, 32), block()),
                              "layer_norm_backward_fp8")  # fmt: skip
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False])) < 1e-2, losses
