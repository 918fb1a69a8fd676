"""torch.nn.functional's losses inside a compiled step: the step's loss and gradients equal
eager PyTorch's, the targets in the batch or closed over as constants (a tensor computed from
constants alone and written in place inside torch's own loss code must be functionalized like
any other: ``cross_entropy`` with a class weight, label smoothing and an ignore index did so);
a loss whose torch code needs values on the host, or whose output shape depends on the data,
is refused with an error that names it (``F.gaussian_nll_loss`` traces as fsg's stand-in)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg

N, C = 8, 12


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (N,), generator=g)
    y[seed % N] = -100
    return {
        "x": torch.randn(N, 16, generator=g), "y": y, "w": torch.rand(C, generator=g) + 0.5,
        "p": torch.softmax(torch.randn(N, C, generator=g), -1),
    }  # fmt: skip


LOSSES = {
    "cross_entropy, weight, smoothing, ignore": lambda o, d: F.cross_entropy(
        o, d["y"], weight=d["w"], label_smoothing=0.2, ignore_index=-100),  # fmt: skip
    "cross_entropy, smoothing, ignore": lambda o, d: F.cross_entropy(o, d["y"], label_smoothing=0.1),
    "cross_entropy, weight, sum": lambda o, d: F.cross_entropy(o, d["y"].clamp_min(0), weight=d["w"], reduction="sum"),
    "cross_entropy, probabilities": lambda o, d: F.cross_entropy(o, d["p"], label_smoothing=0.1),
    "nll_loss, weight": lambda o, d: F.nll_loss(F.log_softmax(o, -1), d["y"].clamp_min(0), weight=d["w"]),
    "kl_div": lambda o, d: F.kl_div(F.log_softmax(o, -1), d["p"], reduction="batchmean"),
    "bce_with_logits, pos_weight": lambda o, d: F.binary_cross_entropy_with_logits(o, (d["p"] > 0.1).float(),
                                                                                    pos_weight=d["w"]),  # fmt: skip
    "huber": lambda o, d: F.huber_loss(o, d["p"], delta=0.05),
    "smooth_l1": lambda o, d: F.smooth_l1_loss(o, d["p"], beta=0.05),
    "multi_margin": lambda o, d: F.multi_margin_loss(o, d["y"].clamp_min(0), weight=d["w"]),
    "multilabel_soft_margin": lambda o, d: F.multilabel_soft_margin_loss(o, (d["p"] > 0.1).float()),
    "poisson_nll": lambda o, d: F.poisson_nll_loss(o, d["p"] * 3),
    "cosine_embedding": lambda o, d: F.cosine_embedding_loss(o, d["p"], torch.where(d["y"] > 3, 1, -1)),
    "margin_ranking": lambda o, d: F.margin_ranking_loss(o[:, 0], o[:, 1], torch.where(d["y"] > 3, 1.0, -1.0)),
    "triplet_margin": lambda o, d: F.triplet_margin_loss(o[:4], o[4:], o.flip(0)[:4]),
    # torch reads var on the host (a negative entry raises); fsg traces a stand-in (stand_ins.py)
    "gaussian_nll, heteroscedastic": lambda o, d: F.gaussian_nll_loss(o, d["p"], F.softplus(o) + d["p"]),
    "gaussian_nll, a variance per row, full, sum": lambda o, d: F.gaussian_nll_loss(
        o, d["p"], d["w"][:N] * o[:, 0].exp(), full=True, reduction="sum"),  # fmt: skip
    "GaussianNLLLoss, broadcast variance": lambda o, d: torch.nn.GaussianNLLLoss(eps=1e-3)(o, d["p"], d["p"][:, :1]),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@settings(max_examples=4, deadline=None)
@given(constants=st.booleans(), seed=st.integers(0, 99))
def test_a_loss_steps_as_eager_pytorch(name, constants, seed):
    torch.manual_seed(seed)
    layer, data, loss = torch.nn.Linear(16, C), _data(seed), LOSSES[name]

    def loss_fn(params, batch):
        return loss(fsg.apply(layer, params, batch["x"]), data if constants else batch)

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0), backend="eager")
    state = step.init(fsg.params(layer))
    before = {k: v.clone() for k, v in state.params.items()}
    state, metrics = step(state, data)
    want = loss(layer(data["x"]), data)
    want.backward()
    torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-5, atol=1e-6)
    for name_, p in layer.named_parameters():
        torch.testing.assert_close(before[name_] - state.params[name_], p.grad, rtol=1e-5, atol=1e-6, msg=name_)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cross_entropy_with_weight_smoothing_and_ignore_index_on_constants(backend):
    """The case that failed stage 1's invariant (its gathered weights filled in place)."""
    torch.manual_seed(0)
    layer, data = torch.nn.Linear(16, C), _data(1)
    loss = LOSSES["cross_entropy, weight, smoothing, ignore"]
    step = fsg.compile_step(lambda p, b: loss(fsg.apply(layer, p, b["x"]), data), optimizer=fsg.optim.sgd(1.0),
                            backend=backend)  # fmt: skip
    _, metrics = step(step.init(fsg.params(layer)), {"x": data["x"]})
    torch.testing.assert_close(metrics["loss"], loss(layer(data["x"]), data).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("loss", "error", "says"),
    [
        (lambda o, d: torch.distributions.Normal(o, o.exp(), validate_args=True).log_prob(d["p"]).mean(),
         fsg.HostSyncError, "(inside torch.distributions.normal.__init__)"),
        (lambda o, d: F.ctc_loss(F.log_softmax(o.reshape(2, 4, C).transpose(0, 1), -1), d["y"].clamp_min(1)[:4].view(2, 2),
                                 torch.tensor([4, 4]), torch.tensor([2, 2])), fsg.UnsupportedError, "_ctc_loss"),
    ],
)  # fmt: skip
def test_a_loss_that_needs_the_data_on_the_host_is_refused_by_name(loss, error, says):
    layer, data = torch.nn.Linear(16, C), _data(0)
    step = fsg.compile_step(lambda p, b: loss(fsg.apply(layer, p, b["x"]), b), optimizer=fsg.optim.sgd(1.0),
                            backend="eager")  # fmt: skip
    with pytest.raises(error) as info:
        step(step.init(fsg.params(layer)), data)
    assert says in str(info.value) and "test_losses.py" in str(info.value)
