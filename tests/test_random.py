"""Random ops in the step are keyed by ``state.rng`` (issue 21): a seed reproduces a run, the
counter gives each step new masks, a checkpoint resumes a run bit for bit, and ops fsg cannot
key raise a clear error. The generator itself is checked statistically on a few million draws.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import fsg
from fsg._src.trace import random as keyed
from tests.helpers import regression_batch

N = 1 << 22  # draws per statistical check: sampling errors ~5e-4, tolerances 5 sigma


def draw(fn, seed=0, counter=0):
    """``fn()`` with its random ops keyed by ``(seed, counter)``, on real tensors."""
    with keyed.Keyed(torch.tensor([seed, counter])):
        return fn()


# ---- the generator ----------------------------------------------------------------------


def test_uniforms_have_the_moments_and_no_correlation():
    u = draw(lambda: torch.rand(N)).double()
    tol = 5 / math.sqrt(N)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < tol * math.sqrt(1 / 12)
    assert abs(float(u.var()) - 1 / 12) < tol * math.sqrt(1 / 180)  # the variance of (u - 1/2)**2
    counts = torch.bincount((u * 256).long(), minlength=256).double()  # chi-square, 255 dof
    chi2 = float(((counts - N / 256) ** 2 / (N / 256)).sum())
    assert chi2 < 255 + 5 * math.sqrt(2 * 255)
    centered = u - 0.5
    for lag in (1, 2, 31, 32):  # neighbours in a row, and a row apart
        r = float((centered[:-lag] * centered[lag:]).mean() / centered.var())
        assert abs(r) < tol, (lag, r)
    # consecutive steps, and the next op of the same step, draw unrelated values
    next_step = draw(lambda: torch.rand(N), counter=1) - 0.5
    second_op = draw(lambda: (torch.rand(1), torch.rand(N))[1]) - 0.5
    for other in (next_step, second_op):
        assert abs(float((centered * other).mean() / centered.var())) < tol


def test_normals_have_mean_zero_std_one_and_gaussian_tails():
    n = draw(lambda: torch.randn(N))
    tol = 5 / math.sqrt(N)
    assert abs(float(n.mean())) < tol
    assert abs(float(n.std()) - 1) < tol / math.sqrt(2)
    assert abs(float((n**4).mean()) - 3) < tol * math.sqrt(96)  # the kurtosis
    assert abs(float((n.abs() > 1.96).double().mean()) - 0.05) < tol * math.sqrt(0.05 * 0.95)
    assert abs(float((n[:-1] * n[1:]).mean())) < tol


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_minus_p_and_scales(p):
    out = draw(lambda: F.dropout(torch.ones(N), p, training=True))
    kept = out != 0
    assert abs(float(kept.double().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / N)
    assert torch.allclose(out[kept], torch.tensor(1 / (1 - p)))
    k = kept.double() - (1 - p)
    assert abs(float((k[:-1] * k[1:]).mean() / k.var())) < 5 / math.sqrt(N)


def test_distributions_have_their_means():
    tol = 5 / math.sqrt(N)
    e = draw(lambda: torch.empty(N).exponential_(2.0))
    assert abs(float(e.mean()) - 0.5) < tol * 0.5 and float(e.min()) >= 0
    b = draw(lambda: torch.bernoulli(torch.full((N,), 0.3)))
    assert abs(float(b.mean()) - 0.3) < tol * math.sqrt(0.21)
    i = draw(lambda: torch.randint(-3, 7, (N,)))
    assert int(i.min()) == -3 and int(i.max()) == 6 and abs(float(i.double().mean()) - 1.5) < tol * 3
    counts = torch.bincount(i + 3, minlength=10).double()
    assert float(((counts - N / 10) ** 2 / (N / 10)).sum()) < 9 + 5 * math.sqrt(18)


SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)
FLOATS = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@given(shape=SHAPES, dtype=FLOATS, seed=st.integers(0, 2**62), counter=st.integers(0, 2**40))
def test_draws_have_the_asked_shape_dtype_and_range_and_are_pure(shape, dtype, seed, counter):
    def ops():
        x = torch.zeros(shape, dtype=dtype)
        return (
            torch.rand(shape, dtype=dtype),
            torch.randn_like(x),
            torch.bernoulli(torch.full(shape, 0.5, dtype=dtype)),
            torch.randint(2, 5, shape),
            x.clone().uniform_(-1, 1),
            torch.native_dropout(x + 1, 0.5, True)[0],
        )

    first, again = draw(ops, seed, counter), draw(ops, seed, counter)
    for a, b in zip(first, again):
        assert a.shape == shape and torch.equal(a, b)  # a pure function of (key, call, index)
    u, n, b, i, v, d = first
    assert u.dtype == dtype and n.dtype == dtype and i.dtype == torch.int64
    assert bool(((u >= 0) & (u < 1)).all()) and bool(n.isfinite().all())
    assert bool(((b == 0) | (b == 1)).all()) and bool(((i >= 2) & (i < 5)).all())
    assert bool(((v >= -1) & (v <= 1)).all()) and bool(((d == 0) | (d == 2)).all())


@given(shape=SHAPES.filter(lambda s: math.prod(s) >= 64), seed=st.integers(0, 2**62))
def test_values_depend_on_the_global_index_only_and_dtypes_agree(shape, seed):
    """The same key and call draw element i alike whatever the shape: a sharded step slices
    the tensor the unsharded step draws. float64 agrees with float32 to its 24 bits, so a
    float64 check of a step (fsg.testing.verify_step) sees the same masks."""
    flat = draw(lambda: torch.rand(math.prod(shape)), seed)
    assert torch.equal(draw(lambda: torch.rand(shape), seed).flatten(), flat)
    wide = draw(lambda: torch.rand(shape, dtype=torch.float64), seed).flatten()
    assert float((wide - flat.double()).abs().max()) < 2**-24
    normal64 = draw(lambda: torch.randn(shape, dtype=torch.float64), seed)
    assert torch.allclose(normal64.float(), draw(lambda: torch.randn(shape), seed), atol=1e-5)
    assert not torch.equal(draw(lambda: torch.rand(shape), seed, counter=1).flatten(), flat)


# ---- the compiled step ----------------------------------------------------------------


def _model(p=0.3):
    with torch.random.fork_rng():  # the same weights, and torch's global generator left as it was
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 4))


def _loss(model):
    def loss_fn(params, batch):
        out = fsg.apply(model, params, batch["x"])
        # a fingerprint of this microbatch's mask, signed by the batch (see the accumulation test)
        mark = (F.dropout(torch.ones(64), 0.5) * torch.arange(64.0)).sum() * batch["sign"].mean()
        return ((out - batch["y"]) ** 2).mean(), {"mask": mark}

    return loss_fn


def _batch(n=16):
    return {**regression_batch(n=n), "sign": torch.ones(n)}


def _state(seed=0):
    return fsg.compile_step(_loss(_model()), optimizer=fsg.optim.sgd(0.1)).init(fsg.params(_model()), seed=seed)


def _run(seed=0, steps=5, state=None, step=None, **options):
    options = {"optimizer": fsg.optim.adamw(1e-2), "backend": "eager", **options}
    model = _model()
    step = step or fsg.compile_step(_loss(model), **options)
    state = step.init(fsg.params(model), seed=seed) if state is None else state
    losses, marks = [], []
    for _ in range(steps):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
        marks.append(float(metrics["mask"]))
    return losses, marks, state


def test_a_seed_reproduces_a_run_and_each_step_draws_new_masks():
    losses, marks, state = _run(seed=0)
    again, _, _ = _run(seed=0)
    other, _, _ = _run(seed=1)
    assert losses == again
    assert losses != other
    assert len(set(marks)) == len(marks)  # a new mask every step, same graph
    assert state.rng.tolist() == [0, 5]


def test_donation_does_not_change_the_draws():
    donated, _, _ = _run(seed=3, steps=3)
    kept, _, _ = _run(seed=3, steps=3, donate=False)
    assert donated == kept


def test_a_restored_checkpoint_continues_bit_for_bit(tmp_path):
    uninterrupted, _, _ = _run(seed=7, steps=5)
    first, _, state = _run(seed=7, steps=2)
    fsg.checkpoint.save(tmp_path / "ckpt", state)
    step = fsg.compile_step(_loss(_model()), optimizer=fsg.optim.adamw(1e-2), backend="eager")
    like = step.init(fsg.params(_model()), seed=123)  # the seed comes back from the checkpoint
    restored = fsg.checkpoint.restore(tmp_path / "ckpt", like)
    assert restored.rng.tolist() == [7, 2]
    rest, _, _ = _run(steps=3, state=restored, step=step)
    assert first + rest == uninterrupted


def test_each_microbatch_draws_its_own_masks():
    model = _model()
    step = fsg.compile_step(_loss(model), optimizer=fsg.optim.adamw(1e-2), backend="eager", accum_steps=2)
    state = step.init(fsg.params(model))
    batch = _batch()
    batch["sign"] = torch.tensor([1.0, -1.0]).repeat(8)  # microbatch 0 takes the +1 rows
    _, metrics = step(state, batch)
    # the mean of +f0 and -f1: zero only if both microbatches drew the same mask
    assert float(metrics["mask"]) != 0
    losses, _, _ = _run(seed=2, steps=3, accum_steps=2)
    assert losses == _run(seed=2, steps=3, accum_steps=2)[0]


def test_the_backward_uses_the_forwards_mask():
    """SGD on ``sum(dropout(w))`` from w = 1: the loss counts the kept elements times the scale,
    and the update subtracts lr * scale from exactly those (both dropout paths: CPU's
    bernoulli_ and native_dropout, what CUDA traces)."""
    for dropout in (lambda w: F.dropout(w, 0.5), lambda w: torch.native_dropout(w, 0.5, True)[0]):
        step = fsg.compile_step(
            lambda params, batch, d=dropout: d(params["w"]).sum() * batch.mean(),
            optimizer=fsg.optim.sgd(0.1), backend="eager",
        )  # fmt: skip
        state = step.init({"w": torch.ones(1000)})
        new, metrics = step(state, torch.ones(2))
        touched = new.params["w"] != 1
        assert torch.allclose(new.params["w"][touched], torch.tensor(1 - 0.1 * 2))
        assert float(metrics["loss"]) == 2 * int(touched.sum())


def test_attention_dropout_runs_the_math_attention_keyed():
    """The fused attention kernels (CUDA) draw their dropout inside: attention with dropout runs
    its math, whatever backend the loss asked for (on CPU, flash with dropout has no kernel)."""

    def loss_fn(params, batch):
        q = (batch @ params["w"]).unflatten(-1, (2, 8)).transpose(1, 2)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.2).square().mean()

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager", donate=False)
    state = step.init({"w": torch.eye(16)}, seed=1)
    batch = torch.linspace(-1, 1, 2 * 4 * 16).reshape(2, 4, 16)
    first, second = step(state, batch)[1]["loss"], step(state, batch)[1]["loss"]
    assert torch.equal(first, second) and not torch.equal(
        first, step(state._replace(rng=torch.tensor([2, 0])), batch)[1]["loss"]
    )


def test_inductor_draws_what_eager_draws():
    eager, _, _ = _run(seed=4, steps=2)
    compiled, _, _ = _run(seed=4, steps=2, backend="inductor")
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_the_element_index_is_xored_with_the_key_before_any_multiplication():
    """Inductor (torch 2.11) folds ``arange * constant`` into an index expression that it
    computes in int32 for small tensors: wrong masks on CPU, a Triton compile error on CUDA
    (seen on an H200). The index's only readers must be xors with the key."""
    gm = fsg._src.trace.tracing.trace(_loss(_model()), fsg.optim.sgd(0.1), _state(), _batch(), donate=True)
    nodes = gm.graph_module.graph.nodes
    aranges = [n for n in nodes if "arange" in str(n.target) and n.meta["val"].dtype == torch.int64]
    assert aranges and all(str(u.target) == "aten.bitwise_xor.Tensor" for n in aranges for u in n.users)


def test_a_step_without_random_ops_has_no_key_math():
    step = fsg.compile_step(_loss(_model(0.0)), optimizer=fsg.optim.sgd(0.1), backend="eager")
    model = _model(0.0)
    text = step.lower(step.init(fsg.params(model)), _batch()).as_text("traced")
    assert "bitwise" in text  # the fingerprint's dropout is keyed
    plain = fsg.compile_step(
        lambda params, batch: F.dropout(params["w"], 0.5, training=False).sum() + batch.sum(),
        optimizer=fsg.optim.sgd(0.1), backend="eager",
    )  # fmt: skip
    state = plain.init({"w": torch.ones(4)})
    assert "bitwise" not in plain.lower(state, torch.ones(2)).as_text("traced")


@pytest.mark.parametrize(
    "op, match",
    [
        (lambda x: x * torch.rand(4, generator=torch.Generator()), r"aten\.rand\.generator at File .*test_random\.py.*explicit generator="),
        (lambda x: x * torch.poisson(x.abs() + 1, generator=torch.Generator()).sum(), r"aten\.poisson.*explicit generator="),
    ],
)
def test_random_ops_without_a_keyed_version_raise_naming_the_op_and_line(op, match):
    step = fsg.compile_step(lambda params, batch: op(params["w"] * batch).sum(), optimizer=fsg.optim.sgd(0.1))
    state = step.init({"w": torch.ones(4)})
    with pytest.raises(fsg.UnsupportedError, match=match):
        step(state, torch.ones(4))


def test_the_call_count_lives_in_torchs_generator_seeding_repeats_draws_as_torch_does():
    """The keyed mode counts its calls in torch's CPU generator (restored when it exits): what
    torch.utils.checkpoint saves and restores around a rerun. So a loss that seeds torch itself
    draws again what it drew after the same seed (Reformer reseeds to redo its dropout), two
    seeds give unrelated streams, and the user's generator is untouched afterwards."""
    torch.manual_seed(123)
    before = torch.get_rng_state()

    def seeded():
        torch.manual_seed(5)
        a = torch.rand(1000)
        b = torch.rand(1000)
        torch.manual_seed(5)
        again = torch.rand(1000)
        torch.manual_seed(6)
        other = torch.rand(1000)
        return a, b, again, other

    a, b, again, other = draw(seeded)
    assert torch.equal(a, again) and not torch.equal(a, b)
    assert float((a - other).abs().mean()) > 0.1 and float((b - other).abs().mean()) > 0.1  # no shifted copy
    assert torch.equal(torch.get_rng_state(), before)
