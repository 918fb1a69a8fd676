"""The bucketing/overlap pass on hand-built per-rank graphs (no process group needed: the
graphs are rewritten, not run). Runs on real ranks are in tests/dist/test_sharding.py."""

import operator

import torch
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import buckets, defer, prefetch

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
    assert buckets.bucket_gradient_collectives(gm) == 1
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
    assert buckets.bucket_gradient_collectives(gm) == 2
    gm.graph.lint()


def test_reduce_ops_and_bucket_size_split_buckets():
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", (256,)) for i in range(4)]  # 1 KiB each
    outs = [_reduce(graph, x, "avg" if i == 3 else "sum") for i, x in enumerate(xs)]
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    # placeholders are their own producers: buckets of 2 KiB hold two sums each, the avg apart
    assert buckets.bucket_gradient_collectives(gm, bucket_mb=2 / 1024) == 3


def test_gradients_between_amax_all_reduces_share_one_bucket():
    """Tensorwise FP8 on a mesh all-reduces each tensor's amax (op "max") in the backward, between
    the gradients' sums: the sums still pack into one bucket, and the maxima, each read at once
    by the next gradient's computation, stay where they were."""
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", (4,)) for i in range(3)]
    grads, h = [], _placeholder(graph, "h", (4,))
    for x in xs:
        amax = _reduce(graph, graph.call_function(torch.ops.aten.amax.default, (h,)), op="max")
        h = graph.call_function(torch.ops.aten.mul.Tensor, (x, amax))  # the next gradient reads the amax
        h.meta["val"] = torch.empty(4, device="meta")
        grads.append(_reduce(graph, h))
    graph.output(tuple(grads))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    for node in gm.graph.nodes:  # the amaxes' inputs: scalars
        if node.target is torch.ops.aten.amax.default:
            node.meta["val"] = torch.empty((), device="meta")
    assert buckets.bucket_gradient_collectives(gm) == 1  # one bucket of sums
    gm.graph.lint()
    sums = [n for n in _all_reduces(gm) if n.args[1] == "sum"]
    assert len(sums) == 1 and sums[0].args[0].target is torch.ops.aten.cat.default
    maxima = [n for n in _all_reduces(gm) if n.args[1] == "max"]
    assert len(maxima) == 3 and all(n.next.target is WAIT and n.next.args[0] is n for n in maxima)


def test_reduce_scatters_pack_as_rows_so_each_rank_keeps_its_shards():
    graph = fx.Graph()
    a, b = _placeholder(graph, "a", (4, 3)), _placeholder(graph, "b", (2,))
    outs = []
    for x in (a, b):
        scattered = graph.call_function(_torch_private.REDUCE_SCATTER, (x, "sum", 2, "group0"))
        outs.append(graph.call_function(WAIT, (scattered,)))
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert buckets.bucket_gradient_collectives(gm) == 1
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


GATHER = _torch_private.ALL_GATHER


def _gather(graph, shard, world=2):
    value = shard.meta["val"]
    node = graph.call_function(GATHER, (shard, world, "group0"))
    node.meta["val"] = torch.empty(world * value.shape[0], *value.shape[1:], dtype=value.dtype, device="meta")
    wait = graph.call_function(WAIT, (node,))
    wait.meta["val"] = node.meta["val"]
    return wait


def _cast(graph, x):
    node = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    node.meta["val"] = torch.empty(x.meta["val"].shape, dtype=torch.bfloat16, device="meta")
    return node


def _mm(graph, a, b):
    return graph.call_function(torch.ops.aten.mm.default, (a, b))


def test_parameter_gathers_pack_in_use_order_and_a_shared_cast_stays_before_its_readers():
    """The first compute node is a gathered shard's cast, and one cast feeds gathers in two
    buckets (a tied weight read twice): the rewrite keeps every op before its readers."""
    graph = fx.Graph()
    a, b, c = (_placeholder(graph, n, (4, 8)) for n in "abc")
    ca, cb, cc = _cast(graph, a), _cast(graph, b), _cast(graph, c)
    ga, gb, gc, ga_again = _gather(graph, ca), _gather(graph, cb), _gather(graph, cc), _gather(graph, ca)
    h = _mm(graph, ga, ga)
    h = _mm(graph, gb, h)
    h = _mm(graph, gc, h)
    graph.output((_mm(graph, ga_again, h),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    two_per_bucket = 2 * 8 * 8 * 2 / 2**20  # MiB: two gathered (8, 8) bf16 tensors
    assert prefetch.bucket_parameter_gathers(gm, bucket_mb=two_per_bucket) == 2
    gm.graph.lint()  # topologically ordered
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if n.target is GATHER]
    waits = [n for n in nodes if n.target is WAIT]
    matmuls = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert all(g.args[0].target is torch.ops.aten.cat.default for g in gathers)  # packed shards
    # bucket 1 ([c, a again]) is issued before bucket 0 ([a, b]) is waited for: one of prefetch
    assert nodes.index(gathers[0]) < nodes.index(gathers[1]) < nodes.index(waits[0]) < nodes.index(matmuls[0])
    # bucket 1 is waited for only where its first tensor is used (the third matmul)
    assert nodes.index(matmuls[1]) < nodes.index(waits[1]) < nodes.index(matmuls[2])


def test_gathers_of_two_dtypes_in_turn_fill_a_bucket_each():
    """FP8 weight gathers (bytes) alternate with their layers' bf16 biases in use order: each
    dtype packs into one collective, not one per weight (a bucket is cut by its own dtype's
    run, not by the other's items), and the bytes' input, a scaled cast computed from the
    graph inputs and an all-reduce, moves up with its bucket."""
    graph = fx.Graph()
    weights = [_placeholder(graph, f"w{i}", (4, 8)) for i in range(3)]
    biases = [_placeholder(graph, f"b{i}", (4,)) for i in range(3)]
    amax = graph.call_function(AR, (graph.call_function(torch.ops.aten.stack.default, (weights,)), "max", "group0"))
    amax = graph.call_function(WAIT, (amax,))
    gathered = []
    for w, b in zip(weights, biases):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (_cast(graph, w), amax))
        as_bytes = graph.call_function(torch.ops.aten.view.dtype, (scaled, torch.uint8))
        as_bytes.meta["val"] = torch.empty(4, 16, dtype=torch.uint8, device="meta")
        gathered.append((_gather(graph, as_bytes), _gather(graph, _cast(graph, b))))
    h = _placeholder(graph, "x", (8, 8))
    for gw, gb in gathered:
        h = graph.call_function(torch.ops.aten.add.Tensor, (_mm(graph, h, gw), gb))
    graph.output((h,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert prefetch.bucket_parameter_gathers(gm) == 2
    gm.graph.lint()
    dtypes = sorted(str(n.args[0].meta["val"].dtype) for n in gm.graph.nodes if n.target is GATHER)
    assert dtypes == ["torch.bfloat16", "torch.uint8"]


def test_a_gather_of_a_computed_tensor_is_left_alone():
    graph = fx.Graph()
    x = _placeholder(graph, "x", (4, 8))
    padded = graph.call_function(torch.ops.aten.constant_pad_nd.default, (x, [0, 0, 0, 1]))
    padded.meta["val"] = torch.empty(5, 8, device="meta")
    graph.output((_mm(graph, _gather(graph, padded), x),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert prefetch.bucket_parameter_gathers(gm) == 0
    assert sum(n.target is GATHER for n in gm.graph.nodes) == 1


def test_the_token_count_is_reduced_first_and_the_loss_metric_waited_for_last():
    """A mean loss on a sharded batch: the count (from the labels) is issued first thing, the
    loss sum's wait (read by the metric, and by the backward's seed for its shape) moves to the
    end; the gradient, written into the state in place, stays where it is."""
    graph = fx.Graph()
    w, x, y = _placeholder(graph, "w", (8, 8)), _placeholder(graph, "x", (4, 8)), _placeholder(graph, "y", (4,))
    h = x
    for _ in range(40):  # the forward: more ops than a batch-only cone may have
        h = _mm(graph, h, w)
        h.meta["val"] = torch.empty(4, 8, device="meta")
    loss_sum = graph.call_function(torch.ops.aten.sum.default, (h,))
    loss_sum.meta["val"] = torch.empty((), device="meta")
    count = graph.call_function(torch.ops.aten.sum.default, (graph.call_function(torch.ops.aten.ne.Scalar, (y, -100)),))
    count.meta["val"] = torch.empty((), dtype=torch.int64, device="meta")
    total, tokens = _reduce(graph, loss_sum), _reduce(graph, count)
    seed = graph.call_function(torch.ops.aten.ones_like.default, (total,))  # the backward's seed
    scaled = graph.call_function(torch.ops.aten.div.Tensor, (seed, tokens))
    grad = _mm(graph, graph.call_function(torch.ops.aten.mul.Tensor, (x, scaled)), w)
    update = graph.call_function(torch.ops.aten.copy_.default, (w, grad))  # donation: in place
    metric = graph.call_function(torch.ops.aten.detach.default, (total,))
    graph.output((metric, update))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert defer.defer_small_collectives(gm) == 2  # the count hoisted, the loss's wait deferred
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    count_reduce, loss_reduce = (next(n for n in nodes if n.target is AR and n.args[0] is v) for v in (count, loss_sum))
    matmuls = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert nodes.index(count_reduce) < nodes.index(matmuls[0])
    loss_wait = next(iter(loss_reduce.users))
    assert nodes.index(update) < nodes.index(loss_wait) < nodes.index(metric)  # after everything else
    assert seed.args[0] is loss_sum  # the seed no longer waits for the reduction


def test_gathers_used_in_another_order_than_their_casts_were_made_stay_ordered():
    """Stage 2 casts the shards in parameter order but the forward may use them in another:
    the bucket's casts that must move up go right after the graph inputs, and the ones already
    in place stay, both before the packed collective (a stale position table once left some
    after it)."""
    graph = fx.Graph()
    a, b = _placeholder(graph, "a", (4, 8)), _placeholder(graph, "b", (4, 8))
    va, vb = (graph.call_function(torch.ops.aten.view.default, (p, [4, 8])) for p in (a, b))
    for v in (va, vb):
        v.meta["val"] = torch.empty(4, 8, device="meta")
    ca, cb = _cast(graph, va), _cast(graph, vb)
    ga, gb = _gather(graph, ca), _gather(graph, cb)
    graph.output((_mm(graph, ga, _mm(graph, gb, gb)),))  # b is used first
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert prefetch.bucket_parameter_gathers(gm) == 1
    gm.graph.lint()
