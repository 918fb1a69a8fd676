"""Fused AdamW: one Triton launch updates every tensor of a dtype group in place.

Shape legend: T tensors in the group, B blocks over all of them (each block lies in one
tensor). The multi-tensor kernel reads each tensor's base address from int64 tables
(params, grads, first and second moments), so one launch covers the whole group; a block
table maps each program to ``(tensor, offset)`` (``_multi_tensor.py``). A CUDA graph replays
that one launch too: the warm-up before the capture uploads the state's tables and sets aside
the gradients' (their addresses are only known while capturing). A capture without a warm-up
takes one launch per tensor, which cost ~0.3 ms a step more at 125M on an H200.

The math is the traced ``fsg.optim.adamw`` update, op for op, in float32:
``m' = b1 m + (1-b1) g``, ``v' = b2 v + (1-b2) g g``,
``u = (m'/(1-b1^t)) / (sqrt(v'/(1-b2^t)) + eps) + wd p``, ``p' = p + (-lr) u``, where ``t`` is
the update count after this step and ``lr`` a 0-d tensor: both stay on the device (the two
bias corrections are two tiny torch ops before the launch), so a schedule never forces a
recompile or a host sync. An optional 0-d bool ``finite`` skips the whole update where it is
False (a step with a non-finite loss or gradient, docs/resilience.md): it travels as the third
entry of the bias-correction tensor and masks every load and store off.
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import HAS_TRITON, capturing, tl, triton, use_triton
from fsg._src.kernels._multi_tensor import MAX_CACHED, Blocks, addresses, upload

# Elements per program and warps: the best of the sweep in benchmarks/kernels.py on an H200
# (512/4: 98% of copy bandwidth; 1024/4: 82%; 4096/16: 76%).
BLOCK = 512
NUM_WARPS = 4


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, wd, bias_ptr, lr_ptr, b1, b2, omb1, omb2, eps):
    bias1 = tl.load(bias_ptr)
    bias2 = tl.load(bias_ptr + 1)
    # 0: a skipped (non-finite) step writes nothing (broadcast to a vector: the interpreter
    # refuses a vector mask & a scalar)
    mask = mask & ((tl.zeros_like(offs).to(tl.float32) + tl.load(bias_ptr + 2)) != 0.0)
    neg_lr = -tl.load(lr_ptr).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = b1 * m + omb1 * g  # omb = 1 - b, computed in double on the host as the traced math does:
    v = b2 * v + omb2 * g * g  # 1 - b2 in float32 is off by 1e-5 relative for b2=0.999
    u = (m / bias1) / (tl.sqrt(v / bias2) + eps) + wd * p
    p = p + neg_lr * u
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_multi_tensor_kernel(
    p_addrs,
    g_addrs,
    m_addrs,
    v_addrs,
    numels,
    wds,
    block_tensor,
    block_offset,
    bias_ptr,
    lr_ptr,
    b1,
    b2,
    omb1,
    omb2,
    eps,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = tl.load(block_tensor + pid)
    offs = tl.load(block_offset + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + i)
    p_ptr = tl.load(p_addrs + i).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_addrs + i).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(m_addrs + i).to(tl.pointer_type(S_DTYPE))
    v_ptr = tl.load(v_addrs + i).to(tl.pointer_type(S_DTYPE))
    wd = tl.load(wds + i)
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, wd, bias_ptr, lr_ptr, b1, b2, omb1, omb2, eps)


@triton.jit
def _adamw_tensor_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, numel, wd, bias_ptr, lr_ptr, b1, b2, omb1, omb2, eps, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < numel, wd, bias_ptr, lr_ptr, b1, b2, omb1, omb2, eps)


# The kernels' element types (none without triton, when no kernel is launched).
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if HAS_TRITON else {}


class _Tables:
    """The state's tables of one multi-tensor launch (addresses of params and moments, weight
    decays, blocks), cached by the state tensors' addresses: a compiled step passes the same
    state storages every call. The gradients' table follows the gradients (``addresses``)."""

    def __init__(self, params, mus, nus, wds, block):
        device = params[0].device
        self.blocks = Blocks([p.numel() for p in params], block, device)
        self.addrs = [upload([t.data_ptr() for t in group], torch.int64, device) for group in (params, mus, nus)]
        self.wds = upload(wds, torch.float32, device)


_TABLES: dict[tuple, _Tables] = {}


def _key(params, mus, nus, wds, block) -> tuple:
    return (block, tuple(wds), *((t.data_ptr(), t.numel()) for t in (*params, *mus, *nus)))


def bias_corrections(count: torch.Tensor, b1: float, b2: float, finite: torch.Tensor | None = None) -> torch.Tensor:
    """``[1 - b1^t, 1 - b2^t, update?]`` (float32, on the device) for the count ``t``, computed
    as the traced update computes them (``1 - b2^t`` cancels badly for small t: an approximate
    in-kernel ``exp`` was off by 1e-4 relative at t=1); ``update?`` is 1, or ``finite``."""
    t = count.to(torch.float32)
    ok = torch.ones_like(t) if finite is None else finite.to(torch.float32)
    return torch.stack([1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t), ok])


def launch_per_tensor(params, grads, mus, nus, count, lr, b1, b2, eps, wds, block: int = BLOCK, finite=None) -> None:
    """The same update as ``launch``, one launch per tensor (no device tables: capturable)."""
    consts = (bias_corrections(count, b1, b2, finite), lr, b1, b2, 1.0 - b1, 1.0 - b2, eps)
    for p, g, m, v, wd in zip(params, grads, mus, nus, wds):
        _adamw_tensor_kernel[(triton.cdiv(p.numel(), block),)](p, g, m, v, p.numel(), wd, *consts, BLOCK=block)


def launch(
    params, grads, mus, nus, count, lr, b1, b2, eps, wds, block: int = BLOCK, num_warps: int = NUM_WARPS, finite=None
) -> None:
    """Updates ``params``, ``mus``, ``nus`` in place (all contiguous, one dtype per role);
    nothing where the 0-d bool ``finite`` is False."""
    if not params:
        return
    key = _key(params, mus, nus, wds, block)
    tables = _TABLES.get(key)
    if tables is None and not capturing(params[0].device):  # while capturing: the warm-up's tables
        if len(_TABLES) >= MAX_CACHED:
            _TABLES.clear()
        tables = _TABLES[key] = _Tables(params, mus, nus, wds, block)
    grad_addrs, (tables,) = addresses(grads, ("adamw", key), (tables,))
    if grad_addrs is None:  # a capture without a warm-up: one launch per tensor needs no tables
        launch_per_tensor(params, grads, mus, nus, count, lr, b1, b2, eps, wds, block, finite)
        return
    consts = (bias_corrections(count, b1, b2, finite), lr, b1, b2, 1.0 - b1, 1.0 - b2, eps)
    p_addrs, m_addrs, v_addrs = tables.addrs
    blocks = tables.blocks
    _adamw_multi_tensor_kernel[(blocks.num_blocks,)](
        p_addrs,
        grad_addrs,
        m_addrs,
        v_addrs,
        blocks.numels,
        tables.wds,
        blocks.block_tensor,
        blocks.block_offset,
        *consts,
        P_DTYPE=_TL_DTYPES[params[0].dtype],
        G_DTYPE=_TL_DTYPES[grads[0].dtype],
        S_DTYPE=_TL_DTYPES[mus[0].dtype],
        BLOCK=block,
        num_warps=num_warps,
    )


# --- eager reference: the traced fsg.optim.adamw math, op for op ---------------------------


def adamw_reference(params, grads, mus, nus, count, lr, b1, b2, eps, wds, finite=None) -> None:
    t = count.to(torch.float32)
    bias1 = 1.0 - torch.pow(b1, t)
    bias2 = 1.0 - torch.pow(b2, t)
    neg_lr = -1.0 * lr.to(torch.float32)
    keep = (lambda new, old: new) if finite is None else (lambda new, old: torch.where(finite, new, old))
    for p, g, m, v, wd in zip(params, grads, mus, nus, wds):
        m_new = (b1 * m + (1.0 - b1) * g).to(m.dtype)  # rounded as copy_ into the state rounds it
        v_new = (b2 * v + (1.0 - b2) * g * g).to(v.dtype)
        u = (m_new / bias1) / (torch.sqrt(v_new / bias2) + eps)
        if wd:
            u = u + wd * p
        p.copy_(keep(p + (neg_lr * u).to(p.dtype), p))
        m.copy_(keep(m_new, m))
        v.copy_(keep(v_new, v))


# --- the registered op: one node in the step graph (the stage-3 pass inserts it) -----------


def _groups(params, grads, mus, nus, wds):
    """Splits the tensors into groups of one (param, grad, state) dtype triple."""
    groups: dict[tuple, list] = {}
    for item in zip(params, grads, mus, nus, wds):
        groups.setdefault((item[0].dtype, item[1].dtype, item[2].dtype), []).append(item)
    return [tuple(map(list, zip(*items))) for items in groups.values()]


@torch.library.custom_op("fsg::fused_adamw_", mutates_args=("params", "mus", "nus"))
def fused_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    mus: list[torch.Tensor],
    nus: list[torch.Tensor],
    count: torch.Tensor,
    lr: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
    weight_decays: list[float],
    finite: torch.Tensor | None = None,
) -> None:
    """One AdamW step on many tensors, in place (see the module docstring for the math);
    none where ``finite`` (a 0-d bool) is False."""
    if not params:
        return
    if not use_triton(params[0]):
        adamw_reference(params, grads, mus, nus, count, lr, b1, b2, eps, weight_decays, finite)
        return
    grads = [g.contiguous() for g in grads]
    for group in _groups(params, grads, mus, nus, weight_decays):
        launch(*group[:4], count, lr, b1, b2, eps, group[4], finite=finite)


@fused_adamw_.register_fake
def _(params, grads, mus, nus, count, lr, b1, b2, eps, weight_decays, finite=None):
    return None
