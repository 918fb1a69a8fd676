"""The stage-3 pass machinery on hand-built graphs: the mutation/alias facts, the invariant
checker, and ``defer_small_collectives`` refusing a move past a write (issue 15). The graphs
are rewritten, and run with stand-ins for the collectives (one rank: a reduction is the
identity), never on a process group."""

import operator

import pytest
import torch
from torch import fx

import fsg
from fsg._src import _torch_private
from fsg._src import graph_facts as facts
from fsg._src.errors import FsgError, PassInvariantError
from fsg._src.passes import CHECK_ENV, defer, invariants, pipeline, run_pass

aten = torch.ops.aten
AR, WAIT = _torch_private.ALL_REDUCE, _torch_private.WAIT_TENSOR


def _placeholder(graph, name, shape=()):
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def _op(graph, target, *args, shape=()):
    node = graph.call_function(target, args)
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def _reduce(graph, x):
    reduced = _op(graph, AR, x, "sum", "group0")
    return reduced, _op(graph, WAIT, reduced)


class _OneRank(fx.Interpreter):
    """Runs a graph with its collectives as one rank's: an all-reduce copies, a wait passes through."""

    def call_function(self, target, args, kwargs):
        if target is AR:
            return args[0].clone()
        if target is WAIT:
            return args[0]
        return super().call_function(target, args, kwargs)


def _metric_graph(metric_reads_scale=True, seed=None):
    """A step whose loss metric is ``all_reduce(loss) / scale`` (a learned temperature), with a
    backward and an update that writes the new ``scale`` in place (the donation epilogue)."""
    graph = fx.Graph()
    x, w, scale = _placeholder(graph, "x", (4, 8)), _placeholder(graph, "w", (8, 8)), _placeholder(graph, "scale")
    h = x
    for _ in range(40):  # the forward: more ops than a batch-only cone may have
        h = _op(graph, aten.mm.default, h, w, shape=(4, 8))
    loss = _op(graph, aten.sum.default, _op(graph, aten.mul.Tensor, h, scale, shape=(4, 8)))
    _, total = _reduce(graph, loss)
    metric = _op(graph, aten.div.Tensor, total, scale if metric_reads_scale else 2.0)
    if seed is not None:  # the backward's seed, read for its shape: h * seed
        target, *fill = seed
        h = _op(graph, aten.mul.Tensor, h, _op(graph, target, total, *fill), shape=(4, 8))
    grad_w = _op(graph, aten.mm.default, _op(graph, aten.t.default, x, shape=(8, 4)), h, shape=(8, 8))
    grad_scale = _op(graph, aten.sum.default, h)
    new_w = _op(graph, aten.sub.Tensor, w, grad_w, shape=(8, 8))
    new_scale = _op(graph, aten.sub.Tensor, scale, grad_scale)
    copies = (_op(graph, aten.copy_.default, w, new_w, shape=(8, 8)), _op(graph, aten.copy_.default, scale, new_scale))
    graph.output((metric,))
    return fx.GraphModule(torch.nn.Module(), graph), total, metric, copies


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8), torch.randn(8, 8), torch.tensor(2.0)


def _run(gm):
    x, w, scale = _inputs()
    (metric,) = _OneRank(gm).run(x, w, scale)
    return metric, scale


def _old_defer(gm, wait):
    """What ``defer_small_collectives`` did before issue 15: the wait's pure tail moves right
    before ``output``, whatever the tail reads."""
    tail = defer._output_only_tail(wait)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    for n in sorted(tail, key=order.__getitem__):
        output.prepend(n)
    gm.recompile()


# --- facts ---------------------------------------------------------------------------------


def test_storage_follows_views_in_place_results_and_lists_of_views():
    graph = fx.Graph()
    p, g = _placeholder(graph, "p", (4, 2)), _placeholder(graph, "g", (4, 2))
    view = _op(graph, aten.t.default, _op(graph, aten.view.default, p, [4, 2]))
    pieces = _op(graph, aten.split_with_sizes.default, p, [2, 2])
    piece = graph.call_function(operator.getitem, (pieces, 1))
    written = graph.call_function(aten.copy_.default, (view, g))
    into = graph.call_function(aten.add.out, (g, g), {"out": piece})
    mul = _op(graph, aten.mul.Tensor, written, g)
    graph.output((mul, into))
    assert facts.storage_of(view) is p and facts.storage_of(piece) is p and facts.storage_of(written) is p
    assert facts.writes(written) == {p} and facts.reads(written) == {p, g}
    assert facts.writes(into) == {p}  # the keyword-only out= argument
    assert facts.is_view(view) and facts.is_view(piece) and not facts.reads(view)
    assert facts.reads(mul) == {p, g} and facts.storage_of(mul) is mul and not facts.writes(mul)


def test_a_fused_update_writes_each_storage_in_its_lists():
    graph = fx.Graph()
    p, g, m, v, c, lr = (_placeholder(graph, n) for n in ("p", "g", "m", "v", "c", "lr"))
    view = _op(graph, aten.view.default, p, [])
    update = graph.call_function(
        torch.ops.fsg.fused_adamw_.default, ([view], [g], [m], [v], c, lr, 0.9, 0.99, 1e-8, [0.0])
    )
    graph.output(())
    assert facts.writes(update) == {p, m, v}
    assert facts.reads(update) == {p, g, m, v, c, lr}


# --- the checker ----------------------------------------------------------------------------


def test_the_checker_catches_the_old_deferral_of_a_metric_that_reads_a_parameter():
    gm, total, metric, (_, copy_scale) = _metric_graph()
    expected, _ = _run(gm)
    before = invariants.snapshot(gm.graph)
    _old_defer(gm, total)
    with pytest.raises(PassInvariantError) as caught:
        invariants.check(before, gm.graph, "defer_small_collectives")
    message = str(caught.value)
    assert "'defer_small_collectives'" in message and "placeholder 'scale'" in message
    assert repr(metric.name) in message and repr(copy_scale.name) in message
    assert isinstance(caught.value, FsgError)
    wrong, _ = _run(gm)  # and it was wrong: the metric divided by the updated scale
    assert not torch.allclose(wrong, expected)


def test_the_fixed_deferral_waits_before_the_update_overwrites_what_the_metric_reads(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    gm, total, metric, (copy_w, copy_scale) = _metric_graph()
    expected, _ = _run(gm)
    assert run_pass("defer_small_collectives", defer.defer_small_collectives, gm) == 1
    nodes = list(gm.graph.nodes)
    # as late as it may go: past the backward and w's update, not past scale's update
    assert nodes.index(copy_w) < nodes.index(total) < nodes.index(metric) < nodes.index(copy_scale)
    got, scale = _run(gm)
    assert torch.equal(got, expected) and not torch.equal(scale, _inputs()[2])  # old scale read, new written


def test_a_tail_that_cannot_move_at_all_stays_where_it_is():
    graph = fx.Graph()
    s, loss = _placeholder(graph, "s"), _placeholder(graph, "loss")
    new_s = _op(graph, aten.add.Tensor, s, 1.0)
    _, reduced = _reduce(graph, loss)
    ratio = _op(graph, aten.div.Tensor, reduced, s)
    graph.call_function(aten.copy_.default, (s, new_s))  # right after the ratio: nothing to wait past
    graph.output((ratio,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    order = [n.name for n in gm.graph.nodes]
    assert defer.defer_small_collectives(gm) == 0
    assert [n.name for n in gm.graph.nodes] == order


def test_a_legal_deferral_still_moves_the_wait_to_the_end(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    gm, total, metric, copies = _metric_graph(metric_reads_scale=False)
    expected, _ = _run(gm)
    assert run_pass("defer_small_collectives", defer.defer_small_collectives, gm) == 1
    nodes = list(gm.graph.nodes)
    assert max(map(nodes.index, copies)) < nodes.index(total) < nodes.index(metric) == len(nodes) - 2
    assert torch.equal(_run(gm)[0], expected)


@pytest.mark.parametrize("seed", [(aten.ones_like.default,), (aten.full_like.default, 1.0)])
def test_a_seed_that_reads_only_the_loss_shape_does_not_pin_the_wait(seed):
    """On a mesh stage 1 decomposes ``ones_like`` to ``full_like``: still only a shape read."""
    gm, total, metric, copies = _metric_graph(metric_reads_scale=False, seed=seed)
    assert defer.defer_small_collectives(gm) == 1
    nodes = list(gm.graph.nodes)
    assert max(map(nodes.index, copies)) < nodes.index(total)


def test_a_count_read_from_a_batch_leaf_written_earlier_is_not_hoisted_above_the_write():
    graph = fx.Graph()
    x, y = _placeholder(graph, "x", (4, 8)), _placeholder(graph, "y", (4,))
    h = x
    for _ in range(3):
        h = _op(graph, aten.mm.default, h, _op(graph, aten.t.default, x, shape=(8, 4)), shape=(4, 4))
    clipped = graph.call_function(aten.copy_.default, (y, _op(graph, aten.clamp.default, y, 0, shape=(4,))))
    count = _op(graph, aten.sum.default, _op(graph, aten.ne.Scalar, y, -100, shape=(4,)))
    _, tokens = _reduce(graph, count)
    graph.output((_op(graph, aten.div.Tensor, h, tokens, shape=(4, 4)), clipped))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    before = invariants.snapshot(gm.graph)
    defer.defer_small_collectives(gm)
    invariants.check(before, gm.graph, "defer_small_collectives")
    nodes = list(gm.graph.nodes)
    assert nodes.index(clipped) < nodes.index(count.args[0])  # still reads the clipped labels


def test_the_checker_catches_a_collective_left_without_its_wait():
    graph = fx.Graph()
    x = _placeholder(graph, "x", (4,))
    reduced, done = _reduce(graph, x)
    out = _op(graph, aten.mul.Tensor, done, 2.0, shape=(4,))
    graph.output((out,))
    before = invariants.snapshot(graph)
    out.replace_input_with(done, reduced)  # a "pass" that drops the wait
    graph.erase_node(done)
    with pytest.raises(
        PassInvariantError, match=r"'drop_wait' left the collective 'all_reduce_default' unwaited: it has 0"
    ):
        invariants.check(before, graph, "drop_wait")


def test_the_checker_catches_a_result_read_before_its_wait():
    graph = fx.Graph()
    x = _placeholder(graph, "x", (4,))
    reduced, done = _reduce(graph, x)
    neg = _op(graph, aten.neg.default, done, shape=(4,))
    graph.output((neg,))
    before = invariants.snapshot(graph)
    neg.replace_input_with(done, reduced)  # reads the collective's buffer before it has landed
    done.prepend(neg)
    with pytest.raises(
        PassInvariantError, match=r"'all_reduce_default' unwaited: it has its result read by 'neg_default' before"
    ):
        invariants.check(before, graph, "early_read")


def test_a_collective_unwaited_before_the_pass_is_not_blamed_on_it():
    graph = fx.Graph()
    reduced = _op(graph, AR, _placeholder(graph, "x", (4,)), "sum", "group0")
    graph.output((_op(graph, aten.neg.default, reduced, shape=(4,)),))
    before = invariants.snapshot(graph)
    assert "all_reduce_default" in before.collective_errors
    invariants.check(before, graph, "noop")


def test_the_checker_catches_a_new_write_before_a_read_of_the_input_value():
    """A fused update inserted too early: the reader of ``p`` saw the step's input, now the update."""
    graph = fx.Graph()
    p, g = _placeholder(graph, "p"), _placeholder(graph, "g")
    metric = _op(graph, aten.mul.Tensor, p, 2.0)
    copy = graph.call_function(aten.copy_.default, (p, _op(graph, aten.sub.Tensor, p, g)))
    graph.output((metric,))
    before = invariants.snapshot(graph)
    with graph.inserting_before(metric):
        graph.call_function(aten.sub_.Tensor, (p, g))
    graph.erase_node(copy)
    with pytest.raises(
        PassInvariantError, match=r"'mul_tensor' sees of the storage of placeholder 'p'.*'sub__tensor' now writes"
    ):
        invariants.check(before, graph, "fuse")


def test_the_checker_catches_a_malformed_graph_and_a_lost_output():
    graph = fx.Graph()
    x = _placeholder(graph, "x")
    a = _op(graph, aten.neg.default, x)
    b = _op(graph, aten.exp.default, a)
    output = graph.output((a, b))
    before = invariants.snapshot(graph)
    x.append(b)  # used before it is defined
    with pytest.raises(PassInvariantError, match="left a malformed graph"):
        invariants.check(before, graph, "bad_move")
    a.append(b)
    output.args = ((b,),)
    with pytest.raises(PassInvariantError, match="number of outputs from 2 to 1"):
        invariants.check(before, graph, "drop")


def test_run_pass_checks_only_under_the_flag(monkeypatch):
    def bad_pass(gm):
        _old_defer(gm, total)
        return "done"

    gm, total, _, _ = _metric_graph()
    monkeypatch.setenv(CHECK_ENV, "0")
    assert run_pass("old_defer", bad_pass, gm) == "done"
    gm, total, _, _ = _metric_graph()
    monkeypatch.setenv(CHECK_ENV, "1")
    with pytest.raises(PassInvariantError, match="'old_defer'"):
        run_pass("old_defer", bad_pass, gm)


def test_the_test_suite_runs_with_the_checker_on():
    """Every step the tests build checks its passes (the root conftest.py sets the flag)."""
    import os

    assert os.environ.get(CHECK_ENV) == "1"


# -- the pipeline (passes/pipeline.py) ------------------------------------------------------


def _noop(name, after=()):
    return pipeline.Pass(name, lambda gm, o: name, lambda o: True, after)


def test_pipeline_orders_passes_by_their_requirements_and_declaration():
    a, b, c, d = _noop("a"), _noop("b", after=("c",)), _noop("c"), _noop("d", after=("a", "b"))
    assert [p.name for p in pipeline.order([d, b, a, c])] == ["a", "c", "b", "d"]
    assert [p.name for p in pipeline.order([_noop("e", after=("fuse_adamw",))])] == ["e"]  # a pass not run is no wait
    with pytest.raises(ValueError, match="wait for each other"):
        pipeline.order([_noop("x", after=("y",)), _noop("y", after=("x",))])
    with pytest.raises(ValueError, match="which no pass is called"):
        pipeline.order([_noop("x", after=("no_such_pass",))])


def test_the_declared_order_is_the_order_the_passes_need():
    everything = pipeline.Options(adamw=object(), on_mesh=True, bucket_mb=25.0)
    names = [p.name for p in pipeline.order([p for p in pipeline.PASSES if p.applies(everything)])]
    assert names == [
        "pack_attention_grads", "fuse_adamw", "strip_markers", "gemm_epilogues", "batch_casts",
        "bucket_parameter_gathers", "bucket_gradient_collectives", "update_on_arrival", "defer_small_collectives",
    ]  # fmt: skip
    applies = [p.name for p in pipeline.PASSES if p.applies(pipeline.Options())]
    assert applies == ["pack_attention_grads", "narrow_reads", "gemm_epilogues", "batch_casts"]
    one_device = pipeline.Options(adamw=object())
    names = [p.name for p in pipeline.order([p for p in pipeline.PASSES if p.applies(one_device)])]
    assert names == ["pack_attention_grads", "fuse_adamw", "strip_markers", "narrow_reads", "gemm_epilogues", "batch_casts"]


def _erase_relu(gm, options):
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])
    gm.graph.erase_node(relu)
    gm.recompile()
    return 1


def test_the_pipeline_rewrites_a_copy_and_keeps_its_input():
    graph = fx.Graph()
    x = _placeholder(graph, "x", (3,))
    graph.output((_op(graph, aten.mul.Tensor, _op(graph, aten.relu.default, x, shape=(3,)), x, shape=(3,)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    before = gm.print_readable(print_output=False)
    rewrite = pipeline.Pass("erase_relu", _erase_relu, lambda o: True)
    out, results = pipeline.run(gm, pipeline.Options(), passes=(rewrite,))
    assert out is not gm and results == {"erase_relu": 1}
    assert gm.print_readable(print_output=False) == before
    assert out.print_readable(print_output=False) != before
    assert pipeline.run(gm, pipeline.Options(), passes=())[0] is gm  # nothing applies: no copy


def _fused_linear_step():
    model = torch.nn.Linear(4, 2)
    step = fsg.compile_step(
        lambda p, b: ((fsg.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=fsg.optim.adamw(1e-2),
        fused_optimizer=True, backend="eager",
    )  # fmt: skip
    return step, step.init(fsg.params(model))


def test_lower_shows_each_stage():
    step, state = _fused_linear_step()
    lowered = step.lower(state, {"x": torch.randn(8, 4), "y": torch.randn(8, 2)})
    assert set(lowered.stages) == {"traced", "optimized"}
    assert "fused_adamw" in lowered.as_text() and "fused_adamw" not in lowered.as_text("traced")
    assert lowered.stages["optimized"] is lowered.graph_module
    with pytest.raises(ValueError, match="no stage 'sharded'"):
        lowered.as_text("sharded")


def test_the_stage_3_log_line_reports_each_pass_in_a_few_words(caplog):
    """Each pass's result is a count or a short summary, never a graph: the fused step's INFO
    line once carried strip_markers' whole GraphModule (thousands of lines at GPT-2 sizes)."""
    step, state = _fused_linear_step()
    with caplog.at_level("INFO", logger="fsg"):
        step(state, {"x": torch.randn(8, 4), "y": torch.randn(8, 2)})
    [line] = [r.getMessage() for r in caplog.records if "stage 3:" in r.getMessage()]
    assert "fuse_adamw (" in line and "strip_markers (" in line
    assert len(line) < 200 and "GraphModule" not in line, line
