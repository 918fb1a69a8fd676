"""Pins the public names: adding or removing one is a deliberate change to this list."""

import fsg
import fsg.nn
import fsg.optim


def test_fsg_public_names():
    assert sorted(fsg.__all__) == sorted([
        "ArgumentError", "BatchError", "ReplicaMismatchError", "check_replicas", "DataError", "DynamicLossScale", "Float8", "NonFiniteError", "SkipNonFinite", "data", "CheckpointError", "checkpoint", "Cost", "CudaGraphWarning", "EvalStep", "FsgError", "Mesh", "MeshError", "P", "Pipeline", "pipeline", "Policy", "ShardingFallbackWarning", "ShardingRuleError", "distributed", "sharding", "HostSyncError", "ImpureLossError", "Lowered", "LossNotScalarError", "Memory",
        "NonTensorLeafError", "RecompileError", "RecompileWarning", "Step", "StructureMismatchError",
        "Topology", "TopologyError", "TrainState", "UnsupportedError", "plan", "topology", "VerificationError", "apply", "buffers", "compile_eval", "compile_step", "nn", "optim", "params",
    ])  # fmt: skip
    for name in fsg.__all__:
        assert getattr(fsg, name) is not None


def test_optim_public_names():
    assert sorted(fsg.optim.__all__) == sorted([
        "AdafactorState", "DampedTraceState", "EmptyState", "ScaleByAdadeltaState", "ScaleByAdamaxState", "ScaleByAmsgradState",
        "ScaleByNadamState", "adadelta", "adamax", "nadam", "radam", "scale_by_adadelta", "scale_by_adamax",
        "scale_by_amsgrad", "scale_by_nadam", "scale_by_radam", "GradientTransformation", "MaskedNode", "Schedule", "ScaleByAdamState",
        "ScaleByLearningRateState", "ScaleByLionState", "ScaleByMuonState", "ScaleByRmsState", "ScaleByRssState", "ScaleByScheduleState", "TraceState",
        "adafactor", "adagrad", "adam", "adamw", "add_decayed_weights", "apply_updates", "chain", "clip_by_global_norm",
        "constant", "cosine", "from_torch", "global_norm", "learning_rate", "linear", "lion", "multi_transform", "muon",
        "piecewise", "rmsprop", "scale", "scale_by_adam", "scale_by_learning_rate", "scale_by_lion", "scale_by_muon", "scale_by_rms", "scale_by_rss",
        "scale_by_schedule", "set_to_zero", "sgd", "trace", "warmup_cosine",
    ])  # fmt: skip
    for name in fsg.optim.__all__:
        assert getattr(fsg.optim, name) is not None


def test_nn_public_names():
    assert fsg.nn.__all__ == ["cross_entropy", "layer_norm", "linear_cross_entropy", "rms_norm"]


def test_errors_are_fsg_errors():
    for name in ["HostSyncError", "ImpureLossError", "LossNotScalarError", "NonTensorLeafError",
                 "RecompileError", "StructureMismatchError", "UnsupportedError", "VerificationError"]:  # fmt: skip
        assert issubclass(getattr(fsg, name), fsg.FsgError)


def test_public_errors_print_under_their_public_names():
    import pickle
    import traceback

    classes = [getattr(fsg, n) for n in fsg.__all__ if isinstance(getattr(fsg, n), type)]
    errors = [c for c in classes if issubclass(c, (Exception, Warning))]
    assert len(errors) >= 20
    for cls in errors:
        assert cls.__module__ == "fsg" and getattr(fsg, cls.__qualname__) is cls, cls
        assert pickle.loads(pickle.dumps(cls)) is cls
    try:
        raise fsg.HostSyncError("loss_fn called .item()")
    except fsg.HostSyncError as exc:
        printed = "".join(traceback.format_exception(exc))
    assert "fsg.HostSyncError: loss_fn called .item()" in printed and "_src" not in printed.splitlines()[-1]


def test_sharding_testing_distributed_names():
    import fsg.distributed
    import fsg.sharding
    import fsg.testing

    assert sorted(fsg.sharding.__all__) == sorted(
        ["Rules", "data_parallel", "fsdp", "fsdp_tensor_parallel", "rules", "tensor_parallel"]
    )
    assert sorted(fsg.testing.__all__) == sorted(
        ["MultiRank", "RankError", "assert_sharded_matches_unsharded", "mesh", "mesh_strategy", "spec_strategy",
         "verify_step"]
    )  # fmt: skip
    assert sorted(fsg.distributed.__all__) == ["ProcessInfo", "initialize", "shutdown"]


def test_pipeline_names():
    import fsg.pipeline

    assert sorted(fsg.pipeline.__all__) == sorted(
        ["Action", "Cost", "Event", "Pipeline", "PipelineStep", "Schedule", "Timeline", "make_schedule", "simulate"]
    )
    assert fsg.Pipeline is fsg.pipeline.Pipeline
