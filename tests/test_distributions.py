"""``torch.distributions`` in a loss: log-probabilities, entropies and KL terms train as in eager
PyTorch, reparametrized samples draw from the step's key, and the distributions' default value
checks (which read values on the host) are off only while a step is traced."""

import copy

import pytest
import torch
from torch import distributions as D
from torch import nn

import fsg


class _Policy(nn.Module):  # a policy-gradient loss: -log pi(a|s) * advantage - entropy bonus
    def __init__(self):
        super().__init__()
        self.logits, self.mean = nn.Linear(4, 3), nn.Linear(4, 2)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs, action, cont, advantage):
        discrete = D.Categorical(logits=self.logits(obs))
        gauss = D.Independent(D.Normal(self.mean(obs), self.log_std.exp()), 1)
        logp = discrete.log_prob(action) + gauss.log_prob(cont)
        return -(logp * advantage).mean() - 0.01 * (discrete.entropy() + gauss.entropy()).mean()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_log_probs_entropies_train_as_eager_pytorch(backend):
    torch.manual_seed(0)
    model = _Policy()
    reference = copy.deepcopy(model)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, **b), optimizer=fsg.optim.adam(1e-2), backend=backend)
    state = step.init(fsg.params(model))
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        batch = {"obs": torch.randn(16, 4, generator=g), "action": torch.randint(0, 3, (16,), generator=g),
                 "cont": torch.randn(16, 2, generator=g), "advantage": torch.randn(16, generator=g)}  # fmt: skip
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = reference(**batch)
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(4, 8)

    def forward(self, x):
        mu, log_std = self.enc(x).chunk(2, -1)
        posterior = D.Normal(mu, log_std.exp())
        reconstruction = D.Normal(self.dec(posterior.rsample()), 1.0).log_prob(x).sum(-1)
        return (D.kl_divergence(posterior, D.Normal(torch.zeros_like(mu), 1.0)).sum(-1) - reconstruction).mean()


def test_a_vae_draws_from_the_steps_key_and_learns():
    """``rsample`` draws from ``state.rng``: two steps from the same state draw the same, and
    the negative ELBO falls."""
    torch.manual_seed(0)
    model = _VAE()
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b), optimizer=fsg.optim.adam(1e-2), backend="eager", donate=False)
    state = step.init(fsg.params(model), seed=3)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    _, first = step(state, x)
    _, again = step(state, x)
    assert torch.equal(first["loss"], again["loss"])
    losses = []
    for _ in range(60):
        state, metrics = step(state, x)
        losses.append(metrics["loss"].item())
    assert sum(losses[-10:]) < sum(losses[:10])


@pytest.mark.parametrize("default", [True, False])
def test_the_default_value_checks_come_back_after_the_trace(default):
    saved = D.Distribution._validate_args
    D.Distribution.set_default_validate_args(default)
    try:
        model = _VAE()
        step = fsg.compile_step(lambda p, b: fsg.apply(model, p, b), optimizer=fsg.optim.adam(1e-2), backend="eager")
        step(step.init(fsg.params(model)), torch.randn(4, 8))  # traced with the checks off
        assert D.Distribution._validate_args is default
        if default:
            with pytest.raises(ValueError, match="scale"):
                D.Normal(torch.zeros(2), -torch.ones(2))  # eager: still checked
    finally:
        D.Distribution.set_default_validate_args(saved)
