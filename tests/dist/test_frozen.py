"""Frozen parameters and parameter groups on a mesh: the sharded step equals the unsharded one,
leaves a frozen weight as it was, and spends no gradient collective on it."""

import pytest

from tests.dist import frozen_workers


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_a_frozen_layer_on_a_mesh(ranks, preset):
    for frozen_sums, all_sums, kept in ranks(2).run(frozen_workers.frozen_layer_on_a_mesh, {"dp": 2}, preset):
        assert kept
        assert all_sums - frozen_sums >= 16 * 16  # the frozen weight's gradient is not reduced


@pytest.mark.parametrize("first", ["adamw", "muon"])
@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_param_groups_on_a_mesh(ranks, preset, first):
    """``fsg.optim.multi_transform`` sharded: equal to the unsharded step, the frozen group kept;
    Muon's orthogonalization of an FSDP-sharded matrix too."""
    assert all(ranks(2).run(frozen_workers.param_groups_on_a_mesh, {"dp": 2}, preset, first))


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_lora_adapters_on_a_mesh(ranks, preset):
    """Hugging Face PEFT's LoRA (a frozen base, trained adapters) sharded equals unsharded."""
    pytest.importorskip("peft")
    ranks(2).run(frozen_workers.lora_on_a_mesh, {"dp": 2}, preset)


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_a_gradient_hook_on_a_parameter_on_a_mesh(ranks, preset):
    """A hook masking an embedding's gradient rows (``p.register_hook``) runs in the sharded
    step as in the unsharded one: equal steps, the masked rows unchanged."""
    assert all(ranks(2).run(frozen_workers.masked_gradient_on_a_mesh, {"dp": 2}, preset))
