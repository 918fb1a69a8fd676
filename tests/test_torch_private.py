"""Pins each private torch API that fsg uses (all imported in fsg/_src/_torch_private/)."""

import io

import pytest
import torch

from fsg._src import _torch_private


def test_trace_fake_records_aten_graph_with_real_constants():
    const = torch.ones(3)

    def fn(x):
        return (x * const).sum()

    gm = _torch_private.trace_fake(fn, torch.randn(3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mul.Tensor in targets
    assert torch.ops.aten.sum.default in targets


def test_trace_fake_traces_through_torch_compiled_code():
    """``torch._dynamo.config.error_on_nested_fx_trace``, patched off in ``trace_fake``: a
    compiled function is traced as the Python it wraps."""
    assert torch._dynamo.config.error_on_nested_fx_trace is True  # torch's default, which refuses

    @torch.compile
    def fn(x):
        return torch.sin(x) * 2

    gm = _torch_private.trace_fake(fn, torch.randn(3))
    assert torch.ops.aten.sin.default in [n.target for n in gm.graph.nodes]


def test_data_dependent_control_flow_raises_a_known_error():
    def fn(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(_torch_private.DATA_DEPENDENT_ERRORS):
        _torch_private.trace_fake(fn, torch.randn(3))


def test_item_is_a_host_sync_op_or_raises():
    def fn(x):
        return x * x.sum().item()

    try:
        gm = _torch_private.trace_fake(fn, torch.randn(3))
    except _torch_private.DATA_DEPENDENT_ERRORS:
        return  # older torch: .item() raises while tracing
    assert any(n.target in _torch_private.HOST_SYNC_OPS for n in gm.graph.nodes)


def test_fake_mode_and_dispatch_mode():
    seen = []

    class Record(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    mode = _torch_private.fake_mode()
    with mode:
        x = mode.from_tensor(torch.randn(2, 2))
    with mode, Record():
        y = x @ x
    assert y.shape == (2, 2)
    assert torch.ops.aten.mm.default in seen
    assert isinstance(torch.ops.aten.mm.default, _torch_private.OpOverload)


def test_functional_collectives_have_the_signatures_the_overlap_pass_uses():
    schema = _torch_private.ALL_REDUCE._schema
    assert [a.name for a in schema.arguments] == ["input", "reduce_op", "group_name"]
    assert [a.name for a in _torch_private.WAIT_TENSOR._schema.arguments] == ["tensor"]
    assert _torch_private.REDUCE_SCATTER._schema.arguments[0].name == "input"
    assert [a.name for a in _torch_private.ALL_GATHER._schema.arguments] == ["input", "group_size", "group_name"]
    assert all(map(_torch_private.is_collective, (_torch_private.ALL_REDUCE, _torch_private.WAIT_TENSOR)))
    assert not _torch_private.is_collective(torch.ops.aten.mm.default) and not _torch_private.is_collective("output")


def test_is_pure_op_reads_the_schema():
    assert _torch_private.is_pure_op(torch.ops.aten.mul.Tensor)
    assert not _torch_private.is_pure_op(torch.ops.aten.copy_.default)
    assert not _torch_private.is_pure_op(torch.ops.fsg.fused_adamw_.default)
    assert not _torch_private.is_pure_op("output")


@torch.library.custom_op("fsg_test::scaled_sum", mutates_args=())
def _scaled_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y


@_scaled_sum.register_fake
def _(x, y):
    return torch.empty_like(x)


def test_inductor_compile_gives_custom_ops_their_fallback_lowering_up_front(monkeypatch):
    """A custom op in the graph gets Inductor's fallback lowering before the compile (what its
    implicit fallback would do), so the implicit path never formats the op's arguments: torch
    2.11 did so eagerly, exponentially along a chain of opaque ops (here it would be asked
    only where its log is on: it is, and nothing may be formatted). A chain of 40 compiles
    and computes what eager does."""
    import logging

    from torch._inductor import config, exc, lowering

    op = torch.ops.fsg_test.scaled_sum.default
    assert op not in lowering.lowerings
    formatted = []
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(lambda *a: formatted.append(a) or ""))
    graph_log = logging.getLogger("torch._inductor.graph")
    handler = logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(graph_log, "level", logging.INFO)
    graph_log.addHandler(handler)

    def fn(x, y):
        for _ in range(40):
            x, y = op(x, y), op(y, x)
        return (x + y,)

    x, y = torch.randn(8) * 1e-6, torch.randn(8) * 1e-6
    try:
        with config.patch(force_disable_caches=True):
            (out,) = _torch_private.inductor_compile(_torch_private.trace_fake(fn, x, y), [x, y])(x, y)
    finally:
        graph_log.removeHandler(handler)
    assert op in lowering.lowerings and not formatted
    torch.testing.assert_close(out, fn(x, y)[0])


def test_inductor_compile_runs_an_aten_graph_with_input_mutation():
    def fn(w, x):
        w.copy_(w - 0.5 * x)
        return ((w * x).sum(),)

    w, x = torch.randn(5), torch.randn(5)
    gm = _torch_private.trace_fake(fn, w, x)
    compiled = _torch_private.inductor_compile(gm, [w, x])
    expected_w = w - 0.5 * x
    (out,) = compiled(w, x)
    assert torch.allclose(w, expected_w)
    assert torch.allclose(out, (expected_w * x).sum())


def test_trace_fake_records_source_lines_only_when_asked():
    class Double(torch.nn.Module):
        def forward(self, x):  # torch records the frames of modules' forward methods
            return x * 2

    plain = _torch_private.trace_fake(Double(), torch.randn(3))
    with_lines = _torch_private.trace_fake(Double(), torch.randn(3), source_lines=True)
    mul = [n for n in with_lines.graph.nodes if n.target is torch.ops.aten.mul.Tensor][0]
    assert "test_torch_private.py" in mul.meta["stack_trace"]
    assert not any(n.meta.get("stack_trace") for n in plain.graph.nodes)


def test_register_sharding_takes_an_op():
    """Used by fsg/_src/kernels/dtensor_rules.py (its behaviour is tested on gloo meshes in
    tests/dist/test_sharding.py)."""
    import inspect

    assert list(inspect.signature(_torch_private.register_sharding).parameters) == ["op"]


def test_mutated_args_reads_the_schemas_write_annotations():
    """Used by fsg/_src/graph_facts.py: ``Tensor(a!)`` arguments, lists of them, ``out=``."""
    assert _torch_private.mutated_args(torch.ops.aten.copy_.default) == {0}
    assert _torch_private.mutated_args(torch.ops.aten.add.out) == {3}  # the keyword-only out
    assert _torch_private.mutated_args(torch.ops.fsg.fused_adamw_.default) == {0, 2, 3}  # Tensor(a!)[]
    assert _torch_private.mutated_args(torch.ops.aten._foreach_add_.Scalar) == {0}
    assert not _torch_private.mutated_args(torch.ops.aten.view.default)
    assert not _torch_private.mutated_args(_torch_private.WAIT_TENSOR)
    assert not _torch_private.mutated_args("output")


def test_aliased_args_finds_views_and_returned_writes():
    assert _torch_private.aliased_args(torch.ops.aten.view.default) == {0}
    assert _torch_private.aliased_args(torch.ops.aten.t.default) == {0}
    assert _torch_private.aliased_args(torch.ops.aten.split_with_sizes.default) == {0}  # Tensor(a -> *)
    assert _torch_private.aliased_args(torch.ops.aten.copy_.default) == {0}  # returns its self
    assert _torch_private.aliased_args(torch.ops.aten.add.out) == {3}
    for op in (torch.ops.aten.mul.Tensor, torch.ops.aten._to_copy.default, _torch_private.ALL_REDUCE):
        assert not _torch_private.aliased_args(op)
    assert not _torch_private.aliased_args(torch.ops.fsg.fused_adamw_.default)  # returns nothing
    assert not _torch_private.aliased_args(len)


def test_arg_names_are_the_schemas():
    assert _torch_private.arg_names(torch.ops.aten.add.out) == ("self", "other", "alpha", "out")
    assert _torch_private.arg_names(len) == ()


def test_op_name_and_view_base():
    assert _torch_private.op_name(torch.ops.aten.mm.default) == "aten.mm"
    assert _torch_private.op_name(torch.ops._c10d_functional.wait_tensor.default) == "_c10d_functional.wait_tensor"
    x = torch.randn(4)
    assert _torch_private.view_base(x[1:]) is x and _torch_private.view_base(x) is x


def test_grad_hooks_lists_a_tensors_hooks_and_flags_post_accumulate_ones():
    p = torch.nn.Parameter(torch.randn(3))
    assert _torch_private.grad_hooks(p) == ([], False)
    hook = lambda g: g * 2  # noqa: E731
    p.register_hook(hook)
    assert _torch_private.grad_hooks(p) == ([hook], False)
    p.register_post_accumulate_grad_hook(lambda t: None)
    assert _torch_private.grad_hooks(p)[1]


def test_copy_graph_module_copies_nodes_and_keeps_constants_and_meta():
    const = torch.arange(3.0)
    gm = _torch_private.trace_fake(lambda x: (x * const).sum(), torch.randn(3))
    copy = _torch_private.copy_graph_module(gm)
    assert copy.graph is not gm.graph
    assert [n.name for n in copy.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert all(a.meta.get("val") is b.meta.get("val") for a, b in zip(copy.graph.nodes, gm.graph.nodes))
    x = torch.randn(3)
    assert torch.equal(
        copy(x)[0] if isinstance(copy(x), tuple) else copy(x), gm(x)[0] if isinstance(gm(x), tuple) else gm(x)
    )
    next(n for n in copy.graph.nodes if n.op == "call_function").meta["touched"] = True
    assert not any(n.meta.get("touched") for n in gm.graph.nodes)


def test_draws_random_reads_the_seeded_tag_and_generator_arguments():
    """Used by fsg/_src/trace/random.py: random ops it has no keyed version of raise."""
    assert _torch_private.draws_random(torch.ops.aten.randperm.default)  # tagged nondeterministic_seeded
    assert _torch_private.draws_random(torch.ops.aten.native_dropout.default)
    assert _torch_private.draws_random(torch.ops.aten.binomial.default)
    untagged = getattr(torch.ops.aten, "_no_grad_uniform_", None)  # takes a Generator, has no tag (2.13)
    assert untagged is None or _torch_private.draws_random(untagged.default)
    assert not _torch_private.draws_random(torch.ops.aten.mul.Tensor)
    assert not _torch_private.draws_random(torch.ops.aten.empty_like.default)
    assert not _torch_private.draws_random("output")


def test_dtensor_index_put_rule_is_positional_on_torch_2_11_only():
    """Used by fsg/_src/sharding/op_support.py: stage 2 gathers ``index_put``'s ``self`` and
    ``values`` where DTensor's rule is torch 2.11's ``prop_index_put``."""
    import torch.distributed.tensor  # noqa: F401 - registers DTensor's rules

    positional = _torch_private.dtensor_index_put_rule_is_positional()
    assert isinstance(positional, bool)
    release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if release in ((2, 11), (2, 13)):  # the releases fsg supports
        assert positional == (release == (2, 11))


def test_trace_fake_traces_batch_norm_as_the_op_that_declares_its_writes():
    # native_batch_norm's schema hides its writes to the running statistics
    # (fsg/_src/decompositions.py DECLARED_WRITES traces the op whose schema declares them).
    assert not _torch_private.mutated_args(torch.ops.aten.native_batch_norm.default)

    def fn(x, mean, var):
        return torch.nn.functional.batch_norm(x, mean, var, training=True).sum()

    gm = _torch_private.trace_fake(fn, torch.randn(4, 3), torch.zeros(3), torch.ones(3))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._native_batch_norm_legit.default in targets
    assert torch.ops.aten.native_batch_norm.default not in targets
    assert _torch_private.mutated_args(torch.ops.aten._native_batch_norm_legit.default) == {3, 4}


def test_functionalize_leaves_one_copy_per_written_input_at_the_end():
    def fn(x, buf):
        y = x.clone()
        y.relu_()
        buf.add_(1.0)
        buf.mul_(2.0)
        return (y.sum() + buf.sum(),)

    gm = _torch_private.trace_fake(fn, torch.randn(3), torch.zeros(3))
    functional = _torch_private.functionalize(gm)
    nodes = [n for n in functional.graph.nodes if n.op == "call_function"]
    writers = [n for n in nodes if _torch_private.mutated_args(n.target)]
    assert [w.target for w in writers] == [torch.ops.aten.copy_.default]
    assert writers[0].args[0].op == "placeholder" and writers[0].args[0].name == "arg1_1"
    assert nodes[-1] is writers[0]  # the epilogue: after every read
    x, buf = torch.randn(3), torch.zeros(3)
    expected = fn(x.clone(), buf.clone())[0]
    got = functional(x, buf)[0]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(buf, torch.full((3,), 2.0))


def test_functionalize_rewrites_in_place_ops_on_tensors_made_of_constants():
    """A tensor computed from the graph's constants alone and then written in place (torch's
    ``cross_entropy`` with a class weight, label smoothing and an ignore index fills its
    gathered weights so) becomes out-of-place too: no write is left but the epilogue's."""
    weight, target = torch.rand(5) + 0.5, torch.tensor([0, 3, 1, 3])

    def fn(x):
        picked = weight.gather(0, target)
        picked.masked_fill_(target == 3, 0.0)
        return ((x * picked).sum(),)

    gm = _torch_private.trace_fake(fn, torch.randn(4))
    assert any(n.target is torch.ops.aten.masked_fill_.Scalar for n in gm.graph.nodes)
    functional = _torch_private.functionalize(gm)
    assert not any(_torch_private.mutated_args(n.target) for n in functional.graph.nodes if n.op == "call_function")
    x = torch.randn(4)
    torch.testing.assert_close(functional(x)[0], fn(x)[0])


def test_return_names_are_the_schemas():
    # backend/inductor.py finds the attention kernels' RNG state by these names.
    assert _torch_private.return_names(torch.ops.aten._scaled_dot_product_efficient_attention.default) == (
        "output", "log_sumexp", "philox_seed", "philox_offset")  # fmt: skip
    assert _torch_private.return_names(torch.ops.aten._scaled_dot_product_flash_attention.default)[6:8] == (
        "rng_state", "unused")  # fmt: skip
    assert _torch_private.return_names(torch.ops.aten.add.Tensor) == ("",)
    assert _torch_private.return_names(len) == ()


def test_default_store_is_none_without_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized() and _torch_private.default_store() is None


def test_version_moves_at_an_in_place_write_to_any_view_also_while_tracing():
    seen = []

    def f(x):
        y, before = x * 2, None
        v = y.view(-1)
        before = (_torch_private.version(y), _torch_private.version(v))
        y[..., :1] += 1  # through another view
        seen.append((before, (_torch_private.version(y), _torch_private.version(v))))
        return v.sum()

    f(torch.ones(2, 3))
    _torch_private.trace_fake(f, torch.ones(2, 3))
    for (y0, v0), (y1, v1) in seen:
        assert y0 == v0 and y1 == v1 and y1 > y0


def test_wrapper_lines_rewritten_sees_the_lines_inductor_writes():
    """The hook ``backend/column_sums.py`` uses: every string line of an Inductor wrapper goes
    through the rewrite, which may add an import; and Inductor's mix-order reductions still
    end with the line it rewrites (``ws[a : b].view(n, C).sum(dim=0)``, written by
    ``SIMDScheduling``; a change of that format fails here, not silently in a GPU profile)."""
    import inspect

    from torch._inductor.codegen import simd
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    source = inspect.getsource(simd)
    assert ".view({nsplit}, {rnumel}).{opname}(dim=0)" in source
    assert "wrapper_code.writeline(final_reduce)" in source
    seen = []

    def rewrite(line, wrapper):
        seen.append(line)
        wrapper.imports.writeline("import math")
        return line.replace("old", "new")

    wrapper = PythonWrapperCodegen.__new__(PythonWrapperCodegen)  # the buffers writeline uses, nothing more
    from torch._inductor.utils import IndentedBuffer

    wrapper.lines, wrapper.imports = [], IndentedBuffer()
    with _torch_private.wrapper_lines_rewritten(rewrite):
        wrapper.writeline("buf0 = old")
    assert seen == ["buf0 = old"] and "buf0 = new" in [str(line) for line in wrapper.lines]
    assert "import math" in wrapper.imports.getvalue()


def test_buffer_storage_tells_a_slice_of_a_cat_from_a_buffer_of_its_own():
    """The question ``backend/column_sums.py`` asks while Inductor writes a wrapper: the inputs
    of a ``cat`` that Inductor computes in place are aliases (``NonOwningLayout``) of the
    ``cat``'s output, which has storage of its own (the layout classes are pinned here)."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(*xs):
        return torch.cat([x.sum(0) for x in xs])

    args = [torch.randn(64, 32) for _ in range(10)]
    seen = {}
    generate = PythonWrapperCodegen.generate

    def spy(self, *a, **k):
        seen.update({b.get_name(): _torch_private.buffer_storage(b.get_name()) for b in V.graph.buffers})
        return generate(self, *a, **k)

    with torch._inductor.config.patch(force_disable_caches=True), pytest.MonkeyPatch.context() as patch:
        patch.setattr(PythonWrapperCodegen, "generate", spy)
        compiled = _torch_private.inductor_compile(make_fx(f)(*args), args)
    assert sorted(seen.values()) == ["alias"] * 10 + ["own"]
    out = compiled(*args)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, f(*args))


def test_reparametrize_swaps_tensors_in_until_exit_tied_weights_too():
    """``torch.func.functional_call``'s context manager, which fsg.apply keeps open through a
    traced step's backward (fsg/_src/recompute.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].weight = model[0].weight  # tied
    own = model[0].weight
    new = torch.ones(2, 2)
    with _torch_private.reparametrize(model, {"0.weight": new}, tie_weights=True, strict=False):
        assert model[0].weight is new and model[1].weight is new and model[0].bias is not None
    assert model[0].weight is own and model[1].weight is own


def test_distributions_default_validation_flag_is_a_class_attribute():
    """``Distribution._validate_args`` (the default ``set_default_validate_args`` sets), read and
    restored by ``trace_fake``: inside a trace a ``Normal`` does not check its scale."""
    default = torch.distributions.Distribution._validate_args
    assert isinstance(default, bool)
    gm = _torch_private.trace_fake(lambda s: torch.distributions.Normal(torch.zeros(2), s).log_prob(torch.zeros(2)), torch.ones(2))
    assert len(gm.graph.nodes) > 2
    assert torch.distributions.Distribution._validate_args is default


def test_von_mises_samples_through_a_module_level_rejection_function():
    """``torch.distributions.von_mises._rejection_sample(loc, concentration, proposal_r, x)``,
    looked up at each ``VonMises.sample``: what ``trace_fake`` replaces with fsg's fixed-size
    loop while it traces, and puts back after."""
    import inspect

    von_mises = torch.distributions.von_mises
    original = von_mises._rejection_sample
    assert list(inspect.signature(original).parameters) == ["loc", "concentration", "proposal_r", "x"]
    gm = _torch_private.trace_fake(lambda k: torch.distributions.VonMises(torch.zeros(()), k).sample((5,)), torch.tensor(2.0))
    assert any(n.target is torch.ops.aten.argmax.default for n in gm.graph.nodes)  # the fixed-size loop's pick
    assert von_mises._rejection_sample is original


def test_wishart_samples_by_a_bartlett_method_of_the_sample_shape():
    """``Wishart._bartlett_sampling(sample_shape)``: one draw, no loop; ``trace_fake`` makes it
    ``Wishart.rsample`` while it traces, and puts ``rsample`` back after."""
    original = torch.distributions.Wishart.rsample
    d = torch.distributions.Wishart(torch.tensor(4.0), covariance_matrix=torch.eye(3))
    assert d._bartlett_sampling(torch.Size((5,))).shape == (5, 3, 3)
    gm = _torch_private.trace_fake(lambda x: x * torch.distributions.Wishart(torch.tensor(3.0), covariance_matrix=torch.eye(2)).rsample((4,)), torch.ones(()))
    assert all(n.target is not torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes)  # no host read
    assert torch.distributions.Wishart.rsample is original


def test_lr_scheduler_parts_reads_one_cycle_phases_and_sequential_parts():
    """OneCycleLR keeps its phases (``_schedule_phases``: end step and the group keys of the
    start and end learning rates) and anneal kind; SequentialLR its schedulers and milestones."""
    from torch.optim import lr_scheduler as L

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    parts = _torch_private.lr_scheduler_parts(L.OneCycleLR(optimizer, max_lr=1.0, total_steps=10, cycle_momentum=False,
                                                           anneal_strategy="linear"))  # fmt: skip
    assert parts["anneal"] == "linear" and [p["end_step"] for p in parts["phases"]] == [2.0, 9]
    assert {(p["start_lr"], p["end_lr"]) for p in parts["phases"]} == {("initial_lr", "max_lr"), ("max_lr", "min_lr")}
    first, second = L.ConstantLR(optimizer, total_iters=2), L.StepLR(optimizer, 3)
    parts = _torch_private.lr_scheduler_parts(L.SequentialLR(optimizer, [first, second], milestones=[4]))
    assert parts["schedulers"] == [first, second] and parts["milestones"] == [4]


def test_higher_order_operators_and_their_eager_compile_flag():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    assert isinstance(torch.ops.higher_order.flex_attention, _torch_private.HigherOrderOperator)
    assert torch.ops.higher_order.flex_attention.name() == "flex_attention"
    assert not isinstance(torch.ops.aten.mm.default, _torch_private.HigherOrderOperator)
    assert not _torch_private.in_hop_compile()
    seen = []

    class Spy(_torch_private.TorchDispatchMode):  # flex_attention's eager call compiles its operator first
        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls):
            seen.append(_torch_private.in_hop_compile())
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 1, 128, 16)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    with Spy():
        flex_attention(q, q, q, block_mask=mask)
    assert True in seen and not _torch_private.in_hop_compile()


def test_aot_eager_compile_keeps_a_0d_float64_input_mutation():
    """``torch.compile(..., backend="aot_eager")`` of ``x.copy_(x - 0.5)`` leaves a 0-d float64
    CPU ``x`` unchanged (Dynamo's ``_tensorify_python_scalars`` restarts and drops the copy, torch
    2.13); AOTAutograd called directly keeps it."""
    x = torch.tensor(0.7, dtype=torch.float64)

    def f(x):
        x.copy_(x - 0.5)
        return (x * 2,)

    gm = _torch_private.trace_fake(f, x.clone())
    fn = _torch_private.aot_eager_compile(gm, [x])
    (out,) = fn(x)
    assert x.item() == pytest.approx(0.2) and out.item() == pytest.approx(0.4)


def test_mkldnn_disabled_restores_the_flag_after_disable_global_flags():
    before = torch.backends.mkldnn.enabled
    torch.backends.disable_global_flags()
    try:
        with _torch_private.mkldnn_disabled():
            assert not torch.backends.mkldnn.enabled
        assert torch.backends.mkldnn.enabled == before
    finally:
        torch.backends.__allow_nonbracketed_mutation_flag = True  # the process's other tests set flags


def test_fake_tensor_log_is_the_logger_that_reports_failed_meta_calls():
    """``trace/libraries.py`` filters this logger's "failed while attempting to run meta"
    records while tracing: the logger is the fake-tensor module's own, and it still logs that."""
    import inspect

    from torch._subclasses import fake_tensor

    assert _torch_private.FAKE_TENSOR_LOG.name == fake_tensor.__name__ == "torch._subclasses.fake_tensor"
    assert "failed while attempting to run meta" in inspect.getsource(fake_tensor)


def test_scaled_mm_is_torchs_fp8_gemm():
    """The call ``passes/float8/cost.py`` times: e4m3 operands, tensorwise scales, bf16 out."""
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    out = _torch_private.scaled_mm(a, b, torch.ones(()), torch.ones(()), out_dtype=torch.bfloat16, use_fast_accum=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (a.float() @ b.float()).bfloat16().float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "line, groups",
    [
        (
            "  buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=0)",
            ("  ", "buf3", "workspace_0[0 : 8].view(2, 4)", "sum", ""),
        ),
        (  # torch 2.13: a view to the buffer's shape and a cast after the reduction
            "buf12 = workspace_1[0 : 96].view(4, 24).amax(dim=0).view([24]).to(torch.bfloat16)",
            ("", "buf12", "workspace_1[0 : 96].view(4, 24)", "amax", ".view([24]).to(torch.bfloat16)"),
        ),
        ("buf3 = buf2.sum(dim=0)", None),
        ("buf3 = workspace_0[0 : 8].view(2, 4).sum(dim=1)", None),
    ],
)
def test_final_reduction_line_matches_the_lines_simd_scheduling_writes(line, groups):
    """``backend/column_sums.py`` reads Inductor's final reductions of mix-order partial sums by
    this pattern (the format ``SIMDScheduling`` writes, pinned in
    ``test_wrapper_lines_rewritten_sees_the_lines_inductor_writes``); any other line is not one."""
    assert _torch_private.final_reduction_line(line) == groups
