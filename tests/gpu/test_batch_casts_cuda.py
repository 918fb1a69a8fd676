"""The parameters' casts as one multi-tensor launch on CUDA (passes/batch_casts.py,
kernels/cast_flat.py; skipped without a GPU): the kernel's bits against ``.to()``, and a GPT
step with and without the pass, replayed as a CUDA graph."""

import pytest
import torch

from fsg._src.kernels import cast_flat as K
from fsg._src.passes.options import Fusions
from tests.helpers import gpt_bf16_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_flat_is_to_bit_for_bit_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(768, 2304), (2304,), (3, 5), (0,), (50304, 768), (1,), (4097,)]
    tensors = [torch.randn(s, device="cuda", generator=g) * 1e3 for s in shapes]
    tensors.append(torch.tensor([1.00390625, -1.01171875, 3e-41, float("inf"), -1e39], device="cuda"))  # ties, subnormal
    flat = K.cast_flat(tensors, dtype)
    starts, total = K.flat_offsets([t.numel() for t in tensors])
    assert flat.shape == (total,)
    for t, s in zip(tensors, starts):
        piece = flat[s : s + t.numel()].view(t.shape)
        assert torch.equal(piece.view(torch.int16), t.to(dtype).view(torch.int16)), t.shape


def _gpt(enabled: bool):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (8, 257), generator=g) for _ in range(5)]
    config = dict(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=256)
    return gpt_bf16_steps(config, rows, "cuda", fusions=Fusions(batch_casts=enabled))


def test_a_gpt_step_with_one_cast_launch_cuda():
    """One ``cast_flat`` feeds every parameter read; five steps (a captured and replayed CUDA
    graph) train as the step with a cast kernel per parameter does."""
    text, losses, params = _gpt(True)
    text_plain, losses_plain, params_plain = _gpt(False)
    assert text.count("fsg.cast_flat.default(") == 1 and "cast_flat" not in text_plain
    print("losses", losses, losses_plain, "same bits:", all(torch.equal(params[k], params_plain[k]) for k in params))
    assert max(abs(a - b) for a, b in zip(losses, losses_plain)) < 1e-2
