"""The slow tier's named tests (tests/conftest.py) still exist: a renamed test would otherwise
drop silently into the fast tier."""

import re
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_each_named_test_is_defined():
    missing = []
    for nodeid in conftest.SLOW_TESTS + conftest.FAST:
        path, _, name = nodeid.partition("::")
        function = name.split("[")[0]
        file = ROOT / path
        if not file.exists() or not re.search(rf"^def {re.escape(function)}\(", file.read_text(), re.M):
            missing.append(nodeid)
    assert not missing, f"tests/conftest.py names tests that are not defined (renamed?): {missing}"


def test_each_longest_entry_names_a_test_or_file():
    missing = []
    for entry in conftest.LONGEST:
        path, _, name = entry.partition("::")
        file = ROOT / path
        if not file.exists() or (name and not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M)):
            missing.append(entry)
    assert not missing, f"tests/conftest.py's LONGEST names what is not defined (renamed?): {missing}"
