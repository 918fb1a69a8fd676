"""LayerNorm forward and backward: Triton kernels, launchers, the registered ops, the reference.

Shape legend: M rows (every leading dim flattened), N the normalized width.
y = (x - mean) * rstd * w + b, statistics in float32 whatever the input dtype. Each program
normalizes a tile of rows (``RowTiling``); the backward writes dx and one float32 partial of
dw and of db per program, which one ``column_sum`` launch each sums (no memset).
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import RowTiling, fused_ops_enabled, row_tile, tl, triton, use_triton
from fsg._src.kernels.column_sum import column_sum


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    rows, row_ok, mask, offs = row_tile(tl.program_id(0) * ROWS, M, N, ROWS, BLOCK)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
    ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        rows, row_ok, mask, offs = row_tile((pid * ITERS + it) * ROWS, M, N, ROWS, BLOCK)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        dxhat = dy * w[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) / N
        c2 = tl.sum(dxhat, axis=1) / N
        dx = rstd[:, None] * (dxhat - c2[:, None] - xhat * c1[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cols < N)
    tl.store(db_part_ptr + pid * N + cols, db, mask=cols < N)


# --- host launchers: write into given outputs (the tests poison them first) ---------------


def launch_fwd(x_MN, w, b, y_MN, mean_M, rstd_M, eps: float, tiling: RowTiling | None = None) -> None:
    M, N = x_MN.shape
    t = tiling or RowTiling(M, N)
    _layer_norm_fwd_kernel[(triton.cdiv(M, t.rows),)](
        x_MN, w, b, y_MN, mean_M, rstd_M, M, N, eps, ROWS=t.rows, BLOCK=t.block, num_warps=t.num_warps
    )


def launch_bwd(dy_MN, x_MN, w, mean_M, rstd_M, dx_MN, dw_part_PN, db_part_PN, tiling: RowTiling | None = None):
    """The partials have ``tiling.programs`` rows (default tiling: ``RowTiling(M, N,
    backward=True)``); their sums are dw and db."""
    M, N = x_MN.shape
    t = tiling or RowTiling(M, N, backward=True)
    _layer_norm_bwd_kernel[(t.programs,)](
        dy_MN, x_MN, w, mean_M, rstd_M, dx_MN, dw_part_PN, db_part_PN, M, N,
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, num_warps=t.num_warps,
    )  # fmt: skip


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
    programs = RowTiling(M, N, backward=True).programs
    dw_part = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    db_part = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    launch_bwd(
        dy.reshape(M, N).contiguous(), x_MN, w.contiguous(), mean.reshape(M).contiguous(),
        rstd.reshape(M).contiguous(), dx_MN, dw_part, db_part,
    )  # fmt: skip
    return dx_MN.reshape(x.shape), column_sum(dw_part).to(w.dtype), column_sum(db_part).to(w.dtype)


@layer_norm_fwd.register_fake
def _(x, w, b, eps):
    lead = x.shape[:-1]
    stats = torch.empty(lead, dtype=torch.float32, device=x.device)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@layer_norm_bwd.register_fake
def _(dy, x, w, mean, rstd):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # mean and rstd get no gradient: no zeros kernels
    x, w, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, w, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # y was not used
        return None, None, None, None
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
