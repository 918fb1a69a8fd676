"""What a trace sets in the libraries a loss calls, so that it leaves nothing of itself there
and they run as they would eagerly (``tracing()``: all of it).

transformers caches tensors that some models build from Python values
(``compile_compatible_method_lru_cache``: BEiT's and Data2VecVision's relative position
indices, and the DETR, SAM and Mask2Former families') unless ``torch.compiler`` says it is
compiling. fsg's trace is not ``torch.compile``, so the cache would keep the trace's fake
tensor, and every later use of the model would read it: after a BEiT step was compiled, the
model's own eager loss came out as a fake tensor, and a second trace (an evaluation step) would
meet a fake tensor of another trace's mode. While fsg traces, that cache calls through.

(Setting ``torch.compiler.is_compiling()`` itself, as ``torch.export``'s non-strict tracing
does, would also do it, but ``torch.compile``d functions called in a loss then run their
compiled code on the fake tensors, and transformers' mixture-of-experts layers pick other
kernels.)

torch's fake tensors log every op whose meta function raised, at ERROR with the whole stack,
before raising the same error: a shape bug in a loss printed some fifty lines of torch
internals above its own traceback. While fsg traces, that one log record is dropped (the error
still propagates, the user's line in its traceback).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Iterator

from fsg._src import _torch_private
from fsg._src.trace import packed_sequences, stand_ins


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Within: libraries' caches bypassed, torch's failed meta calls not logged (raised only),
    torch code a trace cannot run as written replaced (``stand_ins``, ``packed_sequences``), and
    FlexAttention's advice to compile it not shown (the step compiles it)."""
    quiet = _MetaFailuresQuiet()
    _torch_private.FAKE_TENSOR_LOG.addFilter(quiet)
    try:
        with caches_bypassed(), stand_ins.traceable(), packed_sequences.traceable(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            yield
    finally:
        _torch_private.FAKE_TENSOR_LOG.removeFilter(quiet)


class _MetaFailuresQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def caches_bypassed() -> Iterator[None]:
    """Within: transformers' tensor caches call through (when transformers is imported)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    if utils is None or not callable(getattr(utils, "is_torchdynamo_compiling", None)):
        yield
        return
    saved = utils.is_torchdynamo_compiling
    utils.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        utils.is_torchdynamo_compiling = saved
