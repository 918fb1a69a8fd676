"""Fused AdamW: one Triton launch updates every tensor of a dtype group in place.

Shape legend: T tensors in the group, B blocks over all of them (each block lies in one
tensor). The multi-tensor kernel reads each tensor's base address from int64 tables
(params, grads, first and second moments), so one launch covers the whole group; a block
table maps each program to ``(tensor, offset)``. A CUDA graph keeps the one launch too: the
warm-up run before a capture uploads the state's tables and sets aside a pinned host buffer
for the gradients' addresses, which are only known while capturing; the capture writes them
there and records the host-to-device copy (a graph replays a copy from pinned memory), so the
graph replays one launch per group, not one per tensor (per-tensor launches, still used when a
capture had no warm-up, cost ~0.3 ms a step on a 125M model: benchmarks/RESULTS.md).

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

from fsg._src.kernels._common import HAS_TRITON, capturing, in_capture_warmup, keep_alive, tl, triton, use_triton

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


def _upload(values, dtype, device) -> torch.Tensor:
    """A host list as a device tensor, copied from pinned memory without a host sync (the
    caching host allocator keeps the pinned buffer until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Tables:
    """The device tables of one multi-tensor launch, cached by the state tensors' addresses (a
    compiled step passes the same state storages every call). Gradients are new tensors each
    call, often at the same addresses: their table is uploaded again only when one moved."""

    def __init__(self, params, mus, nus, wds, block):
        device = params[0].device
        blocks = [triton.cdiv(p.numel(), block) for p in params]
        self.num_blocks = sum(blocks)
        self.addrs = [_upload([t.data_ptr() for t in group], torch.int64, device) for group in (params, mus, nus)]
        self.numels = _upload([p.numel() for p in params], torch.int64, device)
        self.wds = _upload(wds, torch.float32, device)
        self.block_tensor = _upload([i for i, n in enumerate(blocks) for _ in range(n)], torch.int32, device)
        self.block_offset = _upload([j * block for n in blocks for j in range(n)], torch.int64, device)
        self.grad_ptrs: list[int] = []
        self.grad_addrs: torch.Tensor | None = None

    def grads(self, grads) -> torch.Tensor:
        ptrs = [g.data_ptr() for g in grads]
        if ptrs != self.grad_ptrs:
            self.grad_ptrs, self.grad_addrs = ptrs, _upload(ptrs, torch.int64, grads[0].device)
        return self.grad_addrs


class _CapturedGrads:
    """The gradient-address table of one launch inside a CUDA graph: a pinned host buffer that
    the capture fills with the gradients' addresses (fixed in the graph's memory pool) and a
    device table that the graph copies it into at each replay. Made in the warm-up run before
    the capture (allocating pinned memory while capturing is not allowed); it and the state
    tables it holds live as long as the graph (``keep_alive``)."""

    def __init__(self, tables: _Tables, count: int, device: torch.device):
        self.tables = tables  # a later eviction from _TABLES must not free what the graph reads
        self.host = torch.empty(count, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = torch.empty(count, dtype=torch.int64, device=device)

    def addresses(self, grads) -> torch.Tensor:
        self.host.copy_(torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64))
        self.device.copy_(self.host, non_blocking=True)  # recorded: replayed from the pinned buffer
        return self.device


_TABLES: dict[tuple, _Tables] = {}
_MAX_CACHED = 256  # a step on a mesh launches one update per gradient bucket
_FOR_CAPTURE: dict[tuple, _CapturedGrads] = {}  # set aside by a warm-up run for the capture after it


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
    if capturing(params[0]):  # the tables the warm-up uploaded, or one launch per tensor without one
        captured = _FOR_CAPTURE.pop(key, None)
        if captured is None:
            launch_per_tensor(params, grads, mus, nus, count, lr, b1, b2, eps, wds, block, finite)
            return
        keep_alive(captured)
        tables, grad_addrs = captured.tables, captured.addresses(grads)
    else:
        tables = _TABLES.get(key)
        if tables is None:
            if len(_TABLES) >= _MAX_CACHED:
                _TABLES.clear()
            tables = _TABLES[key] = _Tables(params, mus, nus, wds, block)
        grad_addrs = tables.grads(grads)
        if in_capture_warmup():
            if len(_FOR_CAPTURE) >= _MAX_CACHED:  # warm-ups whose capture never came (it failed)
                _FOR_CAPTURE.clear()
            _FOR_CAPTURE[key] = _CapturedGrads(tables, len(grads), params[0].device)
    consts = (bias_corrections(count, b1, b2, finite), lr, b1, b2, 1.0 - b1, 1.0 - b2, eps)
    p_addrs, m_addrs, v_addrs = tables.addrs
    _adamw_multi_tensor_kernel[(tables.num_blocks,)](
        p_addrs,
        grad_addrs,
        m_addrs,
        v_addrs,
        tables.numels,
        tables.wds,
        tables.block_tensor,
        tables.block_offset,
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
