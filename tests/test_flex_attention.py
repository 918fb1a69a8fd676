"""FlexAttention (``torch.nn.attention.flex_attention``) inside a traced function: the
``flex_attention`` higher-order operator passes through fsg's random-key mode and is traced with
its score and mask functions (tensors they capture included), under every backend. torch's CPU
FlexAttention has no backward, so the CPU tests run evaluation steps; training steps are in
``tests/gpu/test_flex_attention_cuda.py``."""

import warnings

import pytest
import torch

import fsg
from tests.dist.flex_workers import flex_op

flex = pytest.importorskip("torch.nn.attention.flex_attention")

T, H, D = 128, 4, 16


def _setup(mask: str, score: str):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * H * D)
    document = torch.arange(T) // 48  # three packed documents
    rules = {
        "causal": lambda b, h, q, kv: q >= kv,
        "documents": lambda b, h, q, kv: (q >= kv) & (document[q] == document[kv]),
        "window": lambda b, h, q, kv: (q >= kv) & (q - kv < 32),
    }
    block_mask = flex.create_block_mask(rules[mask], None, None, T, T, device="cpu")
    params = {k: v.detach() for k, v in lin.named_parameters()}
    params["slopes"] = torch.linspace(0.1, 0.5, H)  # a learned ALiBi-like bias, read in score_mod

    def loss_fn(params, x):
        qkv = torch.func.functional_call(lin, {"weight": params["weight"], "bias": params["bias"]}, (x,))
        q, k, v = qkv.view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        slopes = params["slopes"]
        mods = {
            "none": None,
            "alibi": lambda s, b, h, q_idx, kv_idx: s - slopes[h] * (q_idx - kv_idx),
            "softcap": lambda s, b, h, q_idx, kv_idx: 20 * torch.tanh(s / 20),
        }
        return flex.flex_attention(q, k, v, score_mod=mods[score], block_mask=block_mask).square().mean()

    return loss_fn, params, torch.randn(2, T, 64)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize(("mask", "score"), [("causal", "none"), ("documents", "alibi"), ("window", "softcap")])
def test_an_evaluation_step_with_flex_attention_equals_eager(backend, mask, score):
    loss_fn, params, x = _setup(mask, score)
    ev = fsg.compile_eval(loss_fn, backend=backend)
    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(params)
    got = ev(state, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        want = loss_fn(params, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torch_cond_in_a_loss_is_refused_with_its_name():
    def loss_fn(params, x):
        y = x @ params["w"]
        return torch.cond(y.sum() > 0, lambda t: t.square().mean(), lambda t: t.abs().mean(), (y,))

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="aot_eager")
    state = step.init({"w": torch.randn(4, 3)})
    with pytest.raises(fsg.UnsupportedError, match="higher-order operator 'cond'.*torch.where"):
        step(state, torch.randn(5, 4))


def flex_llama(positions: int) -> torch.nn.Module:
    """A small Hugging Face Llama with ``attn_implementation="flex_attention"``."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)  # fmt: skip
    cfg._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_hugging_face_model_with_flex_attention_evaluates_as_eager(backend):
    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (2, 32))

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids).loss

    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(fsg.params(model))
    got = fsg.compile_eval(loss_fn, backend=backend)(state, ids)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_two_models_with_flex_attention_compile_one_after_the_other():
    """torch's automatic dynamic shapes had given the second model's score and mask functions
    symbolic sizes (FlexAttention's inner torch.compile saw new sizes), which Inductor refused:
    "A subgraph argument other than striding has been modified"."""
    x = torch.randn(2, T, 64)
    for n, dtype in ((T, torch.int64), (16, torch.float32)):
        torch.manual_seed(n)
        lin = torch.nn.Linear(64, 3 * H * D)
        captured = torch.arange(n, dtype=dtype)
        block_mask = flex.create_block_mask(lambda b, h, q, kv, c=captured, n=n: (q >= kv) & (c[q % n] >= 0),
                                            None, None, T, T, device="cpu")  # fmt: skip

        def loss_fn(params, x, lin=lin, block_mask=block_mask):
            q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
            return flex.flex_attention(q, k, v, block_mask=block_mask).square().mean()

        params = {k: v.detach() for k, v in lin.named_parameters()}
        state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = loss_fn(params, x)
        torch.testing.assert_close(fsg.compile_eval(loss_fn, backend="inductor")(state, x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_step_through_the_flex_attention_backward_equals_finite_differences(backend):
    """The operator's backward in a traced step (CPU; Inductor has no CPU lowering of it): the
    slopes' gradient, which comes through the score function's captured buffer, equals central
    finite differences, and every parameter's update equals eager autograd's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * H * D)
    block_mask = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cpu")

    def loss_fn(params, x):
        weights = {"weight": params["weight"], "bias": params["bias"]}
        q, k, v = torch.func.functional_call(lin, weights, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex_op(q, k, v, params["slopes"], block_mask).square().mean()

    init = {k: v.detach() for k, v in lin.named_parameters()} | {"slopes": torch.linspace(0.1, 0.5, H)}
    x = torch.randn(2, T, 64)
    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(1.0), backend=backend)
    state = step.init(init)
    before = {k: v.clone() for k, v in state.params.items()}
    state, _ = step(state, x)
    params = {k: v.clone().requires_grad_() for k, v in init.items()}
    loss_fn(params, x).backward()
    for k, p in params.items():
        torch.testing.assert_close(before[k] - state.params[k], p.grad, rtol=1e-4, atol=1e-7, msg=k)
    with torch.no_grad():
        for h in range(H):
            e = torch.zeros(H)
            e[h] = 1e-2
            up, down = (loss_fn(init | {"slopes": init["slopes"] + s * e}, x) for s in (1, -1))
            torch.testing.assert_close((before["slopes"] - state.params["slopes"])[h], (up - down) / 2e-2, rtol=2e-2, atol=1e-5)


def _flex_llama_eval_graph(**kwargs):
    """The evaluation graph of the Hugging Face Llama with FlexAttention (``kwargs`` go to the
    model's call)."""
    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (2, 32))

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids, **kwargs).loss

    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(fsg.params(model))
    return fsg.compile_eval(loss_fn, backend="eager").lower(state, ids).graph_module


def _mask_from_the_batch_graph():
    """An evaluation graph whose block mask is built from the batch's values (each sequence's
    length): it stays in the step."""
    lin = torch.nn.Linear(64, 3 * H * D)

    def loss_fn(params, x):
        lengths = (x[:, :, 0] > 0).sum(1) + 8
        mask = flex.create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, T, T, device="cpu")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex.flex_attention(q, k, v, block_mask=mask).square().mean()

    params = {k: v.detach() for k, v in lin.named_parameters()}
    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(params)
    return fsg.compile_eval(loss_fn, backend="eager").lower(state, torch.randn(2, T, 64)).graph_module


def test_a_block_mask_built_from_the_batch_is_found_and_one_built_outside_is_not():
    from torch.nn.attention.flex_attention import create_block_mask

    from fsg._src.backend import flex_attention as backend_flex

    inside = _mask_from_the_batch_graph()
    found = backend_flex.block_masks_built_in_graph(inside)
    assert len(found) == 1 and found[0].target.name() == "flex_attention"
    assert backend_flex.block_masks_built_in_graph(_flex_llama_eval_graph()) == []  # its causal mask: a constant
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, device="cpu")
    assert backend_flex.block_masks_built_in_graph(_flex_llama_eval_graph(attention_mask=causal)) == []
    backend_flex.refuse_block_masks_built_in_graph(inside, devices=("cuda",))  # a CPU graph: not the CUDA rule's
    with pytest.raises(fsg.UnsupportedError) as err:
        backend_flex.refuse_block_masks_built_in_graph(inside)
    message = str(err.value)
    assert "FlexAttention at " in message and "BlockMask built inside the step from its inputs" in message
    assert "CPU Inductor cannot compile" in message
    assert "attention_mask=create_block_mask" in message and "backend='aot_eager'" in message


def test_an_evaluation_step_over_a_block_mask_from_the_batch_is_refused_under_inductor_and_runs_under_aot_eager():
    """torch's CPU Inductor fails to lower it ("NoValidChoicesError"): refused by name instead."""
    lin = torch.nn.Linear(64, 3 * H * D)

    def evaluate(params, x):
        lengths = (x[:, :, 0] > 0).sum(1) + 8
        mask = flex.create_block_mask(lambda b, h, q, kv: (q >= kv) & (kv < lengths[b]), 2, None, T, T, device="cpu")
        q, k, v = torch.func.functional_call(lin, params, (x,)).view(2, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex.flex_attention(q, k, v, block_mask=mask).float()

    params, x = {k: v.detach() for k, v in lin.named_parameters()}, torch.randn(2, T, 64)
    state = fsg.compile_step(evaluate, optimizer=fsg.optim.sgd(0.1)).init(params)
    with pytest.raises(fsg.UnsupportedError, match="BlockMask built inside the step from its inputs"):
        fsg.compile_eval(evaluate)(state, x)
    torch.testing.assert_close(fsg.compile_eval(evaluate, backend="aot_eager")(state, x), evaluate(params, x))


def test_a_block_mask_per_sequence_is_refused_on_cuda_and_evaluates_as_eager_on_cpu():
    """One mask a sequence (B > 1), built outside the step (read as a constant): not a mask
    built in the step; refused by the CUDA rule (a Hugging Face model's step with one was 8e-4
    off eager on an H100, RESULTS.md 2026-12-06), by name and with the fixes; on CPU not
    refused, and the Hugging Face model's Inductor evaluation over packed documents equals its
    eager call; a mask the sequences share is not refused anywhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fsg._src.backend import flex_attention as backend_flex

    T = 32  # _flex_llama_eval_graph's sequence length
    document = torch.stack([torch.arange(T) // 12, torch.arange(T) // 20])
    keep = lambda b, h, q, kv: (q >= kv) & (document[b, q] == document[b, kv])  # noqa: E731
    per_sequence = create_block_mask(keep, 2, None, T, T, device="cpu")
    gm = _flex_llama_eval_graph(attention_mask=per_sequence)
    assert backend_flex.block_masks_built_in_graph(gm) == [] and backend_flex.per_sequence_block_masks(gm)
    backend_flex.refuse_block_masks_built_in_graph(gm)  # not built in the step
    backend_flex.refuse_per_sequence_block_masks(gm)  # a CPU graph: not the CUDA rule's
    with pytest.raises(fsg.UnsupportedError, match=r"one mask per sequence \(B > 1.*aot_eager.*B=None"):
        backend_flex.refuse_per_sequence_block_masks(gm, devices=("cpu",))
    shared = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cpu")
    assert backend_flex.per_sequence_block_masks(_flex_llama_eval_graph(attention_mask=shared)) == []
    assert backend_flex.per_sequence_block_masks(_flex_llama_eval_graph()) == []  # the model's own: one for all

    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (2, T))

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids, attention_mask=per_sequence).loss

    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(fsg.params(model))
    got = fsg.compile_eval(loss_fn)(state, ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(input_ids=ids, labels=ids, attention_mask=per_sequence).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_hugging_face_model_with_an_outside_block_mask_evaluates_as_eager():
    from torch.nn.attention.flex_attention import create_block_mask

    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (2, 32))
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, device="cpu")

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids, attention_mask=causal).loss

    state = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.1), backend="eager").init(fsg.params(model))
    got = fsg.compile_eval(loss_fn)(state, ids)
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss  # its own causal mask
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
