"""While the forward is traced: which module each graph node came from.

Global module hooks (``torch.nn.modules.module.register_module_forward_pre_hook``) name the
module being entered, relative to the outermost module running (the one ``fsg.apply`` calls,
so the names are those of ``fsg.params``: ``layers.4``), and ``torch.fx.traceback.annotate``
records the innermost name in each node the tracer makes (``node.meta["custom"]``). The root
module's own code is named ``""``; code outside any module (the loss) carries no name.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

from torch import fx, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

KEY = "fsg_module"


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Inside (and around the trace, with ``fx.traceback.preserve_node_meta()``), each node
    made records its module's name under ``node.meta["custom"][KEY]``."""
    entered: list[contextlib.AbstractContextManager] = []
    names: dict[int, str] = {}

    def enter(module: nn.Module, args: object) -> None:
        if not entered:  # the outermost module: names are relative to it
            names.clear()
            names.update({id(m): n for n, m in module.named_modules(remove_duplicate=False)})
        scope = fx.traceback.annotate({KEY: names.get(id(module), type(module).__name__)})
        scope.__enter__()
        entered.append(scope)

    def leave(module: nn.Module, args: object, output: object) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with fx.traceback.preserve_node_meta():
            yield
    finally:
        for hook in hooks:
            hook.remove()
        while entered:  # a forward that raised left its scopes open
            entered.pop().__exit__(None, None, None)


def name_of(node: fx.Node) -> str | None:
    """The innermost module ``node`` was traced in, or ``None`` outside every module."""
    custom = node.meta.get("custom")
    return custom.get(KEY) if isinstance(custom, dict) else None


def inside(name: str | None, module: str) -> bool:
    """Whether code of module ``name`` runs inside ``module`` (itself or a submodule)."""
    return name is not None and (name == module or name.startswith(module + "."))


def blocks(names: list[str | None]) -> list[str]:
    """The modules an automatic split may cut before: the largest family of indexed siblings
    (``layers.0``, ``layers.1``, ... of a ``ModuleList`` or ``Sequential``), else the root's
    children, in the order the forward first runs them."""
    families: dict[str, list[str]] = {}
    top: list[str] = []
    for name in names:
        if not name:
            continue
        parts = name.split(".")
        if parts[0] not in top:
            top.append(parts[0])
        for i in range(1, len(parts)):
            if re.fullmatch(r"\d+", parts[i]):
                family, member = ".".join(parts[:i]), ".".join(parts[: i + 1])
                members = families.setdefault(family, [])
                if member not in members:
                    members.append(member)
    if families:
        return max(families.values(), key=len)
    return top
