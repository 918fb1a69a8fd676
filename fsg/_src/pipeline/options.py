"""``fsg.Pipeline``: how a step on a mesh with a ``pp`` axis is split and scheduled."""

from __future__ import annotations

import dataclasses

from fsg._src.errors import ArgumentError
from fsg._src.pipeline.schedules import SCHEDULES


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The pipeline options of ``fsg.compile_step`` on a mesh with a ``pp`` axis (part of the
    step's cache key: a frozen value).

    Args:
      schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"`` or ``"zbh1"``
        (zero bubble, Qi et al. 2023); docs/parallelism.md draws each.
      split_points: module paths the stages start at (the boundary sits before the first op
        of each), ``pp * virtual_stages - 1`` of them in forward order, e.g. ``("layers.2",)``
        (torchtitan's ``pipeline_parallel_split_points``); ``None``: cut between the model's
        repeated blocks so that the costliest stage (FLOPs) costs least.
      virtual_stages: stages per rank (more than 1 for ``"interleaved"`` only).

    Example:
      >>> fsg.Pipeline(schedule="gpipe", split_points=["layers.1"])
      Pipeline(schedule='gpipe', split_points=('layers.1',), virtual_stages=1)
    """

    schedule: str = "1f1b"
    split_points: tuple[str, ...] | None = None
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ArgumentError(f"Pipeline(schedule={self.schedule!r}) is unknown; choose one of {SCHEDULES}")
        points = self.split_points
        if points is not None:
            if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
                raise ArgumentError(
                    f"Pipeline(split_points=...) is a list of module paths such as ['layers.4']; got {points!r}"
                )
            object.__setattr__(self, "split_points", tuple(points))
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ArgumentError(f"Pipeline(virtual_stages={v!r}) must be an int >= 1 (stages per rank)")
