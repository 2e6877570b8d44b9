"""Rules for higher-order primitives; importing this package registers them into ``RULES``."""
from . import calls, control_flow, custom_ad, indexing, parallel  # noqa: F401
