"""The layout keeps the architecture: each layer of ``fsg/_src`` imports only from layers
below it, modules stay small, and private torch APIs stay in ``_torch_private.py``.

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
    if path.name == "_torch_private.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            raise AssertionError(
                f"{path.relative_to(SRC.parent.parent)}:{node.lineno} uses .{node.attr}; "
                f"wrap it in fsg/_src/_torch_private.py with a pin in tests/test_torch_private.py"
            )
