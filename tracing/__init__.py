"""tracing: torch.jit.trace-style checking and torch.jit.freeze-style freezing for JAX and Flax.

``tracing.trace(fn, example_inputs)`` returns a compiled, exportable ``TracedFunction`` after
checking that the trace did not bake in what it should not have (see ``trace.py``);
``tracing.check_trace`` runs only the checks; ``tracing.freeze`` folds a module's variables into
an inference program (``freeze.py``); ``tracing.load`` reads an export of either back.
"""

from jamp import _compat

from .errors import TracerWarning, TracingCheckError
from .export import LoadedFunction, load
from .freeze import FrozenFunction, freeze
from .trace import TracedFunction, check_trace, trace

__all__ = [
    "FrozenFunction",
    "LoadedFunction",
    "TracedFunction",
    "TracerWarning",
    "TracingCheckError",
    "check_trace",
    "freeze",
    "load",
    "trace",
]

# tracing's frames are library frames in JAX's source lines and filtered tracebacks, as jamp's.
_compat.register_library_frames(__file__)
