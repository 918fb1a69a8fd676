"""FlexAttention (``torch.nn.attention.flex_attention``) in a loss on CUDA: the step's loss and
gradients equal eager PyTorch's (torch's CPU FlexAttention has no backward)."""

import warnings

import pytest
import torch

import fsg
from tests.test_flex_attention import flex_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _sgd_step_matches_eager(loss_fn, init: dict, x: torch.Tensor, backend: str = "inductor") -> None:
    """One SGD step (lr 1) of ``loss_fn`` from ``init``: its loss and update equal eager autograd's
    (zero for a parameter the loss does not read)."""
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0), backend=backend)
    state = step.init(init)
    before = {k: v.clone() for k, v in state.params.items()}
    state, metrics = step(state, x)
    params = {k: v.clone().requires_grad_() for k, v in init.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        want = loss_fn(params, x)
    want.backward()
    torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-4, atol=1e-5)
    for k, p in params.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(before[k] - state.params[k], grad, rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("mask", ["causal", "documents", "alibi"])
def test_flex_attention_steps_as_eager(backend, mask):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()
    document = torch.arange(256, device="cuda") // 96  # three documents, packed

    def keep(b, h, q, kv):
        return (q >= kv) & (document[q] == document[kv]) if mask == "documents" else q >= kv

    block_mask = create_block_mask(keep, None, None, 256, 256, device="cuda")

    def loss_fn(params, x):
        weights = {"weight": params["weight"], "bias": params["bias"]}
        q, k, v = torch.func.functional_call(lin, weights, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        slopes = params["slopes"]  # learned: its gradient comes through the score function

        def alibi(s, b, h, q_idx, kv_idx):
            return s - slopes[h] * (q_idx - kv_idx)

        score_mod = alibi if mask == "alibi" else None
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask).square().mean()

    init = {k: v.detach() for k, v in lin.named_parameters()} | {"slopes": torch.linspace(0.1, 0.5, 4, device="cuda")}
    _sgd_step_matches_eager(loss_fn, init, torch.randn(2, 256, 64, device="cuda"), backend)  # slopes: read by ALiBi only


OFF_BY_8E4 = "the loss 4.6274 against eager's 4.6312 on an H100, 2026-12-06: refused (REFUSE_PER_SEQUENCE)"


@pytest.mark.parametrize(
    "mask", ["own", "outside", pytest.param("outside_per_sequence", marks=pytest.mark.xfail(strict=False, reason=OFF_BY_8E4))]
)
def test_a_hugging_face_model_with_flex_attention_trains_as_eager(mask, monkeypatch):
    """``own``: the model builds its causal mask in each forward, which fsg computes once when
    it traces the step (trace/block_masks.py); ``outside``: the causal BlockMask passed as
    the model's ``attention_mask``; ``outside_per_sequence``: a mask per sequence (packed
    documents, split differently in each), with its refusal off. The reference is the model's
    eager call."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fsg._src.backend import flex_attention as backend_flex

    monkeypatch.setattr(backend_flex, "REFUSE_PER_SEQUENCE", False)

    model = flex_llama(256).cuda()
    ids = torch.randint(0, 100, (2, 128), device="cuda")
    kwargs = {}
    if mask == "outside":
        kwargs["attention_mask"] = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cuda")
    if mask == "outside_per_sequence":
        document = torch.stack([torch.arange(128, device="cuda") // 48, torch.arange(128, device="cuda") // 80])
        keep = lambda b, h, q, kv: (q >= kv) & (document[b, q] == document[b, kv])  # noqa: E731
        kwargs["attention_mask"] = create_block_mask(keep, 2, None, 128, 128, device="cuda")

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids, **kwargs).loss

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0))
    state = step.init(fsg.params(model))
    before = {k: v.clone() for k, v in state.params.items()}
    state, metrics = step(state, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - state.params[name], p.grad, rtol=1e-3, atol=1e-5)


def test_a_block_mask_from_the_batch_is_refused_under_inductor():
    """A mask built in the step from the batch's values (each sequence's length), one a
    sequence: not foldable, refused under Inductor; aot_eager trains it as eager."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()

    def loss_fn(params, x):
        lengths = (x[:, :, 0] > 0).sum(1) + 8
        mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, 256, 256, device="cuda")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=mask).square().mean()

    x = torch.randn(2, 256, 64, device="cuda")
    init = {k: v.detach() for k, v in lin.named_parameters()}
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0))
    with pytest.raises(fsg.UnsupportedError, match="BlockMask built inside the step from its inputs"):
        step(step.init(init), x)
    _sgd_step_matches_eager(loss_fn, init, x, backend="aot_eager")


LOWERING = pytest.mark.xfail(strict=False, reason='Inductor\'s lowering failed on an H100, 2026-12-06: "convert FlexibleLayout to FixedLayout first"')


@pytest.mark.parametrize(
    "where",
    ["outside_per_sequence", pytest.param("inside_shared", marks=LOWERING), pytest.param("inside_per_sequence", marks=LOWERING)],
)
def test_each_refused_block_mask_condition_alone(monkeypatch, where):
    """The Hugging Face mask measured wrong was built inside the step and per sequence. Each
    alone, with the refusals off. On an H100 (2026-12-06) ``outside_per_sequence`` passed twice
    (yet a Hugging Face model with one did not: below, so it is refused again);
    ``inside_shared`` failed inside Inductor first on the ``lengths[0]`` constant of its mask
    function (made an op since: trace/subgraph_constants.py), then in the lowering, as
    ``inside_per_sequence`` did."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fsg._src.backend import flex_attention as backend_flex

    monkeypatch.setattr(backend_flex, "REFUSE_BUILT_IN_GRAPH", False)
    monkeypatch.setattr(backend_flex, "REFUSE_PER_SEQUENCE", False)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()
    per_sequence = where.endswith("per_sequence")

    def mask(x):  # inside: from the batch's values (not foldable): the lengths 256 and 100 all the same
        lengths = torch.tensor([256, 100], device="cuda")
        if where.startswith("inside"):
            lengths = lengths + (x[:, :, 0] < -1e4).sum(1)  # + 0
        keep = (lambda b, h, q, kv: (q >= kv) & (kv < lengths[b])) if per_sequence else (
            lambda b, h, q, kv: (q >= kv) & (kv < lengths[0]))  # fmt: skip
        return create_block_mask(keep, 2 if per_sequence else None, None, 256, 256, device="cuda")

    outside = None if where.startswith("inside") else mask(None)

    def loss_fn(params, x):
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=outside if outside is not None else mask(x)).square().mean()

    _sgd_step_matches_eager(loss_fn, {k: v.detach() for k, v in lin.named_parameters()}, torch.randn(2, 256, 64, device="cuda"))


def test_a_block_mask_per_sequence_from_outside_is_refused_under_inductor():
    """A mask per sequence built outside the step: refused on CUDA under Inductor (see
    ``OFF_BY_8E4``), with the fixes named; ``aot_eager`` trains it as eager."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()
    lengths = torch.tensor([256, 100], device="cuda")
    mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, 256, 256, device="cuda")

    def loss_fn(params, x):
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=mask).square().mean()

    x, init = torch.randn(2, 256, 64, device="cuda"), {k: v.detach() for k, v in lin.named_parameters()}
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0))
    with pytest.raises(fsg.UnsupportedError, match="one mask per sequence.*aot_eager"):
        step(step.init(init), x)
    _sgd_step_matches_eager(loss_fn, init, x, backend="aot_eager")


def test_scalar_constants_in_the_mask_and_score_functions_train_as_eager():
    """``lengths[0]`` in ``mask_mod`` and ``torch.tensor(0.5)`` in ``score_mod``: constants of their
    subgraphs, made ops in stage 1 (trace/subgraph_constants.py); Inductor failed on them before."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()
    lengths = torch.tensor([200, 100], device="cuda")
    block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[0]), 2, None, 256, 256, device="cuda")

    def loss_fn(params, x):
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        score_mod = lambda s, b, h, q_idx, kv_idx: s * torch.tensor(0.5, device="cuda")  # noqa: E731
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask).square().mean()

    _sgd_step_matches_eager(loss_fn, {k: v.detach() for k, v in lin.named_parameters()}, torch.randn(2, 256, 64, device="cuda"))


@pytest.mark.parametrize(
    "where", ["hf_own_unfolded", pytest.param("inside_per_sequence", marks=LOWERING), pytest.param("from_the_batch", marks=LOWERING)]
)
def test_block_masks_computed_in_the_step_train_as_eager_with_contiguous_copies(monkeypatch, where):
    """``CONTIGUOUS_BLOCK_MASKS`` (backend/flex_attention.py, off): the candidate fix of the wrong
    gradients with a mask computed in the step (Inductor's templates index the mask's tensors as
    contiguous, asking only a unit last stride). On an H100 (2026-12-06) the Hugging Face
    model's own mask left in the step trained as eager with it (wrong gradients without), and
    the masks per sequence from the batch failed in Inductor's lowering: the flag stays off."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fsg._src.backend import flex_attention as backend_flex
    from fsg._src.trace import block_masks

    monkeypatch.setattr(backend_flex, "CONTIGUOUS_BLOCK_MASKS", True)
    monkeypatch.setattr(backend_flex, "REFUSE_PER_SEQUENCE", False)
    if where == "hf_own_unfolded":  # the failing case: the model's causal mask left in the step
        monkeypatch.setattr(block_masks, "fold", lambda gm: 0)
        model = flex_llama(256).cuda()
        init = {k: v.detach() for k, v in fsg.params(model).items()}
        ids = torch.randint(0, 100, (2, 128), device="cuda")
        _sgd_step_matches_eager(lambda p, ids: fsg.apply(model, p, input_ids=ids, labels=ids).loss, init, ids)
        return
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 192).cuda()

    def loss_fn(params, x):
        lengths = (x[:, :, 0] > -1e4).sum(1) - torch.arange(2, device="cuda") * 156  # 256 and 100
        if where == "from_the_batch":
            lengths = (x[:, :, 0] > 0).sum(1) + 8
        mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, 256, 256, device="cuda")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=mask).square().mean()

    _sgd_step_matches_eager(loss_fn, {k: v.detach() for k, v in lin.named_parameters()}, torch.randn(2, 256, 64, device="cuda"))


@pytest.mark.parametrize(
    "how", ["model_on_cuda", "aot_eager", pytest.param("inductor", marks=pytest.mark.xfail(strict=False, reason=OFF_BY_8E4))]
)
def test_a_per_sequence_mask_loss_against_the_cpu_model(how, monkeypatch):
    """Which of the two CUDA paths is off for the Hugging Face model with a per-sequence
    document mask (``OFF_BY_8E4``): its first loss on CUDA (the model's own call, which runs
    transformers' compiled FlexAttention; fsg's step under ``aot_eager``; under Inductor, the
    refusal off) against the same model's loss on CPU (the math reference, which fsg's CPU
    evaluation equals: tests/test_flex_attention.py)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fsg._src.backend import flex_attention as backend_flex

    monkeypatch.setattr(backend_flex, "REFUSE_PER_SEQUENCE", False)
    ids = torch.randint(0, 100, (2, 128), generator=torch.Generator().manual_seed(1))

    def setup(device):
        model = flex_llama(256).to(device)
        document = torch.stack([torch.arange(128, device=device) // 48, torch.arange(128, device=device) // 80])
        keep = lambda b, h, q, kv: (q >= kv) & (document[b, q] == document[b, kv])  # noqa: E731
        return model, create_block_mask(keep, 2, None, 128, 128, device=device)

    model, mask = setup("cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(input_ids=ids, labels=ids, attention_mask=mask).loss
    model, mask = setup("cuda")
    if how == "model_on_cuda":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = model(input_ids=ids.cuda(), labels=ids.cuda(), attention_mask=mask).loss
    else:
        loss_fn = lambda p, ids: fsg.apply(model, p, input_ids=ids, labels=ids, attention_mask=mask).loss  # noqa: E731
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0), backend=how)
        _, metrics = step(step.init(fsg.params(model)), ids.cuda())
        got = metrics["loss"]
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
