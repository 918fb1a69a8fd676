"""The slow tier: ``python -m pytest -m "not slow"`` is the fast tier (docs/testing.md).

A test is slow when it is in a folder whose every test starts processes or trains a model
corpus, carries the ``inductor`` or ``torchrun`` marker, runs on a pool of ranks (the
``ranks`` fixture), or is named in ``SLOW_TESTS``. ``FAST`` keeps a few multi-rank tests in
the fast tier, so that it still runs a sharded step (FSDP and tensor parallel) end to end.
"""

import pytest

SLOW_FOLDERS = ("tests/dist/", "tests/models/", "tests/resume/", "tests/examples/")
SLOW_MARKERS = ("inductor", "torchrun")
FAST = (
    "tests/dist/test_sharding.py::test_presets_on_a_transformer_match_unsharded[2-axes1-fsdp]",
    "tests/dist/test_sharding.py::test_presets_on_a_transformer_match_unsharded[2-axes2-tp]",
)
# Node ids, or their prefixes (a test without its parameters): the tests outside the rules above
# that took over 3 s each on the 2-core CPU machine under other load (2026-12-07), about half of
# the rest of the suite's time; a test whose parameters were mostly slow is named whole.
SLOW_TESTS = (
    "tests/checkpoint/test_crash.py::test_sigkill_during_saves_never_loses_the_last_checkpoint",
    "tests/checkpoint/test_manager_edges.py::test_exit_flushes_a_pending_async_save",
    "tests/data/test_formats.py::test_prepare_command_line",
    "tests/kernels/test_adamw.py::test_a_failed_fusion_in_default_mode_traces_the_real_update",
    "tests/kernels/test_adamw.py::test_adam_takes_the_fused_kernel_too[inductor]",
    "tests/kernels/test_adamw.py::test_fused_step_matches_traced_math",
    "tests/kernels/test_adamw.py::test_multi_tensor_kernel_matches_reference",
    "tests/optim/test_multi_transform.py::test_param_groups_train_as_torch_optim_param_groups",
    "tests/optim/test_muon.py::test_muon_for_hidden_matrices_and_adamw_for_the_rest_match_torch[inductor]",
    "tests/test_accumulation.py::test_weighted_accumulation_equals_the_full_batch_for_a_loss_over_a_varying_count",
    "tests/test_autocast.py::test_autocast_policy_trains_as_eager_autocast[inductor]",
    "tests/test_batch_casts.py::test_a_gpt_step_with_one_cast_launch",
    "tests/test_batch_casts.py::test_an_accumulated_step_casts_each_parameter_once",
    "tests/test_batch_casts.py::test_an_fp8_gpt_step_keeps_its_matmul_biases_as_casts",
    "tests/test_batch_types.py::test_a_mapping_batch_trains_as_the_dict_it_holds[BatchEncoding]",
    "tests/test_block_masks.py::test_a_constant_mask_that_differs_by_sequence_keeps_its_batch_dim",
    "tests/test_block_masks.py::test_a_mask_built_in_the_step_for_each_sequence_alike_is_one_constant",
    "tests/test_block_masks.py::test_any_constant_mask_built_in_the_step_evaluates_as_eager",
    "tests/test_complex_params.py::test_complex_params_train_as_torch_optim_trains_them",
    "tests/test_complex_params.py::test_complex_params_under_inductor_and_a_float32_policy",
    "tests/test_default_precision.py::test_a_float64_physics_informed_loss_trains_as_eager[inductor]",
    "tests/test_default_precision.py::test_the_state_keeps_the_models_precision_at_least_float32",
    "tests/test_distributions.py::test_log_probs_entropies_train_as_eager_pytorch[inductor]",
    "tests/test_errors.py::test_a_loss_typed_at_the_prompt_is_located_by_its_line",
    "tests/test_float8.py::test_column_sums_fusion_equals_the_unfused_step",
    "tests/test_float8.py::test_filter_keeps_the_layers_it_refuses",
    "tests/test_float8.py::test_fp8_gathers_change_nothing_where_no_weight_is_gathered",
    "tests/test_float8.py::test_fused_concatenation_step_equals_the_unfused_step",
    "tests/test_float8.py::test_fused_gelu_backward_step_equals_the_unfused_step",
    "tests/test_float8.py::test_gpt_fp8_step_tracks_the_bf16_step_and_learns",
    "tests/test_float8.py::test_layer_norm_fusion_equals_the_unfused_step",
    "tests/test_float8.py::test_layer_norm_fusion_equals_the_unfused_step_over_norms",
    "tests/test_float8.py::test_mlp_fp8_step_tracks_the_bf16_step_and_learns",
    "tests/test_float8.py::test_rowwise_gelu_backward_becomes_one_fused_op_that_equals_the_unfused_graph",
    "tests/test_float8.py::test_rowwise_gpt_step_tracks_the_bf16_step_and_learns",
    "tests/test_float8.py::test_rowwise_scales_see_only_their_own_token_so_the_step_stays_causal",
    "tests/test_float8_cost.py::test_auto_measured_here_equals_the_explicit_filter_it_chose",
    "tests/test_float8_gated_mlp.py::test_fused_gated_mlp_step_equals_the_unfused_step",
    "tests/test_float8_weights.py::test_every_weight_of_a_gpt_is_cast_once_from_its_master_and_the_step_is_the_unfused_one",
    "tests/test_float8_weights.py::test_weight_fusion_equals_the_unfused_step_over_stacks",
    "tests/test_frozen.py::test_frozen_parameters_stay_and_the_rest_train_as_eager_pytorch",
    "tests/test_fused_loss.py::test_accumulated_microbatches_each_fuse_their_loss",
    "tests/test_fused_loss.py::test_every_hugging_face_family_gets_the_same_gradients_fused",
    "tests/test_fused_loss.py::test_hugging_face_step_traces_the_fused_loss_and_trains_alike",
    "tests/test_gemm_epilogues.py::test_a_gpt_step_with_the_ops_in_place_equals_the_plain_step",
    "tests/test_losses.py::test_cross_entropy_with_weight_smoothing_and_ignore_index_on_constants[inductor]",
    "tests/test_pack_attention_grads.py::test_under_rowwise_fp8_the_packed_gradient_is_cast_as_any_operand",
    "tests/test_packed_sequences.py::test_a_packed_lstm_classifier_trains_as_eager_under_inductor[cpu]",
    "tests/test_packed_sequences.py::test_packed_sequences_train_as_eager_pytorch",
    "tests/test_random.py::test_inductor_draws_what_eager_draws",
    "tests/test_random_counts.py::test_binomial_draws_the_binomial_probabilities",
    "tests/test_random_counts.py::test_poisson_and_binomial_in_a_step_are_keyed[inductor]",
    "tests/test_random_multinomial.py::test_categorical_sample_in_a_step_is_keyed[inductor]",
    "tests/test_random_samplers.py::test_mixup_rrelu_and_beta_in_a_step_are_keyed[inductor]",
    "tests/test_stand_ins.py::test_a_cumulative_batch_norm_steps_as_eager_pytorch",
    "tests/test_subgraph_constants.py::test_any_int_index_and_scalar_evaluates_as_eager_under_inductor",
    "tests/test_torch_compiled.py::test_torch_compiled_code_in_the_loss_trains_as_eager_pytorch[a compiled submodule-inductor]",
    "tests/test_torch_compiled.py::test_torch_compiled_code_in_the_loss_trains_as_eager_pytorch[decorated helper-inductor]",
    "tests/test_watch.py::test_mode_and_requires_grad_changes_between_steps_train_as_eager_pytorch",
    "tests/test_zero_dim.py::test_leaves_of_every_rank_train_as_eager",
    "tests/topology/test_gathered_mesh.py::test_mesh_from_the_gathered_topology_matches_the_unsharded_step",
)


# The order the work starts in under pytest-xdist, longest first (CI's --durations on the 2-core
# machine, 2026-12-07): a file a unit of work (--dist loadfile) except the tests named here, each
# case of which is a unit of its own; these go out first and the rest in collection order.
# xdist's own order (files with the most tests first) started these last, so one worker ran the
# longest alone at the end: the longest-first rule keeps the tail short.
LONGEST = (
    "tests/dist/test_docs_torchrun.py::test_the_documented_command_runs_as_written",
    "tests/dist/test_models.py::test_every_hugging_face_family_on_two_ranks_matches_unsharded",
    "tests/corpus/test_opinfo.py",
    "tests/dist/test_models.py::test_tp_named_families_under_fsdp_and_tensor_parallel_match_unsharded",
    "tests/models/test_hf_batch_casts.py",
    "tests/dist/test_sharding.py",
    "tests/models/test_hf.py",
    "tests/dist/test_op_corpus.py",
    "tests/dist/test_precision.py",
    "tests/pipeline/test_pipeline_step.py",
    "tests/test_float8.py",
    "tests/test_fused_loss.py",
    "tests/models/test_hf_float8.py",
    "tests/dist/test_opinfo_corpus.py",
    "tests/dist/test_flex_attention.py",
)


def _rank(nodeid: str) -> int:
    return next((i for i, p in enumerate(LONGEST) if nodeid.startswith(p)), len(LONGEST))


def _unit(nodeid: str) -> str:
    """The xdist unit of work a test belongs to: its own for a test named in ``LONGEST``, else its file."""
    alone = any("::" in p and nodeid.startswith(p) for p in LONGEST)
    return nodeid if alone else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":  # another --dist asked for: xdist's own scheduler
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the order the items are in (longest first)
    return LongestFirst(config, log)


def _is_slow(item) -> bool:
    if item.nodeid.startswith(FAST):
        return False
    return (
        item.nodeid.startswith(SLOW_FOLDERS + SLOW_TESTS)
        or any(item.get_closest_marker(m) for m in SLOW_MARKERS)
        or "ranks" in getattr(item, "fixturenames", ())
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers
def pytest_collection_modifyitems(items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: the rest keep their order
