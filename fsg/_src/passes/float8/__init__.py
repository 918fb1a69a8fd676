"""The float8 pass (``Policy(matmul=fsg.Float8())``): the linear layers' matmuls in FP8.

``matmuls`` finds the layers and rewrites their matmuls (``rewrite``; ``plan`` is what it is
told); ``quantize`` builds the scales, casts and FSDP's FP8 gathers; ``cost`` picks the layers
under ``Float8(filter="auto")``; ``fuse`` decides which casts a fused kernel computes, matched
by ``producers``, ``norms`` and ``weights``, with the graph helpers of ``graph``.
"""
