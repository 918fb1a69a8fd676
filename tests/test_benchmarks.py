"""benchmarks/gpt.py's implementations: every name its registry (benchmarks/gpt_impls.py)
builds is a valid step configuration, a name it does not know is refused before anything
runs, and the script times a tiny model on CPU end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsg
from fsg._src.passes.options import Fusions

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# benchmarks/ on sys.path only while gpt_impls (and its _common) import: left there, that
# folder's kernels.py would shadow the kernels package transformers imports in later tests
sys.path.insert(0, str(BENCHMARKS))
try:
    import gpt_impls
finally:
    sys.path.remove(str(BENCHMARKS))


def _names():
    """Each base alone and with each suffix that applies to it."""
    for base in gpt_impls.BASES:
        yield base
        for group in gpt_impls.SUFFIXES:
            yield from (base + s for s, spec in group.items() if base.startswith(spec.applies))


def test_every_name_resolves_to_a_valid_configuration():
    """Each name's fusions build a ``Fusions`` and its FP8 configuration a ``fsg.Float8``; the
    fusions a suffix turns off are off; a suffix on a base it does not apply to is refused."""
    for name in _names():
        impl = gpt_impls.resolve(name)
        fusions = Fusions(**impl.fusions)
        if impl.float8 is not None:
            fsg.Float8(**impl.float8)
        assert (name.endswith("-catgrads")) <= (not fusions.pack_attention_grads), name
        assert (name.endswith("-noln")) <= (not fusions.fp8_layer_norms), name
    assert gpt_impls.resolve("fsg-fp8-row-gw-fastgi-catgrads-noln-nowfp8-bf16proj-auto").suffixes == (
        "-fastgi", "-catgrads", "-noln", "-nowfp8", "-bf16proj", "-auto",
    )  # fmt: skip
    for wrong in ("fsg-noln", "compile-catgrads", "fsg-fp8-row-noln-fastgi"):
        with pytest.raises(ValueError):
            gpt_impls.resolve(wrong)


def test_an_unknown_implementation_is_refused_before_anything_runs():
    """A misspelt name (``fsg-fp8-rw``) used to time bf16 under an FP8 label; now argparse
    refuses it, naming it and what is valid."""
    proc = subprocess.run(
        [sys.executable, "gpt.py", "--device", "cpu", "--impl", "fsg,fsg-fp8-rw"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "[gpt" not in proc.stdout
    assert "unknown implementation 'fsg-fp8-rw'" in proc.stderr and "fsg-fp8-row" in proc.stderr


@pytest.mark.slow
def test_gpt_benchmark_runs_a_tiny_model_on_cpu():
    """One rowwise-FP8 fsg row with two fusions turned off, through the script's own process
    per row (aot_eager: a smoke test of the script, not a timing)."""
    proc = subprocess.run(
        [sys.executable, "gpt.py", "--device", "cpu", "--backend", "aot_eager", "--model", "tiny", "--batch", "1",
         "--seq", "16", "--steps", "1", "--warmup", "3", "--impl", "fsg-fp8-row-catgrads-noln"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = [line for line in proc.stdout.splitlines() if line.startswith("| fsg-fp8-row-catgrads-noln |")]
    assert "failed" not in row
