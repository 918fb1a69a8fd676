"""Functional layers and losses."""

from fsg._src.kernels.cross_entropy import cross_entropy as cross_entropy
from fsg._src.kernels.layer_norm import layer_norm as layer_norm
from fsg._src.kernels.linear_cross_entropy import linear_cross_entropy as linear_cross_entropy
from fsg._src.kernels.rms_norm import rms_norm as rms_norm

__all__ = ["cross_entropy", "layer_norm", "linear_cross_entropy", "rms_norm"]
