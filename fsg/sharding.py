"""Sharding rules and presets: which partition spec each parameter gets."""

from fsg._src.rules import Rules as Rules
from fsg._src.rules import data_parallel as data_parallel
from fsg._src.rules import fsdp as fsdp
from fsg._src.rules import fsdp_tensor_parallel as fsdp_tensor_parallel
from fsg._src.rules import rules as rules
from fsg._src.rules import tensor_parallel as tensor_parallel

__all__ = ["Rules", "data_parallel", "fsdp", "fsdp_tensor_parallel", "rules", "tensor_parallel"]
