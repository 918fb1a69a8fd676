"""Shared pytest set-up: the doctest namespace and the hypothesis profiles."""

import os

import pytest
import torch
from hypothesis import settings

import fsg

# A deterministic profile for CI (chosen by FSG_HYPOTHESIS_PROFILE, "ci" by default) and a
# wider one for local exploration.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=25)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("FSG_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["fsg"] = fsg
    doctest_namespace["torch"] = torch
