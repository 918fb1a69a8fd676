"""Cluster topology: describe a cluster, place mesh axes on its links, predict communication.

``python -m fsg.topology plan --topology cluster.yaml --model gpt-175b`` prints a plan.
"""

from fsg._src.topology.cost import CostModel as CostModel
from fsg._src.topology.cost import KindCost as KindCost
from fsg._src.topology.description import Topology as Topology
from fsg._src.topology.levels import Link as Link
from fsg._src.topology.placement import Placement as Placement
from fsg._src.topology.placement import place as place
from fsg._src.topology.plan import Plan as Plan
from fsg._src.topology.plan import plan as plan
from fsg._src.topology.workload import PRESETS as PRESETS
from fsg._src.topology.workload import GPTConfig as GPTConfig

__all__ = ["CostModel", "GPTConfig", "KindCost", "Link", "PRESETS", "Placement", "Plan", "Topology", "place", "plan"]
