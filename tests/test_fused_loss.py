"""A cross-entropy of a linear layer's logits traced as ``linear_cross_entropy``
(``fsg/_src/trace/fused_loss.py``): rewritten exactly where the rewrite computes the same
loss and gradients, left as written everywhere else, over hypothesis-drawn chains of the ops
between the linear and the loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from fsg._src.errors import ArgumentError
from fsg._src.trace.fused_loss import FusedLoss, _leaves_last_dim
from tests.models import hf_models

# indices of a [B, T, V] tensor's leading dims, and some that touch its last dim
LEADING = [None, (slice(None), slice(None, -1)), (Ellipsis, slice(1, None), slice(None)), 0, (slice(None), 1),
           (1, Ellipsis, slice(None)), (slice(None, None, 2),)]  # fmt: skip
TOUCHING = [(Ellipsis, slice(1, None)), (slice(None), slice(None), 0), (Ellipsis, 0), (0, 0, slice(0, 3))]
FLATTEN = {
    "view": lambda x: x.view(-1, x.shape[-1]),
    "reshape": lambda x: x.reshape(-1, x.shape[-1]),
    "flatten": lambda x: x.flatten(0, -2),
    "torch.flatten": lambda x: torch.flatten(x, 0, -2),
    "contiguous+view": lambda x: x.contiguous().view(-1, x.shape[-1]),
}
CASTS = {
    "none": lambda x: x,
    "float": lambda x: x.float(),
    "to": lambda x: x.to(torch.float32),
    "to(dtype=)": lambda x: x.to(dtype=torch.float32),
    "to(bfloat16)": lambda x: x.to(torch.bfloat16),
}


@st.composite
def chains(draw):
    B, T, D, V = draw(st.integers(2, 3)), draw(st.integers(2, 5)), draw(st.integers(1, 8)), draw(st.integers(2, 12))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    case = dict(
        shape=(B, T, D, V), dtype=dtype, cast=draw(st.sampled_from(sorted(CASTS))),
        index=draw(st.sampled_from(LEADING + TOUCHING)), flatten=draw(st.sampled_from(sorted(FLATTEN))),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        ignore_index=draw(st.sampled_from([-100, 0])), bias=draw(st.booleans()) and draw(st.booleans()),
        smoothing=draw(st.sampled_from([0.0, 0.0, 0.0, 0.1])), class_weight=draw(st.booleans()) and draw(st.booleans()),
        cast_first=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip
    return case


def _run(case, fused: bool):
    B, T, D, V = case["shape"]
    g = torch.Generator().manual_seed(case["seed"])
    h = torch.randn(B, T, D, generator=g).to(case["dtype"]).requires_grad_()
    w = torch.randn(V, D, generator=g).to(case["dtype"]).requires_grad_()
    b = torch.randn(V, generator=g).to(case["dtype"]).requires_grad_() if case["bias"] else None
    mode = FusedLoss()
    with mode if fused else contextlib.nullcontext():
        logits = F.linear(h, w, b)
        if case["cast_first"]:
            logits = CASTS[case["cast"]](logits)
        if case["index"] is not None:
            logits = logits[case["index"]]
        if logits.dim() >= 2:
            logits = FLATTEN[case["flatten"]](logits)
        if not case["cast_first"]:
            logits = CASTS[case["cast"]](logits)
        cw = torch.rand(logits.shape[-1], generator=g) + 0.5 if case["class_weight"] else None
        targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g)
        drop = torch.rand(targets.shape, generator=g) < case["ignored"]
        targets = torch.where(drop, case["ignore_index"], targets)
        loss = F.cross_entropy(logits.float() if cw is not None else logits, targets, weight=cw,
                               ignore_index=case["ignore_index"], reduction=case["reduction"],
                               label_smoothing=case["smoothing"])  # fmt: skip
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
    return loss, grads, mode.rewritten, logits


def _eligible(case, logits) -> bool:
    """What the rewrite's rules admit (the module's docstring), from the case alone."""
    index = case["index"]
    keeps_last = index is None or index in LEADING
    fp32_loss = case["dtype"] == torch.float32 or (case["cast"] in ("float", "to", "to(dtype=)"))
    if case["cast"] == "to(bfloat16)":
        fp32_loss = False
    return (keeps_last and logits.dim() == 2 and fp32_loss and not case["bias"] and not case["smoothing"]
            and case["class_weight"] is False and case["reduction"] in ("mean", "sum"))  # fmt: skip


@settings(max_examples=250, deadline=None)
@given(chains())
def test_rewritten_exactly_where_it_computes_the_same_loss(case):
    plain_loss, plain_grads, _, logits = _run(case, fused=False)
    loss, grads, rewritten, _ = _run(case, fused=True)
    assert rewritten == int(_eligible(case, logits)), case
    # the same GEMM in the same dtype: bf16 logits may round differently in a different kernel
    tol = dict(rtol=1e-5, atol=1e-5) if case["dtype"] == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(loss, plain_loss, equal_nan=True, **tol)
    assert loss.dtype == plain_loss.dtype
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, **tol)


MUTATIONS = {
    "logits +=": lambda logits, h, w: logits.add_(1.0),
    "a slice of the logits": lambda logits, h, w: logits[..., :2].fill_(-1e4),
    "masked_fill_ on a view": lambda logits, h, w: logits.view(-1).masked_fill_(
        torch.arange(logits.numel()) % 3 == 0, 0.0
    ),
    "h *=": lambda logits, h, w: h.mul_(2.0),
    "the weight": lambda logits, h, w: w.mul_(0.5),
}


@pytest.mark.parametrize("when", ["before the cast", "after the cast"])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_write_in_place_between_the_linear_and_the_loss_keeps_the_loss_as_written(mutation, when):
    """The logits, ``h`` or the weight written in place after the linear: the loss reads the
    written values, so nothing is rewritten (the version counters moved)."""
    results = []
    for fused in (True, False):
        g = torch.Generator().manual_seed(0)
        h0, w0 = (
            torch.randn(2, 3, 4, generator=g, requires_grad=True),
            torch.randn(6, 4, generator=g, requires_grad=True),
        )
        targets = torch.randint(0, 6, (6,), generator=g)
        mode = FusedLoss()
        with mode if fused else contextlib.nullcontext():
            h, w = h0 * 1.0, w0 * 1.0  # non-leaf copies: autograd lets them be written in place
            logits = F.linear(h, w)
            if when == "before the cast":
                MUTATIONS[mutation](logits, h, w)
            logits = logits.float()
            if when == "after the cast":
                MUTATIONS[mutation](logits, h, w)
            loss = F.cross_entropy(logits.view(-1, 6), targets)
        try:  # autograd refuses a write to h or the weight, which its backward reads
            results.append((loss, *torch.autograd.grad(loss, (h0, w0))))
        except RuntimeError as e:
            results.append((loss, str(e).split(":")[0]))
        # (a write to h or the weight after the cast leaves the logits as computed: the
        # rewrite would be right, but it cannot tell, and keeps the loss as written)
        assert mode.rewritten == 0
    assert type(results[0][1]) is type(results[1][1])
    if isinstance(results[0][1], str):
        assert results[0][1] == results[1][1]
        torch.testing.assert_close(results[0][0], results[1][0])
    else:
        torch.testing.assert_close(results[0], results[1])


def test_every_target_ignored_gives_torchs_nan_mean_and_zero_gradients():
    case = dict(shape=(2, 3, 4, 5), dtype=torch.float32, cast="float", index=None, flatten="view", reduction="mean",
                ignored=1.0, ignore_index=-100, bias=False, smoothing=0.0, class_weight=False, cast_first=True, seed=0)  # fmt: skip
    loss, grads, rewritten, _ = _run(case, fused=True)
    assert rewritten == 1 and torch.isnan(loss)
    assert all(bool((g == 0).all()) for g in grads)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_an_index_said_to_keep_the_last_dim_commutes_with_a_linear(data):
    """Soundness of ``_leaves_last_dim``: whenever it says yes, ``linear(h)[key] ==
    linear(h[key])``; and it says yes to every index of the leading dims drawn here."""
    ndim = data.draw(st.integers(2, 4))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    h = torch.randn(*shape[:-1], 3)
    w = torch.randn(shape[-1] + 2, 3)

    entry = st.one_of(
        st.integers(-1, 0), st.slices(4), st.none(), st.just(Ellipsis),
        st.just(torch.tensor([0, 0])), st.just(torch.tensor([True])),
    )  # fmt: skip
    key = tuple(data.draw(st.lists(entry, min_size=1, max_size=ndim + 1)))
    logits = F.linear(h, w)
    try:
        want = logits[key]
    except (IndexError, TypeError, ValueError, RuntimeError):
        return  # not a valid index of this tensor
    if _leaves_last_dim(key, logits.dim()):
        torch.testing.assert_close(F.linear(h[key], w), want)
    if all(e is not Ellipsis for e in key) and len([e for e in key if e is not None]) < ndim:
        assert _leaves_last_dim(key, logits.dim())  # the last dim is not indexed at all


def test_hugging_face_step_traces_the_fused_loss_and_trains_alike():
    pytest.importorskip("transformers")

    losses = {}
    for fused in (True, False):
        model = hf_models.make("llama")
        step = fsg.compile_step(hf_models.loss_fn(model), optimizer=fsg.optim.adamw(1e-3), backend="eager",
                                fused_loss=fused)  # fmt: skip
        state = step.init(fsg.params(model))
        batches = hf_models.batches(3, kind="llama")
        text = step.lower(state, batches[0]).as_text()
        assert ("linear_cross_entropy" in text) == fused
        assert ("_log_softmax" in text) != fused  # the logits' loss is gone, not computed twice
        losses[fused] = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[fused].append(metrics["loss"])
    torch.testing.assert_close(torch.stack(losses[True]), torch.stack(losses[False]), rtol=1e-5, atol=1e-6)


def test_fused_loss_must_be_a_bool_or_none():
    with pytest.raises(ArgumentError, match="fused_loss"):
        fsg.compile_step(lambda p, b: p["w"].sum(), optimizer=fsg.optim.sgd(0.1), fused_loss="yes")
    with pytest.raises(ArgumentError, match="fused_loss"):
        fsg.compile_eval(lambda p, b: p["w"].sum(), fused_loss=1)


# The families whose head is a bias-free linear read by a float32 cross-entropy (the others:
# Gemma 2 soft-caps its logits, Phi's, GPT-J's and BART's heads add a bias, the masked LMs'
# decoders too, Pegasus adds its final_logits_bias, ViT classifies with a biased head)
FUSED_KINDS = {
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "phi3",
    "gpt_neox",
    "falcon",
    "bloom",
    "opt",
    "t5",
    "whisper",
}


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_every_hugging_face_family_gets_the_same_gradients_fused(kind):
    """One SGD step at lr 1 (the update is the gradient) with and without the rewrite, on each
    family of the corpus: the same loss and gradients up to float32 rounding, and the rewrite
    where the family's head and loss admit it."""
    pytest.importorskip("transformers")
    out = {}
    for fused in (True, False):
        model = hf_models.make(kind)
        step = fsg.compile_step(hf_models.loss_fn(model), optimizer=fsg.optim.sgd(1.0), backend="eager",
                                donate=False, fused_loss=fused)  # fmt: skip
        state, batch = step.init(fsg.params(model)), hf_models.batches(1, kind=kind)[0]
        new, metrics = step(state, batch)
        # the update is the gradient, read back to within float32's rounding of the param
        grads = {
            n: (state.params[n] - new.params[n], float(state.params[n].abs().max()) * 2**-22) for n in state.params
        }
        ops = step.lower(state, batch).op_counts()
        out[fused] = (
            metrics["loss"],
            grads,
            sum(n for op, n in ops.items() if op.startswith("fsg.linear_cross_entropy")),
        )
    assert out[True][2] == (kind in FUSED_KINDS) and out[False][2] == 0
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    # a gradient zero in exact arithmetic (a key projection's bias) is rounding noise on both
    # sides: tolerances scale with the model's largest gradient, not each tensor's
    largest = max(float(g.abs().max()) for g, _ in out[False][1].values())
    for name, (want, rounding) in out[False][1].items():
        atol = 1e-6 * largest + rounding
        torch.testing.assert_close(out[True][1][name][0], want, rtol=1e-4, atol=atol, msg=name)


def test_an_evaluation_step_fuses_the_loss_without_gradients():
    pytest.importorskip("transformers")
    model = hf_models.make("gpt2")
    train = fsg.compile_step(hf_models.loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="eager")
    state, batch = train.init(fsg.params(model)), hf_models.batches(1, kind="gpt2")[0]
    results = {}
    for fused in (True, False):
        evaluate = fsg.compile_eval(hf_models.loss_fn(model), backend="eager", fused_loss=fused)
        results[fused] = evaluate(state, batch)
        ops = evaluate.lower(state, batch).op_counts()
        assert ops.get("fsg.linear_cross_entropy_fwd", 0) == int(fused)
    torch.testing.assert_close(results[True], results[False], rtol=1e-6, atol=1e-6)


def test_accumulated_microbatches_each_fuse_their_loss():
    pytest.importorskip("transformers")
    out = {}
    for fused in (True, False):
        model = hf_models.make("llama")
        step = fsg.compile_step(hf_models.loss_fn(model), optimizer=fsg.optim.sgd(0.1), backend="eager",
                                accum_steps=2, fused_loss=fused)  # fmt: skip
        state, batch = step.init(fsg.params(model)), hf_models.batches(1, kind="llama")[0]
        assert step.lower(state, batch).op_counts().get("fsg.linear_cross_entropy_fwd", 0) == 2 * fused
        state, metrics = step(state, batch)
        out[fused] = metrics["loss"], state.params
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    for name, want in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], want, rtol=1e-5, atol=1e-6, msg=name)
