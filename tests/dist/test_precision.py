"""Precision policies on a mesh: FP8 where the sharded step equals the unsharded one, refused elsewhere."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dist import precision_workers


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_float8_on_data_parallel_and_fsdp_equals_the_unsharded_step(ranks, preset):
    """A rank's token rows and (gathered) weight channels are the unsharded step's, so are their
    scales: rowwise's are a row's own, tensorwise's the global batch's (each activation's and
    gradient's amax all-reduced, max, over the batch's axis), and those all-reduces, issued
    between the gradients' collectives, do not cut the gradients' buckets. The dp=2 step stays
    within the tolerance the bf16 steps of tests/dist are held to."""
    group = ranks(2)
    (bf16, _), (rowwise, _), (tensorwise, _) = (
        group.run(precision_workers.float8_matches_unsharded, {"dp": 2}, preset, policy)
        for policy in ("bf16", "rowwise", "tensorwise")
    )
    assert bf16[:2] == (0, 0)
    assert rowwise[0] >= 8  # forward and grad-input of qkv, proj, fc, fc_proj
    assert rowwise[1] >= 1  # the MLP's GELU gradient: cast and bias sums fused (kernels/fp8/cast.py)
    assert rowwise[2] == bf16[2]  # a row's scale needs no collective
    assert tensorwise[0] >= 12  # forward, grad-input and grad-weight of the same four layers
    assert tensorwise[2] > bf16[2]  # the amax all-reduces
    assert tensorwise[3] == rowwise[3] == bf16[3]  # ... do not cut the gradients' buckets


@pytest.mark.parametrize("policy", ["rowwise", "tensorwise"])
def test_float8_auto_filter_takes_rank_0s_choice_on_every_rank(ranks, policy):
    """Each rank measures its own GPU; were each to choose its own layers, the ranks' graphs,
    and their collectives, would differ. Here rank 0 measures FP8 as faster and rank 1 as
    slower: both run rank 0's choice (every layer in FP8), and train in step."""
    (count0, losses0), (count1, losses1) = ranks(2).run(precision_workers.float8_auto_agrees_across_ranks, {"dp": 2}, policy)
    assert count0 == count1 >= 8 and losses0 == losses1


@pytest.mark.parametrize("policy", ["rowwise", "tensorwise"])
def test_float8_under_tensor_parallel_is_refused_naming_the_parameter(ranks, policy):
    for message in ranks(2).run(precision_workers.float8_under_tensor_parallel_is_refused, {"tp": 2}, policy):
        assert message.startswith("UnsupportedError") and "is sharded where it is used" in message
        assert "params" in message and "tensor parallel" in message and f"recipe='{policy}'" in message


@pytest.mark.parametrize("policy", ["bf16", "rowwise", "tensorwise"])
def test_float8_on_data_parallel_casts_each_row_as_the_unsharded_step(ranks, policy):
    """The first loss on dp=2 equals one device's to 1e-5 relative: every row was cast with the
    unsharded step's scales, and the output head stayed in bf16 as on one device. Measured
    (CPU, 2026-12-02): bf16 under 1e-6, rowwise 1.4e-6, tensorwise 5.7e-6; tensorwise with
    rank-local scales (no amax all-reduce) 2.4e-5; with the head converted on the mesh (the
    bug this caught: the loss's all-reduce hid the head) 1e-5 (rowwise) to 5e-5."""
    for sharded, unsharded in ranks(2).run(precision_workers.first_losses, {"dp": 2}, "dp", policy):
        assert abs(sharded - unsharded) <= 1e-5 * abs(unsharded), (sharded, unsharded)


@pytest.mark.parametrize("preset, axes", [("dp", {"dp": 2}), ("fsdp", {"dp": 2}), ("tp", {"tp": 2})])
def test_gemm_epilogues_on_a_mesh_keep_the_step(ranks, preset, axes):
    """The GELU epilogues' rewrite is local to a rank's graph: under data parallel, FSDP and
    tensor parallel each rank's MLP takes both ops, and the steps are the plain steps bit for bit
    (the ops run their aten references on CPU; the epilogues themselves: tests/gpu)."""
    for counts, same in ranks(2).run(precision_workers.local_rewrite_keeps_the_step, axes, preset, "gemm_epilogues"):
        assert counts["fsg.linear_gelu.default("] == counts["fsg.mm_gelu_backward.default("] == 1 and same


@pytest.mark.parametrize("preset, axes", [("dp", {"dp": 2}), ("fsdp", {"dp": 2}), ("tp", {"tp": 2})])
def test_batch_casts_on_a_mesh_keep_the_step(ranks, preset, axes):
    """The batched parameter casts are local to a rank's graph too: under data parallel and
    tensor parallel each rank's casts of its parameter inputs come from one ``cast_flat``;
    under FSDP the shards' casts stay their own (each feeds its packed gather bucket: the
    worker checks the graph issues as many all-gathers as without the pass, one here; before
    the fix, found on 2026-12-04 by compiling this step for CUDA, 28), and the casts left, of
    parameters not gathered, are batched. Every step equals the plain step bit for bit (run
    op by op)."""
    gathers = "_c10d_functional.all_gather_into_tensor.default("
    for counts, same in ranks(2).run(precision_workers.local_rewrite_keeps_the_step, axes, preset, "batch_casts"):
        assert same and counts["fsg.cast_flat.default("] == (0 if preset == "fsdp" else 1), counts
        assert preset != "fsdp" or counts[gathers] == 1, counts  # (tensor parallel gathers activations)


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_weight_fusion_on_a_mesh_keeps_the_step(ranks, preset):
    """``Fusions.fp8_weights`` is local to a rank's graph: under data parallel each block weight's two
    FP8 casts come from one op reading the replicated float32 master; under FSDP from the
    gathered bf16 weight (the wait of its all-gather: nothing to round). Every step equals the
    unfused one bit for bit."""
    for count, same in ranks(2).run(precision_workers.weight_fusion_keeps_the_step, {"dp": 2}, preset):
        assert same and count == 4, count  # qkv, proj, fc, fc_proj of its one block


@pytest.mark.parametrize(
    ("case", "backend", "axes", "fsdp_axis"),
    [
        ("gpt", "eager", {"dp": 2}, "dp"),
        ("gpt128", "eager", {"dp": 2}, "dp"),
        ("gpt", "inductor", {"dp": 2}, "dp"),
        ("mlp", "eager", {"dp": 2}, "dp"),
        ("gpt", "eager", {"dp": 2, "fsdp": 2}, "fsdp"),  # HSDP: sharded over fsdp, replicated over dp
    ],
)
def test_fsdp_gathers_weights_in_fp8_as_the_compute_dtype_gather_casts_them(ranks, case, backend, axes, fsdp_axis):
    """``Float8(all_gather="fp8")``: each shard cast with the global amax (one all-reduce of the
    shards' maxima) and gathered as bytes is the cast of the gathered bf16 weight, so three
    SGD steps end bit for bit where the compute-dtype gathers end (the same ops on the same
    values, run one by one); under Inductor, whose fusions round differently in the two graphs
    (each differs from the eager step by ~1e-5 in the first loss, measured on CPU), within
    1e-3. Only weights that FP8 matmuls alone read move one byte an element: the GPT's four
    (qkv, proj, fc, fc_proj), not their biases or the embeddings; the MLP's middle one, not
    the first (its penalty reads it in bf16) or the head. On an HSDP mesh the amaxes are
    all-reduced over the FSDP axis, the gathers' group (the replicas hold the same shards)."""
    world = 2 if len(axes) == 1 else 4
    runs = ranks(world).run(precision_workers.float8_gather_is_the_compute_gather, axes, backend, case, fsdp_axis)
    for run in runs:
        assert run["equal"] if backend == "eager" else run["largest"] < 1e-3, run
        assert all(math.isfinite(x) for x in run["losses"])
        compute, fp8 = run["compute"], run["fp8"]
        assert "torch.uint8" not in compute
        qkv_proj_fc_fc_proj = {width: (3 + 1 + 4 + 4) * width * width for width in (16, 128)}
        assert fp8["torch.uint8"][0] == {"gpt": qkv_proj_fc_fc_proj[16], "gpt128": qkv_proj_fc_fc_proj[128],
                                         "mlp": 64 * 64}[case]  # fmt: skip
        assert compute["torch.bfloat16"][0] - fp8.get("torch.bfloat16", [0])[0] == 2 * fp8["torch.uint8"][0]
        assert fp8["torch.uint8"][1] == 1  # packed into FSDP's prefetch buckets (one bucket at these sizes)
        want = {"gpt": "4 weights gathered in FP8", "gpt128": "4 weights gathered in FP8",
                "mlp": "1 weight gathered in FP8"}[case]  # fmt: skip
        assert want in run["said"], run["said"]
        if case == "mlp":  # the penalty's read is named, with the weight
            said = run["said"]
            assert "1 weight gather stays in the compute dtype" in said and "reads it too" in said and "0.weight" in said


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    widths=st.lists(st.sampled_from([16, 32, 48, 64]), min_size=3, max_size=5),
    bias=st.booleans(),
    data=st.data(),
)
def test_fp8_gathers_are_bit_for_bit_over_drawn_mlps(ranks, widths, bias, data):
    """Over drawn MLPs (widths, biases, a penalty on one layer's weight or none): three FSDP
    steps with FP8 gathers end bit for bit where the compute-dtype gathers end (eager), and
    exactly the weights FP8 matmuls alone read move as bytes: every layer's but the head's
    and the penalized one's."""
    layers = len(widths) - 1
    penalized = data.draw(st.one_of(st.none(), st.integers(0, layers - 1)), label="penalized")
    case = (tuple(widths), bias, penalized)
    for run in ranks(2).run(precision_workers.float8_gather_is_the_compute_gather, {"dp": 2}, "eager", case):
        assert run["equal"], run
        want = sum(widths[i] * widths[i + 1] for i in range(layers - 1) if i != penalized)
        assert run["fp8"].get("torch.uint8", [0])[0] == want, (run["fp8"], want)
