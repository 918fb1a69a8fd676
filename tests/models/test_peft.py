"""LoRA fine-tuning with Hugging Face PEFT through compile_step: the base model's weights are
frozen by PEFT (``requires_grad=False``), the adapters train as in eager PyTorch, and with the
parameter-group recipe of docs/models.md the optimizer state holds the adapters' moments only."""

import copy

import pytest
import torch

import fsg

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ = 128, 16


def _lora_gpt2(dropout=0.0):
    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=dropout,
                           fan_in_fan_out=True)  # fmt: skip
    model = peft.get_peft_model(T.GPT2LMHeadModel(config), lora).train()
    with torch.no_grad():  # lora_B starts at zero, so lora_A's first gradient would be zero too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _frozen_group(model, optimizer):
    """docs/models.md's recipe: the trainable parameters in one group, the frozen in another
    whose transformation keeps no state."""
    labels = {name: "train" if p.requires_grad else "frozen" for name, p in model.named_parameters()}
    return fsg.optim.multi_transform({"train": optimizer, "frozen": fsg.optim.set_to_zero()}, labels)


@pytest.mark.parametrize("grouped", [False, True])
def test_lora_adapters_train_as_eager_pytorch_and_the_base_stays(grouped):
    model = _lora_gpt2()
    reference = copy.deepcopy(model)
    optimizer = fsg.optim.adamw(1e-2, weight_decay=0.1)
    step = fsg.compile_step(lambda p, b: fsg.apply(model, p, input_ids=b["ids"], labels=b["ids"]).loss,
                            optimizer=_frozen_group(model, optimizer) if grouped else optimizer, backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    moments = [leaf for leaf in fsg._src.tree.flatten(state.opt_state)[0] if leaf.dim() > 0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))
    if grouped:  # two moments per adapter, none for the base
        assert sum(m.numel() for m in moments) == 2 * sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        state, metrics = step(state, {"ids": ids})
        opt.zero_grad()
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(state.params[name], p.detach()), name
