"""Inductor's mix-order reductions whose column sums are a ``cat``'s inputs (skipped without a
GPU). Inductor computes such an input in place into the ``cat``'s output, but its mix-order
codegen bound the final sum to a new tensor, so the ``cat`` kept uninitialized memory: every
layer norm's weight and bias gradient of a data-parallel GPT step was wrong (torch 2.11 and
2.13; found on two H200s, 2026-12-04). ``backend/column_sums.py`` writes those sums into their
slice; this test holds it to eager's values, with and without fsg's column-sum kernel;
``test_sharding_cuda.py`` reruns the data-parallel check that found it."""

import re

import pytest
import torch

from fsg._src.backend import column_sums as CS
from fsg._src.passes.options import Fusions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROWS, C = 16384, 768  # a layer norm's backward that Inductor fuses as a mix-order reduction


def _norm_grads_into_a_cat(dy, x, mean, rstd, w, b, *others):
    """A layer norm's backward (its statistics saved by the forward, as in a train step) and
    its weight and bias gradients in a ``cat`` with more inputs than Inductor's pointwise
    ``cat`` takes, so that each input is computed into its slice."""
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, [C], mean, rstd, w, b, [True, True, True])
    return dx, torch.cat([dw, db, *(o.reshape(-1) * 2 for o in others)])


@pytest.mark.parametrize("kernel", [True, False], ids=["fsg-kernel", "inductor-sum"])
def test_the_sums_land_in_the_cat(kernel):
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator(device="cuda").manual_seed(0)
    dy, x = (torch.randn(ROWS, C, device="cuda", generator=g) for _ in range(2))
    w, b = torch.randn(C, device="cuda", generator=g) + 1, torch.randn(C, device="cuda", generator=g)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5)
    args = [dy, x, mean, rstd, w, b, *(torch.randn(64, 96, device="cuda", generator=g) for _ in range(9))]
    torch._dynamo.reset()
    with CS.final_sums_as_kernels(Fusions(column_sums=kernel)), torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(torch.compile(_norm_grads_into_a_cat), *args)
    into = re.compile(r"fsg_column_sum\(workspace.*, out=buf\d+\)" if kernel else r"buf\d+\.copy_\(workspace")
    assert any(into.search(code) for code in codes), (
        "no final sum written into the cat: the test no longer tests the fix"
    )
    for a, b in zip(got, _norm_grads_into_a_cat(*args)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
