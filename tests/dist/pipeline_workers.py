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

    def __init__(self, n: int, d: int = 6, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.inp = nn.Linear(3, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + self.drop(torch.tanh(layer(h)))
        return self.head(h)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        q, k, v = (
            t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x_BTD)).split(D, -1)
        )
        a_BTD = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
            .transpose(1, 2)
            .reshape(B, T, D)
        )
        x_BTD = x_BTD + self.proj(a_BTD)
        return x_BTD + self.out(F.gelu(self.fc(self.ln2(x_BTD))))


class Gpt(nn.Module):
    """A tiny GPT whose head is tied to its token embedding (GPT-2's ``wte``)."""

    def __init__(self, n: int, vocab: int = 11, d: int = 8, t: int = 5, dropout: float = 0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d, 2, dropout) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx_BT):
        x = self.drop(self.wte(idx_BT) + self.wpe(torch.arange(idx_BT.shape[1])))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def problem(model: str, layers: int, rows: int):
    """``(loss_fn, params, batch)`` of a model, seeded: the same on every rank."""
    torch.manual_seed(0)
    dropout = 0.25 if model.endswith("-dropout") else 0.0  # masks keyed by the step: the same as unsharded
    if model == "mlp-frozen":  # what the unsharded step keeps untrained (frozen.py), on the stages' ranks
        net = Mlp(layers).double()
        net.layers[1].weight.requires_grad_(False)  # frozen: fsg.apply detaches it
        own = set(fsg.params(net))
        extra = {"unused": torch.randn(3, dtype=torch.float64), "sign": torch.randn(2, dtype=torch.float64)}

        def loss_fn(params, batch):
            out = fsg.apply(net, {k: v for k, v in params.items() if k in own}, batch["x"])
            # read only through a comparison: no gradient reaches it; "unused" is read by no stage
            return ((out * (params["sign"] > 0) - batch["y"]) ** 2).mean()

        batch = {"x": torch.randn(rows, 3, dtype=torch.float64), "y": torch.randn(rows, 2, dtype=torch.float64)}
        return loss_fn, {**fsg.params(net), **extra}, batch
    if model in ("mlp", "mlp-ratio", "mlp-dropout"):
        net = Mlp(layers, dropout=dropout).double()

        def loss_fn(params, batch):
            squares = (fsg.apply(net, params, batch["x"]) - batch["y"]) ** 2
            if model != "mlp-ratio":
                return squares.mean()
            # not a mean of per-row terms: a ratio of two sums over the rows (both reduced over dp)
            return squares.sum() / (batch["y"].abs().sum() + squares.detach().max())

        batch = {"x": torch.randn(rows, 3, dtype=torch.float64), "y": torch.randn(rows, 2, dtype=torch.float64)}
    else:
        net = Gpt(layers, dropout=dropout).double()

        def loss_fn(params, batch):
            logits = fsg.apply(net, params, batch["idx"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
            return loss, {"logit_mean": logits.mean()}

        batch = {"idx": torch.randint(0, 11, (rows, 5)), "targets": torch.randint(0, 11, (rows, 5))}
    return loss_fn, fsg.params(net), batch


OPTIMIZER = fsg.optim.adamw(1e-2, weight_decay=0.1)
CLIPPED = fsg.optim.chain(fsg.optim.clip_by_global_norm(0.05), fsg.optim.adamw(1e-2, weight_decay=0.1))
_REFERENCES: dict = {}  # unsharded steps by (model, layers, accum_steps): a drawn case's baseline is traced once


def pipeline_matches_unsharded(
    model, layers, schedule, virtual, split_points, accum, steps=2, backend="eager", dp=1, clip=False, poison=None
):
    """Runs ``steps`` pipeline steps and the unsharded ones; returns the largest difference of
    any parameter and metric, and whether each call ran this rank's actions in the schedule's order.

    ``dp``: the mesh is ``{"pp": world // dp, "dp": dp}``; ``clip``: the optimizer clips by the
    global norm; ``poison``: the step at which one input row is NaN (both steps skip it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss_fn, params, batch = problem(model, layers, 2 * accum * dp)
    pipeline = fsg.Pipeline(schedule=schedule, split_points=split_points, virtual_stages=virtual)
    mesh = fsg.testing.mesh({"pp": world // dp, **({"dp": dp} if dp > 1 else {})})
    optimizer, skip = CLIPPED if clip else OPTIMIZER, poison is not None
    options = {"optimizer": optimizer, "accum_steps": accum, "skip_nonfinite": skip}
    step = fsg.compile_step(loss_fn, mesh, backend=backend, pipeline=pipeline, **options)
    key = (model, layers, accum, dp, clip, skip)
    if key not in _REFERENCES:
        # (its loss_fn's model is a template of the same structure: the params come from the state)
        _REFERENCES[key] = fsg.compile_step(loss_fn, backend="eager", **options)
    reference = _REFERENCES[key]
    state, ref_state = step.init(params, batch=batch), reference.init(params)
    worst, in_order = 0.0, True
    want = list(step.schedule().schedule.actions[step.pipeline_index])
    for i in range(steps):
        batch = {k: v.roll(i, 0) for k, v in batch.items()}
        if i == poison:
            batch["x"] = batch["x"].clone()
            batch["x"][-1, 0] = float("nan")
        state, metrics = step(state, batch)
        ref_state, ref_metrics = reference(ref_state, batch)
        in_order &= step.executed == want
        assert sorted(metrics) == sorted(ref_metrics), (sorted(metrics), sorted(ref_metrics))
        for k in ("loss", "skipped", *(k for k in metrics if k not in ("loss", "grad_norm", "lr", "skipped"))):
            if k in metrics:
                worst = max(worst, _difference(metrics[k], ref_metrics[k]))
        worst = max(worst, _difference(metrics["grad_norm"], ref_metrics["grad_norm"]) * 1e-4)  # float32
    full = step.full_params(state)
    for name, p in ref_state.params.items():
        worst = max(worst, _difference(full[name], p))
    return worst, in_order


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference, 0 where both are the same non-finite value, inf where
    only one is finite (a NaN never hides in ``max``)."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    d = torch.where(same, torch.zeros_like(a), (a - b).abs())
    return float(torch.nan_to_num(d, nan=float("inf")).max())


def checkpoint_restores_anywhere(path: str, dp: int, other_pp: int):
    """On ``{"pp": world // dp, "dp": dp}``: two steps, a save, a third step. Then the saved
    checkpoint restored three ways, each running the third step again: onto the same mesh
    (bit for bit), onto ``{"pp": other_pp}`` and into the unsharded step (to 1e-10). Returns
    the largest differences ``(same, other pp, unsharded)`` and whether
    ``fsg.checkpoint.save`` of one rank's part was refused."""
    world = dist.get_world_size()
    loss_fn, params, batch = problem("gpt", 4, 8)
    pipeline = fsg.Pipeline(schedule="gpipe")

    def pipeline_step(axes):
        mesh = fsg.testing.mesh(axes)
        return fsg.compile_step(loss_fn, mesh, optimizer=CLIPPED, accum_steps=2, backend="eager", pipeline=pipeline)

    def batch_at(i):
        return {k: v.roll(i, 0) for k, v in batch.items()}

    step = pipeline_step({"pp": world // dp, **({"dp": dp} if dp > 1 else {})})
    state = step.init(params, batch=batch)
    for i in range(2):
        state, _ = step(state, batch_at(i))
    try:  # the plain save of one rank's part is refused, naming step.save
        fsg.checkpoint.save(path + ".plain", state)
        refused = False
    except fsg.CheckpointError as exc:
        refused = "step.save" in str(exc)
    step.save(path, state, metadata={"step": 2})
    after, metrics = step(state, batch_at(2))
    want = step.full_params(after)

    same = step.restore(path, like=step.init(params, batch=batch))
    again, metrics_again = step(same, batch_at(2))
    exact = max(_difference(a, b) for a, b in zip(tree_leaves(again), tree_leaves(after)))
    exact = max(exact, _difference(metrics["loss"], metrics_again["loss"]))

    other = pipeline_step({"pp": other_pp})
    restored = other.restore(path, like=other.init(params, batch=batch))
    moved, _ = other(restored, batch_at(2))
    moved_full = other.full_params(moved)
    other_pp_diff = max(_difference(moved_full[n], want[n]) for n in want)

    reference = fsg.compile_step(loss_fn, optimizer=CLIPPED, accum_steps=2, backend="eager")
    ref_state = fsg.checkpoint.restore(path, like=reference.init(params))
    ref_state, ref_metrics = reference(ref_state, batch_at(2))
    unsharded = max(_difference(ref_state.params[n], want[n]) for n in want)
    unsharded = max(unsharded, _difference(ref_metrics["loss"], metrics["loss"]))
    return exact, other_pp_diff, unsharded, refused


def tree_leaves(state):
    import optree

    return [leaf for leaf in optree.tree_leaves(state, namespace="fsg") if isinstance(leaf, torch.Tensor)]


def hf_matches_unsharded(kinds: tuple, schedule: str = "1f1b") -> dict:
    """Hugging Face families of tests/models/hf_models.py, in float64, as users bring them
    (``model(**batch).loss``): two pp steps of 2 microbatches against the unsharded step; kind ->
    the largest difference of the loss and every parameter, or the error (every rank alike)."""
    from tests.models import hf_models

    world, results = dist.get_world_size(), {}
    for kind in kinds:
        try:
            model = hf_models.make(kind).double()
            loss_fn, params = hf_models.loss_fn(model), fsg.params(model)
            batch = {
                k: v.double() if v.is_floating_point() else v for k, v in hf_models.batches(1, kind=kind)[0].items()
            }
            options = {"optimizer": OPTIMIZER, "accum_steps": 2, "backend": "eager"}
            mesh = fsg.testing.mesh({"pp": world})
            step = fsg.compile_step(loss_fn, mesh, pipeline=fsg.Pipeline(schedule=schedule), **options)
            reference = fsg.compile_step(loss_fn, **options)
            state, ref_state, worst = step.init(params, batch=batch), reference.init(params), 0.0
            for i in range(2):
                rolled = {k: v.roll(i, 0) for k, v in batch.items()}
                (state, metrics), (ref_state, ref_metrics) = step(state, rolled), reference(ref_state, rolled)
                worst = max(worst, _difference(metrics["loss"], ref_metrics["loss"]))
            full = step.full_params(state)
            results[kind] = max([worst, *(_difference(full[n], p) for n, p in ref_state.params.items())])
        except Exception as e:  # noqa: BLE001 (reported by kind)
            results[kind] = f"{type(e).__name__}: {str(e)[:1500]}"
    return results
