"""Cross-entropy kernels and the fused output projection against torch (CPU: TRITON_INTERPRET=1).

Small ``BLOCK_V`` values make the kernels loop over several vocabulary blocks, with a
partial last block (V not a multiple of the block)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.kernels import cross_entropy as K
from fsg._src.kernels import linear_cross_entropy as LCE
from fsg._src.kernels._common import plain_math
from tests.kernels.common import KERNEL, needs_triton, rel

pytestmark = needs_triton


def _case(n, v, seed, ignore_some=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_some and n > 1:
        targets[torch.rand(n, generator=g) < 0.3] = -100
    return logits, targets


def _torch_loss(logits, targets, z_loss=0.0):
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    if z_loss:
        valid = targets != -100
        lse = torch.logsumexp(logits, -1)
        loss = loss + z_loss * (lse * lse * valid).sum() / valid.sum().clamp_min(1)
    return loss


@KERNEL
@given(n=st.integers(1, 9), v=st.integers(1, 300), block=st.sampled_from([16, 64, 4096]), seed=st.integers(0, 99))
def test_kernels_write_every_element_and_match_reference(n, v, block, seed):
    logits, targets = _case(n, v, seed)
    old, K.BLOCK_V = K.BLOCK_V, block
    try:
        loss = torch.full((n,), float("nan"))
        lse = torch.full((n,), float("nan"))
        K.launch_fwd(logits, targets, loss, lse, -100, 1e-3)
        want_loss, want_lse = K.rows_reference(logits, targets, -100, 1e-3)
        assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
        assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
        drow = torch.rand(n)
        dx = torch.full_like(logits, float("nan"))
        K.launch_bwd(logits, targets, lse, drow, dx, -100, 1e-3)
        want = K.grad_reference(logits, targets, want_lse, drow, -100, 1e-3)
        assert torch.isfinite(dx).all() and torch.allclose(dx, want, rtol=1e-5, atol=1e-6)
    finally:
        K.BLOCK_V = old


@KERNEL
@given(n=st.integers(1, 9), v=st.integers(2, 300), z=st.sampled_from([0.0, 1e-2]), seed=st.integers(0, 99))
def test_cross_entropy_matches_torch_with_autograd(n, v, z, seed):
    logits, targets = _case(n, v, seed)
    x = logits.clone().requires_grad_()
    loss = fsg.nn.cross_entropy(x, targets, z_loss=z)
    loss.backward()
    ref_x = logits.clone().requires_grad_()
    ref = _torch_loss(ref_x, targets, z)
    ref.backward()
    if (targets != -100).any():
        assert rel(loss, ref) < 1e-5 and rel(x.grad, ref_x.grad) < 1e-5
    else:  # torch's mean over no rows is NaN; fsg reports 0 (the count is clamped to 1)
        assert loss == 0 and (x.grad == 0).all()


@KERNEL
@given(
    n=st.integers(1, 9),
    v=st.integers(2, 300),
    d=st.integers(1, 40),
    chunk=st.integers(1, 10),
    seed=st.integers(0, 99),
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_matches_torch(n, v, d, chunk, seed, reduction):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0] = -100 if n > 1 else targets[0]
    loss = fsg.nn.linear_cross_entropy(h, w, targets, chunk_size=chunk, reduction=reduction)
    loss.backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, targets, reduction=reduction)
    ref.backward()
    assert rel(loss, ref) < 1e-5
    assert rel(h.grad, h2.grad) < 1e-5 and rel(w.grad, w2.grad) < 1e-5


def test_leading_dims_and_upstream_gradient_scale():
    h = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    t = torch.randint(0, 11, (2, 3))
    (3.0 * fsg.nn.linear_cross_entropy(h, w, t, chunk_size=4)).backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    (3.0 * F.cross_entropy((h2 @ w2.T).reshape(-1, 11), t.reshape(-1))).backward()
    assert rel(h.grad, h2.grad) < 1e-5 and rel(w.grad, w2.grad) < 1e-5


def test_under_autocast_the_projection_runs_in_autocasts_dtype():
    # As F.linear under autocast: h and the weight are cast to autocast's dtype, the loss is
    # float32, and the gradients flow back to the float32 leaves through the casts.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fsg.nn.linear_cross_entropy(h, w, t, chunk_size=4)
    loss.backward()
    h16, w16 = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = fsg.nn.linear_cross_entropy(h16, w16, t, chunk_size=4)
    ref.backward()
    assert loss.dtype == torch.float32 and torch.equal(loss, ref)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert torch.equal(h.grad, h16.grad.float()) and torch.equal(w.grad, w16.grad.float())


def test_an_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        fsg.nn.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), reduction="none")


def test_no_grad_computes_the_loss_only():
    h, w, t = torch.randn(5, 4), torch.randn(7, 4), torch.randint(0, 7, (5,))
    with torch.no_grad():
        loss = fsg.nn.linear_cross_entropy(h, w, t)
    assert rel(loss, F.cross_entropy(h @ w.T, t)) < 1e-5


def test_target_out_of_range_gives_nan_not_a_wild_read():
    logits, targets = torch.randn(3, 5), torch.tensor([1, 7, 2])
    assert torch.isnan(fsg.nn.cross_entropy(logits, targets))


def test_bad_input_names_the_rule():
    with pytest.raises(ValueError, match="integer dtype"):
        fsg.nn.cross_entropy(torch.randn(3, 5), torch.zeros(3))
    with pytest.raises(ValueError, match=r"targets must have shape \(3,\)"):
        fsg.nn.cross_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must have shape \[V, 4\]"):
        fsg.nn.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))


def _gpt_like_loss(params, batch):
    h = fsg.nn.rms_norm(batch["x"] @ params["proj"], params["norm"])
    return fsg.nn.linear_cross_entropy(h, params["embed"], batch["y"], chunk_size=8)


def test_traced_step_has_one_fused_node_and_trains():
    torch.manual_seed(0)
    params = {"proj": torch.randn(6, 8) * 0.3, "norm": torch.ones(8), "embed": torch.randn(37, 8) * 0.3}
    batch = {"x": torch.randn(20, 6), "y": torch.randint(0, 37, (20,))}
    step = fsg.compile_step(_gpt_like_loss, optimizer=fsg.optim.adam(1e-2), backend="aot_eager")
    state = step.init(params)
    text = step.lower(state, batch).as_text()
    assert text.count("fsg.linear_cross_entropy_fwd") == 1 and "fsg.rms_norm_fwd" in text
    first = None
    for _ in range(10):
        state, metrics = step(state, batch)
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < first


def test_plain_math_traces_torch_ops_except_the_ones_with_sharding_rules():
    """Under a mesh fsg.nn traces plain math (DTensor shards torch ops, not opaque kernels),
    except ops with a DTensor rule: linear_cross_entropy as a sum over rows, then a mean."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params = {"proj": torch.randn(6, 8), "norm": torch.ones(8), "embed": torch.randn(37, 8)}
    batch = {"x": torch.randn(20, 6), "y": torch.randint(0, 37, (20,))}
    with plain_math():
        gm = make_fx(_gpt_like_loss)(params, batch)
    fsg_ops = {line.split("(")[0].split("= ")[-1] for line in gm.code.splitlines() if "fsg." in line}
    assert fsg_ops == {"torch.ops.fsg.linear_cross_entropy_sum.default"}
    assert rel(gm(params, batch), _gpt_like_loss(params, batch)) < 1e-5


@KERNEL
@given(n=st.integers(0, 9), v=st.integers(2, 80), chunk=st.integers(1, 10), seed=st.integers(0, 99))
def test_the_row_sum_variant_matches_torch_with_autograd(n, v, chunk, seed):
    """What a mesh runs per rank: the sum over its rows (also over none: an empty shard)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 5, generator=g).requires_grad_()
    w = (torch.randn(v, 5, generator=g) / 2).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:1] = -100
    loss, _, _ = LCE.linear_cross_entropy_sum(h, w, targets, -100, 0.0, chunk, True)
    (2.0 * loss).backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, targets, reduction="sum")
    (2.0 * ref).backward()
    assert rel(loss, ref) < 1e-5
    assert rel(h.grad, h2.grad) < 1e-5 and rel(w.grad, w2.grad) < 1e-5
