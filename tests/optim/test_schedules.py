"""Schedules are pure tensor functions of the count, equal to their closed forms."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg


@given(st.integers(0, 2000))
def test_warmup_cosine_closed_form(t):
    peak, warmup, total = 3e-4, 100, 1000
    s = fsg.optim.warmup_cosine(peak, warmup=warmup, total=total)
    if t < warmup:
        expected = peak * t / warmup
    else:
        frac = min((t - warmup) / (total - warmup), 1.0)
        expected = peak * 0.5 * (1 + math.cos(math.pi * frac))
    assert float(s(torch.tensor(t, dtype=torch.int32))) == pytest.approx(expected, rel=1e-5, abs=1e-9)


@given(st.integers(0, 500))
def test_linear_and_cosine_closed_forms(t):
    assert float(fsg.optim.linear(1.0, 0.0, 200, transition_begin=50)(t)) == pytest.approx(
        1.0 - min(max(t - 50, 0) / 200, 1.0), abs=1e-6
    )
    assert float(fsg.optim.cosine(2.0, 300, alpha=0.1)(t)) == pytest.approx(
        2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(t / 300, 1.0))) + 0.1), rel=1e-5
    )


def test_piecewise_and_constant():
    s = fsg.optim.piecewise(1.0, {10: 0.5, 20: 0.1})
    assert [float(s(t)) for t in (0, 9, 10, 19, 20, 100)] == pytest.approx([1, 1, 0.5, 0.5, 0.05, 0.05])
    assert float(fsg.optim.constant(0.25)(torch.tensor(123))) == 0.25


def test_schedules_return_float32_0d_tensors():
    count = torch.tensor(5, dtype=torch.int32)
    for s in (
        fsg.optim.constant(1.0),
        fsg.optim.linear(1.0, 0.0, 10),
        fsg.optim.cosine(1.0, 10),
        fsg.optim.warmup_cosine(1.0, warmup=2, total=10),
        fsg.optim.piecewise(1.0, {3: 0.1}),
    ):
        value = s(count)
        assert value.dtype == torch.float32 and value.dim() == 0


def test_bad_schedule_arguments_are_refused():
    with pytest.raises(ValueError, match="warmup < total"):
        fsg.optim.warmup_cosine(1.0, warmup=10, total=10)
    with pytest.raises(ValueError, match="transition_steps must be positive"):
        fsg.optim.linear(1.0, 0.0, 0)
