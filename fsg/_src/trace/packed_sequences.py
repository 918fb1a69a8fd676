"""Packed sequences in a traced step: ``pack_padded_sequence`` -> ``nn.LSTM`` / ``GRU`` / ``RNN``
-> ``pad_packed_sequence``, with the sequence lengths in the batch.

torch's packed layout depends on the lengths' values (``data`` holds ``sum(lengths)`` rows, and
``batch_sizes`` counts the sequences alive at each time step), so a trace cannot build it. While
fsg traces, a packed sequence keeps the padded batch instead, time-major (``data`` ``[T, B,
*]``), with a ``[T, B]`` mask of the steps each sequence has in place of ``batch_sizes``; the
recurrent modules run step by step on it, each sequence's state held where the mask ends it,
as torch's packed kernels do, so the outputs and final states equal torch's: a bidirectional
layer's reverse direction starts at each sequence's own last step. Sorting
(``enforce_sorted=False``) and the hidden states' permutations stay torch's own code.

Two uses would differ from torch's and are refused while tracing, with the fix:
``pad_packed_sequence`` without ``total_length`` (its length is the longest sequence's, a
value), and reading ``packed.data`` outside torch (it holds the padded rows, not the packed).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import rnn as rnn_utils

from fsg._src.errors import UnsupportedError

_VF = rnn_utils._VF  # torch's own: the functions pack/pad_packed_sequence call
_VF_NAMES = ("_pack_padded_sequence", "_pad_packed_sequence")
_PAD = _VF._pad_packed_sequence
_MODULES = (nn.LSTM, nn.GRU, nn.RNN)
_DATA = rnn_utils.PackedSequence.__dict__.get("data")  # None: the NamedTuple's field, on the base class
_FIELD = rnn_utils.PackedSequence.__mro__[1].data
_TORCH = ("torch.nn.utils.rnn", "torch.nn.modules.rnn", __name__)


@contextlib.contextmanager
def traceable() -> Iterator[None]:
    """Within: packed sequences keep the padded batch and the recurrent modules run on it."""
    saved = [(cls, cls.__dict__["forward"]) for cls in _MODULES]
    own = {name: _VF.__dict__.get(name) for name in _VF_NAMES}  # None: resolved through torch's module
    _VF._pack_padded_sequence, _VF._pad_packed_sequence = _pack, _pad
    rnn_utils.PackedSequence.data = property(_guarded_data)
    for cls, forward in saved:
        cls.forward = _forward(forward)
    try:
        yield
    finally:
        for cls, forward in saved:
            cls.forward = forward
        if _DATA is None:
            del rnn_utils.PackedSequence.data
        else:
            rnn_utils.PackedSequence.data = _DATA
        for name, value in own.items():
            if value is None:
                delattr(_VF, name)
            else:
                setattr(_VF, name, value)


def _pack(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    data = input.transpose(0, 1) if batch_first else input
    steps = torch.arange(data.shape[0], device=lengths.device)
    return data, (steps[:, None] < lengths[None, :]).to(torch.int64)  # [T, B]: 1 where a sequence has step t


def _padded(packed: Any) -> bool:
    return isinstance(packed, rnn_utils.PackedSequence) and tuple.__getitem__(packed, 1).dim() == 2


def _pad(data: torch.Tensor, mask: torch.Tensor, batch_first: bool, padding_value: float, total_length: int):
    if mask.dim() != 2:  # a packed sequence made outside fsg's stand-in: torch's
        return _PAD(data, mask, batch_first, padding_value, total_length)
    if total_length == mask.shape[0] and not _total_length_given():
        raise UnsupportedError(
            "pad_packed_sequence(...) in a traced step needs total_length=: without it the output is as long "
            "as the longest sequence, a value of the lengths that the trace cannot know. Pass the padded "
            "length, e.g. pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])"
        )
    keep = mask.to(data.device, torch.bool).reshape(*mask.shape, *([1] * (data.dim() - 2)))
    out = torch.where(keep, data, torch.full((), padding_value, dtype=data.dtype, device=data.device))
    if total_length > out.shape[0]:
        out = F.pad(out, [0, 0] * (out.dim() - 1) + [0, total_length - out.shape[0]], value=padding_value)
    return (out.transpose(0, 1) if batch_first else out), mask.sum(0)


def _total_length_given() -> bool:
    """Whether the ``pad_packed_sequence`` calling ``_pad`` was given ``total_length``."""
    frame = sys._getframe(2)
    return frame.f_code is rnn_utils.pad_packed_sequence.__code__ and frame.f_locals.get("total_length") is not None


def _guarded_data(self: Any) -> torch.Tensor:
    if _padded(self) and sys._getframe(1).f_globals.get("__name__") not in _TORCH:
        raise UnsupportedError(
            "packed.data of a packed sequence in a traced step: its rows depend on the lengths' values, so "
            "while fsg traces it holds the padded batch, time-major, not the packed rows. Unpack it with "
            "pad_packed_sequence(packed, total_length=...) and mask the padding (or weigh the loss by "
            "the lengths) instead"
        )
    return _FIELD.__get__(self)


def _forward(torch_forward):
    def forward(self, input, hx=None):
        if not _padded(input):
            return torch_forward(self, input, hx)
        return _run(self, input, hx)

    forward.__wrapped__ = torch_forward
    return forward


def _run(module: nn.RNNBase, packed: Any, hx: Any) -> tuple[Any, Any]:
    """``module`` over the padded ``packed`` batch, step by step: torch's packed results."""
    data, mask, sorted_indices, unsorted_indices = packed
    lstm = module.mode == "LSTM"
    dirs = 2 if module.bidirectional else 1
    width = module.proj_size if getattr(module, "proj_size", 0) > 0 else module.hidden_size
    layers_dirs, batch = module.num_layers * dirs, data.shape[1]
    if hx is None:
        h0 = data.new_zeros(layers_dirs, batch, width)
        c0 = data.new_zeros(layers_dirs, batch, module.hidden_size) if lstm else None
    else:
        hx = module.permute_hidden(hx, sorted_indices)
        h0, c0 = hx if lstm else (hx, None)
    alive = mask.to(data.device, torch.bool)[..., None]  # [T, B, 1]
    x, h_n, c_n = data, [], []
    for layer in range(module.num_layers):
        outputs = []
        for d in range(dirs):
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            k = layer * dirs + d
            out, h, c = _direction(module, suffix, x, alive, h0[k], None if c0 is None else c0[k], reverse=d == 1)
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outputs, -1) if dirs == 2 else outputs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    hidden = (torch.stack(h_n), torch.stack(c_n)) if lstm else torch.stack(h_n)
    return rnn_utils.PackedSequence(x, mask, sorted_indices, unsorted_indices), module.permute_hidden(hidden, unsorted_indices)


def _direction(module, suffix, x, alive, h, c, *, reverse):
    """One layer's direction: ``(outputs [T, B, H], h_n, c_n)``, a sequence's state held after its last step."""
    w_hh = getattr(module, "weight_hh" + suffix)
    b_ih = getattr(module, "bias_ih" + suffix) if module.bias else None
    b_hh = getattr(module, "bias_hh" + suffix) if module.bias else None
    w_hr = getattr(module, "weight_hr" + suffix, None)
    gates_x = F.linear(x, getattr(module, "weight_ih" + suffix), b_ih)  # every step's input part at once
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    outputs: list[torch.Tensor | None] = [None] * x.shape[0]
    for t in steps:
        h_new, c_new = _cell(module.mode, gates_x[t], F.linear(h, w_hh, b_hh), h, c, w_hr)
        on = alive[t]
        outputs[t] = torch.where(on, h_new, torch.zeros_like(h_new))
        h = torch.where(on, h_new, h)
        c = None if c is None else torch.where(on, c_new, c)
    return torch.stack(outputs), h, c


def _cell(mode, gx, gh, h, c, w_hr):
    """torch's cell formulas (``gx``, ``gh``: the input's and the state's linear parts)."""
    if mode == "LSTM":
        i, f, g, o = (gx + gh).chunk(4, -1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        return (h_new if w_hr is None else F.linear(h_new, w_hr)), c_new
    if mode == "GRU":
        xr, xz, xn = gx.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None
    pre = gx + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None
