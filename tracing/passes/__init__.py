"""Program passes used by ``tracing.freeze``; each takes and returns a closed jaxpr.

- ``fold_constants``: evaluate everything that depends only on the variables (never randomness).
- ``fold_batchnorm``: fold per-feature affine chains (inference BatchNorms) into the conv/dense.
- ``dce``: drop equations and constants no output needs.
- ``quantize_weights``: store matmul/convolution kernels as int8, int4 or float8 with scales.
"""

from .dce import dce
from .fold_batchnorm import fold_batchnorm
from .fold_constants import RANDOM_PRIMITIVES, fold_constants
from .quantize_weights import quantize_weights

__all__ = ["RANDOM_PRIMITIVES", "dce", "fold_batchnorm", "fold_constants", "quantize_weights"]
