"""``fsg.compile_step``: the one entry point, and the documentation of every option."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fsg._src.mesh import Mesh, P
from fsg._src.optim._base import GradientTransformation
from fsg._src.passes import options as fusion_options
from fsg._src.passes.options import Fusions
from fsg._src.pipeline.compile import compile_pipeline_step
from fsg._src.pipeline.options import Pipeline
from fsg._src.pipeline.step import PipelineStep
from fsg._src.precision import Policy
from fsg._src.rules import Rules
from fsg._src.runtime import validate
from fsg._src.runtime.nonfinite import SkipNonFinite
from fsg._src.runtime.step import LossFn, Step


def compile_step(
    loss_fn: LossFn,
    mesh: Mesh | None = None,
    *,
    optimizer: GradientTransformation,
    param_sharding: Rules | None = None,
    batch_sharding: P | None = None,
    precision: Policy | None = None,
    accum_steps: int = 1,
    microbatch_weight: Callable[[Any], torch.Tensor] | None = None,
    backend: str = "inductor",
    donate: bool = True,
    strict: bool = False,
    fused_optimizer: bool | None = None,
    cuda_graph: bool | None = None,
    bucket_mb: float | None = 25.0,
    verify: bool = False,
    skip_nonfinite: bool | SkipNonFinite | None = None,
    check_replicas: int | None = None,
    fused_loss: bool | None = None,
    fusions: Fusions | None = None,
    pipeline: Pipeline | None = None,
) -> Step | PipelineStep:
    """Compiles the whole train step of ``loss_fn`` (forward, backward, optimizer) into one graph.

    Tracing happens at the first call, on the abstract values (shapes, dtypes) of the state
    and batch; later calls with the same signature replay the compiled graph. A new signature
    traces and compiles again, with a ``RecompileWarning`` naming the leaf that changed.

    ``loss_fn`` has global semantics (as under ``jax.jit``): it is written as if everything
    lived on one device; the mesh and specs change where work runs and which collectives are
    issued, not the result.

    Args:
      loss_fn: a pure ``loss_fn(params, batch)`` returning a 0-d loss tensor or
        ``(loss, aux)`` with ``aux`` a dict of tensors (reported as metrics). It may not
        mutate its inputs nor read tensor values on the host (``.item()``, ``if x > 0``).
      mesh: an ``fsg.Mesh``; ``None`` (or a mesh of size 1) runs on one device.
      optimizer: a ``fsg.optim.GradientTransformation``.
      param_sharding: ``fsg.sharding`` rules giving each parameter's spec; default replicated.
      batch_sharding: the spec of every batch leaf; default ``P("dp")`` (dim 0 over the
        ``dp`` axis) when the mesh has a ``dp`` axis. The axes it names are the data axes.
        A 0-d batch leaf is replicated whatever the spec.
        Pass batches as global tensors (each rank keeps its slice) or as DTensors.
      precision: an ``fsg.Policy``: the dtype params and optimizer state live in, and the
        dtype the loss computes in (default: float32 for both).
      accum_steps: split each batch into this many microbatches along dim 0 and average
        their gradients, loss and aux in the one graph (gradient accumulation).
      microbatch_weight: with ``accum_steps`` > 1, a function of a microbatch giving its
        weight as a 0-d tensor (e.g. its count of labelled tokens): the gradients, loss and
        aux become the weighted mean over microbatches, so that a loss averaged over a varying
        number of items (tokens with ``ignore_index``, padding) equals the full batch's, as
        Hugging Face's ``num_items_in_batch``. ``None`` (default): equal weights
        (docs/compiling.md#gradient-accumulation).
      backend: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"`` (no compiler).
      donate: update the state in place (no second copy of params and optimizer state);
        the state passed in is returned, updated.
      strict: raise ``RecompileError`` instead of recompiling when the signature changes.
      fused_optimizer: replace the traced ``fsg.optim.adamw`` update by the fused Triton
        kernel (one launch per dtype group, in place; on a mesh each rank updates its own
        pieces after the gradient reductions). ``None`` (default): on CUDA, when the optimizer
        is ``adamw`` or ``adam`` and ``donate=True``; ``True``: always (also
        on CPU, under ``TRITON_INTERPRET=1`` or via its eager reference), raising if it
        cannot; ``False``: never.
      cuda_graph: replay the whole compiled step as one CUDA graph from its third call on
        (call 1 compiles, call 2 warms up and captures). ``None`` (default): whenever the
        state and batch are on CUDA, on one device, with ``donate=True``; ``True``: raise if
        it cannot, and replay on a mesh too, NCCL collectives inside the graph
        (experimental); ``False``: never. The batch is copied into the graph's own buffers; a
        state in other storages (a restored checkpoint) is captured again.
      bucket_mb: on a mesh, pack gradient all-reduces (and FSDP's reduce-scatters) into
        buckets of at most this many MiB and issue each as soon as its last gradient is
        computed, so that reductions overlap the rest of the backward (as DDP's
        ``bucket_cap_mb``); FSDP's parameter all-gathers are packed the same way and each
        bucket is gathered while the previous one's layers compute. ``None`` or 0: one
        collective per tensor, where stage 2 placed it.
      verify: on a mesh, check the first step against the unsharded step before running it
        (``fsg.testing.verify_step``: both in float64, every metric and state leaf compared)
        and raise ``fsg.VerificationError`` naming the first leaf that differs. Costs two
        extra traces at the first call; nothing after.
      skip_nonfinite: a step whose loss or gradient holds a NaN or an Inf leaves params,
        optimizer state and buffers unchanged, decided in the graph (no host sync) and alike
        on every rank; ``metrics["skipped"]`` and ``state.skips`` count such steps.
        ``None`` or ``False`` (default): off (on CUDA, torch 2.11's Inductor failed to
        launch a kernel of the skipping step of a small GPT: docs/resilience.md); ``True``: on, raising
        ``fsg.NonFiniteError`` after 100 skips in a row (checked every 100 steps);
        ``fsg.SkipNonFinite(max_consecutive=, check_every=)``: on, with those numbers;
        Always on under a float16 loss scale (docs/resilience.md).
      check_replicas: on a mesh, every this many calls (after the step) fingerprint every
        state leaf's local shard on its device, gather the fingerprints with one
        ``all_gather`` and raise ``fsg.ReplicaMismatchError`` naming the first leaf whose
        ranks holding the same shard hold different bytes, and those ranks (silent data
        corruption, replicas drifting apart). ``None`` or 0 (default): never. The check is
        ``fsg.check_replicas(state)``; its cost is in docs/resilience.md#replica-checks.
      fused_loss: trace ``F.cross_entropy`` of a bias-free linear layer's logits (in float32,
        as Hugging Face's losses compute it, or under CUDA autocast) as
        ``fsg.nn.linear_cross_entropy``: the logits are never held whole and the loss makes
        one pass over each chunk of them (docs/compiling.md#fused-loss): the same loss and
        gradients up to float32 rounding. ``None`` (default): when the state is on CUDA, where
        the fused kernels run (on the CPU the fused op runs its reference and gains nothing);
        ``True``: always; ``False``: never.
      fusions: experimental. A ``Fusions`` (``fsg._src.passes.options``) naming which fused
        kernels the graph passes and Inductor's code may use, each on by default where it
        applies; turning one off gives the unfused step (the A/B of ``benchmarks/gpt.py``,
        and the tests' baseline). Fixed for the step: part of its compile cache and of
        Inductor's cache tag (docs/compiling.md#fusions). ``None``: ``Fusions()``.
      pipeline: on a mesh with a ``pp`` axis, an ``fsg.Pipeline``: the schedule, the split
        points and the stages per rank; ``accum_steps`` is the microbatch count. ``None``
        there: ``fsg.Pipeline()`` (1F1B, split balanced by cost). The step is then a
        ``PipelineStep`` (``step.init(params, batch=example)``; docs/parallelism.md says what
        it supports yet).

    Returns:
      A ``Step``: ``state = step.init(params)``, then ``state, metrics = step(state, batch)``.

    Example:
      >>> model = torch.nn.Linear(4, 1)
      >>> def loss_fn(params, batch):
      ...     return ((fsg.apply(model, params, batch["x"]) - batch["y"]) ** 2).mean()
      >>> step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
      >>> state = step.init(fsg.params(model))
      >>> state, metrics = step(state, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})
      >>> sorted(metrics)
      ['grad_norm', 'loss', 'lr']
    """
    options = dict(
        backend=backend, donate=donate, strict=strict, param_sharding=param_sharding, batch_sharding=batch_sharding,
        precision=precision, accum_steps=accum_steps, microbatch_weight=microbatch_weight, fused_optimizer=fused_optimizer, cuda_graph=cuda_graph,
        bucket_mb=bucket_mb, verify=verify, skip_nonfinite=skip_nonfinite, check_replicas=check_replicas,
        fused_loss=fused_loss, fusions=fusion_options.check(fusions),
    )  # fmt: skip
    if pipeline is not None or (isinstance(mesh, Mesh) and "pp" in mesh.axis_names):
        return compile_pipeline_step(loss_fn, mesh, optimizer, pipeline, options)
    validate.check_compile_args(loss_fn, mesh, optimizer, options)
    return Step(loss_fn, optimizer, mesh=mesh, **options)
