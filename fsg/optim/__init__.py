"""Optax-style optimizers: ``GradientTransformation(init, update)``, transforms and schedules."""

from fsg._src.optim._adafactor import AdafactorState as AdafactorState
from fsg._src.optim._adafactor import adafactor as adafactor
from fsg._src.optim._adam_variants import ScaleByAdadeltaState as ScaleByAdadeltaState
from fsg._src.optim._adam_variants import ScaleByAdamaxState as ScaleByAdamaxState
from fsg._src.optim._adam_variants import ScaleByAmsgradState as ScaleByAmsgradState
from fsg._src.optim._adam_variants import ScaleByNadamState as ScaleByNadamState
from fsg._src.optim._adam_variants import adadelta as adadelta
from fsg._src.optim._adam_variants import adamax as adamax
from fsg._src.optim._adam_variants import nadam as nadam
from fsg._src.optim._adam_variants import radam as radam
from fsg._src.optim._adam_variants import scale_by_adadelta as scale_by_adadelta
from fsg._src.optim._adam_variants import scale_by_adamax as scale_by_adamax
from fsg._src.optim._adam_variants import scale_by_amsgrad as scale_by_amsgrad
from fsg._src.optim._adam_variants import scale_by_nadam as scale_by_nadam
from fsg._src.optim._adam_variants import scale_by_radam as scale_by_radam
from fsg._src.optim._alias import adam as adam
from fsg._src.optim._alias import adamw as adamw
from fsg._src.optim._alias import lion as lion
from fsg._src.optim._alias import sgd as sgd
from fsg._src.optim._base import EmptyState as EmptyState
from fsg._src.optim._base import GradientTransformation as GradientTransformation
from fsg._src.optim._base import apply_updates as apply_updates
from fsg._src.optim._base import chain as chain
from fsg._src.optim._base import global_norm as global_norm
from fsg._src.optim._classic import ScaleByRmsState as ScaleByRmsState
from fsg._src.optim._classic import ScaleByRssState as ScaleByRssState
from fsg._src.optim._classic import adagrad as adagrad
from fsg._src.optim._classic import rmsprop as rmsprop
from fsg._src.optim._classic import scale_by_rms as scale_by_rms
from fsg._src.optim._classic import scale_by_rss as scale_by_rss
from fsg._src.optim._clipping import clip_by_global_norm as clip_by_global_norm
from fsg._src.optim._from_torch import from_torch as from_torch
from fsg._src.optim._multi import multi_transform as multi_transform
from fsg._src.optim._multi import set_to_zero as set_to_zero
from fsg._src.optim._muon import ScaleByMuonState as ScaleByMuonState
from fsg._src.optim._muon import muon as muon
from fsg._src.optim._muon import scale_by_muon as scale_by_muon
from fsg._src.optim._schedules import Schedule as Schedule
from fsg._src.optim._schedules import constant as constant
from fsg._src.optim._schedules import cosine as cosine
from fsg._src.optim._schedules import linear as linear
from fsg._src.optim._schedules import piecewise as piecewise
from fsg._src.optim._schedules import warmup_cosine as warmup_cosine
from fsg._src.optim._transforms import DampedTraceState as DampedTraceState
from fsg._src.optim._transforms import ScaleByAdamState as ScaleByAdamState
from fsg._src.optim._transforms import ScaleByLearningRateState as ScaleByLearningRateState
from fsg._src.optim._transforms import ScaleByLionState as ScaleByLionState
from fsg._src.optim._transforms import ScaleByScheduleState as ScaleByScheduleState
from fsg._src.optim._transforms import TraceState as TraceState
from fsg._src.optim._transforms import add_decayed_weights as add_decayed_weights
from fsg._src.optim._transforms import learning_rate as learning_rate
from fsg._src.optim._transforms import scale as scale
from fsg._src.optim._transforms import scale_by_adam as scale_by_adam
from fsg._src.optim._transforms import scale_by_learning_rate as scale_by_learning_rate
from fsg._src.optim._transforms import scale_by_lion as scale_by_lion
from fsg._src.optim._transforms import scale_by_schedule as scale_by_schedule
from fsg._src.optim._transforms import trace as trace
from fsg._src.tree import MaskedNode as MaskedNode

__all__ = [
    "AdafactorState",
    "DampedTraceState",
    "EmptyState",
    "GradientTransformation",
    "MaskedNode",
    "ScaleByAdadeltaState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAmsgradState",
    "ScaleByLearningRateState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScaleByNadamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine",
    "from_torch",
    "global_norm",
    "learning_rate",
    "linear",
    "lion",
    "multi_transform",
    "muon",
    "nadam",
    "piecewise",
    "radam",
    "rmsprop",
    "scale",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_amsgrad",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_nadam",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "set_to_zero",
    "sgd",
    "trace",
    "warmup_cosine",
]
