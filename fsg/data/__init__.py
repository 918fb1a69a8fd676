"""Deterministic, resumable, sharded token data: sources, ``Loader`` and ``prepare``.

``Loader`` yields each data-parallel rank's rows of a global sequence of ``[B, T + 1]`` token
blocks that is a pure function of ``(seed, epoch, position)``; its ``state_dict()`` goes in the
checkpoint beside the train state. See docs/data.md.
"""

from fsg._src.data._formats import read_layout as read_layout
from fsg._src.data._formats import write_tokens as write_tokens
from fsg._src.data._loader import Loader as Loader
from fsg._src.data._order import permute as permute
from fsg._src.data._prepare import prepare as prepare
from fsg._src.data._sources import TokenFile as TokenFile
from fsg._src.data._sources import Tokens as Tokens
from fsg._src.errors import DataError as DataError

__all__ = ["DataError", "Loader", "TokenFile", "Tokens", "permute", "prepare", "read_layout", "write_tokens"]
