"""The passes' shared machinery (issue 15): ``packing.pack``, ``bucketing.buckets`` and
``ordering.NodeOrder``, on hand-built graphs.

A packed graph is run against the unpacked one on W simulated ranks (``_Ranks``: each value is
one tensor per rank, every op runs on each rank's tensors and the collectives combine them as
their definitions say, so a wrong row/column layout gives a rank the wrong shard), and on one
real gloo rank (the emitted nodes are valid calls of the real functional collectives)."""

import operator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import fx

from fsg._src import _torch_private
from fsg._src.passes import bucketing, packing
from fsg._src.passes.ordering import NodeOrder

aten = torch.ops.aten
AR, RS, AG = _torch_private.ALL_REDUCE, _torch_private.REDUCE_SCATTER, _torch_private.ALL_GATHER
WAIT = _torch_private.WAIT_TENSOR


class _PerRank(tuple):
    """One value per rank."""


def _at(value, rank):
    if isinstance(value, _PerRank):
        return value[rank]
    if isinstance(value, (list, tuple)):
        return type(value)(_at(v, rank) for v in value)
    return value


class _Ranks(fx.Interpreter):
    """Runs a per-rank graph for ``world`` ranks in lockstep, its collectives by their
    definitions: all_reduce sums the ranks' inputs, reduce_scatter hands rank r chunk r (dim 0)
    of the sum, all_gather concatenates the inputs along dim 0; a wait passes its input on."""

    def __init__(self, gm, world):
        super().__init__(gm)
        self.world = world

    def call_function(self, target, args, kwargs):
        if target is WAIT:
            return args[0]
        if target in (AR, RS, AG):
            inputs = args[0]
            if target is AG:
                return _PerRank([torch.cat(inputs)] * self.world)
            total = sum(inputs[1:], inputs[0].clone())
            return _PerRank(total.chunk(self.world) if target is RS else [total] * self.world)
        return _PerRank(target(*_at(args, r), **_at(kwargs, r)) for r in range(self.world))


def _unpacked_graph(kind, world, shapes, group="group0"):
    """Inputs -> one collective and wait each -> ``wait + 1`` (its first use) -> outputs."""
    graph = fx.Graph()
    inputs = []
    for k, shape in enumerate(shapes):
        x = graph.placeholder(f"x{k}")
        x.meta["val"] = torch.empty(shape, dtype=torch.float64, device="meta")
        inputs.append(x)
    pairs, uses = [], []
    for x in inputs:
        args = {AR: (x, "sum", group), RS: (x, "sum", world, group), AG: (x, world, group)}[kind]
        collective = graph.call_function(kind, args)
        wait = graph.call_function(WAIT, (collective,))
        if kind is AG:  # stage 2 gives a gather's wait its gathered value
            shape = x.meta["val"].shape
            wait.meta["val"] = torch.empty(world * shape[0], *shape[1:], dtype=torch.float64, device="meta")
        pairs.append((collective, wait))
        uses.append(graph.call_function(aten.add.Tensor, (wait, 1.0)))
    graph.output(tuple(uses))
    return fx.GraphModule(torch.nn.Module(), graph), pairs, uses


@st.composite
def packing_strategy(draw):
    """A collective kind, a group size and 1-5 input shapes it can take (reduce_scatter's dim 0
    divisible by the group size; a gather's shards may be any shape)."""
    kind = draw(st.sampled_from([AR, RS, AG]))
    world = draw(st.integers(1, 4))
    shapes = []
    for _ in range(draw(st.integers(1, 5))):
        rest = draw(st.lists(st.integers(1, 4), max_size=2))
        first = draw(st.integers(1, 3)) * (world if kind is RS else 1)
        shapes.append((first, *rest))
    return kind, world, shapes


def _inputs(world, shapes, seed):
    gen = torch.Generator().manual_seed(seed)  # integers in float64: the sums are exact
    return [_PerRank(torch.randint(-9, 9, s, generator=gen).double() for _ in range(world)) for s in shapes]


@given(packing_strategy(), st.integers(0, 2**16))
def test_a_packed_bucket_gives_every_rank_what_the_separate_collectives_gave(case, seed):
    kind, world, shapes = case
    reference, _, _ = _unpacked_graph(kind, world, shapes)
    gm, pairs, uses = _unpacked_graph(kind, world, shapes)
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    done = packing.pack(gm.graph, pairs, issue_before=last_input.next, wait_before=uses[0])
    gm.graph.lint()
    gm.recompile()
    nodes = list(gm.graph.nodes)
    assert [n for n in nodes if n.target is kind] == [done.args[0]] and [n for n in nodes if n.target is WAIT] == [done]
    assert done.args[0].args[0].target is aten.cat.default
    inputs = _inputs(world, shapes, seed)
    expected, got = _Ranks(reference, world).run(*inputs), _Ranks(gm, world).run(*inputs)
    for want, have in zip(expected, got):
        for rank in range(world):
            assert have[rank].shape == want[rank].shape and torch.equal(have[rank], want[rank])


@pytest.fixture
def one_gloo_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", world_size=1, rank=0, store=dist.HashStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", [AR, RS, AG], ids=["all_reduce", "reduce_scatter", "all_gather"])
def test_a_packed_bucket_runs_on_the_real_collectives(kind, one_gloo_rank):
    shapes = [(2, 3), (5,), (1, 2, 2)]
    reference, _, _ = _unpacked_graph(kind, 1, shapes, one_gloo_rank)
    gm, pairs, uses = _unpacked_graph(kind, 1, shapes, one_gloo_rank)
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    packing.pack(gm.graph, pairs, issue_before=last_input.next, wait_before=uses[0])
    gm.recompile()
    inputs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    assert sum(n.target is kind for n in gm.graph.nodes) == 1
    for want, have in zip(reference(*inputs), gm(*inputs)):
        torch.testing.assert_close(have, want, rtol=0, atol=0)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), max_size=20), st.integers(0, 20))
def test_buckets_keep_the_order_one_key_each_and_close_only_when_they_must(items, budget):
    """Items are (key, bytes); the buckets concatenate to the items, share a key, fit the
    budget unless alone, and each bucket's first item could not have joined the one before."""
    key, nbytes = operator.itemgetter(0), operator.itemgetter(1)
    refused = {k for k in range(len(items)) if k % 4 == 3}  # `joins` refuses some items by index
    indexed = list(enumerate(items))
    found = bucketing.buckets(
        indexed, budget, key=lambda i: key(i[1]), nbytes=lambda i: nbytes(i[1]), joins=lambda b, i: i[0] not in refused
    )
    assert [i for b in found for i in b] == indexed
    for before, bucket in zip([None, *found], found):
        assert len({key(i) for _, i in bucket}) == 1
        assert len(bucket) == 1 or sum(nbytes(i) for _, i in bucket) <= budget
        if before is not None:
            k, first = bucket[0]
            total = sum(nbytes(i) for _, i in before) + nbytes(first)
            assert key(before[0][1]) != key(first) or total > budget or k in refused


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=12))
def test_node_order_answers_for_the_graph_as_it_is_after_each_invalidate(moves):
    graph = fx.Graph()
    x = graph.placeholder("x")
    ops = [graph.call_function(aten.neg.default, (x,)) for _ in range(10)]
    graph.output(tuple(ops))
    order = NodeOrder(graph)
    for a, b in moves:  # independent ops: any order is a valid graph
        if a != b:
            ops[a].prepend(ops[b])
            order.invalidate()
        nodes = list(graph.nodes)
        assert [order.position(n) for n in nodes] == list(range(len(nodes)))
        assert order.before(ops[a], ops[b]) == (nodes.index(ops[a]) < nodes.index(ops[b]))
        assert order.sorted(reversed(ops)) == [n for n in nodes if n in ops]
        assert order.first(ops) is nodes[1] and order.last(ops) is nodes[-2]
    graph.lint()


def test_a_node_order_that_missed_an_insertion_refuses_to_answer():
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.neg.default, (x,))
    graph.output((y,))
    order = NodeOrder(graph)
    assert order.position(y) == 1
    with graph.inserting_before(y):
        z = graph.call_function(aten.relu.default, (x,))
    with pytest.raises(RuntimeError, match="stale NodeOrder"):
        order.position(y)
    order.invalidate()
    assert order.position(z) == 1 and order.position(y) == 2
