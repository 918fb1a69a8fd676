"""Parameter groups: another transformation for each labelled set of parameters.

``multi_transform`` is optax's, and what ``torch.optim``'s param groups are for: a higher
learning rate for a new head, no weight decay for biases and norms, a frozen group. Each
transformation sees the params tree with the other groups' leaves replaced by ``MaskedNode()``
(a node without leaves), so its state holds only its own parameters' moments.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch

from fsg._src import checks, tree
from fsg._src.errors import ArgumentError
from fsg._src.optim import _checks
from fsg._src.optim._base import EmptyState, GradientTransformation, check_transformation
from fsg._src.tree import MaskedNode

Labels = Any  # a tree of hashable labels shaped like the params, or a function of the params


def multi_transform(transforms: Mapping[Hashable, GradientTransformation], param_labels: Labels) -> GradientTransformation:
    """Applies ``transforms[label]`` to the parameters labelled ``label`` (param groups).

    Args:
      transforms: one transformation per label, e.g. ``{"decay": adamw(3e-4, weight_decay=0.1),
        "no_decay": adam(3e-4)}``. A label no parameter carries is allowed (and costs nothing).
      param_labels: a tree shaped like the params with a label at each leaf, or a function
        of the params that returns one (called once, by ``init``, and at each ``update``
        while the step is traced: it must depend only on the tree's structure, names and
        shapes).

    Returns:
      A ``GradientTransformation`` whose state is ``{label: that transformation's state}``.
      Inside, a transformation sees the params and updates with the other groups' leaves
      replaced by ``fsg.optim.MaskedNode()``: a ``mask=`` function given to one must accept
      those (or use a group instead of the mask).

    Raises:
      ArgumentError: a label no transformation has (naming the parameter), or labels not
        shaped like the params.

    Example:
      >>> labels = lambda p: {k: "decay" if v.ndim >= 2 else "no_decay" for k, v in p.items()}
      >>> opt = fsg.optim.multi_transform(
      ...     {"decay": fsg.optim.adamw(3e-4, weight_decay=0.1), "no_decay": fsg.optim.adam(3e-4)}, labels)
      >>> state = opt.init({"w": torch.ones(2, 2), "b": torch.zeros(2)})
      >>> sorted(state)
      ['decay', 'no_decay']
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise checks.fail("multi_transform(transforms=...)", "must be a non-empty dict {label: transformation}",
                          transforms, "e.g. {'decay': fsg.optim.adamw(3e-4), 'no_decay': fsg.optim.adam(3e-4)}")  # fmt: skip
    for label, t in transforms.items():
        check_transformation(f"multi_transform(transforms=...)[{label!r}]", t)

    def masked(leaves: list[Any], treedef: Any, labels: list[Hashable], label: Hashable) -> Any:
        """The tree of ``leaves`` with the leaves of other groups than ``label`` masked."""
        return tree.unflatten(treedef, [x if lab == label else MaskedNode() for x, lab in zip(leaves, labels)])

    def init(params: Any) -> dict:
        leaves, treedef = tree.flatten(params)
        labels = _labels(param_labels, params, transforms)
        return {label: transforms[label].init(masked(leaves, treedef, labels, label)) for label in dict.fromkeys(labels)}

    def update(updates: Any, state: dict, params: Any = None) -> tuple[Any, dict]:
        leaves, treedef = tree.flatten(updates)
        labels = _labels(param_labels, updates, transforms)
        param_leaves = None if params is None else tree.flatten(params)[0]
        new_leaves, new_state = list(leaves), {}
        for label in dict.fromkeys(labels):  # in order of first use; each group's updates replace its leaves
            group_params = None if params is None else masked(param_leaves, treedef, labels, label)
            inner, new_state[label] = transforms[label].update(masked(leaves, treedef, labels, label), state[label], group_params)
            ours = iter(tree.flatten(inner)[0])
            new_leaves = [next(ours) if lab == label else x for x, lab in zip(new_leaves, labels)]
        return tree.unflatten(treedef, new_leaves), new_state

    return GradientTransformation(init, update)


def _labels(param_labels: Labels, params: Any, transforms: Mapping[Hashable, Any]) -> list[Hashable]:
    """The label of each leaf of ``params``, in flatten order, checked."""
    labels = param_labels(params) if callable(param_labels) else param_labels
    label_leaves = _checks.like_params("multi_transform(param_labels=...)", "the labels must be a tree, one label per parameter,",
                                       labels, params, "Give a function of the params, e.g. "
                                       "lambda p: {k: 'decay' if v.ndim >= 2 else 'no_decay' for k, v in p.items()}")  # fmt: skip
    for path, label in zip(tree.leaf_paths(params, "params"), label_leaves):
        if label not in transforms:
            raise ArgumentError(
                f"multi_transform: {path} is labelled {label!r}, but transforms has no {label!r} (labels: "
                f"{sorted(map(repr, transforms))}). Add a transformation for it, or label it with one of those"
            )
    return label_leaves


def set_to_zero() -> GradientTransformation:
    """Sets every update to zero: the parameters it is given do not move (a frozen group of
    ``multi_transform``; weight decay included, as it comes from the other transformations).

    Example:
      >>> opt = fsg.optim.multi_transform({"train": fsg.optim.adam(1e-3), "freeze": fsg.optim.set_to_zero()},
      ...                                 {"head": "train", "body": "freeze"})
    """

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        return tree.tree_map(torch.zeros_like, updates), state

    return GradientTransformation(init, update)

