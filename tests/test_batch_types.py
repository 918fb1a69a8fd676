"""What a batch may be: dicts, tuples and NamedTuples of tensors, and the mappings data
pipelines hand over (Hugging Face's ``BatchEncoding``, from tokenizers and data collators; a
``UserDict``), which a step takes as the dicts they hold and gives back to ``loss_fn`` as
themselves."""

import collections
import collections.abc

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
