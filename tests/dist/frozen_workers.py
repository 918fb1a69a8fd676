"""Functions tests/dist/test_frozen.py runs on every rank (importable by name in the workers)."""

from __future__ import annotations

import torch

import fsg
from tests.dist.workers import MUON_SPREAD, preset_rules


def frozen_layer_on_a_mesh(axes: dict, preset: str) -> tuple[int, int, bool]:
    """An MLP with its middle layer frozen, sharded under ``preset``: equal to the unsharded
    step (AdamW with weight decay), the frozen weight as it was on this rank; returns how many
    elements the frozen and the all-trainable step's summing collectives move, and whether the
    frozen weight stayed bit for bit."""
    counts = []
    for freeze in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))  # fmt: skip
        model[2].requires_grad_(not freeze)
        g = torch.Generator().manual_seed(1)
        batches = [{"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g)} for _ in range(3)]

        def loss_fn(params, batch, model=model):
            return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()

        options = dict(optimizer=fsg.optim.adamw(1e-2, weight_decay=0.1), param_sharding=preset_rules(preset),
                       batch_sharding=fsg.P("dp"))  # fmt: skip
        mesh = fsg.testing.mesh(axes)
        fsg.testing.assert_sharded_matches_unsharded(loss_fn, fsg.params(model), batches, mesh, **options)
        step = fsg.compile_step(loss_fn, mesh, backend="eager", **options)
        state = step.init(fsg.params(model))
        summing = (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.reduce_scatter_tensor.default)
        nodes = step.lower(state, batches[0]).graph_module.graph.nodes
        counts.append(sum(n.args[0].meta["val"].numel() for n in nodes if n.target in summing))  # elements summed
        if freeze:
            before = state.params["2.weight"].full_tensor() if hasattr(state.params["2.weight"], "full_tensor") else None
            for batch in batches:
                state, _ = step(state, batch)
            after = state.params["2.weight"]
            kept = torch.equal(
                after.full_tensor() if hasattr(after, "full_tensor") else after,
                before if before is not None else model[2].weight.detach(),
            )
    return counts[0], counts[1], kept


def param_groups_on_a_mesh(axes: dict, preset: str, muon: str = "adamw") -> bool:
    """An MLP whose first weight, biases and head train in three groups (``multi_transform``:
    AdamW with decay or Muon (``muon="muon"``), SGD with momentum, and a frozen group), sharded
    under ``preset``: equal to the unsharded step; returns whether the frozen group stayed bit
    for bit on this rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    labels = {"0.weight": muon, "0.bias": "plain", "2.weight": "frozen", "2.bias": "plain"}
    optimizer = fsg.optim.multi_transform({"muon": fsg.optim.muon(0.02), "adamw": fsg.optim.adamw(1e-2, weight_decay=0.1),
                                           "plain": fsg.optim.sgd(0.05, momentum=0.9),
                                           "frozen": fsg.optim.set_to_zero()}, labels)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g)} for _ in range(3)]

    def loss_fn(params, batch):
        return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()

    options = dict(optimizer=optimizer, param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"))
    mesh = fsg.testing.mesh(axes)
    atol = MUON_SPREAD if muon == "muon" else 1e-6
    fsg.testing.assert_sharded_matches_unsharded(loss_fn, fsg.params(model), batches, mesh, atol=atol, **options)
    step = fsg.compile_step(loss_fn, mesh, backend="eager", **options)
    state = step.init(fsg.params(model))
    for batch in batches:
        state, _ = step(state, batch)
    after = state.params["2.weight"]
    return torch.equal(after.full_tensor() if hasattr(after, "full_tensor") else after, model[2].weight.detach())


def lora_on_a_mesh(axes: dict, preset: str) -> None:
    """A GPT-2 with PEFT LoRA adapters (its base frozen by PEFT), sharded under ``preset``, with
    plain AdamW and with the frozen-group recipe: equal to the unsharded step."""
    from tests.models.test_peft import VOCAB, _frozen_group, _lora_gpt2

    model = _lora_gpt2()
    g = torch.Generator().manual_seed(1)
    batches = [{"ids": torch.randint(0, VOCAB, (4, 16), generator=g)} for _ in range(3)]
    for grouped in (False, True):
        optimizer = fsg.optim.adamw(1e-2, weight_decay=0.1)
        fsg.testing.assert_sharded_matches_unsharded(
            lambda p, b: fsg.apply(model, p, input_ids=b["ids"], labels=b["ids"]).loss, fsg.params(model), batches,
            fsg.testing.mesh(axes), optimizer=_frozen_group(model, optimizer) if grouped else optimizer,
            param_sharding=preset_rules(preset), rtol=1e-4, atol=1e-5,
        )  # fmt: skip


def masked_gradient_on_a_mesh(axes: dict, preset: str) -> bool:
    """An embedding whose first rows are kept by a gradient hook on its weight
    (``p.register_hook``), sharded under ``preset``: equal to the unsharded step; returns
    whether the masked rows stayed bit for bit on this rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Flatten(), torch.nn.Linear(32, 4))
    trainable = (torch.arange(16) >= 6).float()[:, None]
    model[0].weight.register_hook(lambda g: g * trainable)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randint(0, 16, (8, 4), generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]

    def loss_fn(params, batch):
        return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()

    options = dict(optimizer=fsg.optim.adam(1e-2), param_sharding=preset_rules(preset), batch_sharding=fsg.P("dp"))
    mesh = fsg.testing.mesh(axes)
    fsg.testing.assert_sharded_matches_unsharded(loss_fn, fsg.params(model), batches, mesh, **options)
    step = fsg.compile_step(loss_fn, mesh, backend="eager", **options)
    state = step.init(fsg.params(model))
    for batch in batches:
        state, _ = step(state, batch)
    weight = state.params["0.weight"]
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return torch.equal(weight[:6], model[0].weight.detach()[:6]) and not torch.equal(weight, model[0].weight.detach())
