"""``compile_step``'s pipeline branch: what a step on a mesh with a ``pp`` axis supports yet,
checked before it is built."""

from __future__ import annotations

from typing import Any, Callable

from fsg._src.errors import ArgumentError, UnsupportedError
from fsg._src.mesh import Mesh
from fsg._src.optim._base import GradientTransformation
from fsg._src.pipeline.options import Pipeline
from fsg._src.pipeline.step import PipelineStep

# compile_step's options a pipeline step runs with, and the value each must keep in this slice
_DEFAULTS = {
    "param_sharding": None,
    "batch_sharding": None,
    "precision": None,
    "microbatch_weight": None,
    "fused_optimizer": (None, False),
    "cuda_graph": (None, False),
    "verify": False,
    "skip_nonfinite": (None, False, True),
    "check_replicas": (None, 0),
    "fused_loss": (None, False),
}


def compile_pipeline_step(
    loss_fn: Callable[..., Any],
    mesh: Mesh | None,
    optimizer: GradientTransformation,
    pipeline: Pipeline | None,
    options: dict[str, Any],
) -> PipelineStep:
    """``compile_step``'s pipeline branch: checks what this slice supports, then builds the step."""
    pipeline = Pipeline() if pipeline is None else pipeline
    if not isinstance(pipeline, Pipeline):
        raise ArgumentError(f"compile_step(pipeline=...) takes an fsg.Pipeline, got {type(pipeline).__name__}")
    if mesh is None or "pp" not in mesh.axis_names:
        raise ArgumentError("compile_step(pipeline=...) needs a mesh with a 'pp' axis, e.g. fsg.Mesh({'pp': 2})")
    if set(mesh.axis_names) - {"pp", "dp"}:
        raise UnsupportedError(
            f"a pipeline step runs on a mesh of the 'pp' and 'dp' axes for now; {mesh!r} adds "
            f"{[a for a in mesh.axis_names if a not in ('pp', 'dp')]} (pp x fsdp and pp x tp are follow-ups): use "
            f"fsg.Mesh({{'pp': N, 'dp': M}})"
        )
    for name, allowed in _DEFAULTS.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        value = options.get(name, allowed[0])
        if value not in allowed:
            raise UnsupportedError(
                f"compile_step({name}={value!r}) is not supported with a pipeline (pp) mesh yet; leave {name} at "
                f"its default for a pp step"
            )
    return PipelineStep(
        loss_fn,
        mesh,
        optimizer,
        pipeline,
        accum_steps=options.get("accum_steps", 1),
        backend=options.get("backend", "inductor"),
        strict=options.get("strict", False),
        skip_nonfinite=bool(options.get("skip_nonfinite")),
    )
