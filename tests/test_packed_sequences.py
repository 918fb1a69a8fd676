"""Packed sequences in a compiled step (``trace/packed_sequences.py``): ``pack_padded_sequence``
-> ``nn.LSTM`` / ``GRU`` / ``RNN`` -> ``pad_packed_sequence``, the lengths in the batch, equal
eager PyTorch in float64 (losses, parameters) over hypothesis-drawn modules and lengths; the two
uses whose result would differ from torch's are refused with the fix."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fsg
from tests.helpers import DEVICES, steps_beside_eager


def _loss(rnn_fn, batch, *, batch_first, enforce_sorted, h0):
    x = batch["x"] if batch_first else batch["x"].transpose(0, 1)
    packed = pack_padded_sequence(x, batch["len"], batch_first=batch_first, enforce_sorted=enforce_sorted)
    out, hidden = rnn_fn(packed, h0(batch) if h0 else None)
    h_n = hidden[0] if isinstance(hidden, tuple) else hidden
    padded, lengths = pad_packed_sequence(out, batch_first=batch_first, padding_value=-1.0, total_length=x.shape[1 if batch_first else 0])
    padded = padded if batch_first else padded.transpose(0, 1)
    weights = torch.linspace(0.5, 1.5, padded.shape[1], dtype=padded.dtype)[None, :, None]  # position-dependent
    return h_n.pow(2).mean() + (padded * weights).sin().sum() / lengths.sum()


@settings(max_examples=12)
@given(
    mode=st.sampled_from(["LSTM", "LSTM-proj", "GRU", "RNN_TANH", "RNN_RELU"]),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    bias=st.booleans(),
    sorted_=st.booleans(),
    with_h0=st.booleans(),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_packed_sequences_train_as_eager_pytorch(mode, layers, bidirectional, batch_first, bias, sorted_, with_h0, lengths):
    torch.manual_seed(0)
    kind = {"LSTM": nn.LSTM, "LSTM-proj": nn.LSTM, "GRU": nn.GRU}.get(mode, nn.RNN)
    extra = {"proj_size": 2} if mode == "LSTM-proj" else {"nonlinearity": mode[4:].lower()} if kind is nn.RNN else {}
    rnn = kind(3, 4, num_layers=layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional, **extra).double()
    reference = copy.deepcopy(rnn)
    if sorted_:  # enforce_sorted=True: the caller sorts
        lengths = sorted(lengths, reverse=True)
    dirs, width = (2 if bidirectional else 1), (2 if mode == "LSTM-proj" else 4)

    def h0(batch):
        h = batch["h0"][..., :width]
        return (h, batch["h0"]) if kind is nn.LSTM else h

    opts = dict(batch_first=batch_first, enforce_sorted=sorted_, h0=h0 if with_h0 else None)
    step = fsg.compile_step(lambda p, b: _loss(lambda *a: fsg.apply(rnn, p, *a), b, **opts),
                            optimizer=fsg.optim.sgd(0.1, momentum=0.5), backend="aot_eager")  # fmt: skip
    state = step.init(fsg.params(rnn))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = {"x": torch.randn(len(lengths), 5, 3, generator=g, dtype=torch.float64), "len": torch.tensor(lengths),
                 "h0": torch.randn(layers * dirs, len(lengths), 4, generator=g, dtype=torch.float64)}  # fmt: skip
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = _loss(reference, batch, **opts)
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=1e-12)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-10, atol=1e-12, msg=name)


class _Classifier(nn.Module):
    """The usual text classifier: embedding, packed bidirectional LSTM, the last states."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 6, batch_first=True, bidirectional=True)
        self.head = nn.Linear(12, 3)

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(torch.cat([h[-2], h[-1]], -1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_packed_lstm_classifier_trains_as_eager_under_inductor(device):
    """On CUDA the lengths go to the CPU (``lengths.cpu()``, as torch asks) inside the graph."""
    torch.manual_seed(0)
    model = _Classifier().to(device)
    reference = copy.deepcopy(model)
    loss = lambda m, b: nn.functional.cross_entropy(m(b["ids"], b["len"]), b["y"])  # noqa: E731
    step = fsg.compile_step(lambda p, b: loss(lambda *a: fsg.apply(model, p, *a), b), optimizer=fsg.optim.adam(1e-2),
                            backend="inductor")  # fmt: skip
    state = step.init(fsg.params(model))
    opt = torch.optim.Adam(reference.parameters(), 1e-2)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        lengths = torch.randint(1, 6, (6,), generator=g)
        ids = torch.randint(1, 20, (6, 5), generator=g) * (torch.arange(5) < lengths[:, None])
        batches.append({"ids": ids.to(device), "len": lengths.to(device), "y": torch.randint(0, 3, (6,), generator=g).to(device)})
    # CUDA: eager runs cuDNN's LSTM (TF32 by default), fsg the cell step by step: 1.8e-5 apart
    # in the loss on an H100 (2026-12-06)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-3, atol=1e-4)
    state = steps_beside_eager(step, state, reference, opt, batches, loss, **tol)
    batch = batches[-1]
    assert step.num_compiles == 1  # new lengths, the same graph
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), **({"rtol": 1e-4, "atol": 1e-5} if device == "cpu" else tol), msg=name)
    evaluate = fsg.compile_eval(lambda p, b: {"loss": loss(lambda *a: fsg.apply(model, p, *a), b)}, backend="eager")
    with torch.no_grad():
        expected = loss(reference.eval(), batch)
    torch.testing.assert_close(evaluate(state, batch)["loss"], expected, **tol)


def _refused(loss_fn, match):
    rnn = nn.GRU(3, 4, batch_first=True)
    step = fsg.compile_step(lambda p, b: loss_fn(lambda x: fsg.apply(rnn, p, x), b), optimizer=fsg.optim.sgd(0.1))
    batch = {"x": torch.randn(2, 5, 3), "len": torch.tensor([5, 2])}
    with pytest.raises(fsg.UnsupportedError, match=match):
        step(step.init(fsg.params(rnn)), batch)


def test_pad_packed_sequence_without_total_length_is_refused_with_the_fix():
    def loss(rnn, b):
        out, _ = rnn(pack_padded_sequence(b["x"], b["len"], batch_first=True))
        return pad_packed_sequence(out, batch_first=True)[0].sum()

    _refused(loss, r"needs total_length=.*total_length=x\.shape\[1\]")


def test_reading_packed_data_is_refused_with_the_fix():
    def loss(rnn, b):
        out, _ = rnn(pack_padded_sequence(b["x"], b["len"], batch_first=True))
        return out.data.sum()  # packed rows: their number depends on the lengths

    _refused(loss, r"packed\.data .*pad_packed_sequence\(packed, total_length=\.\.\.\)")


def test_outside_a_trace_torch_is_untouched():
    rnn = nn.LSTM(3, 4)
    packed = pack_padded_sequence(torch.randn(5, 2, 3), torch.tensor([5, 2]))
    out, _ = rnn(packed)
    assert out.data.shape == (7, 4) and out.batch_sizes.tolist() == [2, 2, 1, 1, 1]
    assert "forward" in nn.LSTM.__dict__ and not hasattr(nn.LSTM.forward, "__wrapped__")
