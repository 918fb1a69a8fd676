"""Pipeline parallelism: the options, the schedules as data, and their simulator.

Example:
  >>> from fsg.pipeline import make_schedule, simulate
  >>> timeline = simulate(make_schedule("zbh1", 4, 8))
  >>> round(timeline.bubble, 3)
  0.111
"""

from fsg._src.pipeline.actions import Action as Action
from fsg._src.pipeline.actions import Schedule as Schedule
from fsg._src.pipeline.options import Pipeline as Pipeline
from fsg._src.pipeline.schedules import make_schedule as make_schedule
from fsg._src.pipeline.simulate import Cost as Cost
from fsg._src.pipeline.simulate import Event as Event
from fsg._src.pipeline.simulate import Timeline as Timeline
from fsg._src.pipeline.simulate import simulate as simulate
from fsg._src.pipeline.step import PipelineStep as PipelineStep

__all__ = ["Action", "Cost", "Event", "Pipeline", "PipelineStep", "Schedule", "Timeline", "make_schedule", "simulate"]
