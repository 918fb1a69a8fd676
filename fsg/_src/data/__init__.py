"""``fsg.data``: token sources, a deterministic global batch order, and a prefetching loader.

Modules: ``_formats`` (token file layouts), ``_sources`` (memory-mapped and in-memory
tokens), ``_order`` (the stateless window permutation), ``_ranks`` (which rows a rank reads),
``_prefetch`` (the background workers that feed the device), ``_loader`` (``Loader``), ``_prepare``
(tokenizing text into token files).
"""
