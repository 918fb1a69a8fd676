"""The torch baseline for fsg's 2-D meshes: torchtitan's recipe (tensor parallel over ``tp``,
then FSDP2 over ``dp``, each block ``torch.compile``d) applied to the example GPT.

The GPT's attention has one fused ``qkv`` projection whose output rows are ``[q | k | v]``.
Megatron's column split of that weight would hand rank 0 all of ``q`` and half of ``k``, so
the rows are permuted first to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``q_r``: the rows of
rank r's heads); each rank's ``Shard(0)`` piece then holds q, k and v of its own heads, and the
attention runs on those heads only (``_local_heads_forward``). The permuted model computes
the same function as the original (``check`` asserts it on the mesh). The tied token
embedding / output head stays whole over ``tp`` (FSDP still shards it over ``dp``).

Shape legend: B batch, T time, D model width, K head dim, R = D / tp rows of one part per rank.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def permute_qkv(qkv: nn.Linear, tp: int) -> None:
    """Reorders ``qkv``'s output rows from ``[q | k | v]`` to rank-major ``[q_r k_r v_r]``."""
    d3 = qkv.weight.shape[0]
    index = torch.arange(d3, device=qkv.weight.device).view(3, tp, d3 // (3 * tp)).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        qkv.weight.copy_(qkv.weight[index])
        if qkv.bias is not None:
            qkv.bias.copy_(qkv.bias[index])


def _local_heads_forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
    """The example's attention on whatever heads this rank's ``qkv`` piece holds."""
    B, T, _ = x_BTD.shape
    q_BTR, k_BTR, v_BTR = self.qkv(x_BTD).chunk(3, dim=-1)
    q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q_BTR, k_BTR, v_BTR))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Megatron's plan on every block: qkv and fc column-parallel, proj and fc_proj row-parallel
    (one all-reduce after each pair, forward and backward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "fc_proj": RowwiseParallel(),
    }
    for block in model.blocks:
        attn = block.attn
        if attn.n_head % tp:
            raise SystemExit(f"{attn.n_head} heads do not split over tp={tp}")
        permute_qkv(attn.qkv, tp)
        attn.head_dim = attn.qkv.weight.shape[1] // attn.n_head
        attn.forward = types.MethodType(_local_heads_forward, attn)
        parallelize_module(block, tp_mesh, plan)


def fsdp2_tp(model: nn.Module, mesh, policy) -> nn.Module:
    """Tensor parallel over ``mesh["tp"]`` (if the mesh has it), each block compiled, then
    ``fully_shard`` of each block and of the model over ``mesh["dp"]``; returns the model."""
    from torch.distributed.fsdp import fully_shard

    if "tp" in mesh.mesh_dim_names:
        tensor_parallel(model, mesh["tp"])
    dp_mesh = mesh["dp"] if "dp" in mesh.mesh_dim_names else None
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
        if dp_mesh is not None:
            fully_shard(model.blocks[i], mesh=dp_mesh, mp_policy=policy)
    return fully_shard(model, mesh=dp_mesh, mp_policy=policy) if dp_mesh is not None else model


def check(model: nn.Module, mesh, x_BT: torch.Tensor) -> float:
    """The logits of the tensor-parallel model (float32, no FSDP, no compile) against the
    same model unsharded, on every rank; returns the largest relative difference (raises if
    it is over 1e-4)."""
    with torch.no_grad():
        want = model(x_BT)
        tensor_parallel(model, mesh["tp"])
        got = model(x_BT)
    err = float((got - want).abs().max() / want.abs().max())
    if err > 1e-4:
        raise AssertionError(f"tensor-parallel baseline differs from the unsharded model: {err:.2e}")
    return err
