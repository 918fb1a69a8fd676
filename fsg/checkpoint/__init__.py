"""Checkpoints: msgpack state pytrees, atomic, asynchronous, sharded, resharded on restore."""

from fsg._src.checkpoint._checkpoint import read_meta as read_meta
from fsg._src.checkpoint._checkpoint import restore as restore
from fsg._src.checkpoint._checkpoint import save as save
from fsg._src.checkpoint._manager import CheckpointManager as CheckpointManager
from fsg._src.checkpoint._safetensors import export_safetensors as export_safetensors

__all__ = ["CheckpointManager", "export_safetensors", "read_meta", "restore", "save"]
