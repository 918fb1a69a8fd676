"""Shared pytest set-up: the environment, the doctest namespace and the hypothesis profiles (the
slow tier is tests/conftest.py's)."""

import os
from pathlib import Path

# Triton kernels run in Triton's CPU interpreter when there is no GPU. The variable must be set
# before triton (imported by torch) decorates its own library functions, so nothing may import
# torch or fsg before this line (hence no fsg warning filter in pyproject.toml: see below).
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every stage-3 graph pass is checked for its invariants (fsg/_src/passes/invariants.py), here
# and in the ranks the distributed tests start (they inherit the environment).
os.environ.setdefault("FSG_CHECK_PASSES", "1")
# One intra-op thread in each test process and each rank it starts: pytest-xdist already runs a
# worker per core, and a rank pool's 2-4 processes share the cores too. A second thread per
# process only waits at every kernel's closing barrier for a core another process holds
# (examples/train_gpt.py's cpu_threads measured 7x slower steps so). Read by torch at import.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

import fsg  # noqa: E402

# A deterministic profile for CI (chosen by FSG_HYPOTHESIS_PROFILE, "ci" by default) and a
# wider one for local exploration.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=25)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("FSG_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["fsg"] = fsg
    doctest_namespace["torch"] = torch


def pytest_configure(config):
    # An unexpected recompile is a test failure (set here, after TRITON_INTERPRET, since the
    # ini filter would import fsg, and so torch and triton, before this file runs).
    config.addinivalue_line("filterwarnings", "error::fsg.RecompileWarning")
