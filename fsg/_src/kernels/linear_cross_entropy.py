"""Cross-entropy with the output projection fused in: the registered ops and the functional
API, built on the row kernels of ``cross_entropy.py``.

Shape legend: N rows (tokens), V vocabulary, D hidden width, C rows per chunk.
``linear_cross_entropy`` walks the tokens in chunks of C rows, computes the chunk's logits
(``h_C @ W.T``, in h's dtype), the loss and, in the same visit, the logits' gradient in place,
then ``dh_C = dlogits @ W`` and ``dW += dlogits.T @ h_C`` (float32 accumulator, written by the
GEMM itself on CUDA). Only one chunk of logits ever exists; the backward just scales ``dh``
and ``dW`` by the incoming gradient. Two ops share the math: the mean over the rows (one
device) and their sum (a mesh, where ``dtensor_rules.py`` lets DTensor add the shards' sums).
"""

from __future__ import annotations

import torch

from fsg._src.kernels._common import fused_ops_enabled
from fsg._src.kernels.cross_entropy import _check, _rows, _rows_and_grad_inplace


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
        dw32 = _add_weight_grad(dw32, logits_CV.T, h[rows], last=start + chunk >= N)
    if with_grad and dw32 is None:  # no rows at all (an empty shard)
        dw32 = torch.zeros_like(weight)
    dw = dw32.to(weight.dtype) if with_grad else weight.new_empty(0)
    return loss_N.sum() * scale, dh, dw


def _add_weight_grad(dw32, dlogits_VC, h_CD, last: bool):
    """``dw32 + dlogits_VC @ h_CD``: the weight gradient summed over the chunks in float32.
    The first chunk starts it (in the inputs' dtype when it is the only one: no float32
    accumulator at all). On CUDA, 16-bit GEMMs write float32 and add into the accumulator
    themselves (``out_dtype``: no float32 copy of each chunk's gradient, no separate add)."""
    if dw32 is None and last:
        return dlogits_VC @ h_CD
    if _float32_out(h_CD):
        if dw32 is None:
            return torch.mm(dlogits_VC, h_CD, out_dtype=torch.float32)
        return torch.addmm(dw32, dlogits_VC, h_CD, out_dtype=torch.float32, out=dw32)
    dw_chunk = (dlogits_VC @ h_CD).float()
    return dw_chunk if dw32 is None else dw32.add_(dw_chunk)


def _float32_out(h: torch.Tensor) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``h``: 16-bit inputs on CUDA
    (the CPU build has no kernel for it)."""
    return h.is_cuda and h.dtype in (torch.bfloat16, torch.float16)


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


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(h @ weight.T, targets)`` without ever holding all the logits.

    The output projection is fused in: tokens are processed in chunks of ``chunk_size`` rows
    (default: about 1 GiB of logits), and each chunk's logits turn into their gradient on
    the spot, so peak memory is one chunk of logits plus a float32 ``weight`` gradient, not
    ``N x V`` float32 logits, their softmax and their gradient. The forward computes the
    gradients (a train step always needs them); without autograd it computes the loss only.

    Args:
      h: ``[..., D]`` hidden states (e.g. bfloat16); the logits are computed in this dtype, or
        under ``torch.autocast`` in autocast's dtype, as ``F.linear`` would be (the loss is
        float32 either way).
      weight: ``[V, D]`` output projection (the tied embedding in a GPT).
      targets: ``[...]`` class indices.
      ignore_index, z_loss: as in ``cross_entropy``.
      chunk_size: rows per chunk.
      reduction: ``"mean"`` over the targets that are not ``ignore_index`` (0 when there are
        none), or ``"sum"``.

    Returns:
      The float32 0-d loss.

    Example:
      >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
      >>> t = torch.tensor([1, 2, 3, 4, 5, -100])
      >>> torch.allclose(fsg.nn.linear_cross_entropy(h, w, t), fsg.nn.cross_entropy(h @ w.T, t))
      True
    """
    _check("linear_cross_entropy", (*h.shape[:-1], weight.shape[0]), targets)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must have shape [V, {h.shape[-1]}], got {tuple(weight.shape)}")
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):  # the projection is a matmul: autocast's dtype
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    h_ND, targets_N = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    chunk = chunk_size or default_chunk(weight.shape[0], h.element_size())
    if reduction == "sum" or not fused_ops_enabled():
        # On a mesh, the mean is the sum over this rank's tokens (DTensor adds the shards' sums,
        # see dtensor_rules.py) divided by the count of all of them.
        loss_sum = linear_cross_entropy_sum(h_ND, weight, targets_N, ignore_index, float(z_loss), chunk, with_grad)[0]
        if reduction == "sum":
            return loss_sum
        return loss_sum / (targets_N != ignore_index).sum().clamp_min(1).to(torch.float32)
    return linear_cross_entropy_fwd(h_ND, weight, targets_N, ignore_index, float(z_loss), chunk, with_grad)[0]
