"""The ``pack_attention_grads`` pass (``passes/pack_attention_grads.py``) and its op
(``kernels/attention_grads.py``) on CPU.

Off CUDA the op runs the aten backward it replaces and the concatenation, so a rewritten graph
must compute exactly what the original did: checked bit for bit on traced attention blocks
over drawn shapes and on whole GPT steps, and every case the pass must leave alone is checked
to be left alone. cuDNN's packed backward itself is checked on the GPU
(tests/gpu/test_attention_grads_cuda.py)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fsg
from fsg._src.kernels import attention_grads as A
from fsg._src.passes import pack_attention_grads as P
from fsg._src.passes import pipeline
from fsg._src.passes.options import Fusions
from tests.helpers import tiny_gpt_run

BF16 = torch.bfloat16


def _randn(*shape, seed=0, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _attention_joint(H, causal=True, order=(0, 1, 2), kv_heads=None, reuse_dq=False, mask=False):
    """An attention block's loss and gradients as one traced joint graph: a fused qkv
    projection, heads, ``F.scaled_dot_product_attention``, an output projection."""

    def step(x, w_qkv, w_o, c):
        x, w_qkv, w_o = (t.detach().requires_grad_(i > 0) for i, t in enumerate((x, w_qkv, w_o)))
        B, T, C = x.shape
        D = C // H
        q, k, v = F.linear(x, w_qkv).split([C, C, C], dim=2)
        q, k, v = ([q, k, v][i] for i in order)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        if kv_heads:
            k, v = k[:, :kv_heads], v[:, :kv_heads]
        kwargs = {"enable_gqa": True} if kv_heads else {}
        if mask:
            kwargs["attn_mask"] = torch.ones(T, T, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and not mask, **kwargs)
        if reuse_dq:
            y = y + q  # q's gradient then has a second reader
        out = F.linear(y.transpose(1, 2).reshape(B, T, C), w_o)
        loss = (out.float() * c.float()).sum()
        return (loss.detach(), *torch.autograd.grad(loss, [w_qkv, w_o]))

    return step


def _inputs(B, T, C, dtype=BF16):
    return [_randn(B, T, C, seed=1, dtype=dtype), _randn(3 * C, C, seed=2, dtype=dtype, scale=C**-0.5),
            _randn(C, C, seed=3, dtype=dtype, scale=C**-0.5), _randn(B, T, C, seed=4, dtype=dtype)]  # fmt: skip


ON_CPU = Fusions(on_cpu={"pack_attention_grads"})


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6).map(lambda t: 4 * t), st.sampled_from([1, 2, 4]),
       st.sampled_from([8, 16]), st.booleans(), st.sampled_from([BF16, torch.float16]))  # fmt: skip
def test_the_rewritten_attention_computes_exactly_what_it_did(B, T, H, D, causal, dtype):
    """The backward and the concatenation become one op; the loss and both weight gradients are
    the original graph's bit for bit (the op's CPU path)."""
    inputs = _inputs(B, T, H * D, dtype)
    gm = make_fx(_attention_joint(H, causal))(*inputs)
    want = gm(*inputs)
    assert P.CPU_BACKWARD in _targets(gm) and torch.ops.aten.cat.default in _targets(gm)
    assert P.pack_attention_grads(gm, ON_CPU) == 1
    targets = _targets(gm)
    assert P.PACKED in targets and P.CPU_BACKWARD not in targets and torch.ops.aten.cat.default not in targets
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), want))


@pytest.mark.parametrize(
    "case",
    ["not forced (CPU)", "float32", "k, q, v order", "grouped-query heads", "dq read twice", "explicit mask"],
)
def test_what_the_pass_leaves_alone(case):
    """Each case outside the pattern keeps its graph: nothing rewritten, the same results."""
    joint = {"k, q, v order": dict(order=(1, 0, 2)), "grouped-query heads": dict(kv_heads=1),
             "dq read twice": dict(reuse_dq=True), "explicit mask": dict(mask=True)}.get(case, {})  # fmt: skip
    inputs = _inputs(2, 8, 32, torch.float32 if case == "float32" else BF16)
    gm = make_fx(_attention_joint(2, **joint))(*inputs)
    before = _targets(gm)
    assert P.pack_attention_grads(gm, Fusions() if case == "not forced (CPU)" else ON_CPU) == 0
    assert _targets(gm) == before


def test_the_op_fake_shape_matches_the_real_one_and_cpu_is_not_cudnns():
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, H, T, D = 2, 3, 8, 16
    q, k, v = (_randn(B, T, H, D, seed=i).transpose(1, 2) for i in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)[:2]
    g = _randn(B, T, H, D, seed=5).transpose(1, 2)
    real = A.attention_backward_packed(g, q, k, v, out, lse, None, None, True, None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = A.attention_backward_packed(g, q, k, v, out, lse, None, None, True, None)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((B, T, 3 * H * D), BF16)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        g, q, k, v, out, lse, 0.0, True
    )
    assert torch.equal(real, torch.cat([t.transpose(1, 2).reshape(B, T, H * D) for t in (dq, dk, dv)], -1))
    assert not A.available(torch.device("cpu"))


def test_the_pipeline_runs_it_first_before_float8_also_on_a_mesh():
    names = [p.name for p in pipeline.order(list(pipeline.PASSES))]
    assert names.index("pack_attention_grads") < names.index("float8")
    by_name = {p.name: p for p in pipeline.PASSES}
    assert by_name["pack_attention_grads"].applies(pipeline.Options())
    assert by_name["pack_attention_grads"].applies(pipeline.Options(on_mesh=True))


def _gpt_run(forced: bool, policy=None):
    return tiny_gpt_run({"pack_attention_grads"} if forced else frozenset(), policy=policy)


def test_a_gpt_step_with_the_op_in_place_equals_the_plain_step():
    """examples/gpt.py's GPT under bf16: every layer's attention backward rewritten, and three
    steps end with the plain step's loss and parameters, bit for bit."""
    text, loss, params = _gpt_run(True)
    text_plain, loss_plain, params_plain = _gpt_run(False)
    assert text.count("fsg.attention_backward_packed.default(") == 2
    assert "fsg.attention_backward_packed" not in text_plain
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" not in text
    assert loss == loss_plain
    assert all(torch.equal(params[k], params_plain[k]) for k in params)


def test_under_rowwise_fp8_the_packed_gradient_is_cast_as_any_operand():
    """With ``Float8(recipe="rowwise")`` the pass runs first: the float8 pass then finds no
    concatenation to fuse with its cast (``fsg::cat_rowwise_fp8``) and casts the packed gradient
    for the qkv grad-input with its column sums (``fsg::rowwise_fp8``); the same numbers, so the
    steps end alike."""
    rowwise = fsg.Policy(compute=BF16, matmul=fsg.Float8(recipe="rowwise"))
    text, loss, params = _gpt_run(True, policy=rowwise)
    text_plain, loss_plain, params_plain = _gpt_run(False, policy=rowwise)
    assert text.count("fsg.attention_backward_packed.default(") == 2 and "fsg.cat_rowwise_fp8" not in text
    assert text_plain.count("fsg.cat_rowwise_fp8.default(") == 2
    assert text.count("fsg.rowwise_fp8.default(") == text_plain.count("fsg.rowwise_fp8.default(") + 2
    assert text.count("aten._scaled_mm") == text_plain.count("aten._scaled_mm")
    assert abs(loss - loss_plain) < 1e-3
    assert all(torch.allclose(params[k], params_plain[k], rtol=1e-2, atol=1e-4) for k in params)


def test_cudnn_is_only_handed_rows_it_reads_in_16_byte_vectors():
    """The per-call layout check before cuDNN's packed backward (a built graph is reused for any
    tensor of its shapes and strides): unit last stride, other strides and the address
    multiples of 16 bytes; anything else takes the aten backward."""
    base = torch.zeros(2 * 64 * 3 * 4 * 16 + 8, dtype=BF16)
    qkv = base[:-8].view(2, 64, 3 * 4 * 16)
    q, k, v = (t.view(2, 64, 4, 16).transpose(1, 2) for t in qkv.split(64, dim=2))
    assert all(A._aligned(t) for t in (q, k, v))
    shifted = base[1:-7].view(2, 64, 3 * 4 * 16)[..., :64].view(2, 64, 4, 16).transpose(1, 2)
    assert not A._aligned(shifted)  # the address 2 bytes off
    narrow = torch.zeros(2, 64, 3 * 4 * 12, dtype=BF16)[..., 36:72].view(2, 64, 3, 12).transpose(1, 2)
    assert not A._aligned(narrow)  # heads of 12 elements: 24 bytes apart, and 72 bytes in
    assert not A._aligned(torch.zeros(2, 4, 64, 16, dtype=BF16).transpose(2, 3))  # last stride not 1
