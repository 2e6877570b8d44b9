"""Rules for higher-order and context-dependent primitives; importing this package registers
them into ``RULES``."""

from . import (  # noqa: F401
    calls,
    control_flow,
    custom_ad,
    float8,
    indexing,
    parallel,
    powers,
    reduce,
    softmax,
)
