"""Pytree helpers on top of optree: leaf paths, tensor checks and abstract signatures.

A *leaf path* is the Python expression that reaches a leaf from a named root, for example
``state.params['w']`` or ``batch['x']``; every error and warning about a leaf uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor

from fsg._src.errors import NonTensorLeafError

# None is a leaf so that a missing value is reported, not silently dropped from the tree.
_NONE_IS_LEAF = True
# fsg's optree namespace: mapping types other than dict that a batch may be (Hugging Face's
# BatchEncoding, what tokenizers and data collators return) are registered in it on first sight.
_NAMESPACE = "fsg"
_MAPPINGS: set[type] = set()


def _see(tree: Any) -> None:
    """Registers ``tree``'s type as a node when it is a mapping other than ``dict`` that can be
    rebuilt from a dict (its keys sorted, as a dict's) or a dataclass instance whose fields all
    go to its constructor (its fields in order); anything else stays a leaf."""
    cls = type(tree)
    if cls is dict or cls in _MAPPINGS or not _node_like(tree):
        return
    _MAPPINGS.add(cls)
    if not isinstance(tree, Mapping):
        fields = dataclasses.fields(tree)
        names = [f.name for f in fields]
        if all(f.init for f in fields):
            optree.register_pytree_node(
                cls, lambda d: ([getattr(d, n) for n in names], names, names),
                lambda keys, values, cls=cls: cls(**dict(zip(keys, values))), namespace=_NAMESPACE,
            )  # fmt: skip
        return
    try:
        rebuilt = cls(dict(tree))
        if sorted(rebuilt) != sorted(tree):
            return
    except Exception:  # noqa: BLE001 - not rebuildable from a dict: a leaf (reported as such)
        return
    optree.register_pytree_node(
        cls, lambda m: ([m[k] for k in sorted(m)], sorted(m), sorted(m)),
        lambda keys, values, cls=cls: cls(dict(zip(keys, values))), namespace=_NAMESPACE,
    )  # fmt: skip


def _node_like(x: Any) -> bool:
    """Whether ``x`` is a mapping or a dataclass instance: a container ``_see`` may register."""
    return isinstance(x, Mapping) or _dataclass_instance(x)


def _dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


class MaskedNode(NamedTuple):
    """Stands for a leaf left out of a tree, as optax's: a node without leaves. In
    ``fsg.optim.multi_transform`` each transformation sees the params with the other groups'
    leaves replaced by it."""


def flatten_masked(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` counting each ``MaskedNode`` as a leaf: a tree with some leaves masked
    has the structure of the whole one."""
    _see(tree)
    return optree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, MaskedNode), none_is_leaf=_NONE_IS_LEAF,
                               namespace=_NAMESPACE)  # fmt: skip


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` into its leaves and structure."""
    _see(tree)
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)


def unflatten(treedef: optree.PyTreeSpec, leaves: Any) -> Any:
    """Rebuilds a tree of structure ``treedef`` from ``leaves``."""
    return optree.tree_unflatten(treedef, leaves)


def leaf_paths(tree: Any, root: str) -> list[str]:
    """Returns the path of every leaf of ``tree``, in flatten order, from the name ``root``."""
    _see(tree)
    accessors, _, _ = optree.tree_flatten_with_accessor(tree, none_is_leaf=_NONE_IS_LEAF, namespace=_NAMESPACE)
    return [accessor.codify(root) for accessor in accessors]


def tree_map(fn, tree: Any, *rest: Any) -> Any:
    """Maps ``fn`` over the leaves of ``tree`` (and the matching leaves of ``rest``)."""
    _see(tree)
    return optree.tree_map(fn, tree, *rest, namespace=_NAMESPACE)


def check_tensor_leaves(tree: Any, root: str) -> bool:
    """Raises ``NonTensorLeafError`` naming the first leaf of ``tree`` that is not a tensor. A
    mapping among the leaves (a ``BatchEncoding`` inside a dict) is registered as a node first
    (``_see``); returns whether one was, so that the caller flattens ``tree`` again."""
    leaves, _ = flatten(tree)
    registered = False
    while new := [leaf for leaf in leaves if _node_like(leaf) and type(leaf) not in _MAPPINGS]:
        for leaf in new:
            _see(leaf)
        registered = True
        leaves, _ = flatten(tree)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return registered
    for path, leaf in zip(leaf_paths(tree, root), leaves):
        if _dataclass_instance(leaf):  # registered unless a field is not its constructor's
            raise NonTensorLeafError(
                f"{path} is a {type(leaf).__name__}, a dataclass with a field its constructor does not take "
                f"(field(init=False)), which fsg cannot rebuild; every leaf of {root} must be a torch.Tensor. "
                f"Pass a dict, tuple or NamedTuple of its tensors instead."
            )
        if isinstance(leaf, Mapping):  # not a dict, not rebuildable from one, or nested (only a whole batch is)
            raise NonTensorLeafError(
                f"{path} is a {type(leaf).__name__}, a mapping fsg does not look into there; every leaf of {root} "
                f"must be a torch.Tensor. Pass dict({path.split('.')[-1] if '.' in path else path}) instead (a plain "
                f"dict of tensors)."
            )
        if not isinstance(leaf, torch.Tensor):
            raise NonTensorLeafError(
                f"{path} is a {type(leaf).__name__} ({leaf!r:.60}), but every leaf of {root} must "
                f"be a torch.Tensor (in dicts, lists, tuples, NamedTuples or dataclasses): the step is "
                f"traced once and replayed, so Python values would be frozen into the graph. Wrap it "
                f"with torch.tensor(...), or make it static configuration closed over by loss_fn."
            )


class LeafSpec(NamedTuple):
    """The abstract value of one tensor leaf: what a compiled step is specialized on."""

    shape: tuple[int, ...]  # global shape, for a DTensor
    dtype: torch.dtype
    device: torch.device
    placements: tuple = ()  # a DTensor's placements; () for a plain tensor

    @classmethod
    def of(cls, tensor: torch.Tensor) -> LeafSpec:
        placements = tuple(tensor.placements) if isinstance(tensor, DTensor) else ()
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, placements)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        dims = ",".join(map(str, self.shape))
        where = "" if self.device.type == "cpu" else f"@{self.device}"
        placed = f"({', '.join(map(str, self.placements))})" if self.placements else ""
        return f"{dtype}[{dims}]{where}{placed}"


def leaf_specs(leaves: list[torch.Tensor]) -> tuple[LeafSpec, ...]:
    """The abstract signature of a flat list of tensors."""
    return tuple(LeafSpec.of(leaf) for leaf in leaves)
