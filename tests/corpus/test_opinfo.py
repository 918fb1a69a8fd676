"""PyTorch's OpInfo database as fsg's corpus on one device (issue 60): every differentiable op
with float64 samples, trained 2 SGD steps through ``compile_step``, equals eager
``torch.optim.SGD`` or raises a clear ``fsg.FsgError``; never a silently different result.

Every case runs under ``aot_eager``; the Inductor sample (1 in ``opinfo.INDUCTOR_ONE_IN``,
by name) is compiled with Inductor too. Outcomes other than a match are listed, with their
reasons, in ``tests/corpus/opinfo_expected.py``; the counts must equal the table in
docs/sharding.md (``python -m tests.corpus.opinfo_table`` regenerates it). The mesh part is
``tests/dist/test_opinfo_corpus.py``.
"""

import functools

import pytest

from tests.corpus import opinfo, opinfo_expected, opinfo_run, opinfo_table

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=1)
def one_device() -> dict[str, dict[str, str]]:
    return opinfo_run.one_device(opinfo.inventory().cases)


def test_every_op_trains_as_eager_on_one_device_or_raises_a_clear_error():
    problems = opinfo_expected.problems(one_device())
    assert not problems, "\n".join(problems)


def test_the_corpus_holds_0_d_parameters_and_most_of_op_db():
    """0-d float64 leaves trained silently wrong under ``aot_eager`` before 194ad33: the corpus
    keeps a 0-d sample of every op that has one."""
    inventory = opinfo.inventory()
    assert sum(case.name.endswith("[0-d]") for case in inventory.cases) >= 50
    assert len({case.op_name for case in inventory.cases}) >= 0.9 * len(opinfo.selected_ops())
    assert sum(name in one_device() for name in opinfo_expected.EXPECTED) == len(opinfo_expected.EXPECTED)


def test_the_docs_table_counts_what_the_corpus_shows_on_one_device():
    drift = opinfo_table.drift(one_device(), ("aot_eager", "inductor"))
    assert not drift, f"{drift}: regenerate docs/sharding.md's table with python -m tests.corpus.opinfo_table"
