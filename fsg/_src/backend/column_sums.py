"""Stage 4: the last step of Inductor's mix-order reductions as one fsg kernel each.

Inductor (torch 2.10+) fuses a row-wise reduction with column-wise ones over the same rows (a
layer norm's backward with its weight and bias gradients and a neighbouring bias gradient)
into one kernel that leaves, per column sum, a float32 workspace of partial sums ``[n, C]``
(n = 1024 at 16,384 rows); its wrapper code then adds them up with ``ws[...].view(n, C)
.sum(dim=0)``, a torch reduction that zeroes its semaphores with a memset first. In a replayed
CUDA graph each memset and each hand-over between it and a kernel costs 1.5-3 us on an H200: the
56 final sums of a GPT-2 124M step cost ~0.65 ms, against ~0.47 ms of kernel time the fusion
saved over separate column reductions (``TORCHINDUCTOR_MIX_ORDER_REDUCTION=0``). With fsg's
kernel the 124M step took 30.56 ms against 30.80 (RESULTS.md, eighteenth session).

While fsg compiles a step, each such wrapper line calls ``kernels/column_sum.py``'s
``column_sum`` instead: one Triton launch, no memset, the rows summed in a fixed order (the
result is deterministic, as torch's is, but rounds differently, so the tag below keeps these
compiles apart from others in Inductor's cache). ``ENABLED = False`` turns it off (the A/B:
``benchmarks/gpt.py --impl fsg-nocolsum``).
"""

from __future__ import annotations

import contextlib
import re

import torch

from fsg._src import _torch_private

ENABLED = True
CACHE_TAG = "fsg.column_sum.v1"
IMPORT = "from fsg._src.kernels.column_sum import column_sum as fsg_column_sum"
# ``buf = workspace_0[a : b].view(n, C).sum(dim=0)``, then torch 2.13's ``.view([C])`` and a
# ``.to(dtype)`` where the sum's buffer is not float32
_FINAL_SUM = re.compile(r"^(\s*)(\w+) = (\w+\[[^\]]*\]\.view\(.*?\))\.sum\(dim=0\)(.*)$")


def rewrite(line: str, imports) -> str:
    """``line`` with a mix-order reduction's final ``.sum(dim=0)`` as ``fsg_column_sum(...)``
    (the import added to ``imports`` once); any other line as it is."""
    m = _FINAL_SUM.match(line)
    if m is None:
        return line
    if IMPORT not in imports.getvalue():
        imports.writeline(IMPORT)
    return f"{m[1]}{m[2]} = fsg_column_sum({m[3]}){m[4]}"


@contextlib.contextmanager
def final_sums_as_kernels():
    """Within (when ``ENABLED``): Inductor compiles with ``rewrite`` applied to its wrapper
    code, under a cache-key tag of its own."""
    if not ENABLED:
        yield
        return
    tag = torch.compiler.config.cache_key_tag
    tagged = torch.compiler.config.patch(cache_key_tag=f"{tag}+{CACHE_TAG}" if tag else CACHE_TAG)
    with tagged, _torch_private.wrapper_lines_rewritten(rewrite):
        yield
