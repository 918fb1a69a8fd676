"""NVML on a real GPU: the current device's NVLinks are read (skipped without CUDA)."""

import pytest
import torch

from fsg._src.topology import nvml

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_nvml_reads_the_current_gpus_links():
    bus_id = nvml.cuda_bus_id()
    assert bus_id == nvml.normalize_bus_id(bus_id)
    links = nvml.links_of(bus_id)
    if nvml._library() is None:
        pytest.skip("no libnvidia-ml.so.1 on this machine")
    assert links is not None and links.bus_id == bus_id
    assert 0 <= links.active <= nvml.MAX_LINKS
    assert nvml.nvlink_domains(["here"], [links]) == ["nvl0"]
