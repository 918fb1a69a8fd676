"""What the benchmark scripts share (imported as a sibling module: each script runs as
``python benchmarks/<name>.py`` from the repository root)."""

from __future__ import annotations

import os
from pathlib import Path

# torchao's float8 training recipes the baselines may run, by implementation name
TORCHAO_RECIPES = {
    "compile-fp8": "tensorwise",
    "compile-fp8-row": "rowwise",
    "compile-fp8-row-gwhp": "rowwise_with_gw_hp",
}


def torchao_float8(model, impl: str) -> None:
    """``model``'s linear layers converted in place by torchao's ``convert_to_float8_training``
    with ``impl``'s recipe (``TORCHAO_RECIPES``), as a user of torchao would: the output head
    kept in bf16, and the layers whose dims are not multiples of 16 (cuBLASLt's FP8 GEMMs need
    them) left as they are. Needs torchao (carried to the GPU machine as a wheel)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def fp8_filter(module, fqn: str) -> bool:
        return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[impl])
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)


FAST_ACCUM = {"-fastgi": ("forward", "grad_input"), "-fastall": ("forward", "grad_input", "grad_weight")}


def float8_config(impl: str, configs: dict):
    """``configs[impl]`` (an ``fsg.Float8`` or ``None``), where ``impl`` may end in a suffix of
    ``FAST_ACCUM``: ``-fastgi`` (the grad-inputs accumulate fast too) or ``-fastall`` (all)."""
    import fsg

    for suffix, roles in FAST_ACCUM.items():
        if impl.endswith(suffix) and configs.get(impl[: -len(suffix)]) is not None:
            return fsg.Float8(**{**configs[impl[: -len(suffix)]]._asdict(), "fast_accum": roles})
    return configs.get(impl)


def byte_windows(data: bytes, n: int, batch: int, seq: int, seed: int, device: str):
    """``n`` batches of ``batch`` random windows of ``seq + 1`` bytes of ``data`` (drawn from
    ``seed``), as ``(inputs, targets)`` pairs of token ids on ``device``."""
    import torch

    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq - 1, (n, batch), generator=g)
    windows = tokens[starts[..., None] + torch.arange(seq + 1)]  # [n, B, T + 1]
    return [(w[:, :-1].to(device), w[:, 1:].to(device)) for w in windows]


def profile_table(step, sync, path: Path, steps: int = 3) -> None:
    """A CUDA-time table of ``steps`` more calls of ``step(i)`` (torch.profiler), top kernels
    first, written to ``path``: the costliest 60 rows, or ``FSG_PROFILE_ROWS`` from the environment;
    ``FSG_PROFILE_TRACE=1`` also writes the timeline (``path`` with ``.json``, chrome://tracing)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        sync()
    rows = int(os.environ.get("FSG_PROFILE_ROWS", "60"))
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} steps\n{table}\n")
    if os.environ.get("FSG_PROFILE_TRACE") == "1":
        prof.export_chrome_trace(str(path.with_suffix(".json")))
