"""Rowwise FP8 (``Policy(matmul=fsg.Float8(recipe="rowwise"))``, issue 18) on models we did not
write: every family of the Hugging Face corpus (tests/models/hf_models.py) takes one step whose
loss and update track the bf16 step's, and the fused GELU-gradient and gated-MLP casts
(kernels/fp8/cast.py, kernels/fp8/gated.py) change nothing where a family's MLP has one."""

import pytest
import torch

import fsg
from fsg._src.passes.options import Fusions

pytest.importorskip("transformers")

from tests.models import hf_models  # noqa: E402

BF16 = fsg.Policy(compute=torch.bfloat16)
ROWWISE = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe="rowwise"))
NOT_CONVERTED = {
    "vit": "its 4 x 17 token rows (M=68) are not a multiple of 16, as cuBLASLt's FP8 GEMMs need",
    "beit": "its 4 x 17 token rows (M=68), as ViT's", "dinov2": "its 4 x 17 token rows (M=68), as ViT's",
    "deit": "its 4 x 18 token rows (class and distillation tokens: M=72) are not a multiple of 16",
    "poolformer": "its MLPs are 1x1 convolutions, and the classifier head stays bf16 by default",
}


UNFUSED = Fusions(fp8_producers=frozenset())  # no producer computes its output's FP8 cast


def one_step(kind, policy, fusions=None):
    """The first step's loss, the update it made (all parameters, flattened, float32) and the
    graph's op counts."""
    model = hf_models.make(kind)
    step = fsg.compile_step(
        hf_models.loss_fn(model),
        optimizer=fsg.optim.sgd(0.05),
        precision=policy,
        backend="eager",
        donate=False,
        fusions=fusions,
    )
    before, batch = step.init(fsg.params(model)), hf_models.batches(1, kind=kind)[0]
    after, metrics = step(before, batch)
    update = torch.cat([(after.params[k].float() - before.params[k].float()).flatten() for k in before.params])
    return float(metrics["loss"]), update, step.lower(before, batch).op_counts()


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_rowwise_step_tracks_the_bf16_step(kind):
    """Measured over the corpus: losses within 0.03%, updates at cosine >= 0.991 and norm ratio
    0.995-1.010 of the bf16 step's (Gemma 2, OPT and T5 the farthest)."""
    bf16_loss, bf16_update, _ = one_step(kind, BF16)
    loss, update, counts = one_step(kind, ROWWISE)
    assert (counts.get("aten._scaled_mm", 0) > 0) != (kind in NOT_CONVERTED), counts
    assert abs(loss - bf16_loss) <= 5e-3 * abs(bf16_loss), (loss, bf16_loss)
    cosine = float(update @ bf16_update / (update.norm() * bf16_update.norm()))
    assert cosine > 0.98 and 0.97 < float(update.norm() / bf16_update.norm()) < 1.03, cosine


@pytest.mark.parametrize("kind", ["bert", "gpt_neox"])  # erf GELU, tanh GELU (Gemma's gated GELU: below)
def test_the_fused_gelu_gradient_cast_equals_the_unfused_one(kind):
    loss, update, counts = one_step(kind, ROWWISE)
    assert counts.get("fsg.gelu_backward_fp8", 0) >= 2 and "aten.gelu_backward" not in counts
    plain_loss, plain_update, plain_counts = one_step(kind, ROWWISE, UNFUSED)
    assert "fsg.gelu_backward_fp8" not in plain_counts
    assert loss == plain_loss
    torch.testing.assert_close(update, plain_update, rtol=1e-3, atol=1e-7)


# fused (gated_fp8, gated_backward_fp8) per family, two layers: Phi-3's gate and up are the
# halves of one projection, so their gradients meet in a concatenation (cat_rowwise_fp8's) and
# only the product is a gated op's; Gemma's activation is a tanh GELU, the others' a SiLU
GATED = {"llama": (4, 2), "mistral": (4, 2), "qwen2": (4, 2), "qwen3": (4, 2), "phi3": (2, 0), "gemma": (4, 2),
         "gemma2": (4, 2)}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(GATED))
def test_the_fused_gated_mlp_casts_equal_the_unfused_ones(kind):
    """Each layer's gated MLP: the product and the up-projection's gradient in ``gated_fp8``,
    the gate's gradient in ``gated_backward_fp8``; the step is the unfused one's (loss bit for
    bit)."""
    loss, update, counts = one_step(kind, ROWWISE)
    products, gate_grads = GATED[kind]
    assert counts.get("fsg.gated_fp8") == products and counts.get("fsg.gated_backward_fp8", 0) == gate_grads, counts
    backward = "aten.gelu_backward" if kind.startswith("gemma") else "aten.silu_backward"
    assert counts.get(backward, 0) == 2 - gate_grads and "fsg.gelu_backward_fp8" not in counts
    plain_loss, plain_update, plain_counts = one_step(kind, ROWWISE, UNFUSED)
    assert "fsg.gated_fp8" not in plain_counts and plain_counts.get(backward) == 2
    assert loss == plain_loss
    torch.testing.assert_close(update, plain_update, rtol=1e-3, atol=1e-7)
