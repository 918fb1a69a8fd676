"""Hugging Face models on a mesh equal the unsharded step (issue 21): GPT-2 (tied head,
Conv1D) and Llama (grouped-query attention) under data parallel, FSDP and FSDP x tensor
parallel, on gloo ranks."""

import pytest

pytest.importorskip("transformers")

from tests.dist import model_workers  # noqa: E402


@pytest.mark.parametrize("kind, preset", [("gpt2", "dp"), ("llama", "fsdp")])
def test_hugging_face_models_on_two_ranks_match_unsharded(ranks, kind, preset):
    ranks(2).run(model_workers.check_hf, kind, {"dp": 2}, preset)


def test_hugging_face_gpt2_under_fsdp_and_tensor_parallel_matches_unsharded(ranks):
    ranks(4).run(model_workers.check_hf, "gpt2", {"dp": 2, "tp": 2}, "fsdp_tp")
