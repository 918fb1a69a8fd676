"""The op set a sharded step is built from: what stage 1 decomposes, what stage 2 trusts.

DTensor derives a sharding strategy for an op without a registered rule by running the op's
decomposition on a size-1 mesh and then running the *whole* op on each rank's shard. For an
op whose decomposition divides by a size (``mse_loss``'s mean, its backward's ``2 / numel``,
``native_group_norm_backward``'s ``1 / N``) the local op then divides by the local size:
the sharded step's gradients were silently wrong (issue 14: 5e-3 to 4e-2 off for
``F.mse_loss``, ``F.huber_loss``, ``F.binary_cross_entropy``, a ``GroupNorm`` model...).

So on a mesh fsg never relies on that path:

1. Stage 1 traces with ``mesh_decompositions()``: the decomposition of every op that has no
   registered DTensor rule, and of the ``DISTRUSTED`` ops whose registered rule the op
   corpus caught computing something else. The decomposition runs on the *global* shapes,
   so every size it divides by is the global one.
2. Stage 2 runs an op on DTensors only if DTensor has a registered rule for it
   (``_torch_private.dtensor_has_rule``); anything else is a ``ShardingRuleError`` naming
   the op, the user's line and the placements it met. Registered rules the corpus caught
   wrong on a torch release are worked around (``SCANS``, ``FULL_REDUCTIONS``, ``stack``'s
   dim, 2.11's ``index_put``); where a rule fails or gives a malformed result even on whole
   inputs (2.11's ``convolution``, ``constant_pad_nd`` on a 2-D mesh), each rank runs the
   op on its whole copy (``run_replicated``).

Ops that have a rule stay whole. Decomposing them too (all of torch's core-ATen table, as
Inductor does) was tried and is worse: on torch 2.13 ``sum.default`` becomes
``sum.dim_IntList(x, [])``, which DTensor's rule reads as "no dim reduced" and leaves a 0-d
result marked ``Shard(0)``; on torch 2.11 view ops become ``prims`` ops, which have no rules.
The rules kept are exercised by the op corpus (``tests/dist/test_op_corpus.py``), and
``compile_step(..., verify=True)`` checks a user's own step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsg._src import _torch_private, tree
from fsg._src.errors import ShardingRuleError
from fsg._src.sharding import flex_attention

_aten = torch.ops.aten

# Ops DTensor has rules for that are decomposed all the same, because the op corpus saw the
# rule compute something else: with class weights or ignore_index and rows sharded, the
# nll_loss rules divide each rank's sum by its *local* total weight (F.cross_entropy(weight=)
# and F.nll_loss(ignore_index=) off by up to 20%). Decomposed, the weight sum is a partial
# sum, reduced before the division.
DISTRUSTED: frozenset = frozenset(
    {
        _aten.nll_loss_forward.default,
        _aten.nll_loss_backward.default,
        _aten.nll_loss2d_forward.default,
        _aten.nll_loss2d_backward.default,
    }
)


@functools.lru_cache(maxsize=1)
def mesh_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table stage 1 traces with on a mesh (see the module docstring)."""
    candidates = {**_torch_private.all_decompositions(), **_torch_private.core_decompositions()}
    table = {
        op: fn
        for op, fn in candidates.items()
        if isinstance(op, _torch_private.OpOverload) and (op in DISTRUSTED or not _torch_private.dtensor_has_rule(op))
    }
    copies = {op: fn for op, fn in COPIES.items() if not _torch_private.dtensor_has_rule(op)}
    return {**table, **SHIFTS, **copies}


# ``x >> k`` and ``x << k``: torch 2.13's DTensor takes ``aten.__rshift__`` / ``__lshift__`` for
# in-place ops (their names end in an underscore) and returns ``x`` unchanged, silently. On a
# mesh stage 1 traces them as the bitwise shifts, whose rules are the pointwise ones.
SHIFTS = {
    _aten.__rshift__.Scalar: lambda x, k: _aten.bitwise_right_shift.Tensor_Scalar(x, k),
    _aten.__rshift__.Tensor: lambda x, k: _aten.bitwise_right_shift.Tensor(x, k),
    _aten.__lshift__.Scalar: lambda x, k: _aten.bitwise_left_shift.Tensor_Scalar(x, k),
    _aten.__lshift__.Tensor: lambda x, k: _aten.bitwise_left_shift.Tensor(x, k),
}


def _functional_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy(self, src)``: ``src`` in ``self``'s dtype and device, broadcast to its shape."""
    placed = {"dtype": self.dtype} if src.device == self.device else {"dtype": self.dtype, "device": self.device}
    out = _aten._to_copy.default(src, **placed)
    return out if out.shape == self.shape else _aten.expand.default(out, list(self.shape)).clone()


# ``aten.copy`` (the functional op): what torch's functionalization makes of a write into a view,
# such as T5's and BART's ``shifted[..., 1:] = labels[..., :-1]``. It is emitted when stage 1
# re-traces a step with in-place writes (``trace/epilogue.py``), after the tables above were
# applied, and DTensor has no rule for it: it ran replicated on gathered inputs. The re-trace
# lowers it with this, to ops that have rules.
COPIES = {_aten.copy.default: _functional_copy}


# Scans along a dim: DTensor's rules run them on each shard of a dim sharded along the scan
# (the op corpus saw torch.cumsum over a tensor-parallel dim off by 30%). Stage 2 gathers the
# scanned dim first.
SCANS: frozenset = frozenset(
    {
        _aten.cumsum.default,
        _aten.cumprod.default,
        _aten.logcumsumexp.default,
        _aten.cummax.default,
        _aten.cummin.default,
    }
)


# Reductions over ``dim=[]``: aten reduces every dim, DTensor's rule reduces none (a 0-d
# result marked Shard(0), then a crash or worse). Stage 2 runs them as full reductions.
FULL_REDUCTIONS = {_aten.sum.dim_IntList: _aten.sum.default, _aten.mean.dim: _aten.mean.default}


def full_reduction(target: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    """``(op, args, kwargs)`` of the full reduction a ``dim=[]`` reduction means, else None."""
    if target not in FULL_REDUCTIONS or len(args) < 2 or args[1] not in ([], (), None):
        return None
    keepdim = bool(args[2]) if len(args) > 2 else kwargs.get("keepdim", False)
    if keepdim:
        return None  # keeps every dim at size 1: rare; DTensor's own rule handles the shape
    dtype = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
    return FULL_REDUCTIONS[target], (args[0],), dtype


def non_negative_stack_dim(target: Any, args: tuple) -> tuple:
    """``stack``'s args with a negative ``dim`` counted from the front. torch 2.11's rule for
    ``stack(dim=-1)`` of tensors sharded on dim 1 marks the result Shard(2), the new dim,
    instead of Shard(1) (the op corpus saw ``torch.stack([h, g], -1).flatten(1)`` off by 45%
    under tensor parallelism)."""
    if target is not _aten.stack.default or len(args) < 2 or args[1] >= 0:
        return args
    return (args[0], args[1] + args[0][0].dim() + 1, *args[2:])


# torch 2.11's index_put rule (``_torch_private.dtensor_index_put_rule_is_positional``) shards
# the indexed dim of ``self`` when ``values`` is sharded on its rows, and indexes each shard
# with the gathered global ids: the op corpus saw the backward of ``table.index_select(0, ids)``
# fail at run time (4 rows of values for 8 ids); where the shapes happened to broadcast it
# would be wrong. Stage 2 gathers ``self`` and ``values`` first there (torch 2.13's rule
# gathers them for this case too).
INDEX_PUTS = frozenset({_aten.index_put.default, _aten._index_put_impl_.default})


def index_put_args(target: Any, args: tuple, device_mesh: Any) -> tuple:
    """``index_put``'s args with ``values`` and ``self`` gathered where torch's rule for it is
    the positional one (``self`` only for the functional op: the in-place one must write the
    tensor it was given); other ops' args unchanged."""
    if target not in INDEX_PUTS or len(args) < 3 or not _torch_private.dtensor_index_put_rule_is_positional():
        return args
    self_ = _gather(args[0], device_mesh) if _torch_private.is_pure_op(target) else args[0]
    return (self_, args[1], _gather(args[2], device_mesh), *args[3:])


def _gather(x: Any, device_mesh: Any) -> Any:
    """``x`` replicated over the whole mesh, if it is a DTensor that is not already."""
    if not isinstance(x, DTensor) or all(isinstance(p, Replicate) for p in x.placements):
        return x
    return x.redistribute(device_mesh, [Replicate()] * device_mesh.ndim)


def gather_all(args_kwargs: Any, device_mesh: Any) -> Any:
    """``args_kwargs`` with every DTensor replicated; ``None`` if all already are (nothing to
    gather: an op failing on them fails for a reason other than their placements)."""
    leaves = tree.flatten(args_kwargs)[0]
    if all(all(isinstance(p, Replicate) for p in a.placements) for a in leaves if isinstance(a, DTensor)):
        return None
    return tree.tree_map(lambda a: _gather(a, device_mesh), args_kwargs)


def plain_containers(value: Any) -> Any:
    """``value`` with FX's ``immutable_list``/``immutable_dict`` as plain lists and dicts, which
    pytrees see into (a plain tensor inside ``cat``'s list must be found and replicated)."""
    if isinstance(value, tuple):
        return tuple(plain_containers(v) for v in value)
    if isinstance(value, list):
        return [plain_containers(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    return value


def covers_mesh(result: Any, ndim: int) -> bool:
    """Whether every DTensor in an op's result has one placement per mesh dim. torch 2.11's
    rule for ``constant_pad_nd`` (``F.pad``) places its result ``(Replicate(),)`` whatever the
    mesh: on a 2-D mesh that DTensor is malformed (the op corpus saw ``F.pad`` under FSDP x TP
    fail two ops later)."""
    return all(len(leaf.placements) == ndim for leaf in tree.flatten(result)[0] if isinstance(leaf, DTensor))


def run_replicated(target: Any, args: tuple, kwargs: dict, device_mesh: Any, like: Any = None) -> Any:
    """``target`` run by each rank on the whole of its inputs (every DTensor gathered), its
    tensor results replicated DTensors: the global op, on every rank, without DTensor's rule.
    ``None`` where that may not be the global op: an op that writes its inputs, draws random
    numbers (each rank would draw its own), or is not an ATen op (a custom op's rule that
    refuses whole inputs is taken at its word; ``prims`` ops, which torch 2.11's decompositions
    of ``flip``, ``var``, ``prod``... produce, are torch's own; FlexAttention's are run too). ``like``, the values the global trace saw
    (the node's ``meta["val"]``), gives each result its strides: gathered inputs are
    contiguous where the global ones were not, and a later ``view`` may rely on the layout."""
    if not flex_attention.is_flex(target) and (not _torch_private.is_pure_op(target) or target.namespace not in ("aten", "prims")):
        return None
    if _torch_private.draws_random(target):
        return None
    replicate = [Replicate()] * device_mesh.ndim

    def whole(x: Any) -> Any:
        return _gather(x, device_mesh).to_local() if isinstance(x, DTensor) else x

    out = target(*tree.tree_map(whole, args), **tree.tree_map(whole, kwargs))
    if like is not None and tree.flatten(like)[1] == tree.flatten(out)[1]:
        out = tree.tree_map(_restride, out, like)
    return tree.tree_map(
        lambda t: DTensor.from_local(t, device_mesh, replicate, run_check=False) if isinstance(t, torch.Tensor) else t,
        out,
    )


def _restride(t: Any, like: Any) -> Any:
    """``t`` copied into ``like``'s strides where they differ and describe a dense layout."""
    if not isinstance(t, torch.Tensor) or not isinstance(like, torch.Tensor) or t.shape != like.shape:
        return t
    if t.stride() == like.stride() or not _dense(like.shape, like.stride()):
        return t
    return torch.empty_strided(t.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether ``stride`` lays ``shape`` out without gaps or overlaps (a permuted contiguous
    layout, size-1 dims ignored)."""
    expected = 1
    for size, step in sorted(((n, st) for n, st in zip(shape, stride) if n != 1), key=lambda x: x[1]):
        if step != expected:
            return False
        expected *= size
    return True


def _placement_text(placement: Any) -> str:
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return str(placement)


def placements_text(args: Any) -> str:
    """The global shape and placements of every DTensor among ``args``, for error messages:
    ``(16, 4) [Shard(0)]``."""
    seen = []
    for leaf in tree.flatten(args)[0]:
        if isinstance(leaf, DTensor):
            placements = ", ".join(_placement_text(p) for p in leaf.placements)
            seen.append(f"{tuple(leaf.shape)} [{placements}]")
    return "; ".join(seen) or "no DTensor inputs"


def no_rule_error(target: Any, where: str, exc: Exception | None, args_kwargs: Any) -> ShardingRuleError:
    """The error for an op no rank can run on these placements, naming it, the user's line and
    the placements it met."""
    why = "no verified sharding rule" if exc is None else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return ShardingRuleError(
        f"the sharded step needs op {target} at {where}, which has no sharding rule for "
        f"its inputs' placements ({placements_text(args_kwargs)}; {why}), and cannot run "
        f"replicated on gathered inputs either. Write that computation with other ops, change "
        f"the spec of the parameters feeding it (replicate them over that axis), or shard the "
        f"batch only (fsg.sharding.data_parallel()). docs/sharding.md lists the ops verified on a mesh.",
        op=target,
    )
