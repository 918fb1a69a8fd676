"""fsg: full-step graphs, a JAX-style functional training API for PyTorch."""

from fsg import checkpoint as checkpoint
from fsg import data as data
from fsg import distributed as distributed
from fsg import nn as nn
from fsg import optim as optim
from fsg import pipeline as pipeline
from fsg import sharding as sharding
from fsg import topology as topology
from fsg._src.errors import ArgumentError as ArgumentError
from fsg._src.errors import BatchError as BatchError
from fsg._src.errors import CheckpointError as CheckpointError
from fsg._src.errors import CudaGraphWarning as CudaGraphWarning
from fsg._src.errors import DataError as DataError
from fsg._src.errors import FsgError as FsgError
from fsg._src.errors import HostSyncError as HostSyncError
from fsg._src.errors import ImpureLossError as ImpureLossError
from fsg._src.errors import LossNotScalarError as LossNotScalarError
from fsg._src.errors import MeshError as MeshError
from fsg._src.errors import NonFiniteError as NonFiniteError
from fsg._src.errors import NonTensorLeafError as NonTensorLeafError
from fsg._src.errors import RecompileError as RecompileError
from fsg._src.errors import RecompileWarning as RecompileWarning
from fsg._src.errors import ReplicaMismatchError as ReplicaMismatchError
from fsg._src.errors import ShardingFallbackWarning as ShardingFallbackWarning
from fsg._src.errors import ShardingRuleError as ShardingRuleError
from fsg._src.errors import StructureMismatchError as StructureMismatchError
from fsg._src.errors import TopologyError as TopologyError
from fsg._src.errors import UnsupportedError as UnsupportedError
from fsg._src.errors import VerificationError as VerificationError
from fsg._src.float8_config import Float8 as Float8
from fsg._src.functional import apply as apply
from fsg._src.functional import buffers as buffers
from fsg._src.functional import params as params
from fsg._src.mesh import Mesh as Mesh
from fsg._src.mesh import P as P
from fsg._src.pipeline.options import Pipeline as Pipeline
from fsg._src.precision import DynamicLossScale as DynamicLossScale
from fsg._src.precision import Policy as Policy
from fsg._src.runtime.compile_step import compile_step as compile_step
from fsg._src.runtime.eval_step import EvalStep as EvalStep
from fsg._src.runtime.eval_step import compile_eval as compile_eval
from fsg._src.runtime.lowered import Cost as Cost
from fsg._src.runtime.lowered import Lowered as Lowered
from fsg._src.runtime.memory import Memory as Memory
from fsg._src.runtime.nonfinite import SkipNonFinite as SkipNonFinite
from fsg._src.runtime.replicas import check_replicas as check_replicas
from fsg._src.runtime.step import Step as Step
from fsg._src.topology.description import Topology as Topology
from fsg._src.topology.plan import plan as plan
from fsg._src.train_state import TrainState as TrainState
from fsg._src.version import __version__ as __version__

__all__ = [
    "ArgumentError",
    "BatchError",
    "CheckpointError",
    "checkpoint",
    "Cost",
    "CudaGraphWarning",
    "EvalStep",
    "Mesh",
    "MeshError",
    "P",
    "Pipeline",
    "pipeline",
    "Policy",
    "ShardingFallbackWarning",
    "ShardingRuleError",
    "ReplicaMismatchError",
    "check_replicas",
    "DataError",
    "DynamicLossScale",
    "Float8",
    "NonFiniteError",
    "SkipNonFinite",
    "data",
    "Topology",
    "TopologyError",
    "plan",
    "topology",
    "distributed",
    "sharding",
    "FsgError",
    "HostSyncError",
    "ImpureLossError",
    "Lowered",
    "LossNotScalarError",
    "Memory",
    "NonTensorLeafError",
    "RecompileError",
    "RecompileWarning",
    "Step",
    "StructureMismatchError",
    "VerificationError",
    "TrainState",
    "UnsupportedError",
    "apply",
    "buffers",
    "compile_eval",
    "compile_step",
    "nn",
    "optim",
    "params",
]
