"""Convolutions on a mesh (issue 60): each rank convolves its own images, the step graph holds
only functional collectives, and the result is the global convolution's.

torch's DTensor convolution handlers exchanged halo columns with raw ``c10d.send``/``recv_``
ops wherever an input was sharded on a dim other than the batch, which a BatchNorm's output is
on a data mesh: examples/resnet.py on ``dp=2`` failed to compile under Inductor and aot_eager.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dist import convolution_workers


@st.composite
def conv_case_strategy(draw) -> dict:
    """A convolution (1-D or 2-D, strided, padded, grouped or transposed) and placements of its
    images, output gradient and weight on a 2-rank mesh."""
    groups = draw(st.sampled_from([1, 2]))
    transposed = draw(st.booleans())
    stride = draw(st.sampled_from([1, 2]))
    kernel = draw(st.sampled_from([1, 2, 3]))
    images = st.sampled_from(["batch", "channels", "width", "replicated", "partial"])
    return {
        "seed": draw(st.integers(0, 2**16)),
        "dims": draw(st.sampled_from([1, 2])),
        "n": draw(st.integers(1, 5)),
        "c_in": groups * draw(st.integers(1, 3)),
        "c_out": groups * draw(st.integers(1, 3)),
        "groups": groups,
        "kernel": kernel,
        "size": draw(st.integers(kernel, 6)),
        "stride": stride,
        "padding": draw(st.integers(0, (kernel - 1) // 2 if transposed else kernel // 2)),
        "transposed": transposed,
        "bias": draw(st.booleans()),
        "x": draw(images),
        "grad_out": draw(images),
        "weight": draw(st.sampled_from(["replicated", "split"])),
        "data_axis": draw(st.booleans()),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=conv_case_strategy())
def test_convolution_on_any_placement_equals_the_global_one(ranks, case):
    ranks(2).run(convolution_workers.check_conv_matches_global, case)


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_conv_batchnorm_step_holds_only_functional_collectives_and_matches_unsharded(ranks, preset):
    ranks(2).run(convolution_workers.check_conv_bn_step, preset)


def test_guard_stops_a_raw_collective(ranks):
    ranks(2).run(convolution_workers.check_guard_stops_raw_collectives)
