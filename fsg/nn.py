"""Functional layers and losses."""

from fsg._src.kernels.layer_norm import layer_norm as layer_norm
from fsg._src.kernels.rms_norm import rms_norm as rms_norm
from fsg._src.losses import cross_entropy as cross_entropy

__all__ = ["cross_entropy", "layer_norm", "rms_norm"]
