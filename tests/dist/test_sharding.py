"""The sharded step equals the unsharded step, and issues the collectives the rules promise.

Real gloo process groups on CPU (2 and 4 ranks), one pool per world size for the session.
"""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fsg.testing
from tests.dist import workers

MLP_SHAPES = {"0.weight": (32, 8), "0.bias": (32,), "2.weight": (4, 32), "2.bias": (4,)}
GPT_SHAPES = {
    "wte.weight": (32, 16), "wpe.weight": (16, 16), "blocks.0.ln_1.weight": (16,),
    "blocks.0.attn.qkv.weight": (48, 16), "blocks.0.attn.proj.weight": (16, 16),
    "blocks.0.ln_2.weight": (16,), "blocks.0.fc.weight": (64, 16), "blocks.0.fc_proj.weight": (16, 64),
    "ln_f.weight": (16,),
}  # fmt: skip
DIST = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def case_strategy(draw, shapes: dict, batch: int):
    world = draw(st.sampled_from([1, 2, 4]))
    axes = draw(fsg.testing.mesh_strategy(world))
    specs = {name: tuple(draw(fsg.testing.spec_strategy(shape, axes))) for name, shape in shapes.items()}
    batch_axes = draw(st.sampled_from([()] + [(a,) for a, n in axes.items() if batch % n == 0]))
    return world, axes, specs, batch_axes


def run_case(ranks, fn, world, axes, specs, batch_axes):
    if world == 1:
        fn(axes, specs, batch_axes)  # a mesh of size 1: the single-device path, in process
    else:
        ranks(world).run(fn, axes, specs, batch_axes)


@DIST
@given(case_strategy(MLP_SHAPES, batch=16))
@example(
    (4, {"dp": 2, "tp": 2}, {"0.weight": ("tp", "dp"), "0.bias": ("tp",), "2.weight": (None, ("dp", "tp"))}, ("dp",))
)
def test_sharded_mlp_matches_unsharded(ranks, case):
    run_case(ranks, workers.check_mlp, *case)


@DIST
@given(case_strategy(GPT_SHAPES, batch=4))
@example(
    (4, {"dp": 2, "tp": 2}, {"blocks.0.fc.weight": ("tp", "dp"), "blocks.0.fc_proj.weight": ("dp", "tp")}, ("dp",))
)
def test_sharded_transformer_matches_unsharded(ranks, case):
    run_case(ranks, workers.check_gpt, *case)


@pytest.mark.parametrize(
    "world, axes, preset",
    [(2, {"dp": 2}, "dp"), (2, {"dp": 2}, "fsdp"), (2, {"tp": 2}, "tp"), (4, {"dp": 2, "tp": 2}, "fsdp_tp")],
)
def test_presets_on_a_transformer_match_unsharded(ranks, world, axes, preset):
    assert ranks(world).run(workers.check_gpt_preset, axes, preset) == [0] * world


@pytest.mark.parametrize("world, axes, preset", [(2, {"dp": 2}, "fsdp"), (2, {"tp": 2}, "tp")])
def test_adafactor_on_a_transformer_matches_unsharded(ranks, world, axes, preset):
    """Adafactor's factored moments (row and column factors of each matrix) sharded."""
    ranks(world).run(workers.check_gpt_preset, axes, preset, None, "adafactor")


@pytest.mark.parametrize("world, axes, preset", [(2, {"dp": 2}, "fsdp"), (2, {"tp": 2}, "tp")])
def test_nadam_and_radam_on_a_transformer_match_unsharded(ranks, world, axes, preset):
    ranks(world).run(workers.check_gpt_preset, axes, preset, None, "nadam_radam")


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_weighted_accumulation_on_a_mesh_matches_unsharded(ranks, preset):
    ranks(2).run(workers.check_weighted_accumulation, {"dp": 2}, preset)


@pytest.mark.parametrize(
    "world, axes, preset", [(2, {"dp": 2}, "fsdp"), (2, {"tp": 2}, "tp"), (4, {"dp": 2, "tp": 2}, "fsdp_tp")]
)
def test_muon_and_adamw_groups_on_a_transformer_match_unsharded(ranks, world, axes, preset):
    """Muon's orthogonalization of sharded matrices (FSDP rows, tensor-parallel columns or
    rows, both) equals the unsharded step: each rank orthogonalizes the gathered matrix."""
    ranks(world).run(workers.check_gpt_preset, axes, preset, None, "muon")
    ranks(world).run(workers.verify_muon, axes, preset)


def test_data_parallel_all_reduces_each_gradient_once_and_nothing_in_forward(ranks):
    table, param_bytes = ranks(2).run(workers.collectives_of, {"dp": 2}, "dp", "mlp", None)[0]
    # One all-reduce per gradient (4 params) plus the 4-byte loss metric; no gathers: no
    # collective touches an activation, so none happens in the forward pass.
    assert table == [("all_reduce", "dp", sum(param_bytes) + 4, len(param_bytes) + 1)]


def test_fsdp_gathers_params_and_reduce_scatters_grads_only(ranks):
    table, local_bytes = ranks(2).run(workers.collectives_of, {"dp": 2}, "fsdp")[0]
    rows = {kind: (nbytes, count) for kind, axis, nbytes, count in table}
    # each rank holds half of every parameter: (32*8 + 32 + 4*32 + 4) float32 = 1680 bytes
    assert sum(local_bytes) * 2 == 1680
    # all-gathers read exactly the local parameter shards: never an activation.
    assert rows["all_gather_into_tensor"] == (sum(local_bytes), len(local_bytes))
    # reduce-scatters read full-size gradients (2 x the local shards), one per parameter.
    assert rows["reduce_scatter_tensor"] == (2 * sum(local_bytes), len(local_bytes))
    # the rest are scalars: the loss and the global grad norm.
    assert rows["all_reduce"] == (8, 2)


def test_column_row_tensor_parallel_mlp_all_reduces_once_forward_once_backward(ranks):
    table, _ = ranks(2).run(workers.collectives_of, {"tp": 2}, "tp", "tp_mlp")[0]
    activation = 16 * 8 * 4  # [batch, features] float32
    # forward: the row-parallel output; backward: the gradient entering the column layer;
    # plus the 4-byte sum of squares of the sharded gradients for grad_norm.
    assert table == [("all_reduce", "tp", 2 * activation + 4, 3)]


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("unknown_axis", "MeshError", r"P\('mp', None\) for params\['0.weight'\] names axis 'mp'"),
        (
            "no_rule",
            "ShardingRuleError",
            r"fsg_test.unruled.default at File .*workers.py.*unruled\(out\).*\(16, 4\) \[Shard\(0\)\]",
        ),
    ],
)
def test_bad_specs_and_ops_get_clear_errors(ranks, case, error, match):
    import re

    message = ranks(2).run(workers.expect_error, {"dp": 2}, case)[0]
    assert message.startswith(error)
    assert re.search(match, message), message


def test_indivisible_spec_names_the_leaf_and_sizes(ranks):
    message = ranks(4).run(workers.expect_error, {"dp": 4}, "indivisible")[0]
    assert message.startswith("MeshError")
    assert "shards dim 0 of params['0.bias'] (size 30) over ('dp',) (4 ways)" in message


def test_an_op_whose_rule_refuses_its_placements_runs_replicated_with_a_warning(ranks):
    messages = ranks(2).run(workers.check_fallback, {"dp": 2})[0]  # and matches unsharded
    assert messages and "fsg_test.double.default" in messages[0]
    assert "its inputs were gathered and it ran replicated" in messages[0]


def test_a_tensor_the_loss_closes_over_stays_defined_before_its_readers(ranks):
    ranks(2).run(workers.check_closed_over_constant, {"dp": 2})


def test_fsdp_with_bf16_compute_gathers_half_the_bytes(ranks):
    gathered32, local = ranks(2).run(workers.fsdp_gather_bytes, {"dp": 2}, "float32")[0]
    gathered16, _ = ranks(2).run(workers.fsdp_gather_bytes, {"dp": 2}, "bfloat16")[0]
    assert gathered32 == local  # float32 shards
    assert gathered16 * 2 == local  # cast to bf16 before the all-gather


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_gradients_reduced_in_bf16_move_half_the_bytes(ranks, preset):
    """``Policy(reduce=torch.bfloat16)``: each gradient is cast to bf16 before its all-reduce
    (reduce-scatter) and the fused AdamW reads the bf16 result directly; the step stays
    within bf16's precision of the unsharded float32 one."""
    f32 = ranks(2).run(workers.reduce_dtype_bytes, preset, None)[0]
    bf16 = ranks(2).run(workers.reduce_dtype_bytes, preset, "bfloat16")[0]
    assert f32["grad_dtypes"] == ["torch.float32"]
    assert bf16["grad_dtypes"] == ["torch.bfloat16"]
    # the loss metric's float32 all-reduce (4 bytes) is not a gradient and is not cast
    assert bf16["bytes"] - (4 if preset == "dp" else 0) == (f32["bytes"] - (4 if preset == "dp" else 0)) // 2


def test_gradient_accumulation_on_a_mesh_matches_and_moves_no_batch_data(ranks):
    kinds = ranks(2).run(workers.check_accumulation, {"dp": 2}, "dp")[0]
    assert kinds == ["all_reduce"]  # splitting the sharded batch into microbatches is local
    ranks(2).run(workers.check_accumulation, {"dp": 2}, "fsdp")


def test_bucketing_packs_gradient_all_reduces_and_issues_them_during_the_backward(ranks):
    one_bucket = ranks(2).run(workers.bucketed_data_parallel, 25.0)[0]
    # all gradients in one all-reduce, plus the loss metric (an average, never packed with sums)
    assert one_bucket["table"] == [("all_reduce", "dp", one_bucket["param_bytes"] + 4, 2)]
    small = ranks(2).run(workers.bucketed_data_parallel, 0.02)[0]  # ~20 KB: several buckets
    count = small["table"][0][3]
    assert 2 < count < 9  # 8 params: fewer collectives than tensors, more than one bucket
    # the first bucket is reduced while backward matmuls remain (overlap on NCCL)
    assert small["first_grad_all_reduce"] < small["last_matmul"]


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_with_bf16_compute_buckets_are_still_issued_during_the_backward(ranks, preset):
    """A float32 param is cast to bf16 before the forward, so autograd casts its gradient back
    only after the whole backward; the pass hoists that cast to the gradient's matmul (before,
    every bucket waited for the end of the backward)."""
    small = ranks(2).run(workers.bucketed_data_parallel, 0.02, preset, "bfloat16")[0]
    assert small["first_grad_all_reduce"] < small["last_matmul"]


def test_fsdp_reduce_scatters_are_packed_and_issued_during_the_backward(ranks):
    one_bucket = ranks(2).run(workers.bucketed_data_parallel, 25.0, "fsdp")[0]
    rows = {kind: (nbytes, count) for kind, axis, nbytes, count in one_bucket["table"]}
    assert rows["reduce_scatter_tensor"] == (one_bucket["param_bytes"], 1)  # all 8 gradients at once
    small = ranks(2).run(workers.bucketed_data_parallel, 0.02, "fsdp")[0]
    assert 1 < dict((k, c) for k, _, _, c in small["table"])["reduce_scatter_tensor"] < 8
    assert small["first_grad_all_reduce"] < small["last_matmul"]  # the first reduce-scatter


def test_fsdp_parameter_gathers_are_packed_and_prefetched_one_bucket_ahead(ranks):
    """Stage 2 gathers every parameter, each waited at once, at the step's start; the pass
    packs them in forward order and issues bucket k+1 before bucket k's wait."""
    one = ranks(2).run(workers.fsdp_gather_order, 25.0)[0]
    assert len(one["issued"]) == 1 and one["issued"][0] < one["first_matmul"]
    assert one["gathered_bytes"] == one["param_bytes_bf16"] // 2  # each rank's bf16 shards, once
    assert one["dtypes"] == ["torch.bfloat16"]  # cast before the gather
    small = ranks(2).run(workers.fsdp_gather_order, 0.005)[0]  # ~5 KB: several buckets
    issued, waits = small["issued"], small["waits"]
    assert 2 < len(issued) < 8  # 8 params
    assert waits == sorted(waits) and issued[0] < small["first_matmul"]
    assert all(issued[k + 1] < waits[k] for k in range(len(issued) - 1))  # one bucket of prefetch
    assert waits[-1] > small["first_matmul"]  # the last layer's bucket is waited for mid-forward


def test_the_forward_small_collectives_leave_the_critical_path(ranks):
    """The token count (read from the labels) is reduced first thing and the loss metric's
    sum is waited for only at the step's end: neither blocks the compute between them."""
    order = ranks(2).run(workers.small_collective_order)[0]
    assert order["count_issued"] < order["first_matmul"]
    assert order["loss_issued"] < order["last_matmul"] < order["loss_waited"]


@pytest.mark.parametrize(
    "world, axes, preset",
    [(2, {"dp": 2}, "dp"), (2, {"dp": 2}, "fsdp"), (4, {"dp": 2, "tp": 2}, "fsdp_tp")],
)
def test_the_fused_optimizer_on_a_mesh_updates_each_ranks_shards(ranks, world, axes, preset):
    """AdamW is elementwise: the fused kernel updates each rank's local pieces after stage 2
    has reduced the gradients, whatever the placements."""
    fused_nodes = ranks(world).run(workers.check_gpt_preset, axes, preset, True)
    # one update per group of gradients that arrive together (one bucket here on dp and fsdp;
    # on dp x tp gradients reduced over different axes come out of different collectives)
    assert fused_nodes == [1] * world if preset in ("dp", "fsdp") else all(n >= 1 for n in fused_nodes)


def test_each_buckets_params_are_updated_as_soon_as_its_reduction_lands(ranks):
    """With small buckets the fused AdamW is split: one update per bucket, in the order the
    buckets were issued, each after its own bucket's wait and before the next wait, so the
    last reduction overlaps the earlier updates; the step still equals the unsharded one."""
    out = ranks(2).run(workers.fused_update_order, 0.004)[0]
    assert out["updates"] >= 3
    assert out["sequence"] == ["wait", "update"] * out["updates"]
    assert out["issue_order_matches"]


@pytest.mark.parametrize("preset, accum_steps", [("fsdp", 1), ("dp", 2)])
def test_updates_on_arrival_with_fsdp_shards_and_accumulation(ranks, preset, accum_steps):
    out = ranks(2).run(workers.fused_update_order, 0.004, preset, accum_steps)[0]
    assert out["updates"] >= 3 and out["issue_order_matches"]


@pytest.mark.parametrize(
    "world, axes, preset",
    [(2, {"dp": 2}, "dp"), (2, {"dp": 2}, "fsdp"), (2, {"tp": 2}, "tp"), (4, {"dp": 2, "tp": 2}, "fsdp_tp")],
)
def test_the_fused_linear_cross_entropy_stays_fused_on_a_mesh(ranks, world, axes, preset):
    """Its DTensor rule: each rank sums the loss over its tokens; the sums and the weight
    gradient are reduced over the ranks (a vocabulary-sharded weight is gathered first)."""
    assert ranks(world).run(workers.check_gpt_fused_loss, axes, preset) == [1] * world


def test_a_step_with_collectives_keeps_its_order_through_inductor(ranks):
    """Inductor's peak-memory reordering moved every bucketed all-reduce after the backward on
    two H200s; a graph with collectives is compiled without it, a single-device one with it."""
    on_mesh = ranks(2).run(workers.inductor_options, {"dp": 2})
    assert on_mesh == [{"config_patches": {"reorder_for_peak_memory": False}}] * 2
    assert workers.inductor_options(None) is None


@pytest.mark.parametrize(
    "preset, momentum, sync", [("dp", 0.1, False), ("fsdp", 0.1, False), ("dp", None, False), ("dp", 0.1, True),
                               ("fsdp", None, True)])  # fmt: skip
def test_batch_norm_running_statistics_on_a_data_mesh_match_unsharded(ranks, preset, momentum, sync):
    """momentum=None: the cumulative average; sync: SyncBatchNorm (torch's refuses CPU tensors),
    run as the BatchNorm it is over the global batch: both traced as fsg's stand-ins (stand_ins.py)."""
    ranks(2).run(workers.check_batch_norm_running_stats, {"dp": 2}, preset, momentum, sync)


def test_a_sync_batch_norm_over_a_subset_of_the_ranks_is_refused(ranks):
    for message in ranks(2).run(workers.sync_batch_norm_of_a_subgroup, {"dp": 2}):
        assert "SyncBatchNorm with a process_group of its own" in message and "process_group=None" in message
        assert "'1' (SyncBatchNorm)" in message


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_packed_sequences_on_a_data_mesh_match_unsharded(ranks, preset):
    """pack_padded_sequence -> bidirectional LSTM -> pad_packed_sequence with the lengths
    sharded with the batch (sorted across it: enforce_sorted=False)."""
    ranks(2).run(workers.check_packed_sequences, {"dp": 2}, preset)
