"""jamp: torch.autocast-style automatic mixed precision for JAX, as a program transformation."""

from .interpreter import RewriteError, UnsupportedPrimitiveWarning
from .loss_scale import (
    DynamicLossScale,
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
from .transform import autocast_jaxpr, autocast_transform

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
    "all_finite",
    "select_tree",
    "scaled_value_and_grad",
    "explain",
    "Report",
    "UnmatchedRuleWarning",
    "find_nonfinite",
    "NonFinite",
    "value_ranges",
    "Ranges",
]
__version__ = "0.1.0"
