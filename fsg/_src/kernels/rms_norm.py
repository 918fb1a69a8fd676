"""RMSNorm forward and backward: Triton kernels, launchers, the registered op, its reference.

Shape legend: M rows (every leading dim flattened), N the normalized width.
y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), computed in float32 whatever the
input dtype. Each program normalizes a tile of rows (``RowTiling``); the backward writes dx and
one float32 partial of dw per program, which one ``column_sum`` launch sums (no memset).
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import RowTiling, fused_ops_enabled, row_tile, tl, triton, use_triton
from fsg._src.kernels.column_sum import column_sum


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, row_ok, mask, offs = row_tile(tl.program_id(0) * ROWS, M, N, ROWS, BLOCK)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(y_ptr + offs, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, N,
    ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        rows, row_ok, mask, offs = row_tile((pid * ITERS + it) * ROWS, M, N, ROWS, BLOCK)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        dxhat = dy * w[None, :]
        dx = rstd[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / N)[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cols < N)


# --- host launchers: write into given outputs (the tests poison them first) ---------------


def launch_fwd(x_MN, w, y_MN, rstd_M, eps: float, tiling: RowTiling | None = None) -> None:
    M, N = x_MN.shape
    t = tiling or RowTiling(M, N)
    grid = (triton.cdiv(M, t.rows),)
    _rms_norm_fwd_kernel[grid](x_MN, w, y_MN, rstd_M, M, N, eps, ROWS=t.rows, BLOCK=t.block, num_warps=t.num_warps)


def launch_bwd(dy_MN, x_MN, w, rstd_M, dx_MN, dw_part_PN, tiling: RowTiling | None = None) -> None:
    """``dw_part_PN`` has ``tiling.programs`` rows (default tiling: ``RowTiling(M, N,
    backward=True)``); their sum is dw."""
    M, N = x_MN.shape
    t = tiling or RowTiling(M, N, backward=True)
    _rms_norm_bwd_kernel[(t.programs,)](
        dy_MN, x_MN, w, rstd_M, dx_MN, dw_part_PN, M, N,
        ROWS=t.rows, ITERS=t.iters, BLOCK=t.block, num_warps=t.num_warps,
    )  # fmt: skip


# --- eager reference (tests and benchmarks import it) -----------------------------------


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` in plain torch, float32 math: the definition the kernels are held to."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return (x32 * rstd[..., None] * w.float()).to(x.dtype), rstd


def rms_norm_backward_reference(dy, x, w, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    x32, dy32, w32 = x.float(), dy.float(), w.float()
    xhat = x32 * rstd[..., None]
    dxhat = dy32 * w32
    dx = rstd[..., None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (dy32 * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


# --- registered ops: one opaque node each in a traced graph ------------------------------
# torch.library.custom_op rather than triton_op: Inductor and AOTAutograd trace *into* a
# triton_op's body, which Triton's CPU interpreter cannot follow; an opaque op is one node for
# make_fx, AOTAutograd and Inductor alike, with its fake and autograd registered below.


@torch.library.custom_op("fsg::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return rms_norm_reference(x, w, eps)
    x_MN = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x_MN.shape
    y_MN = torch.empty_like(x_MN)
    rstd_M = torch.empty(M, dtype=torch.float32, device=x.device)
    launch_fwd(x_MN, w.contiguous(), y_MN, rstd_M, eps)
    return y_MN.reshape(x.shape), rstd_M.reshape(x.shape[:-1])


@torch.library.custom_op("fsg::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return rms_norm_backward_reference(dy, x, w, rstd)
    x_MN = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x_MN.shape
    dx_MN = torch.empty_like(x_MN)
    dw_part_PN = torch.empty((RowTiling(M, N, backward=True).programs, N), dtype=torch.float32, device=x.device)
    launch_bwd(dy.reshape(M, N).contiguous(), x_MN, w.contiguous(), rstd.reshape(M).contiguous(), dx_MN, dw_part_PN)
    return dx_MN.reshape(x.shape), column_sum(dw_part_PN).to(w.dtype)


@rms_norm_fwd.register_fake
def _(x, w, eps):
    return torch.empty_like(x), torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


@rms_norm_bwd.register_fake
def _(dy, x, w, rstd):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # rstd gets no gradient: no zeros kernel for it
    x, w, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, w, rstd)


def _backward(ctx, dy, _drstd):
    if dy is None:  # y was not used
        return None, None, None
    x, w, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, w, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --- functional API ---------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight``, statistics in float32.

    Forward and backward are fused Triton kernels on CUDA (one registered op each, a single
    node in a traced step); on CPU the eager reference runs.

    Example:
      >>> fsg.nn.rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), eps=0.0)
      tensor([[0.8485, 1.1314]])
    """
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    if not fused_ops_enabled():  # e.g. under a mesh: plain math that DTensor can shard
        return rms_norm_reference(x, weight, eps)[0]
    return rms_norm_fwd(x, weight, eps)[0]
