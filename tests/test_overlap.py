"""The bucketing/overlap pass on hand-built per-rank graphs (no process group needed: the
graphs are rewritten, not run). Runs on real ranks are in tests/dist/test_sharding.py."""

import operator

import torch
from torch import fx

from fsg._src import _torch_private, overlap

AR, WAIT = _torch_private.ALL_REDUCE, _torch_private.WAIT_TENSOR


def _placeholder(graph, name, shape):
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def _reduce(graph, x, op="sum"):
    return graph.call_function(WAIT, (graph.call_function(AR, (x, op, "group0")),))


def _all_reduces(gm):
    return [n for n in gm.graph.nodes if n.target is AR]


def test_independent_gradients_share_one_bucket_and_keep_their_shapes():
    graph = fx.Graph()
    a, b = _placeholder(graph, "a", (3, 4)), _placeholder(graph, "b", (5,))
    ga = graph.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
    ga.meta["val"] = torch.empty(3, 4, device="meta")
    gb = graph.call_function(torch.ops.aten.mul.Tensor, (b, 3.0))
    gb.meta["val"] = torch.empty(5, device="meta")
    ra, rb = _reduce(graph, ga), _reduce(graph, gb)
    graph.output((graph.call_function(operator.add, (ra, 1.0)), graph.call_function(operator.add, (rb, 1.0))))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert overlap.bucket_gradient_collectives(gm) == 1
    (reduced,) = _all_reduces(gm)
    assert reduced.args[0].target is torch.ops.aten.cat.default
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert [list(v.args[1]) for v in views] == [[3, 4], [5]]


def test_an_all_reduce_of_a_reduced_result_is_never_packed_with_it():
    graph = fx.Graph()
    x = _placeholder(graph, "x", (4,))
    first = _reduce(graph, x)
    first.meta["val"] = torch.empty(4, device="meta")
    second = _reduce(graph, first)  # e.g. reduce over one mesh axis, then another
    graph.output((second,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert overlap.bucket_gradient_collectives(gm) == 2
    gm.graph.lint()


def test_reduce_ops_and_bucket_size_split_buckets():
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", (256,)) for i in range(4)]  # 1 KiB each
    outs = [_reduce(graph, x, "avg" if i == 3 else "sum") for i, x in enumerate(xs)]
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    # placeholders are their own producers: buckets of 2 KiB hold two sums each, the avg apart
    assert overlap.bucket_gradient_collectives(gm, bucket_mb=2 / 1024) == 3


def test_reduce_scatters_pack_as_rows_so_each_rank_keeps_its_shards():
    graph = fx.Graph()
    a, b = _placeholder(graph, "a", (4, 3)), _placeholder(graph, "b", (2,))
    outs = []
    for x in (a, b):
        scattered = graph.call_function(_torch_private.REDUCE_SCATTER, (x, "sum", 2, "group0"))
        outs.append(graph.call_function(WAIT, (scattered,)))
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert overlap.bucket_gradient_collectives(gm) == 1
    (packed,) = [n for n in gm.graph.nodes if n.target is _torch_private.REDUCE_SCATTER]
    assert packed.args[0].target is torch.ops.aten.cat.default and packed.args[0].args[1] == 1
    assert [list(r.args[1]) for r in packed.args[0].args[0]] == [[2, -1], [2, -1]]
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert [list(v.args[1]) for v in views] == [[2, 3], [1]]
    # run it with a stand-in collective on 2 "ranks": rank r must get rows r of each input
    x_a, x_b = torch.arange(12.0).reshape(4, 3), torch.tensor([100.0, 200.0])
    rows = torch.cat([x_a.reshape(2, -1), x_b.reshape(2, -1)], 1)
    for rank in range(2):
        flat = rows[rank].reshape(-1)
        got_a, got_b = (p.view(s) for p, s in zip(flat.split([6, 1]), ([2, 3], [1])))
        assert torch.equal(got_a, x_a[2 * rank : 2 * rank + 2]) and torch.equal(got_b, x_b[rank : rank + 1])
