"""Multi-process set-up: ``initialize()`` under ``torchrun``."""

from fsg._src.distributed import ProcessInfo as ProcessInfo
from fsg._src.distributed import initialize as initialize
from fsg._src.distributed import shutdown as shutdown

__all__ = ["ProcessInfo", "initialize", "shutdown"]
