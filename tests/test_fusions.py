"""``Fusions`` (``passes/options.py``): the one object that switches fused kernels. Its fields
are checked, its cache tag tells any two apart, each pass's ``applies`` reads its field, no
module global or ContextVar switches a pass, and each field changes a step's graph where its
fusion applies (tests/graph_corpus.py's steps)."""

import ast
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.passes import pipeline
from fsg._src.passes.options import CUDA_PASSES, FP8_PRODUCERS, Fusions
from tests import graph_corpus

SRC = Path(__file__).resolve().parents[1] / "fsg" / "_src"


@st.composite
def fusions_strategy(draw) -> Fusions:
    fields = {}
    for f in dataclasses.fields(Fusions):
        if f.name == "fp8_producers":
            fields[f.name] = draw(st.frozensets(st.sampled_from(sorted(FP8_PRODUCERS))))
        elif f.name == "on_cpu":
            fields[f.name] = draw(st.frozensets(st.sampled_from(sorted(CUDA_PASSES))))
        else:
            fields[f.name] = draw(st.booleans())
    return Fusions(**fields)


@given(fusions_strategy(), fusions_strategy())
def test_the_cache_tag_tells_any_two_apart(a, b):
    assert (a.tag() == b.tag()) == (a == b)
    assert hash(a) == hash(Fusions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_casts": 1}, r"Fusions\(batch_casts=...\) must be True or False"),
        ({"fp8_producers": {"gelu_fp8"}}, r"unknown \['gelu_fp8'\]"),
        ({"fp8_producers": "gelu"}, r"must be a set of names"),
        ({"on_cpu": {"float8"}}, r"Fusions\(on_cpu=...\): unknown \['float8'\]"),
    ],
)
def test_a_wrong_field_is_an_argument_error(kwargs, match):
    with pytest.raises(fsg.ArgumentError, match=match):
        Fusions(**kwargs)


def test_compile_step_takes_a_fusions_only():
    with pytest.raises(fsg.ArgumentError, match=r"compile_step\(fusions=...\) must be a Fusions"):
        fsg.compile_step(lambda p, b: p["w"].sum(), optimizer=fsg.optim.sgd(0.1), fusions={"batch_casts": False})
    with pytest.raises(TypeError):
        Fusions(False)  # keyword-only


@pytest.mark.parametrize("name", ["pack_attention_grads", "gemm_epilogues", "batch_casts"])
def test_a_pass_applies_by_its_field(name):
    """The pass and its ``Fusions`` field share a name; the field alone turns it off."""
    [p] = [p for p in pipeline.PASSES if p.name == name]
    for on_mesh in (False, True):
        assert p.applies(pipeline.Options(on_mesh=on_mesh))
        assert not p.applies(pipeline.Options(on_mesh=on_mesh, fusions=Fusions(**{name: False})))


def _module_switches(path: Path) -> list[str]:
    """A module-level ``NAME = True/False`` or ``ContextVar(...)`` in ``path``."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                found.append(f"{path.name}:{node.lineno}")
            if (
                isinstance(value, ast.Call)
                and getattr(value.func, "attr", getattr(value.func, "id", "")) == "ContextVar"
            ):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_global_or_context_var_switches_a_pass_or_the_compiler():
    """Stage 3 and 4 and the kernels they put in have no module-level boolean or ContextVar:
    a switch is a ``Fusions`` field (the kernels' own dispatch contexts live in
    ``kernels/_common.py``: where a kernel runs, not which graph is compiled)."""
    paths = [*(SRC / "passes").glob("*.py"), *(SRC / "backend").glob("*.py"), *(SRC / "kernels").glob("*.py")]
    found = [s for p in paths if p.name != "_common.py" for s in _module_switches(p)]
    assert not found, found


# each case that turns a fusion off, and the case it differs from by that field alone
DIFFERS_FROM = {
    "cpu_gemm_epilogues": "bf16",
    "cpu_gemm_epilogues_fwd": "cpu_gemm_epilogues",
    "cpu_batch_casts": "bf16",
    "cpu_pack_attention_grads": "bf16",
    "fp8_rowwise_noweights": "fp8_rowwise",
    "fp8_rowwise_noln": "fp8_rowwise",
    "fp8_rowwise_noadds": "fp8_rowwise",
    "fp8_rowwise_noproducers": "fp8_rowwise",
    "fp8_rowwise_nocolsum": "fp8_rowwise",
    "fp8_rowwise_geluback_only": "fp8_rowwise",
    "fp8_gated_nomul": "fp8_gated",
}


@pytest.mark.slow
def test_each_field_changes_the_graph_where_its_fusion_applies():
    """The corpus's steps on CPU: each field turned off changes the optimized graph of a step
    its fusion applies to (no switch is dead), and the same ``Fusions`` gives the same graph."""
    texts = {name: graph_corpus.CASES[name]() for name in {*DIFFERS_FROM, *DIFFERS_FROM.values()}}
    for case, base in DIFFERS_FROM.items():
        assert texts[case] != texts[base], case
    assert graph_corpus.CASES["fp8_rowwise"]() == texts["fp8_rowwise"]
