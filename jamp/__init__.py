"""jamp: torch.autocast-style automatic mixed precision for JAX, as a program transformation."""

from . import optim
from .accumulate import MicroBatchesState, accumulate_micro_batches
from .float8_check import Float8FallbackWarning
from .interpreter import RewriteError, UnsupportedPrimitiveWarning
from .loss_scale import (
    DynamicLossScale,
    MicroBatchLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    scaled_value_and_grad,
    select_tree,
)
from .nonfinite import NonFinite, find_nonfinite
from .policy import Policy, UnmatchedRuleWarning
from .ranges import Ranges, value_ranges
from .regions import AutocastWarning, autocast, get_autocast_dtype, is_autocast_enabled
from .report import Report, explain
from .rounding import stochastic_round
from .transform import autocast_jaxpr, autocast_transform
from .tune import DeviceSpeeds, TuneResult, WeightsTuneResult, tune, tune_weights

__all__ = [
    "Policy",
    "autocast_transform",
    "autocast_jaxpr",
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "AutocastWarning",
    "RewriteError",
    "UnsupportedPrimitiveWarning",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "MicroBatchLossScale",
    "all_finite",
    "select_tree",
    "scaled_value_and_grad",
    "accumulate_micro_batches",
    "MicroBatchesState",
    "explain",
    "Report",
    "UnmatchedRuleWarning",
    "Float8FallbackWarning",
    "find_nonfinite",
    "NonFinite",
    "value_ranges",
    "Ranges",
    "tune",
    "TuneResult",
    "DeviceSpeeds",
    "tune_weights",
    "WeightsTuneResult",
    "stochastic_round",
    "optim",
]
__version__ = "0.1.0"
