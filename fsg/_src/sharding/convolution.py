"""Convolutions on a mesh: each rank convolves its own images.

DTensor's handlers for ``aten.convolution`` and ``aten.convolution_backward``
(``torch.distributed.tensor._tp_conv``, torch 2.11 and 2.13) take an input sharded on any dim
but the batch for one sharded on its width, and exchange halo columns with
``dist.batch_isend_irecv``. Traced, those are raw ``c10d.send`` / ``c10d.recv_`` nodes with a
process group baked in as a constant, which AOTAutograd and Inductor refuse (issue 60: a
ResNet on ``dp=2``, whose BatchNorms leave their outputs sharded on channels, where DTensor's
batch-norm rule puts them). On a channel-sharded input the exchange is wrong as well: the local
convolution then fails on the channel count, and the replicated fallback reran it, the sends
left in the graph. Their propagation rules also ignore the weight's placement and mark the
weight gradient ``Partial`` over mesh dim 0 alone, whatever mesh dims shard the batch.

A convolution is independent per image, so stage 2 runs both ops itself, only the batch dim
sharded: over each mesh dim the images (input, and output gradient for the backward) are
``Shard(0)`` where one of them already is, or where the dim is a data axis and the batch
divides; elsewhere they are gathered (a ``Partial`` one reduced). The weight and bias are
gathered whole (a weight sharded over a tensor-parallel axis is not split by channels). Each
rank runs the op on its images; the output and the input gradient keep the images' placement,
the weight and bias gradients are ``Partial`` (a sum over the ranks' images) over the mesh
dims that shard the batch. The redistributions are DTensor's, so only functional collectives
reach the graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

_aten = torch.ops.aten
FORWARD, BACKWARD = _aten.convolution.default, _aten.convolution_backward.default


def run_local(target: Any, args: tuple, kwargs: dict, device_mesh: Any, data_dims: frozenset, like: Any = None) -> Any:
    """``target(*args)`` for a convolution (or its backward) with a DTensor among its inputs,
    run on each rank's images as the module docstring says; ``None`` for any other op. ``like``,
    the global trace's value of the node, gives the results their strides."""
    if target not in (FORWARD, BACKWARD) or kwargs or not any(isinstance(a, DTensor) for a in args[:3]):
        return None
    if target is FORWARD:
        x, weight, bias, *rest = args
        placements = _image_placements([x], device_mesh, data_dims)
        local = FORWARD(_local(x, placements, device_mesh), _whole(weight), _whole(bias), *rest)
        return _place(local, placements, (x.shape[0], *local.shape[1:]), like, device_mesh)
    grad_out, x, weight, *rest = args
    placements = _image_placements([grad_out, x], device_mesh, data_dims)
    grads = BACKWARD(
        _local(grad_out, placements, device_mesh), _local(x, placements, device_mesh), _whole(weight), *rest
    )
    summed = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in placements)
    likes = like if isinstance(like, (tuple, list)) and len(like) == 3 else (None, None, None)
    grad_x, grad_w, grad_b = grads
    return (
        None if grad_x is None else _place(grad_x, placements, tuple(x.shape), likes[0], device_mesh),
        None if grad_w is None else _place(grad_w, summed, tuple(grad_w.shape), likes[1], device_mesh),
        None if grad_b is None else _place(grad_b, summed, tuple(grad_b.shape), likes[2], device_mesh),
    )


def _image_placements(images: list, device_mesh: Any, data_dims: frozenset) -> tuple[Placement, ...]:
    """Per mesh dim, ``Shard(0)`` where one of ``images`` is batch-sharded, or where the dim is a
    data axis and the batch still divides evenly; ``Replicate()`` elsewhere."""
    sharded = [
        any(isinstance(t, DTensor) and t.placements[d] == Shard(0) for t in images) for d in range(device_mesh.ndim)
    ]
    batch = images[0].shape[0]
    for d in sorted(data_dims):
        ways = math.prod(device_mesh.size(i) for i in range(device_mesh.ndim) if sharded[i])
        if not sharded[d] and batch % (ways * device_mesh.size(d)) == 0:
            sharded[d] = True
    return tuple(Shard(0) if s else Replicate() for s in sharded)


def _local(x: Any, placements: tuple[Placement, ...], device_mesh: Any) -> torch.Tensor:
    """This rank's images of ``x`` (a DTensor redistributed to ``placements``, a plain tensor
    sliced like one)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
    if tuple(x.placements) != placements:
        x = x.redistribute(device_mesh, placements)
    return x.to_local()


def _whole(t: Any) -> Any:
    """``t`` whole on every rank (a weight, a bias, or ``None``)."""
    if not isinstance(t, DTensor):
        return t
    if not all(isinstance(p, Replicate) for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
    return t.to_local()


def _place(local: torch.Tensor, placements: tuple, shape: tuple, like: Any, device_mesh: Any) -> DTensor:
    """``local`` as the DTensor of global ``shape``, strided as the global trace's value was
    (contiguously where that is not known)."""
    if isinstance(like, torch.Tensor) and tuple(like.shape) == tuple(shape):
        stride = tuple(like.stride())
    else:
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
