"""Functions for tests/pipeline (importable by name in the workers): a pipeline step on the
ranks' ``pp`` mesh against the unsharded step, both in float64."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsg
import fsg.testing


class Mlp(nn.Module):
    """An input projection, ``n`` residual tanh layers, a head; a mean squared error."""

    def __init__(self, n: int, d: int = 6):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        q, k, v = (
            t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x_BTD)).split(D, -1)
        )
        a_BTD = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x_BTD = x_BTD + self.proj(a_BTD)
        return x_BTD + self.out(F.gelu(self.fc(self.ln2(x_BTD))))


class Gpt(nn.Module):
    """A tiny GPT whose head is tied to its token embedding (GPT-2's ``wte``)."""

    def __init__(self, n: int, vocab: int = 11, d: int = 8, t: int = 5):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.h = nn.ModuleList(Block(d, 2) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx_BT):
        x = self.wte(idx_BT) + self.wpe(torch.arange(idx_BT.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def problem(model: str, layers: int, rows: int):
    """``(loss_fn, params, batch)`` of a model, seeded: the same on every rank."""
    torch.manual_seed(0)
    if model == "mlp":
        net = Mlp(layers).double()

        def loss_fn(params, batch):
            return ((fsg.apply(net, params, batch["x"]) - batch["y"]) ** 2).mean()

        batch = {"x": torch.randn(rows, 3, dtype=torch.float64), "y": torch.randn(rows, 2, dtype=torch.float64)}
    else:
        net = Gpt(layers).double()

        def loss_fn(params, batch):
            logits = fsg.apply(net, params, batch["idx"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
            return loss, {"logit_mean": logits.mean()}

        batch = {"idx": torch.randint(0, 11, (rows, 5)), "targets": torch.randint(0, 11, (rows, 5))}
    return loss_fn, fsg.params(net), batch


OPTIMIZER = fsg.optim.adamw(1e-2, weight_decay=0.1)
_REFERENCES: dict = {}  # unsharded steps by (model, layers, accum_steps): a drawn case's baseline is traced once


def pipeline_matches_unsharded(model, layers, schedule, virtual, split_points, accum, steps=2, backend="eager"):
    """Runs ``steps`` pipeline steps and the unsharded ones; returns the largest difference of
    any parameter and metric, and whether each call ran this rank's actions in the schedule's order."""
    pp, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    loss_fn, params, batch = problem(model, layers, 2 * accum)
    pipeline = fsg.Pipeline(schedule=schedule, split_points=split_points, virtual_stages=virtual)
    mesh = fsg.testing.mesh({"pp": pp})
    step = fsg.compile_step(loss_fn, mesh, optimizer=OPTIMIZER, accum_steps=accum, backend=backend, pipeline=pipeline)
    key = (model, layers, accum)
    if key not in _REFERENCES:
        # (its loss_fn's model is a template of the same structure: the params come from the state)
        _REFERENCES[key] = fsg.compile_step(loss_fn, optimizer=OPTIMIZER, accum_steps=accum, backend="eager")
    reference = _REFERENCES[key]
    state, ref_state = step.init(params, batch=batch), reference.init(params)
    worst, in_order = 0.0, True
    want = list(step.schedule().schedule.actions[rank])
    for i in range(steps):
        batch = {k: v.roll(i, 0) for k, v in batch.items()}
        state, metrics = step(state, batch)
        ref_state, ref_metrics = reference(ref_state, batch)
        in_order &= step.executed == want
        assert sorted(metrics) == sorted(ref_metrics), (sorted(metrics), sorted(ref_metrics))
        for k in ("loss", *(k for k in metrics if k not in ("loss", "grad_norm", "lr"))):
            worst = max(worst, float((metrics[k] - ref_metrics[k]).abs()))
        worst = max(worst, float((metrics["grad_norm"] - ref_metrics["grad_norm"]).abs()) * 1e-4)  # float32
    full = step.full_params(state)
    for name, p in ref_state.params.items():
        worst = max(worst, float((full[name] - p).abs().max()))
    return worst, in_order
