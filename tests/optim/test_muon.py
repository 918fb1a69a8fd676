"""``fsg.optim.muon`` against ``torch.optim.Muon``, alone and beside AdamW in parameter groups."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 12), st.integers(2, 12), st.integers(2, 12), st.booleans(),
       st.sampled_from([None, "original", "match_rms_adamw"]), st.sampled_from([0.0, 0.1]), st.sampled_from([0.9, 0.95]))  # fmt: skip
def test_muon_matches_torch_optim_muon(d_in, hidden, d_out, nesterov, adjust_lr_fn, weight_decay, momentum):
    """Tall, wide and square matrices, Nesterov or not, each learning-rate adjustment: given
    the same gradients, 4 updates equal ``torch.optim.Muon``'s with the same arguments (to
    float32 rounding: the iteration runs the same bfloat16 ops). The same gradients: a model's
    gradients from fsg's traced backward and eager's differ by float32 rounding, which the
    bfloat16 cast of the iteration's input can turn into a 1e-5 difference in the loss."""
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(hidden, d_in, generator=g), "b": torch.randn(d_out, hidden, generator=g)}
    reference = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    kw = dict(weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = fsg.optim.muon(0.02, **kw)
    torch_opt = torch.optim.Muon(reference.values(), lr=0.02, **kw)
    state = opt.init(params)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = fsg.optim.apply_updates(params, updates)
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
    for name, p in reference.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_muon_for_hidden_matrices_and_adamw_for_the_rest_match_torch(backend):
    """The usual split (as modded-nanogpt and torch's docs): Muon for the hidden 2-D weights,
    AdamW for the embedding, biases, norms and head; equal to the two torch optimizers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 20))  # fmt: skip
    reference = copy.deepcopy(model)
    hidden = {"1.weight", "4.weight"}
    labels = {name: "muon" if name in hidden else "adamw" for name, _ in model.named_parameters()}
    opt = fsg.optim.multi_transform({"muon": fsg.optim.muon(0.02), "adamw": fsg.optim.adamw(3e-3, weight_decay=0.01)}, labels)
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b["ids"]).flatten(0, 1), b["ids"].roll(1, 1).flatten())  # noqa: E731
    step = fsg.compile_step(lambda p, b: loss(lambda x: fsg.apply(model, p, x), b), optimizer=opt, backend=backend)
    state = step.init(fsg.params(model))
    named = dict(reference.named_parameters())
    muon = torch.optim.Muon([named[n] for n in sorted(hidden)], lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in hidden], lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        batch = {"ids": torch.randint(0, 20, (4, 6), generator=g)}
        state, metrics = step(state, batch)
        muon.zero_grad()
        adamw.zero_grad()
        eager = loss(reference, batch)
        eager.backward()
        muon.step()
        adamw.step()
        torch.testing.assert_close(metrics["loss"], eager.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
    for name, p in named.items():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_muon_refuses_what_it_cannot_orthogonalize_by_name():
    opt = fsg.optim.muon(0.02)
    with pytest.raises(fsg.ArgumentError, match=r"params\['b'\] has shape \(3,\).*2-D.*multi_transform"):
        opt.init({"w": torch.ones(3, 2), "b": torch.ones(3)})
    with pytest.raises(fsg.ArgumentError, match="adjust_lr_fn"):
        fsg.optim.muon(0.02, adjust_lr_fn="rms")
    with pytest.raises(fsg.ArgumentError, match="ns_steps"):
        fsg.optim.muon(0.02, ns_steps=0)
    with pytest.raises(fsg.ArgumentError, match="momentum"):
        fsg.optim.muon(0.02, momentum=1.5)


def test_cost_counts_the_iterations_flops():
    """``Lowered.cost()`` counts the Newton-Schulz matmuls (a flop formula for the op): five
    iterations of ``4 m^2 n + 2 m^3`` per ``m x n`` matrix (``m <= n``) on top of the model's."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 4, bias=False))
    loss = lambda p, b: fsg.apply(model, p, b).pow(2).mean()  # noqa: E731
    x = torch.randn(4, 8)
    flops = {}
    for name, opt in (("sgd", fsg.optim.sgd(0.1)), ("muon", fsg.optim.muon(0.02))):
        step = fsg.compile_step(loss, optimizer=opt, backend="eager")
        flops[name] = step.lower(step.init(fsg.params(model)), x).cost().flops
    assert flops["muon"] - flops["sgd"] == 5 * (4 * 8 * 8 * 16 + 2 * 8**3) + 5 * (4 * 4 * 4 * 16 + 2 * 4**3)
