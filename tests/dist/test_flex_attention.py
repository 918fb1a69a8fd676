"""FlexAttention on a mesh: evaluation and training steps equal the unsharded ones, on 2 gloo
ranks; an attention sharded on batch or heads whose functions read no sharded index stays local."""

import pytest

from tests.dist import flex_workers

MESHES = [({"dp": 2}, "dp"), ({"dp": 2}, "fsdp"), ({"tp": 2}, "tp")]


@pytest.mark.parametrize("variant", ["alibi", "per_sequence", "heads"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("axes", "preset"), MESHES)
def test_flex_attention_evaluates_on_a_mesh_as_unsharded(ranks, axes, preset, backend, variant):
    ranks(2).run(flex_workers.check_flex_attention_eval, axes, preset, backend, variant)


@pytest.mark.parametrize("variant", ["alibi", "per_sequence", "heads"])
@pytest.mark.parametrize(("axes", "preset"), MESHES)
def test_flex_attention_trains_on_a_mesh_as_unsharded(ranks, axes, preset, variant):
    ranks(2).run(flex_workers.check_flex_attention_training, axes, preset, variant)


@pytest.mark.parametrize(("axes", "preset"), [({"dp": 2}, "dp"), ({"dp": 2}, "fsdp")])
def test_a_hugging_face_model_with_flex_attention_evaluates_locally_on_a_mesh(ranks, axes, preset):
    pytest.importorskip("transformers")
    ranks(2).run(flex_workers.check_hugging_face_flex_eval, axes, preset)
