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

``linear_cross_entropy.py`` builds the projection-fused loss on these kernels.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import fused_ops_enabled, tl, triton, use_triton

BLOCK_V = 4096  # vocabulary columns per iteration of a row's loop
# The forward + backward kernel over rows that wide runs 16 warps: 0.87 against 1.20 ms with
# 4 for 10672 x 50304 bf16 logits on an H200 (8 warps 1.05; 2048 or 8192 columns an iteration,
# rows walked by 1-8 programs per SM, or a whole row in registers were no faster: RESULTS.md)


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
    (the second pass re-reads the row, partly from L2)."""
    _row_fwd_bwd(x_ptr, stride, t_ptr, loss_ptr, drow_ptr, tl.program_id(0).to(tl.int64), ignore_index, z_loss, V, BLOCK)


@triton.jit
def _row_fwd_bwd(x_ptr, stride, t_ptr, loss_ptr, drow_ptr, row, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr):
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
    block = _block(V)
    _ce_fwd_bwd_kernel[(N,)](
        x_NV, x_NV.stride(0), targets_N, loss_N, drow_N, ignore_index, z_loss, V=V, BLOCK=block,
        num_warps=16 if block >= BLOCK_V else 4,
    )  # fmt: skip


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
