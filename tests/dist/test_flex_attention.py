"""FlexAttention on a mesh: evaluation and training steps equal the unsharded ones, on 2 gloo ranks."""

import pytest

from tests.dist import flex_workers


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("axes", "preset"), [({"dp": 2}, "dp"), ({"dp": 2}, "fsdp"), ({"tp": 2}, "tp")])
def test_flex_attention_evaluates_on_a_mesh_as_unsharded(ranks, axes, preset, backend):
    ranks(2).run(flex_workers.check_flex_attention_eval, axes, preset, backend)


@pytest.mark.parametrize(("axes", "preset"), [({"dp": 2}, "dp"), ({"dp": 2}, "fsdp"), ({"tp": 2}, "tp")])
def test_flex_attention_trains_on_a_mesh_as_unsharded(ranks, axes, preset):
    ranks(2).run(flex_workers.check_flex_attention_training, axes, preset)
