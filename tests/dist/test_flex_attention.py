"""FlexAttention on a mesh: evaluation and training steps equal the unsharded ones, on 2 gloo
ranks; a batch-sharded attention whose masks do not read the batch index stays local."""

import pytest

from tests.dist import flex_workers

MESHES = [({"dp": 2}, "dp"), ({"dp": 2}, "fsdp"), ({"tp": 2}, "tp")]


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("axes", "preset"), MESHES)
def test_flex_attention_evaluates_on_a_mesh_as_unsharded(ranks, axes, preset, backend, per_sequence):
    ranks(2).run(flex_workers.check_flex_attention_eval, axes, preset, backend, per_sequence)


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize(("axes", "preset"), MESHES)
def test_flex_attention_trains_on_a_mesh_as_unsharded(ranks, axes, preset, per_sequence):
    ranks(2).run(flex_workers.check_flex_attention_training, axes, preset, per_sequence)
