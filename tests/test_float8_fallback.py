"""The float8 fallback check (jamp/float8_check.py, issue 23).

The GPU cases read optimized-HLO modules: small ones written by hand for these tests in the
textual format XLA prints for GPU programs (tests/data/gpu_*.hlo), and the programs of
tests/float8_gpu_programs.py as an H200 compiled them (tests/data/gpu_h200_*.hlo, captured on a
lent GPU); each file says what it represents. tests/test_float8_gpu.py compiles those programs
live where a GPU is present. The CPU cases compile real programs
with ``jamp.explain(..., compiled=True)``.
"""
from __future__ import annotations

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import jamp
from jamp import float8_check as fc

DATA = pathlib.Path(__file__).parent / "data"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FP8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)
# The fixtures and the shapes of the dots they hold (as a jamp-recorded dot would have them).
LT_E4M3_E5M2, LT_E4M3_E4M3 = "gpu_f8_cublaslt_e4m3_e5m2.hlo", "gpu_f8_cublaslt_e4m3_e4m3.hlo"
CUBLAS_F32, TRITON_BF16 = "gpu_gemm_cublas_f32.hlo", "gpu_gemm_triton_bf16.hlo"
FALLBACK = "gpu_f8_fallback_plain_dot.hlo"
E4M3_E5M2_SHAPES = ((32, 64), (64, 48))
FALLBACK_SHAPES = ((32, 48), (48, 16))


def fixture(name):
    return (DATA / name).read_text()


def dot(index=0, formats=(E4M3, E4M3), shapes=((16, 32), (32, 16)), contracting=((1,), (0,)),
        batch=((), ())):
    flops = 2 * shapes[0][0] * shapes[0][1] * shapes[1][1]
    return fc.Float8Dot(index, "model.py:12 (loss)", "", formats, shapes, contracting, batch, flops)


# --- the GEMMs of a program --------------------------------------------------------------------

@pytest.mark.parametrize("name, kernel, operands, sources", [
    (LT_E4M3_E5M2, "cuBLASLt float8",
     ("f8e4m3fn[32,64]{1,0}", "f8e5m2[48,64]{1,0}"), ("f8e4m3fn", "f8e5m2")),
    (LT_E4M3_E4M3, "cuBLASLt float8",
     ("f8e4m3fn[64,32]{1,0}", "f8e4m3fn[128,32]{1,0}"), ("f8e4m3fn", "f8e4m3fn")),
    (CUBLAS_F32, "cuBLAS", ("f32[96,80]{1,0}", "f32[80,112]{1,0}"), (None, None)),
    # the dot inside a Triton fusion, its operands the fusion's parameters
    (TRITON_BF16, "Triton", ("bf16[256,512]{1,0}", "bf16[512,384]{1,0}"), (None, None)),
    # the float8 operands widened to f16 in loop fusions before a plain dot: a fallback
    (FALLBACK, fc.XLA_DOT, ("f16[32,48]{1,0}", "f16[48,16]{1,0}"), ("f8e5m2", "f8e5m2")),
])
def test_gemms_of_gpu_modules(name, kernel, operands, sources):
    (gemm,) = fc.find_gemms(fc.parse(fixture(name)))
    assert (gemm.kernel, gemm.operands, gemm.float8_sources) == (kernel, operands, sources)
    assert gemm.float8 == (kernel in ("cuBLASLt float8", "Triton float8"))
    assert gemm.reads_float8 == (sources != (None, None))


def test_dimension_numbers_from_dot_attributes_and_gemm_config():
    (custom,) = fc.find_gemms(fc.parse(fixture(LT_E4M3_E5M2)))
    assert custom.contracting == ((1,), (1,)) and custom.batch == ((), ())  # rhs transposed
    (multiline,) = fc.find_gemms(fc.parse(fixture(LT_E4M3_E4M3)))  # multi-line config
    assert multiline.contracting == ((1,), (1,)) and multiline.batch == ((), ())
    (plain,) = fc.find_gemms(fc.parse(fixture(FALLBACK)))
    assert plain.contracting == ((1,), (0,))


def test_untagged_check_counts_and_fallback_gemms():
    f8 = fc.check_hlo(fixture(LT_E4M3_E5M2), platform="gpu")
    assert f8.counts() == {"cuBLASLt float8": 1} and f8.float8_gemms == 1
    assert f8.fallback_gemms == () and f8.dots == ()
    fallback = fc.check_hlo(fixture(FALLBACK), platform="gpu")
    assert fallback.float8_gemms == 0
    (gemm,) = fallback.fallback_gemms
    assert gemm.name == "widened_dot"
    assert "1 GEMM(s) read float8 data upcast" in str(fallback)
    assert "from f8e5m2 x f8e5m2" in str(fallback)
    plain = fc.check_hlo(fixture(CUBLAS_F32), platform="gpu")
    assert plain.counts() == {"cuBLAS": 1} and plain.fallback_gemms == ()


def test_parser_reads_one_line_instructions_with_operand_types_and_comments():
    text = """HloModule m, entry_computation_layout={(f8e4m3fn[32,64]{1,0})->f32[32,16]{1,0}}

%fused (p0: f8e4m3fn[32,64], p1: f32[64,16]) -> f32[32,16] {
  %p0 = f8e4m3fn[32,64]{1,0} parameter(0)
  %c = f32[32,64]{1,0} convert(f8e4m3fn[32,64]{1,0} %p0)
  %p1 = f32[64,16]{1,0} parameter(1)
  ROOT %dot.3 = f32[32,16]{1,0} dot(f32[32,64]{1,0} %c, f32[64,16]{1,0} %p1), \
lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
}

ENTRY %main (a: f8e4m3fn[32,64], b: f32[64,16]) -> f32[32,16] {
  %a = f8e4m3fn[32,64]{1,0} parameter(0)
  %b = f32[64,16]{1,0} parameter(1)
  ROOT %fusion = f32[32,16]{1,0} fusion(%a, /*index=1*/%b), kind=kOutput, calls=%fused
}
"""
    module = fc.parse(text)
    assert set(module.computations) == {"fused", "main"}
    assert module.roots == {"fused": "dot.3", "main": "fusion"}
    (gemm,) = fc.find_gemms(module)
    assert gemm.kernel == fc.XLA_DOT and gemm.op_name == "jit(f)/dot_general"
    assert gemm.float8_sources == ("f8e4m3fn", None)   # through the fusion's parameter


# --- a verdict per float8 dot ------------------------------------------------------------------

def with_tag(text, index, target="__cublas$lt$matmul$f8"):
    """The fixture with the op_name metadata XLA would carry over from a jamp-tagged dot (the
    fixture's GEMM has none)."""
    return text.replace(
        f'custom_call_target="{target}",',
        f'custom_call_target="{target}", metadata={{op_name="jit(loss)/jvp('
        f'{fc.TAG}{index})/dot_general"}},')


def test_float8_gemm_found_by_its_tag():
    text = with_tag(fixture(LT_E4M3_E5M2), 3)
    # dot 4 comes first and has the same sizes: only the tag gives the GEMM to dot 3
    dots = [dot(4, shapes=E4M3_E5M2_SHAPES), dot(3, (E4M3, E5M2), shapes=E4M3_E5M2_SHAPES)]
    check = fc.check_hlo(text, dots, platform="gpu",
                         device="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    missing, found = check.dots
    assert found.status == "float8 GEMM" and found.reason == ""
    assert [g.name for g in found.gemms] == ["lt_f8_matmul"]
    assert missing.status == "not found" and "removed it" in missing.reason
    assert check.fallbacks == ()
    text = str(check)
    assert "float8 check (gpu, NVIDIA H100 80GB HBM3, compute capability 9.0)" in text
    assert "1 of 2 float8 dots run as float8 GEMMs" in text
    assert "#3 model.py:12 (loss): e4m3fn[32, 64] x e5m2[64, 48] -> float8 GEMM" in text


def test_dot_without_metadata_is_matched_by_operand_sizes():
    check = fc.check_hlo(fixture(LT_E4M3_E4M3),
                         [dot(0, shapes=((64, 32), (32, 128)))], platform="gpu")
    (verdict,) = check.dots
    assert verdict.status == "float8 GEMM" and verdict.gemms[0].name == "scores_gemm"
    # sizes alone never claim a GEMM that reads no float8 data
    check = fc.check_hlo(fixture(CUBLAS_F32),
                         [dot(0, shapes=((96, 80), (80, 112)))], platform="gpu")
    assert check.dots[0].status == "not found"


def test_fallback_with_the_dtype_pair_as_reason():
    e5m2_dot = dot(0, (E5M2, E5M2), shapes=FALLBACK_SHAPES)
    check = fc.check_hlo(fixture(FALLBACK), [e5m2_dot],
                         platform="gpu", compute_capability="9.0")
    (verdict,) = check.fallbacks
    assert verdict.status == "fallback"
    assert "dtype pair: both operands float8_e5m2" in verdict.reason
    assert "compute capability" not in verdict.reason and "multiples of 16" not in verdict.reason
    assert ("-> fallback: XLA dot emitter widened_dot on f16[32,48] x f16[48,16] "
            "(from f8e5m2 x f8e5m2)") in str(check)


@pytest.mark.parametrize("kwargs, reason", [
    ({"compute_capability": "8.0"}, "backend: compute capability 8.0 has no float8 GEMMs"),
    ({"dot": dot(0, shapes=((24, 40), (40, 16)))}, "shape: dimensions [24, 40] are not multiples"),
    ({"dot": dot(0, shapes=((4, 8, 32), (32, 16)), contracting=((2,), (0,)))},
     "layout: operand 0 has 1 contracting and 2 other non-batch dimensions"),
    ({"dot": dot(0, shapes=((16, 32), (32, 16)), contracting=((0, 1), (0, 1)))},
     "layout: operand 0 has 2 contracting"),
    ({"dot": dot(0, shapes=((70000, 16, 16), (70000, 16, 16)), contracting=((2,), (1,)),
                 batch=((0,), (0,)))}, "batch: 70000 matrices, over cuBLASLt's 65535"),
    ({}, "unknown: XLA's GEMM rewriter did not match"),
])
def test_fallback_reasons(kwargs, reason):
    target = kwargs.pop("dot", dot(0, shapes=((16, 16), (16, 16))))
    gemm = fc.Gemm("cublas-gemm.1", "cuBLASLt", ("bf16[16,16]",) * 2, "bf16[16,16]",
                   ("f8e4m3fn", "f8e4m3fn"), "")
    reasons = fc.fallback_reasons(target, [gemm], **kwargs)
    assert any(r.startswith(reason) for r in reasons), reasons


def test_float8_gemm_on_padded_shapes_notes_the_padding():
    check = fc.check_hlo(with_tag(fixture(LT_E4M3_E5M2), 0),
                         [dot(0, (E4M3, E5M2), shapes=((30, 64), (64, 40)))], platform="gpu")
    assert check.dots[0].status == "float8 GEMM"
    assert "padded to multiples of 16" in check.dots[0].reason


def test_other_backends():
    text = with_tag(fixture(LT_E4M3_E5M2), 0)
    assert fc.check_hlo(text, [dot(0)], platform="tpu").dots[0].status == "unchecked"
    cpu = fc.check_hlo(fixture(FALLBACK),
                       [dot(0, (E5M2, E5M2), shapes=FALLBACK_SHAPES)], platform="cpu")
    assert cpu.dots[0].status == "emulated" and cpu.fallbacks == ()
    assert "converts the float8 operands to f16" in cpu.dots[0].reason


# --- programs compiled on a real GPU (an H200, jax 0.11.2: tests/float8_gpu_programs.py) -------

H200 = {"platform": "gpu", "device": "NVIDIA H200", "compute_capability": "9.0"}


@pytest.mark.parametrize("name, counts, fallbacks", [
    ("f8_forward_4096", {"cuBLASLt float8": 1}, 0),
    ("f8_gradients_4096", {"cuBLASLt float8": 2}, 0),
    # XLA's autotuner ran one backward product as a Triton GEMM on the float8 operands
    ("f8_gradients_1024", {"cuBLASLt float8": 1, "Triton float8": 1}, 0),
    ("f8_forward_not_16", {"Triton float8": 1}, 0),  # 4100x4096x4104: no padding, Triton
    ("f8_e5m2_pair", {"cuBLASLt": 1}, 1),  # both widened to bf16: a real fallback
])
def test_checks_of_programs_compiled_on_an_h200(name, counts, fallbacks):
    check = fc.check_hlo(fixture(f"gpu_h200_{name}.hlo"), **H200)
    assert check.counts() == counts, str(check)
    assert len(check.fallback_gemms) == fallbacks
    assert check.float8_gemms == sum(n for k, n in counts.items() if k.endswith("float8"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if fallbacks:
            with pytest.warns(jamp.Float8FallbackWarning, match=f"{fallbacks} of {fallbacks} "):
                fc.warn_fallbacks(check, name)
        else:
            fc.warn_fallbacks(check, name)  # no warning for a float8 GEMM of either kernel


def test_a_triton_gemm_on_float8_operands_is_a_float8_gemm_only_where_tensor_cores_take_float8():
    text = fixture("gpu_h200_f8_forward_not_16.hlo")
    (gemm,) = fc.find_gemms(fc.parse(text))
    assert (gemm.kernel, gemm.operands) == (
        "Triton float8", ("f8e4m3fn[4100,4096]{1,0}", "f8e4m3fn[4096,4104]{0,1}"))
    layer = dot(0, shapes=((4100, 4096), (4096, 4104)))  # matched by operand sizes
    [verdict] = fc.check_hlo(text, [layer], **H200).dots
    assert (verdict.status, verdict.reason) == ("float8 GEMM", "")  # Triton does not pad
    # the same program read for an Ampere GPU: Triton upcasts float8 there
    ampere = fc.check_hlo(text, [layer], platform="gpu", compute_capability="8.0")
    [verdict] = ampere.dots
    assert verdict.status == "fallback" and "compute capability 8.0" in verdict.reason
    assert ampere.float8_gemms == 0 and len(ampere.fallback_gemms) == 1


# --- the warning -------------------------------------------------------------------------------

def test_gpu_fallback_warns_once_per_program():
    e5m2_dot = dot(0, (E5M2, E5M2), shapes=FALLBACK_SHAPES)
    check = fc.check_hlo(fixture(FALLBACK), [e5m2_dot],
                         platform="gpu", device="NVIDIA H100 80GB HBM3")
    with pytest.warns(jamp.Float8FallbackWarning) as caught:
        fc.warn_fallbacks(check, "loss_fn_under_test")
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith("1 of 1 float8 matmuls of loss_fn_under_test compiled to no "
                              "float8 GEMM on NVIDIA H100 80GB HBM3")
    assert "dtype pair" in message
    assert warning.filename == __file__            # points at the caller, not at jamp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fc.warn_fallbacks(check, "loss_fn_under_test")                 # once per program
        fc.warn_fallbacks(fc.check_hlo(fixture(FALLBACK),
                                       [e5m2_dot], platform="cpu"), "on_the_cpu")
        ok = fc.check_hlo(fixture(LT_E4M3_E5M2), platform="gpu")
        fc.warn_fallbacks(ok, "all_float8")
    with pytest.warns(jamp.Float8FallbackWarning, match="1 of 1 float8 matmuls of untagged"):
        fc.warn_fallbacks(fc.check_hlo(fixture(FALLBACK),
                                       platform="gpu"), "untagged")


# --- explain(compiled=True) on this machine's CPU ---------------------------------------------

def mlp(w1, w2, x):
    with jax.named_scope("head"):
        return jnp.tanh(x @ w1) @ w2


ARGS = (jnp.ones((64, 48)), jnp.ones((48, 16)), jnp.ones((32, 64)))


@pytest.mark.parametrize("grad", [False, True])
def test_explain_compiled_on_cpu_says_emulated_and_does_not_warn(grad):
    fn = jax.grad(lambda *a: jnp.sum(mlp(*a)), argnums=(0, 1)) if grad else mlp
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.Float8FallbackWarning)
        report = jamp.explain(fn, *ARGS, policy=FP8, compiled=True)
    check = report.float8_check
    assert check.platform == "cpu" and check.fallbacks == ()
    statuses = {v.status for v in check.dots}
    assert statuses <= {"emulated", "not found"} and "emulated" in statuses
    for verdict in check.dots:
        # matched through the scope jamp compiled each dot under, not by size
        assert all(re.search(rf"\b{verdict.dot.tag}\b", g.op_name) for g in verdict.gemms)
        for gemm in verdict.gemms:
            assert not gemm.float8 and gemm.reads_float8
    assert len(check.dots) == (5 if grad else 2)   # forward, and two transposes per used dot
    assert "the CPU backend emulates float8" in str(report)
    if not grad:
        assert [v.status for v in check.dots] == ["emulated", "emulated"]
        assert [v.dot.formats for v in check.dots] == [(E4M3, E4M3)] * 2
        assert [v.dot.scope for v in check.dots] == ["head", "head"]


def test_explain_compiled_counts_gemms_without_float8_dots():
    report = jamp.explain(mlp, *ARGS, policy=jamp.Policy(), compiled=True)
    assert report.float8_check.dots == ()
    assert sum(report.float8_check.counts().values()) == 2
    assert report.float8_check.fallback_gemms == ()
    assert jamp.explain(mlp, *ARGS).float8_check is None      # compiled=False: no check


def test_explain_compiled_keeps_the_rewrite_unchanged():
    plain = jamp.explain(mlp, *ARGS, policy=FP8)
    compiled = jamp.explain(mlp, *ARGS, policy=FP8, compiled=True)
    assert (plain.ops, plain.flops, plain.casts) == (compiled.ops, compiled.flops, compiled.casts)


def test_explain_compiled_must_be_a_bool():
    with pytest.raises(TypeError, match=r"explain\(compiled=...\) must be True or False"):
        jamp.explain(mlp, *ARGS, policy=FP8, compiled="yes")

    def untraceable(x):
        raise AssertionError("traced before compiled= was checked")

    with pytest.raises(TypeError, match=r"must be True or False, got 1"):
        jamp.explain(untraceable, ARGS[0], compiled=1)
