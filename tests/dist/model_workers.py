"""Rank functions for tests/dist/test_models.py (spawn-importable)."""

import fsg
import fsg.testing
from tests.dist.workers import preset_rules
from tests.models import hf_models

# AdamW's first update is lr * g / (|g| + eps): with eps=1e-8 an element whose gradient is ~1e-8
# turns a last-bit difference of reassociation (a sharded sum) into a visible update difference
# (seen on Qwen3 and Phi-3: one element of 8192 off by 0.6%; their SGD steps match). A larger
# eps keeps the optimizer in the check without that amplification.
EPS = 1e-6


def check_hf(kind: str, axes: dict, preset: str, **options) -> int:
    """Sharded == unsharded for two steps of ``kind``; returns how many of its parameters the
    preset shards over a ``tp`` axis. ``options`` go to both ``compile_step`` calls."""
    model, mesh, rules = hf_models.make(kind), fsg.testing.mesh(axes), preset_rules(preset)
    fsg.testing.assert_sharded_matches_unsharded(
        hf_models.loss_fn(model), fsg.params(model), hf_models.batches(2, kind=kind), mesh,
        optimizer=fsg.optim.adamw(1e-3, eps=EPS), param_sharding=rules, batch_sharding=fsg.P("dp"),
        rtol=1e-4, atol=1e-5, **options,
    )  # fmt: skip
    return sum("tp" in str(rules.spec_for(name, tuple(p.shape), mesh)) for name, p in fsg.params(model).items())


def check_hf_corpus(kinds: tuple, axes: dict, preset: str, **options) -> dict:
    """``check_hf`` for each of ``kinds``: kind -> ("ok" or the error, parameters sharded over
    tp). Every rank raises alike: the comparison runs on gathered values."""
    results = {}
    for kind in kinds:
        try:
            results[kind] = ("ok", check_hf(kind, axes, preset, **options))
        except Exception as e:  # noqa: BLE001 (reported by kind)
            results[kind] = (f"{type(e).__name__}: {str(e)[:1500]}", 0)
    return results


def shifted_loss(params, batch):
    """A loss through a write into a slice, as T5's and BART's ``shift_right`` make their
    decoder inputs: functionalized, the write becomes ``aten.copy`` + ``slice_scatter``."""
    shifted = batch["x"].new_zeros(batch["x"].shape)
    shifted[:, 1:] = batch["x"][:, :-1] * params["w"][1:]
    shifted[:, 0] = params["w"][0]
    return (shifted.sin() * batch["x"]).sum(-1).mean()


def check_slice_write(axes: dict) -> tuple[list[str], int]:
    """Sharded == unsharded for ``shifted_loss``; returns the warnings the sharded step raised
    and how many ``aten.copy`` nodes its sharded graph keeps."""
    import warnings

    import torch

    g = torch.Generator().manual_seed(0)
    params, batch = {"w": torch.randn(8, generator=g)}, [{"x": torch.randn(4, 8, generator=g)} for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsg.testing.assert_sharded_matches_unsharded(
            shifted_loss, params, batch, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1),
            batch_sharding=fsg.P("dp"), rtol=1e-5, atol=1e-6,
        )  # fmt: skip
    step = fsg.compile_step(shifted_loss, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), backend="eager")
    text = step.lower(step.init(params), batch[0]).as_text("sharded")
    return [type(w.message).__name__ for w in caught], text.count("aten.copy.default(")
