"""Hugging Face mixtures of experts (Mixtral, Qwen2-MoE) through compile_step.

transformers runs their experts with ``torch.nn.functional.grouped_mm`` where it can: on CPU its
kernel takes float32, but its meta function (what a traced step runs) takes bfloat16 only. So a
float32 step is refused with the two fixes named, a bfloat16 step runs the grouped matmuls, and
the ``batched_mm`` implementation trains in float32 as eager PyTorch does.
"""

import copy

import pytest
import torch

import fsg

T = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)  # fmt: skip
FAMILIES = {
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}  # fmt: skip


def _model(kind):
    torch.manual_seed(0)
    return FAMILIES[kind]()


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(1, VOCAB, (4, SEQ), generator=g)), "labels": ids} for _ in range(n)]


def _step(model, **options):
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, **b).loss, backend="eager", **options)
    return step, step.init(fsg.params(model))


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_float32_grouped_matmuls_are_refused_naming_the_op_and_the_fixes(kind):
    model = _model(kind)
    step, state = _step(model, optimizer=fsg.optim.sgd(0.1))
    with pytest.raises(fsg.UnsupportedError) as info:
        step(state, _batches(1)[0])
    message = str(info.value)
    assert "aten._grouped_mm" in message and "experts" in message and "meta function" in message
    assert "fsg.Policy(compute=torch.bfloat16)" in message and "set_experts_implementation('batched_mm')" in message


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_batched_experts_train_as_eager_pytorch_does(kind):
    """Three AdamW steps with the ``batched_mm`` experts equal eager PyTorch's (whose experts
    take the grouped kernel on CPU): the routing (top-k, softmax, the load-balancing loss where
    the family adds it) is traced with static shapes. As in tests/models/test_hf.py, elements
    whose gradient is rounding noise (AdamW normalizes it) are bounded by the step size only."""
    lr, steps = 1e-3, 3
    model = _model(kind)
    model.set_experts_implementation("batched_mm")
    reference = _model(kind)
    step, state = _step(model, optimizer=fsg.optim.adamw(lr, weight_decay=0.01))  # torch's default decay
    opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.01)
    named = dict(reference.named_parameters())
    largest_grad = {name: torch.zeros_like(p) for name, p in named.items()}
    for batch in _batches(steps):
        state, metrics = step(state, batch)
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        for name, p in named.items():
            largest_grad[name] = torch.maximum(largest_grad[name], p.grad.abs())
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    assert sorted(state.params) == sorted(named)
    for name, value in state.params.items():
        noise, want = largest_grad[name] < 1e-6, named[name].detach()
        assert float((value - want).abs().where(noise, 0.0).max()) <= 2 * lr * steps, name
        torch.testing.assert_close(value[~noise], want[~noise], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_bfloat16_steps_run_the_grouped_matmuls(kind):
    """Under ``Policy(compute=bfloat16)`` the grouped kernel's operands are bfloat16: the step
    traces, keeps ``aten._grouped_mm`` and its loss stays within bf16's reach of float32's."""
    model = _model(kind)
    batch = _batches(1)[0]
    fp32_loss = float(copy.deepcopy(model)(**batch).loss)
    step, state = _step(model, optimizer=fsg.optim.sgd(0.1), precision=fsg.Policy(compute=torch.bfloat16))
    assert step.lower(state, batch).op_counts().get("aten._grouped_mm", 0) >= 2
    _, metrics = step(state, batch)
    assert abs(float(metrics["loss"]) - fp32_loss) < 0.05 * fp32_loss
