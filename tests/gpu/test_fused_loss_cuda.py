"""The fused loss on CUDA (skipped without a GPU), where it is on by default: Hugging Face
models' cross-entropy traced as ``linear_cross_entropy`` (its Triton kernel), compiled by
Inductor and replayed as a CUDA graph, trains as the loss written out does."""

import pytest
import torch

import fsg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

from tests.models import hf_models  # noqa: E402


def _losses(kind: str, fused: bool | None, precision: fsg.Policy, steps: int = 4):
    model = hf_models.make(kind).cuda()
    step = fsg.compile_step(hf_models.loss_fn(model), optimizer=fsg.optim.adamw(1e-3), precision=precision,
                            fused_loss=fused)  # fmt: skip
    state = step.init(fsg.params(model))
    batches = [{k: v.cuda() for k, v in b.items()} for b in hf_models.batches(steps, kind=kind)]
    ops = step.lower(state, batches[0]).op_counts()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return torch.stack(losses).cpu(), sum(n for op, n in ops.items() if op.startswith("fsg.linear_cross_entropy"))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_default_step_on_cuda_fuses_the_loss_and_trains_as_written(kind, compute):
    precision = fsg.Policy(compute=compute)
    fused, n_fused = _losses(kind, None, precision)
    plain, n_plain = _losses(kind, False, precision)
    assert (n_fused, n_plain) == (1, 0)
    tol = 1e-4 if compute == torch.float32 else 2e-2  # bf16: the GEMMs' and kernels' rounding
    torch.testing.assert_close(fused, plain, rtol=tol, atol=tol)
    assert bool(torch.isfinite(fused).all())
