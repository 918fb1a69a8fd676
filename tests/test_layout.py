"""The layout keeps the architecture: each layer of ``fsg/_src`` imports only from layers
below it, modules stay small, and private torch APIs stay in ``_torch_private/``.

The layers, bottom to top (docs/architecture.md draws them):
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "fsg" / "_src"

# Each entry is one layer; a layer's packages may import from earlier layers only (and from
# themselves). kernels, optim, checkpoint and data are libraries: none imports another or any stage.
LAYERS = [
    {"_torch_private", "errors", "checks", "tree", "version", "graph_facts", "decompositions"},
    {"mesh", "rules", "train_state", "precision", "float8_config", "functional", "frozen", "recompute", "watch", "distributed", "topology"},
    {"kernels"},
    {"optim"},
    {"checkpoint"},
    {"data"},
    {"trace"},  # stage 1
    {"sharding"},  # stage 2
    {"passes"},  # stage 3
    {"backend"},  # stage 4
    {"pipeline"},  # the pp axis: splits stage 1's forward into stages, compiles each with stage 4
    {"runtime"},  # Step: builds with stages 1-3, compiles with 4, caches and runs
    {"testing"},
]
# What each library layer may use besides the foundation (layers 0-1).
LIBRARY_DEPENDENCIES = {"kernels": set(), "optim": set(), "checkpoint": set(), "data": set()}
MAX_LINES = 300
PRIVATE_ATTRIBUTES = {"_schema", "_opname", "_base", "_overloadpacket"}


def _component(module: str) -> str:
    return module.split(".")[2]  # fsg._src.<component>[.module]


def _layer(component: str) -> int:
    for i, layer in enumerate(LAYERS):
        if component in layer:
            return i
    raise AssertionError(f"fsg/_src/{component} is in no layer of tests/test_layout.py; add it to LAYERS")


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(("fsg", *path.relative_to(SRC.parent.parent).with_suffix("").parts[1:]))
        if path.name == "__init__.py":
            name = name.rsplit(".", 1)[0]
        yield path, name


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.startswith("fsg.") or name == "fsg"]


MODULES = [(p, n) for p, n in _modules() if n != "fsg._src"]


@pytest.mark.parametrize("path, module", MODULES, ids=[n for _, n in MODULES])
def test_imports_point_down_the_layers(path, module):
    here = _component(module)
    for line, imported in _imports(path):
        where = f"{path.relative_to(SRC.parent.parent)}:{line} imports {imported}"
        assert imported.startswith("fsg._src."), f"{where}: fsg/_src imports only fsg._src, never the public fsg"
        there = _component(imported)
        if there == here or _layer(there) == _layer(here) <= 1:  # the foundation's modules
            continue
        assert _layer(there) < _layer(here), f"{where}, a layer above or beside {here} (tests/test_layout.py)"
        if here in LIBRARY_DEPENDENCIES and _layer(there) > 1:
            assert there in LIBRARY_DEPENDENCIES[here], f"{where}: the {here} library imports no other library"


@pytest.mark.parametrize("path, module", MODULES, ids=[n for _, n in MODULES])
def test_modules_stay_small(path, module):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC.parent.parent)} has {lines} lines; split it (one concept per module)"


@pytest.mark.parametrize("path, module", MODULES, ids=[n for _, n in MODULES])
def test_private_torch_apis_only_in_torch_private(path, module):
    if "_torch_private" in path.parts:
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            raise AssertionError(
                f"{path.relative_to(SRC.parent.parent)}:{node.lineno} uses .{node.attr}; "
                f"wrap it in fsg/_src/_torch_private/ with a pin in tests/test_torch_private.py"
            )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Each ``torch._x`` attribute chain (``torch.a._b.c``), ``import torch._x`` and ``from torch...
    import _x`` in ``tree``. Allowed, by ``ALLOWED_PRIVATE_TORCH``'s rules: what follows
    ``torch.ops`` (op namespaces and op names, ``torch.ops.aten._to_copy.default``, are the IR
    the graphs are written in, not APIs) and dunders (``torch.__version__``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Call):
            chain, root = [], node
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            chain.reverse()
            head = chain[: chain.index("ops")] if "ops" in chain else chain
            if isinstance(root, ast.Name) and root.id == "torch" and any(map(_private, head)):
                found.append((node.lineno, "torch." + ".".join(chain)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = [a.name for a in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
    return sorted(set(found))


@pytest.mark.parametrize("path, module", MODULES, ids=[n for _, n in MODULES])
def test_private_torch_names_only_in_torch_private(path, module):
    """No module outside ``_torch_private/`` names a private torch API (``torch._*``, a private
    submodule or name imported from torch); torch's op names in ``torch.ops...`` are allowed."""
    if "_torch_private" in path.parts:
        return
    uses = _private_torch_uses(ast.parse(path.read_text()))
    assert not uses, (
        f"{path.relative_to(SRC.parent.parent)} uses private torch APIs {uses}; wrap each in "
        "fsg/_src/_torch_private/ with a pin in tests/test_torch_private.py"
    )


def test_the_private_torch_check_sees_each_form():
    source = """
import torch
import torch._dynamo
from torch._ops import OpOverload
from torch.nn.utils.stateless import _reparametrize_module
torch._scaled_mm(a, b)
torch.cuda._lazy_init()
x = torch.ops.aten._to_copy.default
y = torch.ops._c10d_functional.wait_tensor.default
v = torch.__version__
"""
    got = [what for _, what in _private_torch_uses(ast.parse(source))]
    assert got == [
        "import torch._dynamo",
        "from torch._ops import OpOverload",
        "from torch.nn.utils.stateless import _reparametrize_module",
        "torch._scaled_mm",
        "torch.cuda._lazy_init",
    ]
