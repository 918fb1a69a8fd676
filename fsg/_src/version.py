"""The version of fsg (written into checkpoint metadata)."""

__version__ = "0.1.0"
