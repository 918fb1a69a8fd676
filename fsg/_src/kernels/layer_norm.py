"""LayerNorm forward and backward: Triton kernels, launchers, the registered ops, the reference.

Shape legend: M rows (every leading dim flattened), N the normalized width.
y = (x - mean) * rstd * w + b, statistics in float32 whatever the input dtype. One program
normalizes one row; the backward writes dx per row and per-row float32 partials of dw and db
that one torch reduction sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsg._src.kernels._common import fused_ops_enabled, row_block, use_triton


@triton.jit
def _layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_rows_ptr, db_rows_ptr, N, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    dxhat = dy * w
    c1 = tl.sum(dxhat * xhat, axis=0) / N
    c2 = tl.sum(dxhat, axis=0) / N
    dx = rstd * (dxhat - c2 - xhat * c1)
    tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_rows_ptr + row * N + cols, dy * xhat, mask=mask)
    tl.store(db_rows_ptr + row * N + cols, dy, mask=mask)


# --- host launchers: write into given outputs (the tests poison them first) ---------------


def launch_fwd(x_MN, w, b, y_MN, mean_M, rstd_M, eps: float) -> None:
    M, N = x_MN.shape
    _layer_norm_fwd_kernel[(M,)](x_MN, w, b, y_MN, mean_M, rstd_M, N, eps, BLOCK=row_block(N))


def launch_bwd(dy_MN, x_MN, w, mean_M, rstd_M, dx_MN, dw_rows_MN, db_rows_MN) -> None:
    M, N = x_MN.shape
    _layer_norm_bwd_kernel[(M,)](dy_MN, x_MN, w, mean_M, rstd_M, dx_MN, dw_rows_MN, db_rows_MN, N, BLOCK=row_block(N))


# --- eager reference (tests and benchmarks import it) -----------------------------------


def layer_norm_reference(x, w, b, eps: float):
    """``(y, mean, rstd)`` in plain torch, float32 statistics."""
    x32 = x.float()
    mean = x32.mean(-1)
    rstd = torch.rsqrt(x32.var(-1, unbiased=False) + eps)
    y = (x32 - mean[..., None]) * rstd[..., None] * w.float() + b.float()
    return y.to(x.dtype), mean, rstd


def layer_norm_backward_reference(dy, x, w, mean, rstd):
    x32, dy32 = x.float(), dy.float()
    xhat = (x32 - mean[..., None]) * rstd[..., None]
    dxhat = dy32 * w.float()
    dx = rstd[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    n = x.shape[-1]
    return dx.to(x.dtype), (dy32 * xhat).reshape(-1, n).sum(0).to(w.dtype), dy32.reshape(-1, n).sum(0).to(w.dtype)


# --- registered ops: one opaque node each in a traced graph (see rms_norm.py for why) -----


@torch.library.custom_op("fsg::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return layer_norm_reference(x, w, b, eps)
    x_MN = x.reshape(-1, x.shape[-1]).contiguous()
    M = x_MN.shape[0]
    y_MN = torch.empty_like(x_MN)
    mean_M = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd_M = torch.empty(M, dtype=torch.float32, device=x.device)
    launch_fwd(x_MN, w.contiguous(), b.contiguous(), y_MN, mean_M, rstd_M, eps)
    lead = x.shape[:-1]
    return y_MN.reshape(x.shape), mean_M.reshape(lead), rstd_M.reshape(lead)


@torch.library.custom_op("fsg::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return layer_norm_backward_reference(dy, x, w, mean, rstd)
    x_MN = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x_MN.shape
    dx_MN = torch.empty_like(x_MN)
    dw_rows = torch.empty((M, N), dtype=torch.float32, device=x.device)
    db_rows = torch.empty((M, N), dtype=torch.float32, device=x.device)
    launch_bwd(
        dy.reshape(M, N).contiguous(), x_MN, w.contiguous(), mean.reshape(M).contiguous(),
        rstd.reshape(M).contiguous(), dx_MN, dw_rows, db_rows,
    )  # fmt: skip
    return dx_MN.reshape(x.shape), dw_rows.sum(0).to(w.dtype), db_rows.sum(0).to(w.dtype)


@layer_norm_fwd.register_fake
def _(x, w, b, eps):
    lead = x.shape[:-1]
    stats = torch.empty(lead, dtype=torch.float32, device=x.device)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@layer_norm_bwd.register_fake
def _(dy, x, w, mean, rstd):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, w, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, w, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(dy, x, w, mean, rstd)
    return dx, dw, db, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- functional API ---------------------------------------------------------------------


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5):
    """LayerNorm over the last dim with an affine ``weight`` (and ``bias``), statistics in
    float32. Fused Triton kernels on CUDA (one node each way in a traced step); the eager
    reference on CPU.

    Example:
      >>> fsg.nn.layer_norm(torch.tensor([[1.0, 3.0]]), torch.ones(2), torch.zeros(2), eps=0.0)
      tensor([[-1.,  1.]])
    """
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        shapes = (tuple(weight.shape), None if bias is None else tuple(bias.shape))
        raise ValueError(f"layer_norm: weight and bias must have shape [{n}], got {shapes}")
    if bias is None:
        bias = torch.zeros_like(weight)
    if not fused_ops_enabled():  # e.g. under a mesh: plain math that DTensor can shard
        return layer_norm_reference(x, weight, bias, eps)[0]
    return layer_norm_fwd(x, weight, bias, eps)[0]
