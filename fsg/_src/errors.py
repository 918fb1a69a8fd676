"""The exceptions and warnings fsg raises.

Every user mistake gets an ``FsgError`` subclass whose message names the leaf path or graph
node, states the rule and suggests the fix.
"""

from __future__ import annotations


class FsgError(Exception):
    """Base class of every error fsg raises for a user mistake."""


class NonTensorLeafError(FsgError, TypeError):
    """A state or batch pytree holds a leaf that is not a ``torch.Tensor``."""


class LossNotScalarError(FsgError, ValueError):
    """``loss_fn`` returned something other than a 0-d floating-point tensor that depends on
    the trained parameters (or a bad aux dict)."""


class ImpureLossError(FsgError):
    """``loss_fn`` mutated one of its inputs (a parameter or a batch leaf) in place."""


class HostSyncError(FsgError):
    """``loss_fn`` needs a value on the host while tracing (``.item()``, ``if tensor:``...)."""


class BatchError(FsgError, ValueError):
    """A batch that the step cannot use as configured (e.g. not divisible by ``accum_steps``)."""


class StructureMismatchError(FsgError, ValueError):
    """A state or batch pytree does not have the structure the step was compiled for."""


class RecompileError(FsgError):
    """A compile-cache miss under ``compile_step(..., strict=True)``."""


class UnsupportedError(FsgError):
    """A feature combination this version of fsg does not support yet."""


class RecompileWarning(UserWarning):
    """A compile-cache miss: the step is traced and compiled again for a new signature."""


class MeshError(FsgError, ValueError):
    """A mesh that does not match the world, or a partition spec that does not fit a tensor."""


class ShardingRuleError(FsgError):
    """An op of the step has no sharding rule for the placements of its inputs."""

    def __init__(self, message: str, *, op=None):
        super().__init__(message)
        self.op = op


class CheckpointError(FsgError):
    """A checkpoint that is missing, incomplete, corrupt, or does not match ``like=``."""


class ShardingFallbackWarning(UserWarning):
    """An op could not run on its inputs' placements and ran replicated (after gathers)."""


class CudaGraphWarning(UserWarning):
    """The compiled step could not be captured as a CUDA graph and runs without replay."""


class PassInvariantError(FsgError):
    """A stage-3 graph pass broke an invariant of the step's graph (the order of a storage's
    reads and writes, a collective's wait, the outputs): a bug in fsg, not in the user's code."""


class VerificationError(FsgError):
    """``compile_step(..., verify=True)`` (or ``fsg.testing.verify_step``) found the sharded
    step computing something other than the unsharded step."""


class ArgumentError(FsgError, ValueError, TypeError):
    """An argument a public fsg function does not accept: of the wrong type (``optimizer=None``,
    a schedule where a float is due) or out of its range (a negative learning rate,
    ``accum_steps=0``, ``max_to_keep=0``). A ``ValueError`` and a ``TypeError`` both, so code
    that caught either before still does."""


class DataError(FsgError, ValueError):
    """Input data that ``fsg.data`` cannot serve: a truncated or odd-sized token file, a wrong
    header, a token id at or beyond the vocabulary, a sequence longer than the data, a batch
    that does not divide over the data-parallel ranks. The message names the file and value."""


class TopologyError(FsgError, ValueError):
    """A cluster description that fsg cannot use (an unknown level, a missing or bad field), a
    mesh larger than the described cluster, or a mesh axis that cannot be placed on its links."""


class NonFiniteError(FsgError, FloatingPointError):
    """Too many steps in a row had a non-finite loss or gradient and were skipped
    (``compile_step(skip_nonfinite=fsg.SkipNonFinite(max_consecutive=...))``): training is
    not recovering by itself. The message names the steps."""


class ReplicaMismatchError(FsgError):
    """``compile_step(check_replicas=N)`` (or ``check_replicas(state)``) found ranks that hold
    the same shard of a state leaf holding different bytes: replicas drifted apart (silent data
    corruption, a non-deterministic update, a state changed on some ranks only). The message
    names the first such leaf and the ranks that differ."""


# The public classes print under their public names (``fsg.HostSyncError``, not
# ``fsg._src.errors.HostSyncError``) in tracebacks and reprs; ``fsg`` re-exports each of them,
# so pickling by ``__module__`` and ``__qualname__`` finds them there.
PUBLIC = (
    ArgumentError,
    BatchError,
    CheckpointError,
    CudaGraphWarning,
    DataError,
    FsgError,
    HostSyncError,
    ImpureLossError,
    LossNotScalarError,
    MeshError,
    NonFiniteError,
    NonTensorLeafError,
    RecompileError,
    RecompileWarning,
    ReplicaMismatchError,
    ShardingFallbackWarning,
    ShardingRuleError,
    StructureMismatchError,
    TopologyError,
    UnsupportedError,
    VerificationError,
)
for _cls in PUBLIC:
    _cls.__module__ = "fsg"
del _cls
