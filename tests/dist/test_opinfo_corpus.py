"""The OpInfo corpus on a mesh (issue 60): the cases whose sharding rules fsg trusts
(``opinfo_workers.trusted``), trained under data parallel and FSDP on 2 gloo ranks with one
input sharded on dim 0, equal eager ``torch.optim.SGD`` or raise a clear ``fsg.FsgError``.

CI runs 1 in ``opinfo_workers.MESH_ONE_IN`` of them (by name); ``FSG_OPINFO=full`` runs all.
Outcomes other than a match are listed in ``tests/corpus/opinfo_expected.py``; the counts of
the CI run must equal docs/sharding.md's table.
"""

import os

import pytest

from tests.corpus import opinfo, opinfo_expected, opinfo_table
from tests.dist import opinfo_workers

pytestmark = pytest.mark.slow


def test_trusted_ops_sharded_train_as_eager_or_raise_a_clear_error(ranks):
    names = opinfo_workers.mesh_cases(opinfo.inventory().cases)
    assert len(names) >= 30
    results = opinfo_workers.run_on(ranks(opinfo_workers.WORLD), names)
    problems = opinfo_expected.problems(results)
    assert not problems, "\n".join(problems)
    if os.environ.get("FSG_OPINFO") != "full":
        drift = opinfo_table.drift(results, opinfo_workers.PRESETS)
        assert not drift, f"{drift}: regenerate docs/sharding.md's table with python -m tests.corpus.opinfo_table"
