"""What a batch may be: dicts, tuples, NamedTuples and dataclasses of tensors, and the mappings data
pipelines hand over (Hugging Face's ``BatchEncoding``, from tokenizers and data collators; a
``UserDict``), which a step takes as the dicts they hold and gives back to ``loss_fn`` as
themselves."""

import collections
import collections.abc
import dataclasses

import pytest
import torch

import fsg

T = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                          bos_token_id=0, eos_token_id=0))  # fmt: skip


class _Batch(collections.UserDict):
    pass


@pytest.mark.parametrize("wrap", [T.BatchEncoding, _Batch])
def test_a_mapping_batch_trains_as_the_dict_it_holds(wrap):
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    seen = []
    losses = {}
    for kind, batch in (("dict", data), ("mapping", wrap(dict(data)))):
        model = _gpt2()

        def loss_fn(params, b, model=model):
            seen.append(type(b))
            return fsg.apply(model, params, **b).loss

        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
        state = step.init(fsg.params(model))
        for _ in range(2):
            state, metrics = step(state, batch)
        assert step.num_compiles == 1
        losses[kind] = metrics["loss"]
    assert torch.equal(losses["dict"], losses["mapping"])
    assert seen[-1] is wrap  # loss_fn gets the batch's own type back


def test_a_mapping_inside_the_batch_is_looked_into_too():
    """A ``BatchEncoding`` nested in a dict, whether or not its type was seen before."""
    model = _gpt2()
    ids = torch.randint(0, 50, (2, 8))
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, **b["inputs"]).loss, optimizer=fsg.optim.sgd(0.1),
                            backend="eager")  # fmt: skip
    state, metrics = step(step.init(fsg.params(model)), {"inputs": _Nested({"input_ids": ids, "labels": ids})})
    assert metrics["loss"].isfinite()


class _Nested(collections.UserDict):  # a type no other test registers first
    pass


class _Frozen(collections.abc.Mapping):  # a mapping that cannot be rebuilt from a dict
    def __init__(self, **kw):
        self._d = kw

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_a_mapping_fsg_cannot_rebuild_is_named_with_the_fix():
    model = _gpt2()
    ids = torch.randint(0, 50, (2, 8))
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, **b["inputs"]).loss, optimizer=fsg.optim.sgd(0.1),
                            backend="eager")  # fmt: skip
    with pytest.raises(fsg.NonTensorLeafError, match=r"batch\['inputs'\] is a _Frozen.*dict\("):
        step(step.init(fsg.params(model)), {"inputs": _Frozen(input_ids=ids, labels=ids)})


@dataclasses.dataclass(frozen=True)
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Example:
    pair: _Pair
    weight: torch.Tensor


def test_a_dataclass_batch_trains_as_the_tuple_it_holds():
    """Dataclasses (frozen or not, nested) are looked into, field by field, and loss_fn gets
    them back as themselves; one compile for the run."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g), torch.rand(4, generator=g)) for _ in range(3)]
    model = torch.nn.Linear(3, 2)

    def per_row(params, x, y, w):
        return ((fsg.apply(model, params, x) - y) ** 2).mean(-1).mul(w).mean()

    seen = []

    def loss_fn(params, b):
        seen.append(type(b))
        return per_row(params, b.pair.x, b.pair.y, b.weight)

    losses = []
    for fn, wrap in ((lambda p, b: per_row(p, *b), tuple), (loss_fn, lambda t: _Example(_Pair(t[0], t[1]), t[2]))):
        step = fsg.compile_step(fn, optimizer=fsg.optim.sgd(0.1), backend="eager")
        state = step.init(fsg.params(model))
        for t in batches:
            state, metrics = step(state, wrap(t))
        assert step.num_compiles == 1
        losses.append(metrics["loss"])
    assert torch.equal(*losses) and seen[-1] is _Example


@dataclasses.dataclass
class _WithCount:
    x: torch.Tensor
    seen: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass
class _WithFloat:
    x: torch.Tensor
    scale: float = 1.0


@pytest.mark.parametrize("batch, match", [
    (_WithCount(torch.ones(2, 3)), r"batch is a _WithCount, a dataclass with a field its constructor does not take"),
    (_WithFloat(torch.ones(2, 3)), r"batch\.scale is a float \(1\.0\).*torch\.tensor"),
])  # fmt: skip
def test_a_dataclass_fsg_cannot_trace_is_named_with_the_fix(batch, match):
    model = torch.nn.Linear(3, 2)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b.x).sum(), optimizer=fsg.optim.sgd(0.1), backend="eager")
    with pytest.raises(fsg.NonTensorLeafError, match=match):
        step(step.init(fsg.params(model)), batch)
