"""``torch.multinomial`` (and ``Categorical.sample()``, which calls it) keyed by ``state.rng``:
categories drawn in proportion to their weights, never one of weight 0; without replacement,
distinct categories; reproducible from the key, new at each step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributions as D

import fsg
from fsg._src.trace import random as keyed


def draw(fn, seed=0, counter=0):
    with keyed.Keyed(torch.tensor([seed, counter])):
        return fn()


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0]), min_size=2, max_size=6).filter(lambda w: sum(w) > 0),
       st.integers(0, 2**31 - 1))  # fmt: skip
def test_with_replacement_frequencies_follow_the_weights(weights, seed):
    w = torch.tensor(weights)
    n = 1 << 16
    samples = draw(lambda: torch.multinomial(w, n, replacement=True), seed)
    assert samples.shape == (n,) and samples.dtype == torch.int64
    freq = torch.bincount(samples, minlength=len(weights)).double() / n
    p = w.double() / w.sum()
    assert torch.all(freq[p == 0] == 0)  # a category of weight 0 is never drawn
    assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9)  # 5 sigma


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**31 - 1), st.data())
def test_without_replacement_draws_distinct_categories_of_positive_weight(n, seed, data):
    w = torch.rand(4, n, generator=torch.Generator().manual_seed(seed)) + 0.01
    w[:, 0] = 0.0
    k = data.draw(st.integers(1, n - 1))
    samples = draw(lambda: torch.multinomial(w, k), seed)
    assert samples.shape == (4, k)
    for row in samples:
        assert len(set(row.tolist())) == k and 0 not in row.tolist()


def test_the_first_of_sequential_draws_without_replacement_follows_the_weights():
    """Gumbel top-k: the first index is a draw from the weights (later ones condition on it)."""
    w = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(1 << 15, 4)
    first = draw(lambda: torch.multinomial(w, 2)[:, 0])
    freq = torch.bincount(first, minlength=4).double() / first.numel()
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.015)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_categorical_sample_in_a_step_is_keyed(backend):
    """``Categorical.sample()`` in a loss (a REINFORCE-style estimator): the same state draws the
    same, the next step draws anew, eager and Inductor draw alike."""
    def loss_fn(params, obs):
        dist = D.Categorical(logits=obs @ params["w"])
        action = dist.sample()
        return -(dist.log_prob(action)).mean(), {"action": action}

    draws = {}
    for b in ("eager", backend):
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend=b, donate=False)
        state = step.init({"w": torch.randn(4, 5, generator=torch.Generator().manual_seed(0))}, seed=7)
        obs = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
        _, first = step(state, obs)
        _, again = step(state, obs)
        assert torch.equal(first["action"], again["action"])
        state, _ = step(state, obs)
        _, later = step(state, obs)
        assert not torch.equal(first["action"], later["action"])
        draws[b] = first["action"]
    assert torch.equal(draws["eager"], draws[backend])
