"""Stage 4: the last step of Inductor's mix-order reductions as one fsg kernel each.

Inductor (torch 2.10+) fuses a row-wise reduction with column-wise ones over the same rows (a
layer norm's backward with its weight and bias gradients and a neighbouring bias gradient)
into one kernel that leaves, per column sum, a float32 workspace of partial sums ``[n, C]``
(n = 1024 at 16,384 rows); its wrapper code then adds them up with ``ws[...].view(n, C)
.sum(dim=0)``, a torch reduction that zeroes its semaphores with a memset first. In a replayed
CUDA graph those memsets and hand-overs cost more than the fusion saved over separate column
reductions (``TORCHINDUCTOR_MIX_ORDER_REDUCTION=0``); fsg's kernel made the step faster
(benchmarks/RESULTS.md).

While fsg compiles a step, each such wrapper line calls ``kernels/column_sum.py``'s
``column_sum`` instead: one Triton launch, no memset, the rows summed in a fixed order (the
result is deterministic, as torch's is, but rounds differently, so the tag below keeps these
compiles apart from others in Inductor's cache). ``Fusions(column_sums=False)`` turns it off (the
A/B: ``benchmarks/gpt.py --impl fsg-atensums``).

The rewrite also corrects those lines where Inductor's are wrong (torch 2.11 and 2.13, found on
two GPUs, 2026-12-04): the line binds the sum to the buffer's name, a new tensor, even when the
buffer is a slice of another's storage (``NonOwningLayout``: a ``cat`` input Inductor computes
in place into the ``cat``'s output, as it does with the gradient buckets of a data-parallel
step). The sum never reached the ``cat``, which kept uninitialized memory there: every layer
norm's weight and bias gradient of a data-parallel GPT step was wrong. Here such a line
allocates the slice first and writes the sum into it, whether the kernel is on or not; a buffer of
any other foreign layout (a mutated input) raises ``UnsupportedError`` rather than compile a
step that computes something else.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fsg._src import _torch_private
from fsg._src.errors import UnsupportedError
from fsg._src.passes.options import Fusions

CACHE_TAG = "fsg.column_sum.v2"  # v2: final sums written into their slice (compiles before it are not reused)
FIX_TAG = "fsg.final_sums_in_place.v1"  # the kernel off: Inductor's sums, with the slices fixed
IMPORT = "from fsg._src.kernels.column_sum import column_sum as fsg_column_sum"


def rewrite(line: str, wrapper, kernel: bool = True) -> str:
    """``line`` with a mix-order reduction's final reduction corrected (written into the
    buffer's slice when the buffer is one) and, with ``kernel``, a final ``.sum(dim=0)`` as
    ``fsg_column_sum(...)`` (its import added to ``wrapper.imports`` once); any other line as
    it is. Raises ``UnsupportedError`` for a buffer of another foreign layout."""
    m = _torch_private.final_reduction_line(line)
    if m is None:
        return line
    indent, name, partials, op, tail = m
    storage = _torch_private.buffer_storage(name, wrapper)  # an alias's slice is allocated here
    if storage == "other":
        raise UnsupportedError(
            f"Inductor's mix-order reduction would bind its result {name} to a new tensor, but {name} "
            f"writes into another buffer (a mutated input): the step would compute something else. "
            f"Compile with TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 and report this graph to fsg"
        )
    in_place = storage == "alias"
    if kernel and op == "sum":
        if IMPORT not in wrapper.imports.getvalue():
            wrapper.imports.writeline(IMPORT)
        if in_place:
            return f"{indent}fsg_column_sum({partials}, out={name})"
        return f"{indent}{name} = fsg_column_sum({partials}){tail}"
    if in_place:
        return f"{indent}{name}.copy_({partials}.{op}(dim=0){tail})"
    return line


@contextlib.contextmanager
def final_sums_as_kernels(fusions: Fusions):
    """Within: Inductor compiles with ``rewrite`` applied to its wrapper code (the kernel where
    ``fusions.column_sums``), under a cache-key tag of its own (``CACHE_TAG``, or ``FIX_TAG``
    without the kernel, joined by ``fusions.tag()``: a compile under other fusions is not reused)."""
    tag = torch.compiler.config.cache_key_tag
    mine = f"{CACHE_TAG if fusions.column_sums else FIX_TAG}+{fusions.tag()}"
    tagged = torch.compiler.config.patch(cache_key_tag=f"{tag}+{mine}" if tag else mine)
    with tagged, _torch_private.wrapper_lines_rewritten(functools.partial(rewrite, kernel=fusions.column_sums)):
        yield
