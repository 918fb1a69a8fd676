"""The FP8 cast kernels the float8 pass puts in: rowwise casts fused into their producers
(``cast`` over ``cast_kernel``), a gated MLP's (``gated``), a layer norm's (``layer_norm``) and a
weight's two casts from its master (``weight``)."""
