"""Cross-entropy over a large vocabulary without float32 logits: Triton kernels, the fused
output projection, registered ops, references.

Shape legend: N rows (tokens), V vocabulary, D hidden width, C rows per chunk.
The vocabulary size is a compile-time constant of the kernels (one build per model; it
also lets Triton's CPU interpreter run the loop over it). Per row the forward kernel makes one pass over the logits with an online softmax (a running
max and sum per lane, in float32) and writes the row's loss ``lse - x[target] + z lse^2`` and
its log-sum-exp; the backward kernel makes one more pass and writes
``(softmax (1 + 2 z lse) - onehot(target)) * drow`` in the logits' dtype, in place if asked.
Rows whose target is ``ignore_index`` contribute 0 and get a 0 gradient; the mean divides by
the count of the other rows, computed on the device (no ``.item()``). A target outside
``[0, V)`` gives a NaN loss.

``linear_cross_entropy`` also fuses the output projection: it walks the tokens in chunks of
C rows, computes the chunk's logits (``h_C @ W.T``, in h's dtype), the loss and, in the same
visit, the logits' gradient in place, then ``dh_C = dlogits @ W`` and ``dW += dlogits.T @ h_C``
(float32 accumulator). Only one chunk of logits ever exists; the backward just scales
``dh`` and ``dW`` by the incoming gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsg._src.kernels._common import fused_ops_enabled, use_triton

BLOCK_V = 4096  # vocabulary columns per iteration of a row's loop


@triton.jit
def _row_lse(base, V: tl.constexpr, BLOCK: tl.constexpr):
    """log-sum-exp of one row: a running max and sum per lane over vocabulary blocks."""
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # running max per lane
    s = tl.zeros([BLOCK], tl.float32)  # running sum of exp(x - m) per lane
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with no column yet: s stays 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    m_row = tl.max(m, axis=0)
    return m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))


@triton.jit
def _row_loss(base, t, lse, ignore_index, z_loss, V: tl.constexpr):
    """``lse - x[t] + z lse^2``; 0 for an ignored row, NaN for a target outside [0, V)."""
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(base + t, mask=valid & in_range, other=0.0).to(tl.float32)
    loss = tl.where(valid, lse - x_t + z_loss * lse * lse, 0.0)
    return tl.where(valid & ~in_range, float("nan"), loss)


@triton.jit
def _row_grad(src, dst, t, lse, scale, z_loss, V: tl.constexpr, BLOCK: tl.constexpr):
    """Writes ``(softmax (1 + 2 z lse) - onehot(t)) * scale`` of the row at ``src`` to ``dst``
    (the same row is fine: each element is read before it is written)."""
    cols = tl.arange(0, BLOCK)
    coef = 1.0 + 2.0 * z_loss * lse
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(src + c, mask=c < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) * coef - tl.where(c == t, 1.0, 0.0)) * scale
        tl.store(dst + c, g.to(dst.dtype.element_ty), mask=c < V)


@triton.jit
def _ce_fwd_kernel(x_ptr, stride, t_ptr, loss_ptr, lse_ptr, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lse = _row_lse(base, V, BLOCK)
    tl.store(loss_ptr + row, _row_loss(base, tl.load(t_ptr + row), lse, ignore_index, z_loss, V))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(
    x_ptr, stride, t_ptr, lse_ptr, drow_ptr, dx_ptr, dstride, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    scale = tl.where(t != ignore_index, tl.load(drow_ptr + row), 0.0)
    _row_grad(x_ptr + row * stride, dx_ptr + row * dstride, t, tl.load(lse_ptr + row), scale, z_loss, V, BLOCK)


@triton.jit
def _ce_fwd_bwd_kernel(
    x_ptr, stride, t_ptr, loss_ptr, drow_ptr, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr
):
    """The forward and, in place, the backward of one row: its logits become their gradient
    (the second pass re-reads the row, mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    t = tl.load(t_ptr + row)
    lse = _row_lse(base, V, BLOCK)
    tl.store(loss_ptr + row, _row_loss(base, t, lse, ignore_index, z_loss, V))
    scale = tl.where(t != ignore_index, tl.load(drow_ptr + row), 0.0)
    _row_grad(base, base, t, lse, scale, z_loss, V, BLOCK)


# --- host launchers -----------------------------------------------------------------------


def launch_fwd(x_NV, targets_N, loss_N, lse_N, ignore_index: int, z_loss: float) -> None:
    N, V = x_NV.shape
    _ce_fwd_kernel[(N,)](x_NV, x_NV.stride(0), targets_N, loss_N, lse_N, ignore_index, z_loss, V=V, BLOCK=_block(V))


def launch_bwd(x_NV, targets_N, lse_N, drow_N, dx_NV, ignore_index: int, z_loss: float) -> None:
    N, V = x_NV.shape
    _ce_bwd_kernel[(N,)](
        x_NV,
        x_NV.stride(0),
        targets_N,
        lse_N,
        drow_N,
        dx_NV,
        dx_NV.stride(0),
        ignore_index,
        z_loss,
        V=V,
        BLOCK=_block(V),
    )


def launch_fwd_bwd_inplace(x_NV, targets_N, loss_N, drow_N, ignore_index: int, z_loss: float) -> None:
    """Writes each row's loss into ``loss_N`` and overwrites ``x_NV`` with its gradient."""
    N, V = x_NV.shape
    _ce_fwd_bwd_kernel[(N,)](
        x_NV, x_NV.stride(0), targets_N, loss_N, drow_N, ignore_index, z_loss, V=V, BLOCK=_block(V)
    )


def _block(V: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(V))


# --- eager references (float32 math) --------------------------------------------------------


def rows_reference(x_NV, targets_N, ignore_index: int, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss per row, lse per row)`` in float32, as the forward kernel defines them."""
    x = x_NV.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets_N != ignore_index
    in_range = (targets_N >= 0) & (targets_N < x.shape[-1])
    x_t = x.gather(1, torch.where(valid & in_range, targets_N, 0)[:, None])[:, 0]
    loss = torch.where(valid, lse - x_t + z_loss * lse * lse, 0.0)
    return torch.where(valid & ~in_range, float("nan"), loss), lse


def grad_reference(x_NV, targets_N, lse_N, drow_N, ignore_index: int, z_loss: float) -> torch.Tensor:
    """The logits' gradient, as the backward kernel defines it."""
    x = x_NV.float()
    valid = targets_N != ignore_index
    onehot = torch.nn.functional.one_hot(torch.where(valid, targets_N, 0).clamp(0, x.shape[-1] - 1), x.shape[-1])
    g = torch.exp(x - lse_N[:, None]) * (1.0 + 2.0 * z_loss * lse_N[:, None]) - onehot
    return (g * torch.where(valid, drow_N, 0.0)[:, None]).to(x_NV.dtype)


def _rows(x_NV, targets_N, ignore_index, z_loss):
    if not use_triton(x_NV):
        return rows_reference(x_NV, targets_N, ignore_index, z_loss)
    N = x_NV.shape[0]
    loss_N = torch.empty(N, dtype=torch.float32, device=x_NV.device)
    lse_N = torch.empty(N, dtype=torch.float32, device=x_NV.device)
    launch_fwd(x_NV, targets_N, loss_N, lse_N, ignore_index, z_loss)
    return loss_N, lse_N


def _rows_and_grad_inplace(x_NV, targets_N, drow_N, ignore_index, z_loss) -> torch.Tensor:
    """The rows' losses; ``x_NV`` now holds the logits' gradient."""
    if not use_triton(x_NV):
        loss_N, lse_N = rows_reference(x_NV, targets_N, ignore_index, z_loss)
        x_NV.copy_(grad_reference(x_NV, targets_N, lse_N, drow_N, ignore_index, z_loss))
        return loss_N
    loss_N = torch.empty(x_NV.shape[0], dtype=torch.float32, device=x_NV.device)
    launch_fwd_bwd_inplace(x_NV, targets_N, loss_N, drow_N, ignore_index, z_loss)
    return loss_N


def _grad(x_NV, targets_N, lse_N, drow_N, ignore_index, z_loss, out_NV):
    if not use_triton(x_NV):
        out_NV.copy_(grad_reference(x_NV, targets_N, lse_N, drow_N, ignore_index, z_loss))
        return
    launch_bwd(x_NV, targets_N, lse_N, drow_N, out_NV, ignore_index, z_loss)


# --- registered ops -------------------------------------------------------------------------


@torch.library.custom_op("fsg::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp of ``logits[N, V]`` (float32)."""
    return _rows(logits.contiguous(), targets.contiguous(), ignore_index, z_loss)


@cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index, z_loss):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows)


@torch.library.custom_op("fsg::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, drow: torch.Tensor, ignore_index: int, z_loss: float
) -> torch.Tensor:
    """The gradient of ``sum(drow * loss_rows)`` with respect to ``logits``, in their dtype."""
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _grad(logits.contiguous(), targets.contiguous(), lse, drow.contiguous(), ignore_index, z_loss, out)
    return out


@cross_entropy_bwd.register_fake
def _(logits, targets, lse, drow, ignore_index, z_loss):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _ce_setup(ctx, inputs, output):
    logits, targets, ctx.ignore_index, ctx.z_loss = inputs
    ctx.save_for_backward(logits, targets, output[1])


def _ce_backward(ctx, drow, _dlse):
    logits, targets, lse = ctx.saved_tensors
    return cross_entropy_bwd(logits, targets, lse, drow, ctx.ignore_index, ctx.z_loss), None, None, None


cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


def default_chunk(V: int, itemsize: int) -> int:
    """Rows per chunk of ``linear_cross_entropy``: about 1 GiB of logits, at least 1 (fewer,
    larger chunks keep the matmuls efficient and the float32 weight-gradient sums few)."""
    return max(1, (1 << 30) // (V * itemsize))


def _linear_ce(h, weight, targets, ignore_index: int, z_loss: float, chunk: int, with_grad: bool, mean: bool):
    """``(loss, dloss/dh, dloss/dweight)`` of the cross-entropy of ``h @ weight.T`` over the
    rows: their mean (``mean``) or their sum."""
    N = h.shape[0]
    h, weight, targets = h.contiguous(), weight.contiguous(), targets.contiguous()
    if mean:
        scale = 1.0 / (targets != ignore_index).sum().clamp_min(1).to(torch.float32)
    else:
        scale = torch.ones((), dtype=torch.float32, device=h.device)
    loss_N = torch.empty(N, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if with_grad else h.new_empty(0)
    dw32 = None  # float32 sum of the chunks' weight gradients
    drow = scale.expand(min(chunk, N)).contiguous() if with_grad else None
    for start in range(0, N, chunk):
        rows = slice(start, min(start + chunk, N))
        logits_CV = h[rows] @ weight.T
        if not with_grad:
            loss_N[rows] = _rows(logits_CV, targets[rows], ignore_index, z_loss)[0]
            continue
        # the chunk's logits become their gradient, in place, in the same kernel
        loss_N[rows] = _rows_and_grad_inplace(
            logits_CV, targets[rows], drow[: logits_CV.shape[0]], ignore_index, z_loss
        )
        torch.mm(logits_CV, weight, out=dh[rows])
        dw_chunk = logits_CV.T @ h[rows]
        if dw32 is None:  # one chunk (the common case): no float32 accumulator at all
            dw32 = dw_chunk if start + chunk >= N else dw_chunk.float()
        else:
            dw32 += dw_chunk.float()
    if with_grad and dw32 is None:  # no rows at all (an empty shard)
        dw32 = torch.zeros_like(weight)
    dw = dw32.to(weight.dtype) if with_grad else weight.new_empty(0)
    return loss_N.sum() * scale, dh, dw


def _linear_ce_op(name: str, mean: bool):
    @torch.library.custom_op(f"fsg::{name}", mutates_args=())
    def op(
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        z_loss: float,
        chunk: int,
        with_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _linear_ce(h, weight, targets, ignore_index, z_loss, chunk, with_grad, mean=mean)

    return op


# ``(mean loss, dloss/dh, dloss/dweight)`` of ``cross_entropy(h @ weight.T, targets)``; the
# gradients are empty when ``with_grad`` is false.
linear_cross_entropy_fwd = _linear_ce_op("linear_cross_entropy_fwd", mean=True)
# The same with the rows' sum instead of their mean: what a mesh runs, since sums over token
# shards add up (dtensor_rules.py).
linear_cross_entropy_sum = _linear_ce_op("linear_cross_entropy_sum", mean=False)


def _lce_fake(h, weight, targets, ignore_index, z_loss, chunk, with_grad):
    loss = h.new_empty((), dtype=torch.float32)
    if not with_grad:
        return loss, h.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _lce_backward(ctx, dloss, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    return (dh * dloss).to(dh.dtype), (dw * dloss).to(dw.dtype), None, None, None, None, None


for _op in (linear_cross_entropy_fwd, linear_cross_entropy_sum):
    _op.register_fake(_lce_fake)
    _op.register_autograd(_lce_backward, setup_context=_lce_setup)


# --- functional API -------------------------------------------------------------------------


def _check(what: str, logits_shape, targets: torch.Tensor) -> None:
    if tuple(logits_shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"{what}: targets must have shape {tuple(logits_shape[:-1])} (the leading dims of the "
            f"input), got {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"{what}: targets must be class indices (an integer dtype), got {targets.dtype}")


def _mean(rows_N: torch.Tensor, targets_N: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return rows_N.sum() / (targets_N != ignore_index).sum().clamp_min(1).to(torch.float32)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, z_loss: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of ``logits[..., V]`` against integer ``targets[...]``.

    Computed in float32 whatever the logits' dtype, without a float32 copy of the logits:
    on CUDA a Triton kernel runs an online softmax over vocabulary blocks (forward) and writes
    the gradient in the logits' dtype (backward); on CPU the same math runs in torch. Targets
    equal to ``ignore_index`` count neither in the sum nor in the mean's denominator (counted
    on the device, no host sync).

    Args:
      logits: ``[..., V]`` unnormalized scores.
      targets: ``[...]`` class indices, integer dtype.
      ignore_index: the target value to skip.
      z_loss: adds ``z_loss * logsumexp(logits)**2`` per row (PaLM's auxiliary loss).

    Returns:
      A float32 0-d tensor.

    Example:
      >>> fsg.nn.cross_entropy(torch.zeros(2, 4), torch.tensor([1, 3]))
      tensor(1.3863)
    """
    _check("cross_entropy", logits.shape, targets)
    logits_NV, targets_N = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if fused_ops_enabled():
        rows, _ = cross_entropy_fwd(logits_NV, targets_N, ignore_index, float(z_loss))
    else:
        rows, _ = rows_reference(logits_NV, targets_N, ignore_index, z_loss)
    return _mean(rows, targets_N, ignore_index)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(h @ weight.T, targets)`` without ever holding all the logits.

    The output projection is fused in: tokens are processed in chunks of ``chunk_size`` rows
    (default: about 1 GiB of logits), and each chunk's logits turn into their gradient on
    the spot, so peak memory is one chunk of logits plus a float32 ``weight`` gradient, not
    ``N x V`` float32 logits, their softmax and their gradient. The forward computes the
    gradients (a train step always needs them); without autograd it computes the loss only.

    Args:
      h: ``[..., D]`` hidden states (e.g. bfloat16); the logits are computed in this dtype.
      weight: ``[V, D]`` output projection (the tied embedding in a GPT).
      targets: ``[...]`` class indices.
      ignore_index, z_loss: as in ``cross_entropy``.
      chunk_size: rows per chunk.

    Returns:
      The float32 0-d mean loss.

    Example:
      >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
      >>> t = torch.tensor([1, 2, 3, 4, 5, -100])
      >>> torch.allclose(fsg.nn.linear_cross_entropy(h, w, t), fsg.nn.cross_entropy(h @ w.T, t))
      True
    """
    _check("linear_cross_entropy", (*h.shape[:-1], weight.shape[0]), targets)
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must have shape [V, {h.shape[-1]}], got {tuple(weight.shape)}")
    h_ND, targets_N = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    chunk = chunk_size or default_chunk(weight.shape[0], h.element_size())
    if not fused_ops_enabled():
        # On a mesh: the sum over this rank's tokens (DTensor adds the shards' sums, see
        # dtensor_rules.py), divided by the count of all of them.
        loss_sum = linear_cross_entropy_sum(h_ND, weight, targets_N, ignore_index, float(z_loss), chunk, with_grad)[0]
        return loss_sum / (targets_N != ignore_index).sum().clamp_min(1).to(torch.float32)
    return linear_cross_entropy_fwd(h_ND, weight, targets_N, ignore_index, float(z_loss), chunk, with_grad)[0]
