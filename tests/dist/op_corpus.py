"""The op corpus: losses, layers and ops a sharded step must get right (issue 14).

Each ``Case`` builds a tiny model whose train step goes through one op (or loss, or layer),
forward and backward. A runner trains every case sharded (data parallel, FSDP, and tensor
parallel where ``case.tp``) and compares it with the unsharded step; this module holds only
the cases, no mesh code.

Interface:

- ``case.build(sizes, gen)`` returns ``(params, loss_fn, batch)``:

  - ``params``: a flat ``{name: float32 tensor}``, drawn from ``gen`` only, so the same
    ``(sizes, seed)`` gives the same case on every process.
  - ``loss_fn(params, batch)``: pure, returns a 0-d float32 loss; the op under test is on
    the path from the params to the loss, so its backward runs too.
  - ``batch``: ``{name: tensor}``, every leaf with ``dim 0 == sizes.B`` (the batch is
    sharded on dim 0): inputs, targets, masks (bool), indices (int64).

- ``case.tp``: tensor parallelism over the hidden dim is meaningful for this case. Those
  cases name their parameters for ``fsg.sharding.tensor_parallel("tp")``: ``fc`` (Linear
  D -> H, column-split) makes the hidden ``h``, the op acts on it (so on a tensor sharded
  along H), and ``proj`` (bias-free Linear -> C, row-split) maps it out. Where the op
  changes the hidden width to one the tp size may not divide, the output layer is called
  ``head`` instead (replicated).

Shape legend of the cases: B batch rows, D input features, H hidden features, C classes or
output features, T sequence length (or the side of a T x T image).

Example:
  >>> case = by_name("F.mse_loss")
  >>> params, loss_fn, batch = case.build(Sizes(B=8, D=6, H=8, C=4, T=6), torch.Generator().manual_seed(0))
  >>> loss_fn(params, batch).shape
  torch.Size([])
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fsg


class Sizes(NamedTuple):
    B: int  # batch rows: always a multiple of 4 (so 2 and 4 ranks divide it)
    D: int  # input features, 2..12
    H: int  # hidden features: a multiple of 4 (tensor parallel splits it 2 or 4 ways)
    C: int  # classes / output features, 2..8
    T: int  # sequence length / spatial size, 4..8, even


class Case(NamedTuple):
    name: str  # unique, human readable, e.g. "F.mse_loss(reduction='sum')"
    group: str  # "loss" | "layer" | "op"
    build: Callable[[Sizes, torch.Generator], tuple[dict, Callable, dict]]  # -> (params, loss_fn, batch)
    tp: bool = False  # True when tensor parallel over the hidden dim is meaningful for this case


Params = dict[str, torch.Tensor]
Batch = dict[str, torch.Tensor]
Extra = Callable[[Sizes, torch.Generator], Batch]

N_HEADS = 4  # attention heads: H is a multiple of 4, and each tp rank then holds whole heads


# --- drawing from the generator ------------------------------------------------------------


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def _linear(gen: torch.Generator, name: str, d_in: int, d_out: int, *, bias: bool = True) -> Params:
    p = {f"{name}.weight": _randn(gen, d_out, d_in, scale=d_in**-0.5)}
    if bias:
        p[f"{name}.bias"] = _randn(gen, d_out, scale=0.1)
    return p


def _labels(gen: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen)


def _bits(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen).float()


def _signs(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return _bits(gen, *shape) * 2 - 1


def _perms(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """``rows`` random permutations of ``range(n)``, int64 ``[rows, n]``."""
    return torch.rand(rows, n, generator=gen).argsort(-1)


def _lengths_mask(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """bool ``[rows, n]``: a prefix of random length 1..n per row is True (never all False)."""
    lengths = torch.randint(1, n + 1, (rows,), generator=gen)
    return torch.arange(n) < lengths[:, None]


def _module(gen: torch.Generator, make: Callable[[], nn.Module]) -> tuple[nn.Module, Params]:
    """An ``nn.Module`` initialized from a seed drawn from ``gen`` (the global RNG is restored)."""
    seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    return model, {name: p.clone() for name, p in fsg.params(model).items()}


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Written by hand: issue 14 saw it shard right where F.mse_loss did not, so a failing
    # case points at its op, not at this loss.
    return ((out - y) ** 2).mean()


class _Fn(nn.Module):
    """A function as a layer of an ``nn.Sequential``."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# --- case builders -------------------------------------------------------------------------


def _on_output(loss: Callable[[torch.Tensor, Batch], torch.Tensor], targets: Extra):
    """An MLP ``x[B, D] -> tanh(fc) -> proj -> out[B, C]`` and ``loss(out, batch)``;
    ``targets(sizes, gen)`` draws the batch's other leaves."""

    def build(s: Sizes, gen: torch.Generator):
        params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
        batch = {"x": _randn(gen, s.B, s.D), **targets(s, gen)}

        def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
            h = torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"]))
            return loss(F.linear(h, params["proj.weight"]), batch)

        return params, loss_fn, batch

    return build


def _on_hidden(
    op: Callable[[torch.Tensor, Batch], torch.Tensor],
    *,
    seq=False,
    keeps_time=True,
    width=None,
    head="proj",
    extra=None,
):
    """``h = fc(x)``, ``out = <head>(op(h, batch))``, mean squared error against ``y``.

    ``h`` is ``[B, H]``, or ``[B, T, H]`` with ``seq``; ``op`` returns ``[..., W]`` with
    ``W = width(sizes)`` (default H) and the same leading dims (``keeps_time=False``: only
    ``[B, W]`` from ``[B, T, H]``); ``extra(sizes, gen)`` draws more batch leaves (masks,
    indices) for ``op``.
    """

    def build(s: Sizes, gen: torch.Generator):
        w = width(s) if width else s.H
        params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, head, w, s.C, bias=False)}
        lead = (s.B, s.T) if seq else (s.B,)
        y_lead = lead if keeps_time else (s.B,)
        batch = {"x": _randn(gen, *lead, s.D), "y": _randn(gen, *y_lead, s.C), **(extra(s, gen) if extra else {})}

        def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
            h = F.linear(batch["x"], params["fc.weight"], params["fc.bias"])
            return _mse(F.linear(op(h, batch), params[f"{head}.weight"]), batch["y"])

        return params, loss_fn, batch

    return build


def _pointwise(fn: Callable[[torch.Tensor], torch.Tensor]):
    return _on_hidden(lambda h, b: fn(h))


def _net(layers: Callable[[Sizes], list], x_shape: Callable[[Sizes], tuple], *, x=None):
    """An ``nn.Sequential`` of the named ``layers(sizes)`` (names ``fc``/``proj`` get tensor
    parallel specs) on ``x`` of ``x_shape(sizes)`` (or drawn by ``x(sizes, gen)``), its
    ``[B, C]`` output regressed on ``y``."""

    def build(s: Sizes, gen: torch.Generator):
        model, params = _module(gen, lambda: nn.Sequential(OrderedDict(layers(s))))
        batch = {"x": x(s, gen) if x else _randn(gen, *x_shape(s)), "y": _randn(gen, s.B, s.C)}

        def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
            return _mse(fsg.apply(model, params, batch["x"]), batch["y"])

        return params, loss_fn, batch

    return build


def _mean_over(*dims: int) -> _Fn:
    return _Fn(lambda t: t.mean(dims))


# --- losses: every loss of torch.nn.functional on an MLP's output ---------------------------
# Reductions mean / sum / 'none' then .mean() or .sum(), class weights, ignore_index, label
# smoothing, soft targets. The fused loss ops and their *_backward ops normalize by a count,
# which must be the global one (issue 14: F.mse_loss & co. were off by 5e-3 to 4e-2).
# Not here, as no unsharded step can trace them: F.gaussian_nll_loss (its ``var < 0`` check
# reads a tensor on the host: HostSyncError) and F.ctc_loss (aten._ctc_loss has a
# data-dependent output shape: DynamicOutputShapeException under fake tensors).


def _regression(s: Sizes, gen: torch.Generator) -> Batch:
    return {"y": _randn(gen, s.B, s.C)}


def _classes(s: Sizes, gen: torch.Generator) -> Batch:
    return {"y": _labels(gen, s.C, s.B)}


def _classes_some_ignored(s: Sizes, gen: torch.Generator) -> Batch:
    y = _labels(gen, s.C, s.B)
    ignored = torch.rand(s.B, generator=gen) < 0.4
    ignored[0] = False  # at least one row counts, globally (a rank's shard may have none)
    return {"y": y.masked_fill(ignored, -100)}


def _binary(s: Sizes, gen: torch.Generator) -> Batch:
    return {"t": _bits(gen, s.B, s.C)}


def _soft_binary(s: Sizes, gen: torch.Generator) -> Batch:
    return {"t": torch.rand(s.B, s.C, generator=gen)}


def _binary_weighted(s: Sizes, gen: torch.Generator) -> Batch:
    return {"t": _bits(gen, s.B, s.C), "w": torch.rand(s.B, s.C, generator=gen) + 0.5}


def _pm_ones(s: Sizes, gen: torch.Generator) -> Batch:
    return {"t": _signs(gen, s.B, s.C)}


def _distribution(s: Sizes, gen: torch.Generator) -> Batch:
    return {"p": torch.softmax(_randn(gen, s.B, s.C), -1)}


def _counts(s: Sizes, gen: torch.Generator) -> Batch:
    return {"y": torch.randint(0, 5, (s.B, s.C), generator=gen).float()}


def _multilabel_indices(s: Sizes, gen: torch.Generator) -> Batch:
    # multilabel_margin_loss's target: each row's labels first, then -1 (1..C-1 labels a row).
    labels = _perms(gen, s.B, s.C)
    k = torch.randint(1, max(s.C, 2), (s.B, 1), generator=gen)
    return {"y": torch.where(torch.arange(s.C) < k, labels, -1)}


def _pair_targets(s: Sizes, gen: torch.Generator) -> Batch:
    return {"z": _randn(gen, s.B, s.C), "t": _signs(gen, s.B)}


def _triplets(s: Sizes, gen: torch.Generator) -> Batch:
    return {"pos": _randn(gen, s.B, s.C), "neg": _randn(gen, s.B, s.C)}


def _class_weights(c: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, c)


def _cross_entropy_seq(s: Sizes, gen: torch.Generator):
    # logits [B, C, T] (the k-dimensional form), some targets ignored.
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    y = _labels(gen, s.C, s.B, s.T)
    ignored = torch.rand(s.B, s.T, generator=gen) < 0.3
    ignored[:, 0] = False
    batch = {"x": _randn(gen, s.B, s.T, s.D), "y": y.masked_fill(ignored, -100)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h = torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"]))
        logits_BTC = F.linear(h, params["proj.weight"])
        return F.cross_entropy(logits_BTC.transpose(1, 2), batch["y"])

    return params, loss_fn, batch


def _cross_entropy_2d(s: Sizes, gen: torch.Generator):
    # per-pixel logits [B, C, T, T] (nll_loss2d), as in segmentation.
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _randn(gen, s.B, s.T, s.T, s.D), "y": _labels(gen, s.C, s.B, s.T, s.T)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h = torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"]))
        logits_BTTC = F.linear(h, params["proj.weight"])
        return F.cross_entropy(logits_BTTC.permute(0, 3, 1, 2), batch["y"], label_smoothing=0.05)

    return params, loss_fn, batch


def _linear_cross_entropy(s: Sizes, gen: torch.Generator):
    # fsg's fused head + loss: proj's weight is the head, h[B, H] goes in unprojected.
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _randn(gen, s.B, s.D), **_classes_some_ignored(s, gen)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h = torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"]))
        return fsg.nn.linear_cross_entropy(h, params["proj.weight"], batch["y"])

    return params, loss_fn, batch


def _bce(o, b, **kw):
    return F.binary_cross_entropy(torch.sigmoid(o), b["t"], **kw)


LOSSES = [
    Case("((o - y) ** 2).mean() (by hand)", "loss", _on_output(lambda o, b: ((o - b["y"]) ** 2).mean(), _regression)),
    Case("F.mse_loss", "loss", _on_output(lambda o, b: F.mse_loss(o, b["y"]), _regression)),
    Case("F.mse_loss(reduction='sum')", "loss", _on_output(lambda o, b: F.mse_loss(o, b["y"], reduction="sum"), _regression)),
    Case("F.mse_loss(reduction='none').mean()", "loss", _on_output(lambda o, b: F.mse_loss(o, b["y"], reduction="none").mean(), _regression)),
    Case("F.l1_loss", "loss", _on_output(lambda o, b: F.l1_loss(o, b["y"]), _regression)),
    Case("F.l1_loss(reduction='sum')", "loss", _on_output(lambda o, b: F.l1_loss(o, b["y"], reduction="sum"), _regression)),
    Case("F.l1_loss(reduction='none').sum()", "loss", _on_output(lambda o, b: F.l1_loss(o, b["y"], reduction="none").sum(), _regression)),
    Case("F.huber_loss", "loss", _on_output(lambda o, b: F.huber_loss(o, b["y"]), _regression)),
    Case("F.huber_loss(delta=0.5, reduction='sum')", "loss", _on_output(lambda o, b: F.huber_loss(o, b["y"], delta=0.5, reduction="sum"), _regression)),
    Case("F.huber_loss(reduction='none').mean()", "loss", _on_output(lambda o, b: F.huber_loss(o, b["y"], reduction="none").mean(), _regression)),
    Case("F.smooth_l1_loss", "loss", _on_output(lambda o, b: F.smooth_l1_loss(o, b["y"]), _regression)),
    Case("F.smooth_l1_loss(beta=0.5, reduction='sum')", "loss", _on_output(lambda o, b: F.smooth_l1_loss(o, b["y"], beta=0.5, reduction="sum"), _regression)),
    Case("F.smooth_l1_loss(reduction='none').sum()", "loss", _on_output(lambda o, b: F.smooth_l1_loss(o, b["y"], reduction="none").sum(), _regression)),
    Case("F.binary_cross_entropy(torch.sigmoid(o), t)", "loss", _on_output(lambda o, b: _bce(o, b), _binary)),
    Case("F.binary_cross_entropy(reduction='sum')", "loss", _on_output(lambda o, b: _bce(o, b, reduction="sum"), _binary)),
    Case("F.binary_cross_entropy(weight=per-element)", "loss", _on_output(lambda o, b: _bce(o, b, weight=b["w"]), _binary_weighted)),
    Case("F.binary_cross_entropy_with_logits", "loss", _on_output(lambda o, b: F.binary_cross_entropy_with_logits(o, b["t"]), _binary)),
    Case("F.binary_cross_entropy_with_logits(pos_weight=...)", "loss", _on_output(lambda o, b: F.binary_cross_entropy_with_logits(o, b["t"], pos_weight=_class_weights(o.shape[-1])), _binary)),
    Case("F.binary_cross_entropy_with_logits(soft targets, reduction='sum')", "loss", _on_output(lambda o, b: F.binary_cross_entropy_with_logits(o, b["t"], reduction="sum"), _soft_binary)),
    Case("F.binary_cross_entropy_with_logits(weight=per-element, reduction='none').mean()", "loss", _on_output(lambda o, b: F.binary_cross_entropy_with_logits(o, b["t"], weight=b["w"], reduction="none").mean(), _binary_weighted)),
    Case("F.soft_margin_loss", "loss", _on_output(lambda o, b: F.soft_margin_loss(o, b["t"]), _pm_ones)),
    Case("F.soft_margin_loss(reduction='sum')", "loss", _on_output(lambda o, b: F.soft_margin_loss(o, b["t"], reduction="sum"), _pm_ones)),
    Case("F.cross_entropy", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"]), _classes)),
    Case("F.cross_entropy(reduction='sum')", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], reduction="sum"), _classes)),
    Case("F.cross_entropy(reduction='none').mean()", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], reduction="none").mean(), _classes)),
    Case("F.cross_entropy(weight=class weights)", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], weight=_class_weights(o.shape[-1])), _classes)),
    Case("F.cross_entropy(ignore_index=-100)", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], ignore_index=-100), _classes_some_ignored)),
    Case("F.cross_entropy(label_smoothing=0.1)", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], label_smoothing=0.1), _classes)),
    Case("F.cross_entropy(weight, ignore_index, label_smoothing=0.2)", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["y"], weight=_class_weights(o.shape[-1]), ignore_index=-100, label_smoothing=0.2), _classes_some_ignored)),
    Case("F.cross_entropy(probability targets)", "loss", _on_output(lambda o, b: F.cross_entropy(o, b["p"]), _distribution)),
    Case("F.cross_entropy([B, C, T] logits, ignore_index)", "loss", _cross_entropy_seq),
    Case("F.cross_entropy([B, C, T, T] logits, label_smoothing)", "loss", _cross_entropy_2d),
    Case("F.nll_loss(F.log_softmax(o))", "loss", _on_output(lambda o, b: F.nll_loss(F.log_softmax(o, -1), b["y"]), _classes)),
    Case("F.nll_loss(weight=class weights, reduction='sum')", "loss", _on_output(lambda o, b: F.nll_loss(F.log_softmax(o, -1), b["y"], weight=_class_weights(o.shape[-1]), reduction="sum"), _classes)),
    Case("F.nll_loss(weight=class weights, ignore_index=-100)", "loss", _on_output(lambda o, b: F.nll_loss(F.log_softmax(o, -1), b["y"], weight=_class_weights(o.shape[-1])), _classes_some_ignored)),
    Case("F.kl_div(reduction='batchmean')", "loss", _on_output(lambda o, b: F.kl_div(F.log_softmax(o, -1), b["p"], reduction="batchmean"), _distribution)),
    Case("F.kl_div(log_target=True, reduction='sum')", "loss", _on_output(lambda o, b: F.kl_div(F.log_softmax(o, -1), b["p"].log(), reduction="sum", log_target=True), _distribution)),
    Case("F.kl_div(reduction='none').sum(-1).mean()", "loss", _on_output(lambda o, b: F.kl_div(F.log_softmax(o, -1), b["p"], reduction="none").sum(-1).mean(), _distribution)),
    Case("F.poisson_nll_loss", "loss", _on_output(lambda o, b: F.poisson_nll_loss(o, b["y"]), _counts)),
    Case("F.poisson_nll_loss(log_input=False, full=True, reduction='sum')", "loss", _on_output(lambda o, b: F.poisson_nll_loss(F.softplus(o) + 0.1, b["y"], log_input=False, full=True, reduction="sum"), _counts)),
    Case("F.margin_ranking_loss", "loss", _on_output(lambda o, b: F.margin_ranking_loss(o[:, 0], o[:, 1], b["t"][:, 0], margin=0.2), _pm_ones)),
    Case("F.hinge_embedding_loss", "loss", _on_output(lambda o, b: F.hinge_embedding_loss(o, b["t"]), _pm_ones)),
    Case("F.multilabel_margin_loss", "loss", _on_output(lambda o, b: F.multilabel_margin_loss(o, b["y"]), _multilabel_indices)),
    Case("F.multilabel_soft_margin_loss", "loss", _on_output(lambda o, b: F.multilabel_soft_margin_loss(o, b["t"]), _binary)),
    Case("F.multi_margin_loss", "loss", _on_output(lambda o, b: F.multi_margin_loss(o, b["y"]), _classes)),
    Case("F.multi_margin_loss(p=2, margin=0.5, weight=class weights)", "loss", _on_output(lambda o, b: F.multi_margin_loss(o, b["y"], p=2, margin=0.5, weight=_class_weights(o.shape[-1])), _classes)),
    Case("F.cosine_embedding_loss", "loss", _on_output(lambda o, b: F.cosine_embedding_loss(o, b["z"], b["t"], margin=0.1), _pair_targets)),
    Case("F.triplet_margin_loss", "loss", _on_output(lambda o, b: F.triplet_margin_loss(o, b["pos"], b["neg"], margin=2.0), _triplets)),
    Case("F.triplet_margin_with_distance_loss(cosine distance)", "loss", _on_output(lambda o, b: F.triplet_margin_with_distance_loss(o, b["pos"], b["neg"], distance_function=lambda u, v: 1 - F.cosine_similarity(u, v), margin=1.0), _triplets)),
    Case("F.pdist(o).mean() (distances between batch rows)", "loss", _on_output(lambda o, b: F.pdist(o).mean(), _regression)),
    Case("fsg.nn.cross_entropy(ignore_index=-100)", "loss", _on_output(lambda o, b: fsg.nn.cross_entropy(o, b["y"]), _classes_some_ignored)),
    Case("fsg.nn.linear_cross_entropy", "loss", _linear_cross_entropy, tp=True),
]  # fmt: skip


# --- layers: nn modules and functional layers ------------------------------------------------
# Linear, conv 1d/2d/transposed, batch/group/layer/instance/RMS norm, embedding, pooling,
# dropout switched off and on (keyed by state.rng: the same masks sharded and unsharded),
# attention (SDPA causal and with a padding mask), recurrent layers.
# Batch norm in training computes its statistics over the (sharded) batch rows.


def _seq_x(s: Sizes) -> tuple:
    return (s.B, s.T, s.D)


def _chan_x(s: Sizes) -> tuple:
    return (s.B, s.D, s.T)


def _image_x(s: Sizes) -> tuple:
    return (s.B, s.D, s.T, s.T)


def _flat_x(s: Sizes) -> tuple:
    return (s.B, s.D)


def _mlp_with(*middle: Callable[[Sizes], tuple[str, nn.Module]], proj_bias: bool = False):
    """``fc`` (D -> H), the ``middle`` layers on ``[B, H]``, ``proj`` (H -> C)."""
    return lambda s: [
        ("fc", nn.Linear(s.D, s.H)),
        *(m(s) for m in middle),
        ("proj", nn.Linear(s.H, s.C, bias=proj_bias)),
    ]


def _pool1d(pool: Callable[[torch.Tensor], torch.Tensor]):
    # fc on each step of [B, T, D]: channels [B, H, T] sharded by tp; pool over T, mean, proj.
    return _net(
        lambda s: [
            ("fc", nn.Linear(s.D, s.H)),
            ("chan", _Fn(lambda t: t.transpose(1, 2))),
            ("pool", _Fn(pool)),
            ("mean", _mean_over(-1)),
            ("proj", nn.Linear(s.H, s.C, bias=False)),
        ],
        _seq_x,
    )


def _pool2d(pool: Callable[[torch.Tensor], torch.Tensor]):
    # fc on each pixel of [B, T, T, D]: channels [B, H, T, T]; pool, mean over space, proj.
    return _net(
        lambda s: [
            ("fc", nn.Linear(s.D, s.H)),
            ("chan", _Fn(lambda t: t.permute(0, 3, 1, 2))),
            ("pool", _Fn(pool)),
            ("mean", _mean_over(-2, -1)),
            ("proj", nn.Linear(s.H, s.C, bias=False)),
        ],
        lambda s: (s.B, s.T, s.T, s.D),
    )


def _conv1d(*middle: Callable[[Sizes], tuple[str, nn.Module]]):
    # x [B, D, T] -> Conv1d(D, H, 3) -> middle -> mean over T -> head [B, C].
    return _net(
        lambda s: [
            ("conv", nn.Conv1d(s.D, s.H, 3, padding=1)),
            *(m(s) for m in middle),
            ("mean", _mean_over(-1)),
            ("head", nn.Linear(s.H, s.C)),
        ],
        _chan_x,
    )


def _recurrent(make: Callable[[Sizes], nn.Module]):
    # [B, T, D] -> rnn (batch_first) -> last step's output -> head.
    return _net(
        lambda s: [
            ("rnn", make(s)),
            ("last", _Fn(lambda out: out[0][:, -1])),
            ("head", nn.Linear(s.H, s.C)),
        ],
        _seq_x,
    )


class _Unrolled(nn.Module):
    """An ``nn.LSTMCell`` run over the T steps of ``x[B, T, D]``; returns the last ``h[B, H]``."""

    def __init__(self, cell: nn.LSTMCell):
        super().__init__()
        self.cell = cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for x_BD in x.unbind(1):
            state = self.cell(x_BD, state)
        return state[0]


class _SelfAttention(nn.Module):
    def __init__(self, make: Callable[[], nn.Module]):
        super().__init__()
        self.attn = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Batch], torch.Tensor], *, mask=False):
    """Multi-head self-attention on ``x[B, T, D]``: ``q_proj``/``k_proj``/``v_proj`` (column
    split by tp: each rank holds whole heads), ``attend(q, k, v, batch)`` on ``[B, heads, T,
    hd]``, ``o_proj`` (row split) to ``[B, T, C]``. ``mask``: a bool ``keep[B, T]`` of valid
    (non-padding) keys in the batch."""

    def build(s: Sizes, gen: torch.Generator):
        params = {}
        for name in ("q_proj", "k_proj", "v_proj"):
            params.update(_linear(gen, name, s.D, s.H, bias=False))
        params.update(_linear(gen, "o_proj", s.H, s.C, bias=False))
        batch = {"x": _randn(gen, s.B, s.T, s.D), "y": _randn(gen, s.B, s.T, s.C)}
        if mask:
            batch["keep"] = _lengths_mask(gen, s.B, s.T)

        def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
            def heads(name: str) -> torch.Tensor:  # [B, T, H] -> [B, heads, T, hd]
                return F.linear(batch["x"], params[f"{name}.weight"]).unflatten(-1, (N_HEADS, -1)).transpose(1, 2)

            a_BNTK = attend(heads("q_proj"), heads("k_proj"), heads("v_proj"), batch)
            out = F.linear(a_BNTK.transpose(1, 2).flatten(2), params["o_proj.weight"])
            return _mse(out, batch["y"])

        return params, loss_fn, batch

    return build


def _by_hand_attention(q, k, v, b):
    T = q.shape[-2]
    scores_BNTT = q @ k.mT * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(scores_BNTT.masked_fill(~causal, float("-inf")), -1) @ v


def _embedding(make: Callable[[Sizes], nn.Module], *, zero_some: bool = False):
    # token ids [B, T] -> embedding [B, T, H] -> mean over T -> proj.
    def ids(s: Sizes, gen: torch.Generator) -> torch.Tensor:
        x = _labels(gen, s.D + 4, s.B, s.T)
        return x.masked_fill(torch.rand(s.B, s.T, generator=gen) < 0.3, 0) if zero_some else x

    return _net(
        lambda s: [("emb", make(s)), ("mean", _mean_over(1)), ("proj", nn.Linear(s.H, s.C, bias=False))],
        None,
        x=ids,
    )


def _embedding_bag(s: Sizes, gen: torch.Generator):
    params = {"table": _randn(gen, s.D + 4, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _labels(gen, s.D + 4, s.B, s.T), "y": _randn(gen, s.B, s.C)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        bags_BH = F.embedding_bag(batch["x"], params["table"], mode="mean")
        return _mse(F.linear(bags_BH, params["proj.weight"]), batch["y"])

    return params, loss_fn, batch


def _batch_norm_eval(s: Sizes):
    bn = nn.BatchNorm1d(s.H).eval()
    bn.running_mean.uniform_(-0.5, 0.5)  # under _module's seeded RNG
    bn.running_var.uniform_(0.5, 2.0)
    return ("norm", bn)


def _affine_norm(norm: Callable[[torch.Tensor, Params], torch.Tensor], *, bias: bool = True, seq: bool = False):
    """fc -> ``norm(h, params)`` with ``norm.weight`` (and ``norm.bias``) of shape [H] -> gelu -> proj."""

    def build(s: Sizes, gen: torch.Generator):
        params = _linear(gen, "fc", s.D, s.H)
        params["norm.weight"] = 1 + _randn(gen, s.H, scale=0.1)
        if bias:
            params["norm.bias"] = _randn(gen, s.H, scale=0.1)
        params.update(_linear(gen, "proj", s.H, s.C, bias=False))
        lead = (s.B, s.T) if seq else (s.B,)
        batch = {"x": _randn(gen, *lead, s.D), "y": _randn(gen, *lead, s.C)}

        def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
            h = F.linear(batch["x"], params["fc.weight"], params["fc.bias"])
            return _mse(F.linear(F.gelu(norm(h, params)), params["proj.weight"]), batch["y"])

        return params, loss_fn, batch

    return build


LAYERS = [
    Case("nn.Linear -> nn.ReLU -> nn.Linear", "layer", _net(_mlp_with(lambda s: ("act", nn.ReLU())), _flat_x), tp=True),
    Case("nn.Linear(bias=True) row-parallel after column-parallel", "layer", _net(_mlp_with(lambda s: ("act", nn.Tanh()), proj_bias=True), _flat_x), tp=True),
    Case("nn.Conv1d(padding=1)", "layer", _conv1d(lambda s: ("act", nn.ReLU()))),
    Case("nn.Conv1d + nn.GroupNorm", "layer", _conv1d(lambda s: ("norm", nn.GroupNorm(2, s.H)), lambda s: ("act", nn.SiLU()))),
    Case("nn.Conv1d + nn.BatchNorm1d (training)", "layer", _conv1d(lambda s: ("norm", nn.BatchNorm1d(s.H, track_running_stats=False)), lambda s: ("act", nn.ReLU()))),
    Case("nn.Conv1d + nn.InstanceNorm1d(affine=True)", "layer", _conv1d(lambda s: ("norm", nn.InstanceNorm1d(s.H, affine=True)), lambda s: ("act", nn.Tanh()))),
    Case("nn.Conv1d(groups=H) depthwise, stride=2, dilation=2", "layer", _conv1d(lambda s: ("dw", nn.Conv1d(s.H, s.H, 3, stride=2, padding=2, dilation=2, groups=s.H)), lambda s: ("act", nn.GELU()))),
    Case("nn.Conv1d(groups=4, padding_mode='circular')", "layer", _conv1d(lambda s: ("grouped", nn.Conv1d(s.H, s.H, 3, padding=1, groups=4, padding_mode="circular")), lambda s: ("act", nn.Tanh()))),
    Case("nn.ConvTranspose1d(stride=2)", "layer", _net(lambda s: [("up", nn.ConvTranspose1d(s.D, s.H, 2, stride=2)), ("act", nn.Tanh()), ("mean", _mean_over(-1)), ("head", nn.Linear(s.H, s.C))], _chan_x)),
    Case("nn.Conv2d(padding=1)", "layer", _net(lambda s: [("conv", nn.Conv2d(s.D, s.H, 3, padding=1)), ("act", nn.ReLU()), ("mean", _mean_over(-2, -1)), ("head", nn.Linear(s.H, s.C))], _image_x)),
    Case("nn.Conv2d(stride=2) + nn.BatchNorm2d (training)", "layer", _net(lambda s: [("conv", nn.Conv2d(s.D, s.H, 3, stride=2, padding=1)), ("norm", nn.BatchNorm2d(s.H, track_running_stats=False)), ("act", nn.ReLU()), ("mean", _mean_over(-2, -1)), ("head", nn.Linear(s.H, s.C))], _image_x)),
    Case("nn.BatchNorm1d (training, batch statistics)", "layer", _net(_mlp_with(lambda s: ("norm", nn.BatchNorm1d(s.H, track_running_stats=False)), lambda s: ("act", nn.ReLU())), _flat_x), tp=True),
    Case("nn.BatchNorm1d (eval, running statistics)", "layer", _net(_mlp_with(_batch_norm_eval, lambda s: ("act", nn.ReLU())), _flat_x)),
    Case("nn.GroupNorm(2, H) on [B, H]", "layer", _net(_mlp_with(lambda s: ("norm", nn.GroupNorm(2, s.H)), lambda s: ("act", nn.GELU())), _flat_x), tp=True),
    Case("nn.LayerNorm", "layer", _net(_mlp_with(lambda s: ("norm", nn.LayerNorm(s.H)), lambda s: ("act", nn.GELU())), _flat_x), tp=True),
    Case("nn.LayerNorm((T, H)) on [B, T, H]", "layer", _net(lambda s: [("fc", nn.Linear(s.D, s.H)), ("norm", nn.LayerNorm((s.T, s.H))), ("act", nn.GELU()), ("mean", _mean_over(1)), ("proj", nn.Linear(s.H, s.C, bias=False))], _seq_x), tp=True),
    Case("F.layer_norm(weight, bias) on [B, T, H]", "layer", _affine_norm(lambda h, p: F.layer_norm(h, h.shape[-1:], p["norm.weight"], p["norm.bias"]), seq=True), tp=True),
    Case("F.layer_norm (no affine)", "layer", _pointwise(lambda h: F.gelu(F.layer_norm(h, h.shape[-1:]))), tp=True),
    Case("F.rms_norm(weight)", "layer", _affine_norm(lambda h, p: F.rms_norm(h, h.shape[-1:], p["norm.weight"], eps=1e-6), bias=False), tp=True),
    Case("nn.RMSNorm on [B, T, H]", "layer", _net(lambda s: [("fc", nn.Linear(s.D, s.H)), ("norm", nn.RMSNorm(s.H)), ("act", nn.SiLU()), ("mean", _mean_over(1)), ("proj", nn.Linear(s.H, s.C, bias=False))], _seq_x), tp=True),
    Case("fsg.nn.rms_norm", "layer", _affine_norm(lambda h, p: fsg.nn.rms_norm(h, p["norm.weight"]), bias=False, seq=True), tp=True),
    Case("fsg.nn.layer_norm", "layer", _affine_norm(lambda h, p: fsg.nn.layer_norm(h, p["norm.weight"], p["norm.bias"])), tp=True),
    Case("nn.Embedding", "layer", _embedding(lambda s: nn.Embedding(s.D + 4, s.H))),
    Case("nn.Embedding(padding_idx=0)", "layer", _embedding(lambda s: nn.Embedding(s.D + 4, s.H, padding_idx=0), zero_some=True)),
    Case("F.embedding_bag(mode='mean')", "layer", _embedding_bag),
    Case("F.dropout(p=0.0, training=True)", "layer", _pointwise(lambda h: F.dropout(torch.tanh(h), p=0.0, training=True)), tp=True),
    Case("F.dropout(p=0.5, training=False)", "layer", _pointwise(lambda h: F.dropout(torch.tanh(h), p=0.5, training=False)), tp=True),
    Case("F.dropout(p=0.3) (keyed by state.rng)", "layer", _pointwise(lambda h: F.dropout(torch.tanh(h), p=0.3, training=True)), tp=True),
    Case("nn.PReLU(num_parameters=H)", "layer", _net(_mlp_with(lambda s: ("act", nn.PReLU(s.H, init=0.2))), _flat_x), tp=True),
    Case("F.max_pool1d(2)", "layer", _pool1d(lambda t: F.max_pool1d(t, 2)), tp=True),
    Case("F.avg_pool1d(3, stride=1, padding=1, count_include_pad=False)", "layer", _pool1d(lambda t: F.avg_pool1d(t, 3, stride=1, padding=1, count_include_pad=False)), tp=True),
    Case("F.adaptive_avg_pool1d(3)", "layer", _pool1d(lambda t: F.adaptive_avg_pool1d(t, 3)), tp=True),
    Case("F.adaptive_max_pool1d(3)", "layer", _pool1d(lambda t: F.adaptive_max_pool1d(t, 3)), tp=True),
    Case("F.max_pool2d(3, stride=2, padding=1)", "layer", _pool2d(lambda t: F.max_pool2d(t, 3, stride=2, padding=1)), tp=True),
    Case("F.avg_pool2d(2)", "layer", _pool2d(lambda t: F.avg_pool2d(t, 2)), tp=True),
    Case("F.adaptive_avg_pool2d(3)", "layer", _pool2d(lambda t: F.adaptive_avg_pool2d(t, 3)), tp=True),
    Case("F.adaptive_max_pool2d(2)", "layer", _pool2d(lambda t: F.adaptive_max_pool2d(t, 2)), tp=True),
    Case("F.interpolate(scale_factor=2, mode='linear')", "layer", _pool1d(lambda t: torch.tanh(F.interpolate(t, scale_factor=2, mode="linear"))), tp=True),
    Case("F.scaled_dot_product_attention", "layer", _attention(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v)), tp=True),
    Case("F.scaled_dot_product_attention(is_causal=True)", "layer", _attention(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, is_causal=True)), tp=True),
    Case("F.scaled_dot_product_attention(attn_mask=bool padding mask)", "layer", _attention(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b["keep"][:, None, None, :]), mask=True), tp=True),
    Case("nn.MultiheadAttention(batch_first=True)", "layer", _net(lambda s: [("fc", nn.Linear(s.D, s.H)), ("mha", _SelfAttention(lambda: nn.MultiheadAttention(s.H, 2, batch_first=True))), ("mean", _mean_over(1)), ("head", nn.Linear(s.H, s.C))], _seq_x)),
    Case("nn.TransformerEncoderLayer(dropout=0.0)", "layer", _net(lambda s: [("fc", nn.Linear(s.D, s.H)), ("block", nn.TransformerEncoderLayer(s.H, 2, 2 * s.H, dropout=0.0, batch_first=True)), ("mean", _mean_over(1)), ("head", nn.Linear(s.H, s.C))], _seq_x)),
    Case("nn.TransformerEncoderLayer(dropout=0.1) (keyed by state.rng)", "layer", _net(lambda s: [("fc", nn.Linear(s.D, s.H)), ("block", nn.TransformerEncoderLayer(s.H, 2, 2 * s.H, dropout=0.1, batch_first=True)), ("mean", _mean_over(1)), ("head", nn.Linear(s.H, s.C))], _seq_x)),
    Case("nn.GRU(batch_first=True)", "layer", _recurrent(lambda s: nn.GRU(s.D, s.H, batch_first=True))),
    # nn.LSTM failed on CPU until 2026-12-04: torch's decomposition took oneDNN's kernel, whose
    # backward traced on fake tensors gets no workspace; stage 1 now traces with oneDNN off
    Case("nn.LSTM(batch_first=True)", "layer", _recurrent(lambda s: nn.LSTM(s.D, s.H, batch_first=True))),
    Case("nn.LSTM(num_layers=2, bidirectional=True)", "layer",
         _recurrent(lambda s: nn.LSTM(s.D, s.H // 2, num_layers=2, bidirectional=True, batch_first=True))),
    Case("nn.LSTM(proj_size=2)", "layer", _net(lambda s: [("rnn", nn.LSTM(s.D, s.H, proj_size=2, batch_first=True)),
         ("last", _Fn(lambda out: out[0][:, -1])), ("head", nn.Linear(2, s.C))], _seq_x)),
    Case("nn.LSTMCell unrolled over T", "layer", _net(lambda s: [("cell", _Unrolled(nn.LSTMCell(s.D, s.H))), ("head", nn.Linear(s.H, s.C))], _seq_x)),
]  # fmt: skip


# --- ops: tensor ops on the hidden h = fc(x), between fc and proj ---------------------------
# Activations, softmax family, reductions over the hidden, time and batch dims (the batch dim
# is the data-parallel one), cumulative ops, einsum, indexing (gather, scatter_add,
# index_select, masks), shape ops on sharded dims, joins and splits, pointwise math, and
# order statistics (topk, sort, max/min: their gradient picks elements).


def _hidden_perms(s: Sizes, gen: torch.Generator) -> Batch:
    return {"idx": _perms(gen, s.B, s.H)}


def _hidden_mask(s: Sizes, gen: torch.Generator) -> Batch:
    return {"mask": torch.rand(s.B, s.H, generator=gen) < 0.5}


def _hidden_keep(s: Sizes, gen: torch.Generator) -> Batch:
    return {"keep": _lengths_mask(gen, s.B, s.H)}


def _mixup(h: torch.Tensor) -> torch.Tensor:
    lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample()
    return lam * h + (1 - lam) * h[torch.randperm(h.shape[0])]


def _shot_noise(h: torch.Tensor) -> torch.Tensor:
    """Poisson shot noise of mean 1 on each feature (the rate from ``|h|``, no gradient)."""
    rate = 4 * h.detach().abs() + 1
    return h * torch.poisson(rate) / rate


def _complex_rope(h: torch.Tensor, b: Batch) -> torch.Tensor:
    """Rotary embedding as Meta's Llama and torchtitan write it: pairs of ``h``'s features as
    complex numbers, rotated by ``polar(1, t * freq)``."""
    t, pairs = h.shape[1], h.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(pairs, dtype=torch.float32) / pairs))
    rotation = torch.polar(torch.ones(t, pairs), torch.outer(torch.arange(t, dtype=torch.float32), freqs))
    return torch.view_as_real(torch.view_as_complex(h.reshape(*h.shape[:-1], pairs, 2)) * rotation).flatten(-2)


def _half(s: Sizes) -> int:
    return s.H // 2


def _mix_over_time(s: Sizes, gen: torch.Generator):
    # [B, T, H] -> transpose to [B, H, T] -> a Linear over T ("mix") -> back -> proj.
    params = {
        **_linear(gen, "fc", s.D, s.H),
        **_linear(gen, "mix", s.T, s.T),
        **_linear(gen, "proj", s.H, s.C, bias=False),
    }
    batch = {"x": _randn(gen, s.B, s.T, s.D), "y": _randn(gen, s.B, s.T, s.C)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h_BTH = F.linear(batch["x"], params["fc.weight"], params["fc.bias"])
        mixed_BHT = F.linear(h_BTH.transpose(1, 2), params["mix.weight"], params["mix.bias"])
        return _mse(F.linear(mixed_BHT.transpose(1, 2), params["proj.weight"]), batch["y"])

    return params, loss_fn, batch


def _param_rows(s: Sizes, gen: torch.Generator):
    # index_select of a parameter table's rows by per-row ids (an embedding by hand).
    params = {"table": _randn(gen, s.D + 4, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"ids": _labels(gen, s.D + 4, s.B), "y": _randn(gen, s.B, s.C)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        rows_BH = params["table"].index_select(0, batch["ids"])
        return _mse(F.linear(torch.tanh(rows_BH), params["proj.weight"]), batch["y"])

    return params, loss_fn, batch


def _einsum_head(s: Sizes, gen: torch.Generator):
    # the output layer as an einsum contracting the (tp-sharded) hidden dim.
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _randn(gen, s.B, s.D), "y": _randn(gen, s.B, s.C)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h = torch.einsum("bd,hd->bh", batch["x"], params["fc.weight"]) + params["fc.bias"]
        return _mse(torch.einsum("bh,ch->bc", torch.tanh(h), params["proj.weight"]), batch["y"])

    return params, loss_fn, batch


def _one_hot_loss(s: Sizes, gen: torch.Generator):
    # cross-entropy by hand: one_hot targets times log_softmax.
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _randn(gen, s.B, s.D), **_classes(s, gen)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        h = torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"]))
        logp = F.log_softmax(F.linear(h, params["proj.weight"]), -1)
        return -(F.one_hot(batch["y"], logp.shape[-1]) * logp).sum(-1).mean()

    return params, loss_fn, batch


def _cosine_to_target(s: Sizes, gen: torch.Generator):
    params = {**_linear(gen, "fc", s.D, s.H), **_linear(gen, "proj", s.H, s.C, bias=False)}
    batch = {"x": _randn(gen, s.B, s.D), "y": _randn(gen, s.B, s.C)}

    def loss_fn(params: Params, batch: Batch) -> torch.Tensor:
        out = F.linear(torch.tanh(F.linear(batch["x"], params["fc.weight"], params["fc.bias"])), params["proj.weight"])
        return (1 - F.cosine_similarity(out, batch["y"], dim=-1)).mean()

    return params, loss_fn, batch


def _swap_row_pairs(h: torch.Tensor) -> torch.Tensor:
    # rows (0, 1), (2, 3), ... swapped: a reshape that merges rows of the sharded batch dim.
    return h.reshape(-1, 2, h.shape[-1]).flip(1).reshape(h.shape)


def _cat_batch(h: torch.Tensor) -> torch.Tensor:
    # cat along the batch dim with the batch reversed, then the two halves summed.
    both = torch.cat([h, torch.tanh(h).flip(0)], 0)
    return both[: h.shape[0]] + both[h.shape[0] :]


class _RoundStraightThrough(torch.autograd.Function):
    """A user's own ``autograd.Function``: rounds to quarters, passes the gradient where
    ``|h| < 2`` (a straight-through estimator, as in quantization-aware training)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return torch.round(h * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return grad * (h.abs() < 2).to(grad.dtype)


def _gradient_penalty(h: torch.Tensor) -> torch.Tensor:
    """``h`` plus the gradient of a scalar of ``h`` with respect to ``h``, kept in the graph
    (``create_graph=True``: WGAN-GP's penalty, the step differentiates through a backward)."""
    (grad,) = torch.autograd.grad(torch.tanh(h).pow(3).sum(), h, create_graph=True)
    return h + grad.square()


def _checkpointed(h: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda t: torch.tanh(t) * torch.softmax(t, -1), h, use_reentrant=False)


def _rotate_resample(t: torch.Tensor) -> torch.Tensor:
    """``t [B, C, T, T]`` resampled on a slightly rotated and shifted grid (a spatial transformer)."""
    theta = torch.tensor([[0.9, -0.2, 0.1], [0.2, 0.9, -0.05]]).expand(t.shape[0], 2, 3)
    return F.grid_sample(t, F.affine_grid(theta, list(t.shape), align_corners=False), align_corners=False)


def _unfold_fold(t: torch.Tensor) -> torch.Tensor:
    """``t [B, C, T, T]``: 3x3 patches (``F.unfold``), weighted by position, summed back (``F.fold``)."""
    patches = F.unfold(t, 3, padding=1)
    weights = torch.linspace(0.5, 1.5, patches.shape[1])[:, None]
    return F.fold(patches * weights, t.shape[-2:], 3, padding=1)


ACTIVATIONS = [
    ("F.relu", F.relu),
    ("F.gelu", F.gelu),
    ("F.gelu(approximate='tanh')", lambda h: F.gelu(h, approximate="tanh")),
    ("F.silu", F.silu),
    ("torch.tanh", torch.tanh),
    ("torch.sigmoid", torch.sigmoid),
    ("F.softplus", F.softplus),
    ("F.leaky_relu(0.1)", lambda h: F.leaky_relu(h, 0.1)),
    ("F.elu", F.elu),
    ("F.hardtanh(-0.5, 0.5)", lambda h: F.hardtanh(h, -0.5, 0.5)),
]

OPS = [Case(name, "op", _pointwise(fn), tp=True) for name, fn in ACTIVATIONS] + [
    # softmax family over the hidden dim, the time dim and the batch dim
    Case("torch.softmax(dim=-1)", "op", _pointwise(lambda h: torch.softmax(h, -1)), tp=True),
    Case("F.log_softmax(dim=-1)", "op", _pointwise(lambda h: F.log_softmax(h, -1)), tp=True),
    Case("torch.logsumexp(dim=-1)", "op", _pointwise(lambda h: h * torch.logsumexp(h, -1, keepdim=True)), tp=True),
    Case("F.log_softmax(dim=1) over T of [B, T, H]", "op", _on_hidden(lambda h, b: F.log_softmax(h, 1), seq=True), tp=True),
    Case("torch.softmax(dim=0) over the batch", "op", _pointwise(lambda h: torch.softmax(h, 0))),
    Case("torch.logsumexp(dim=0) over the batch", "op", _pointwise(lambda h: h - torch.logsumexp(h, 0, keepdim=True))),
    # reductions
    Case("Tensor.sum(dim=-1)", "op", _pointwise(lambda h: h * torch.tanh(h.sum(-1, keepdim=True))), tp=True),
    Case("Tensor.mean(dim=-1)", "op", _pointwise(lambda h: h - h.mean(-1, keepdim=True)), tp=True),
    Case("Tensor.var(dim=-1)", "op", _pointwise(lambda h: h * h.var(-1, keepdim=True)), tp=True),
    Case("Tensor.std(dim=-1, correction=0)", "op", _pointwise(lambda h: h / (h.std(-1, correction=0, keepdim=True) + 1)), tp=True),
    Case("Tensor.norm(dim=-1)", "op", _pointwise(lambda h: h / h.norm(dim=-1, keepdim=True)), tp=True),
    Case("torch.linalg.vector_norm(ord=1, dim=-1)", "op", _pointwise(lambda h: h * torch.linalg.vector_norm(h, 1, dim=-1, keepdim=True)), tp=True),
    Case("Tensor.amax(dim=-1)", "op", _pointwise(lambda h: h * h.amax(-1, keepdim=True)), tp=True),
    Case("Tensor.max(dim=-1).values", "op", _pointwise(lambda h: h * h.max(-1, keepdim=True).values), tp=True),
    Case("Tensor.min(dim=-1).values", "op", _pointwise(lambda h: h * h.min(-1, keepdim=True).values), tp=True),
    Case("Tensor.median(dim=-1).values", "op", _pointwise(lambda h: h * h.median(-1, keepdim=True).values), tp=True),
    Case("Tensor.prod(dim=-1)", "op", _pointwise(lambda h: h * (1 + 0.1 * torch.tanh(h)).prod(-1, keepdim=True)), tp=True),
    Case("Tensor.mean(dim=0) over the batch", "op", _pointwise(lambda h: h - h.mean(0, keepdim=True))),
    Case("Tensor.var(dim=0) over the batch", "op", _pointwise(lambda h: h * h.var(0, keepdim=True))),
    Case("Tensor.amax(dim=0) over the batch", "op", _pointwise(lambda h: h * h.amax(0, keepdim=True))),
    Case("Tensor.sum() over all dims", "op", _pointwise(lambda h: h * torch.tanh(h.sum()))),
    Case("Tensor.std(dim=(0, 1)) of [B, T, H]", "op", _on_hidden(lambda h, b: h / h.std((0, 1), keepdim=True), seq=True), tp=True),
    Case("Tensor.mean(dim=(1, 2)) of [B, T, H]", "op", _on_hidden(lambda h, b: h - h.mean((1, 2), keepdim=True), seq=True), tp=True),
    # cumulative ops
    Case("torch.cumsum(dim=-1)", "op", _pointwise(lambda h: torch.cumsum(h, -1)), tp=True),
    Case("torch.cumsum(dim=1) over T of [B, T, H]", "op", _on_hidden(lambda h, b: torch.cumsum(h, 1), seq=True), tp=True),
    Case("torch.cumsum(dim=0) over the batch", "op", _pointwise(lambda h: torch.cumsum(h, 0))),
    Case("torch.cumprod(dim=-1)", "op", _pointwise(lambda h: torch.cumprod(1 + 0.1 * torch.tanh(h), -1)), tp=True),
    Case("torch.logcumsumexp(dim=-1)", "op", _pointwise(lambda h: torch.logcumsumexp(h, -1)), tp=True),
    Case("torch.cummax(dim=-1).values", "op", _pointwise(lambda h: torch.cummax(h, -1).values), tp=True),
    # einsum and matmuls
    Case("torch.einsum('bd,hd->bh' and 'bh,ch->bc')", "op", _einsum_head, tp=True),
    Case("torch.einsum('bth,bsh->bts') then 'bts,bsh->bth'", "op", _on_hidden(lambda h, b: torch.einsum("bts,bsh->bth", torch.einsum("bth,bsh->bts", h, h).softmax(-1), h), seq=True), tp=True),
    Case("torch.einsum('bh,bh->b') row-wise dot", "op", _pointwise(lambda h: h * torch.einsum("bh,bh->b", h, h)[:, None].add(1).rsqrt()), tp=True),
    Case("attention by hand: q @ k.mT, causal masked_fill, softmax, @ v", "op", _attention(_by_hand_attention), tp=True),
    # indexing
    Case("torch.gather(dim=-1, per-row permutation)", "op", _on_hidden(lambda h, b: torch.gather(h, -1, b["idx"]), extra=_hidden_perms), tp=True),
    Case("Tensor.scatter_add(dim=-1, per-row permutation)", "op", _on_hidden(lambda h, b: torch.zeros_like(h).scatter_add(-1, b["idx"], h), extra=_hidden_perms), tp=True),
    Case("Tensor.scatter(dim=-1, src, per-row permutation)", "op", _on_hidden(lambda h, b: torch.zeros_like(h).scatter(-1, b["idx"], torch.tanh(h)), extra=_hidden_perms), tp=True),
    Case("Tensor.index_select(-1, reversed range)", "op", _pointwise(lambda h: h.index_select(-1, torch.arange(h.shape[-1] - 1, -1, -1))), tp=True),
    Case("Tensor.index_add(-1, rolled range)", "op", _pointwise(lambda h: h.index_add(-1, torch.arange(h.shape[-1]).roll(1), torch.tanh(h))), tp=True),
    Case("h[:, index tensor] (advanced indexing)", "op", _pointwise(lambda h: h[:, torch.arange(h.shape[-1]).roll(-1)] * h), tp=True),
    Case("Tensor.index_select(0, ids) of a parameter table", "op", _param_rows),
    Case("Tensor.masked_fill(mask, 0.0)", "op", _on_hidden(lambda h, b: h.masked_fill(b["mask"], 0.0), extra=_hidden_mask), tp=True),
    Case("Tensor.masked_fill(~keep, -inf) then softmax", "op", _on_hidden(lambda h, b: torch.softmax(h.masked_fill(~b["keep"], float("-inf")), -1), extra=_hidden_keep), tp=True),
    Case("torch.where(mask, h, 0.1 * h)", "op", _on_hidden(lambda h, b: torch.where(b["mask"], h, 0.1 * h), extra=_hidden_mask), tp=True),
    Case("torch.where(h > 0, h, torch.expm1(h))", "op", _pointwise(lambda h: torch.where(h > 0, h, torch.expm1(h))), tp=True),
    Case("F.one_hot targets * log_softmax", "op", _one_hot_loss),
    Case("F.cosine_similarity", "op", _cosine_to_target),
    # shape ops on sharded dims
    Case("Tensor.reshape(B, 2, H // 2).transpose(1, 2).reshape(B, H)", "op", _pointwise(lambda h: torch.tanh(h).reshape(h.shape[0], 2, -1).transpose(1, 2).reshape(h.shape)), tp=True),
    Case("Tensor.unflatten(-1, (4, H // 4)), softmax across the 4 groups, flatten", "op", _pointwise(lambda h: h.unflatten(-1, (4, -1)).softmax(-2).flatten(1)), tp=True),
    Case("Tensor.reshape merging batch rows (swap row pairs)", "op", _pointwise(lambda h: torch.tanh(_swap_row_pairs(h)))),
    Case("Tensor.flatten(1) of [B, T, H]", "op", _on_hidden(lambda h, b: torch.tanh(h).flatten(1), seq=True, keeps_time=False, width=lambda s: s.T * s.H), tp=True),
    Case("Tensor.transpose(1, 2) of [B, T, H], Linear over T", "op", _mix_over_time, tp=True),
    Case("Tensor.unsqueeze(1).expand(-1, 2, -1).reshape(B, 2 * H)", "op", _on_hidden(lambda h, b: torch.tanh(h).unsqueeze(1).expand(-1, 2, -1).reshape(h.shape[0], -1) * torch.arange(2.0).repeat_interleave(h.shape[-1]).add(1), width=lambda s: 2 * s.H), tp=True),
    Case("Tensor.repeat(1, 2)", "op", _on_hidden(lambda h, b: torch.tanh(h.repeat(1, 2)), width=lambda s: 2 * s.H), tp=True),
    Case("Tensor.repeat_interleave(2, dim=-1)", "op", _on_hidden(lambda h, b: torch.tanh(h).repeat_interleave(2, -1), width=lambda s: 2 * s.H), tp=True),
    Case("Tensor.flip(-1)", "op", _pointwise(lambda h: h * torch.tanh(h).flip(-1)), tp=True),
    Case("torch.roll(1, dims=-1)", "op", _pointwise(lambda h: h * torch.roll(torch.tanh(h), 1, -1)), tp=True),
    Case("Tensor.flip(0) over the batch", "op", _pointwise(lambda h: h * torch.tanh(h).flip(0))),
    Case("h[:, ::2] strided slice", "op", _on_hidden(lambda h, b: torch.tanh(h[:, ::2]), width=_half, head="head"), tp=True),
    Case("h[:, H // 4 : 3 * H // 4] slice", "op", _on_hidden(lambda h, b: torch.tanh(h[:, h.shape[-1] // 4 : 3 * h.shape[-1] // 4]), width=_half, head="head"), tp=True),
    Case("F.pad(h, (2, 2))", "op", _on_hidden(lambda h, b: torch.tanh(F.pad(h, (2, 2), value=0.5)), width=lambda s: s.H + 4), tp=True),
    # joins and splits
    Case("torch.cat(dim=-1)", "op", _on_hidden(lambda h, b: torch.cat([h, torch.tanh(h)], -1), width=lambda s: 2 * s.H), tp=True),
    Case("torch.cat(dim=0) over the batch", "op", _pointwise(_cat_batch)),
    Case("torch.stack(dim=-1).flatten(1)", "op", _on_hidden(lambda h, b: torch.stack([h, torch.sigmoid(h)], -1).flatten(1), width=lambda s: 2 * s.H), tp=True),
    Case("Tensor.split(H // 2, dim=-1) gated", "op", _on_hidden(lambda h, b: (lambda a, g: a * torch.sigmoid(g))(*h.split(h.shape[-1] // 2, -1)), width=_half, head="head"), tp=True),
    Case("Tensor.chunk(2, dim=-1) swapped, cat", "op", _pointwise(lambda h: torch.cat(torch.tanh(h).chunk(2, -1)[::-1], -1) * h), tp=True),
    Case("F.glu(dim=-1)", "op", _on_hidden(lambda h, b: F.glu(h, -1), width=_half, head="head"), tp=True),
    Case("torch.unbind(dim=1) of [B, T, H], summed", "op", _on_hidden(lambda h, b: sum(torch.tanh(t) * (i + 1) for i, t in enumerate(h.unbind(1))), seq=True, keeps_time=False), tp=True),
    # pointwise math
    Case("torch.clamp(-0.5, 0.5)", "op", _pointwise(lambda h: torch.clamp(h, -0.5, 0.5)), tp=True),
    Case("torch.abs", "op", _pointwise(torch.abs), tp=True),
    Case("torch.pow(h, 3)", "op", _pointwise(lambda h: torch.pow(h, 3)), tp=True),
    Case("(|h| + 1) ** 1.5", "op", _pointwise(lambda h: (h.abs() + 1) ** 1.5), tp=True),
    Case("torch.exp", "op", _pointwise(lambda h: torch.exp(0.5 * h)), tp=True),
    Case("torch.log(1 + h * h)", "op", _pointwise(lambda h: torch.log(1 + h * h)), tp=True),
    Case("torch.sqrt and torch.rsqrt", "op", _pointwise(lambda h: torch.sqrt(h * h + 1) * torch.rsqrt(h * h + 2)), tp=True),
    Case("h / (1 + |h|) (division)", "op", _pointwise(lambda h: h / (1 + h.abs())), tp=True),
    Case("torch.maximum(h, 0.3 * h)", "op", _pointwise(lambda h: torch.maximum(h, 0.3 * h)), tp=True),
    Case("F.normalize(dim=-1)", "op", _pointwise(lambda h: F.normalize(h, dim=-1)), tp=True),
    # order statistics
    Case("torch.topk(k=H // 2, dim=-1).values", "op", _on_hidden(lambda h, b: torch.topk(h, h.shape[-1] // 2, -1).values, width=_half, head="head"), tp=True),
    Case("torch.sort(dim=-1).values", "op", _pointwise(lambda h: torch.sort(h, -1).values), tp=True),
    Case("torch.sort(dim=0, descending=True).values over the batch", "op", _pointwise(lambda h: torch.sort(h, 0, descending=True).values)),
    Case("torch.cdist(h, h) @ h over the batch", "op", _pointwise(lambda h: torch.cdist(h, h) @ h / h.shape[0])),
    Case("Tensor.scatter_reduce('amax', per-row permutation)", "op", _on_hidden(lambda h, b: torch.zeros_like(h).scatter_reduce(-1, b["idx"], h, "amax", include_self=False), extra=_hidden_perms), tp=True),
    # Fourier transforms and complex numbers (FNet's token mixing, Llama's complex rotary embedding)
    Case("torch.fft.rfft(dim=-1).abs()", "op", _on_hidden(lambda h, b: torch.fft.rfft(h, dim=-1).abs(), width=lambda s: s.H // 2 + 1, head="head"), tp=True),
    Case("torch.fft.fft over H then T, real part (FNet)", "op", _on_hidden(lambda h, b: torch.fft.fft(torch.fft.fft(h, dim=-1), dim=1).real, seq=True), tp=True),
    Case("view_as_complex(h) * polar(1, angles), view_as_real (complex RoPE)", "op", _on_hidden(_complex_rope, seq=True), tp=True),
    # sampling (keyed by state.rng): REINFORCE-style estimators, sampled softmax
    Case("torch.gather(h, torch.multinomial(softmax(h), H // 2, replacement=True))", "op", _on_hidden(lambda h, b: torch.gather(h, -1, torch.multinomial(torch.softmax(h.detach(), -1), h.shape[-1] // 2, replacement=True)), width=_half, head="head"), tp=True),
    Case("torch.gather(h, torch.multinomial(softmax(h), H // 2)) without replacement", "op", _on_hidden(lambda h, b: torch.gather(h, -1, torch.multinomial(torch.softmax(h.detach(), -1), h.shape[-1] // 2)), width=_half, head="head"), tp=True),
    Case("mixup: Beta(0.4, 0.4) weight, rows of h shuffled by torch.randperm(B)", "op", _pointwise(_mixup), tp=True),
    Case("F.rrelu(training=True)", "op", _pointwise(lambda h: F.rrelu(h, training=True)), tp=True),
    Case("Poisson shot noise: h * torch.poisson(rate) / rate, rate = 4 abs(h) + 1", "op", _pointwise(_shot_noise), tp=True),
    Case("binomial thinning: h * Binomial(20, 0.75).sample() / 15", "op", _pointwise(lambda h: h * torch.distributions.Binomial(torch.full_like(h, 20.0), probs=torch.full_like(h, 0.75)).sample() / 15), tp=True),
    # autograd inside the loss: a user's autograd.Function, activation checkpointing, a
    # gradient penalty (double backward), torch.func's per-row gradients
    Case("a user's torch.autograd.Function (straight-through rounding)", "op", _pointwise(lambda h: _RoundStraightThrough.apply(h) + 0.1 * h), tp=True),
    Case("torch.utils.checkpoint(tanh(h) * softmax(h), use_reentrant=False)", "op", _pointwise(_checkpointed), tp=True),
    Case("torch.autograd.grad(create_graph=True) gradient penalty", "op", _pointwise(_gradient_penalty), tp=True),
    Case("torch.func.vmap(torch.func.grad(logsumexp)) per-row gradients", "op", _pointwise(lambda h: torch.func.vmap(torch.func.grad(lambda r: torch.logsumexp(r, 0)))(h) * h), tp=True),
    # resampling and patches (spatial transformers, hand-written convolutions)
    Case("F.grid_sample(F.affine_grid(rotation))", "op", _pool2d(_rotate_resample), tp=True),
    Case("F.unfold(3, padding=1) then F.fold", "op", _pool2d(_unfold_fold), tp=True),
]  # fmt: skip


CASES: list[Case] = LOSSES + LAYERS + OPS

_BY_NAME = {case.name: case for case in CASES}
assert len(_BY_NAME) == len(CASES), "case names must be unique"


def by_name(name: str) -> Case:
    """The case called ``name``; ``KeyError`` naming close names if none is."""
    try:
        return _BY_NAME[name]
    except KeyError:
        close = [n for n in _BY_NAME if name.lower() in n.lower()]
        raise KeyError(f"no op corpus case named {name!r}; cases containing it: {close}") from None
