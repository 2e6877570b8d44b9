"""Rules for higher-order and context-dependent primitives; importing this package registers
them into ``RULES``."""
from . import calls, control_flow, custom_ad, indexing, parallel, powers  # noqa: F401
