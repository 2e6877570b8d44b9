"""The float8 fallback check on programs compiled for a real GPU (issue 35).

These compile on the GPU they run on, so they run where one is present (a lent device:
``python -m pytest tests/test_float8_gpu.py``); on the CPU the same check is tested on the
optimized HLO these programs compiled to on an H200 (``tests/test_float8_fallback.py``, the
``gpu_h200_*`` fixtures).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import float8_check
from tests.float8_gpu_programs import PROGRAMS

_CAPABILITY = float8_check.device_info()["compute_capability"]  # None off CUDA
pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or _CAPABILITY is None
    or float8_check._before_ada(_CAPABILITY),  # the check's own rule for float8 tensor cores
    reason="compiles float8 GEMMs: needs an NVIDIA GPU of compute capability 8.9+")


def test_a_float8_layer_compiles_to_a_float8_gemm_and_does_not_warn():
    program = PROGRAMS["f8_forward_4096"]
    check = program.explain().float8_check
    assert [v.status for v in check.dots] == ["float8 GEMM"], str(check)
    assert check.float8_gemms == 1 and not check.fallback_gemms, str(check)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.Float8FallbackWarning)
        float8_check.warn_fallbacks(check, "layer")
    # and it computes the product: within float8's rounding of the bf16 product
    x, w = program.args
    got = np.asarray(program.jitted()(x, w), np.float32)
    want = np.asarray(x.astype(jnp.float32) @ w)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1


def test_every_dot_of_a_float8_layers_gradients_is_a_float8_gemm_at_4096():
    check = PROGRAMS["f8_gradients_4096"].explain().float8_check
    found = [v for v in check.dots if v.status != "not found"]
    assert found and all(v.status == "float8 GEMM" for v in found), str(check)
    formats = {v.dot.formats for v in found}
    assert ("float8_e5m2", "float8_e4m3fn") in formats or \
        ("float8_e4m3fn", "float8_e5m2") in formats, str(check)


def test_a_dot_of_two_e5m2_operands_falls_back_and_the_check_warns_naming_it():
    check = float8_check.check_compiled(PROGRAMS["f8_e5m2_pair"].compiled())
    assert check.float8_gemms == 0 and len(check.fallback_gemms) == 1, str(check)
    with pytest.warns(jamp.Float8FallbackWarning, match=r"1 of 1 float8 matmuls of e5m2 pair"):
        float8_check.warn_fallbacks(check, "e5m2 pair")


def test_shapes_not_multiples_of_16_run_as_a_triton_float8_gemm_and_do_not_warn():
    """XLA's autotuner picks a Triton GEMM on the float8 operands (no padding to 16) over the
    cuBLASLt float8 GEMM here: a float8 GEMM, not a fallback (seen on an H200, jax 0.11.2)."""
    check = PROGRAMS["f8_forward_not_16"].explain().float8_check
    [verdict] = check.dots
    assert verdict.status == "float8 GEMM", str(check)
    assert {g.kernel for g in verdict.gemms} <= {"Triton float8", "cuBLASLt float8"}, str(check)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.Float8FallbackWarning)
        float8_check.warn_fallbacks(check, "layer")


def test_every_dot_of_a_float8_layers_gradients_is_a_float8_gemm_at_1024():
    check = PROGRAMS["f8_gradients_1024"].explain().float8_check
    found = [v for v in check.dots if v.status != "not found"]
    assert len(found) == 2 and all(v.status == "float8 GEMM" for v in found), str(check)
    assert not check.fallback_gemms, str(check)
