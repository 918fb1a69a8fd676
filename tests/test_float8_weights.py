"""The float8 pass's fusion of a weight's two rowwise casts into one op from its float32 master
(``fsg::weight_fp8``, ``passes/float8/weights.py``, ``Fusions.fp8_weights``): where it applies, and
that the step is the unfused one (on CPU the op runs the unfused graph's casts: bit for bit)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsg
from fsg._src.passes.float8 import weights as float8_weights
from fsg._src.passes.options import Fusions
from tests.test_float8 import (
    GPT_CFG,
    ROWWISE_POLICY,
    _gpt_batches,
    _gpt_step,
    _inductor_losses,
    _losses_and_state,
    _states_equal,
)

WEIGHT_FP8 = "fsg.weight_fp8.default("


def test_every_weight_of_a_gpt_is_cast_once_from_its_master_and_the_step_is_the_unfused_one():
    """Each of a GPT's block weights (qkv, proj, fc, fc_proj: their grad-inputs all run in FP8)
    gets both casts from one op reading the float32 master; its compute-dtype copy and the
    generic casts' row and column reductions are gone. Losses and parameters (AdamW) equal the
    unfused step's bit for bit."""
    batches = _gpt_batches(3)
    runs = {}
    for fuse in (True, False):
        step, state = _gpt_step(ROWWISE_POLICY, fusions=Fusions(fp8_weights=fuse))
        lowered = step.lower(state, batches[0])
        assert lowered.as_text().count(WEIGHT_FP8) == (4 * GPT_CFG.n_layer if fuse else 0)
        runs[fuse] = (lowered.op_counts().get("aten.amax", 0), *_losses_and_state(step, state, batches))
    assert runs[False][0] - runs[True][0] == 2 * 4 * GPT_CFG.n_layer  # each weight's two generic casts
    assert runs[True][1] == runs[False][1]
    _states_equal(runs[True][2], runs[False][2])


class _Stack(nn.Module):
    """Linear layers with GELUs between; the first one's input needs no gradient, so its
    grad-input is never computed; ``tied`` reads the middle weight once more outside a matmul."""

    def __init__(self, widths, bias, tied):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
        self.tied = tied

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(nn.functional.gelu(x))
        if self.tied:
            x = x + self.layers[len(self.layers) // 2].weight.float().sum() * 1e-3
        return x


def _run(widths, bias, tied, params_bf16, grad_weight, dropped, head, fuse):
    torch.manual_seed(0)
    model = _Stack(widths, bias, tied)
    if params_bf16:
        model = model.to(torch.bfloat16)
    names = [f"layers.{i}.weight" for i in range(len(widths) - 1)]
    config = fsg.Float8(recipe="rowwise", keep_output_head=head, grad_weight=grad_weight,
                        filter=lambda name: name != names[dropped] if dropped is not None else True)  # fmt: skip
    step = fsg.compile_step(
        lambda p, b: (fsg.apply(model, p, b["x"]).float() ** 2).mean(),
        optimizer=fsg.optim.sgd(0.1),
        precision=fsg.Policy(compute=torch.bfloat16, matmul=config),
        backend="eager",
        fusions=Fusions(fp8_weights=fuse),
    )
    state = step.init(fsg.params(model))
    batches = [{"x": torch.randn(2, 8, widths[0], generator=torch.Generator().manual_seed(i))} for i in range(2)]
    text = step.lower(state, batches[0]).as_text()
    losses, state = _losses_and_state(step, state, batches)
    return text, losses, state


@settings(max_examples=12, deadline=None)
@example((16, 32, 16), True, False, False, None, None, False)
@example((16, 32, 48, 16), False, True, True, "fp8", 1, True)
@given(
    st.sampled_from([(16, 32, 16), (16, 48, 32, 16), (32, 16, 16, 32)]), st.booleans(), st.booleans(), st.booleans(),
    st.sampled_from([None, "fp8"]), st.sampled_from([None, 1, 2]), st.booleans(),
)  # fmt: skip
def test_weight_fusion_equals_the_unfused_step_over_stacks(widths, bias, tied, params_bf16, grad_weight, dropped, head):
    """Over stacks of linear layers (with and without bias, a weight read again outside a
    matmul, parameters kept in float32 or in bfloat16, FP8 grad-weights or not, a layer the
    filter keeps in bf16, the head kept or not): exactly the weights whose forward and
    grad-input both run in FP8 are fused (never the first layer's: no grad-input), and the
    step's losses and parameters are the unfused step's bit for bit."""
    n = len(widths) - 1
    dropped = dropped if dropped is not None and dropped < n else None
    fused_text, fused_losses, fused = _run(widths, bias, tied, params_bf16, grad_weight, dropped, head, True)
    plain_text, plain_losses, plain = _run(widths, bias, tied, params_bf16, grad_weight, dropped, head, False)
    in_fp8 = {i for i in range(1, n) if i != dropped and not (head and i == n - 1)}
    assert fused_text.count(WEIGHT_FP8) == len(in_fp8), fused_text
    assert WEIGHT_FP8 not in plain_text
    assert fused_losses == plain_losses
    _states_equal(fused, plain)


def test_source_reads_the_master_through_a_plain_cast_only():
    """What the op reads: what a plain cast of a float32 step input reads (here its detach),
    with the cast's dtype; a weight already in the compute dtype itself; nothing for an activation or a
    cast that also changes the layout."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(w32, w16, x):
        return (
            torch.ops.aten._to_copy.default(w32.detach(), dtype=torch.bfloat16),
            w16,
            torch.ops.aten._to_copy.default(w32, dtype=torch.bfloat16, memory_format=torch.contiguous_format),
            x @ x,
        )

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cast, bf16, odd, activation = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert float8_weights.source(cast) == (cast.args[0], torch.bfloat16) and cast.args[0].args[0] is placeholders[0]
    assert float8_weights.source(bf16) == (placeholders[1], None)
    assert float8_weights.source(odd) is None and float8_weights.source(activation) is None


@pytest.mark.inductor
def test_the_fused_op_under_inductor_tracks_the_unfused_step():
    """Under Inductor the op is an opaque node running its reference on CPU, while the unfused
    step's casts are Inductor's own code: the losses agree to Inductor's rounding."""
    losses = _inductor_losses("fp8_weights", lambda: _Stack((32, 64, 32), True, False), "weight_fp8")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False])) < 1e-2, losses
