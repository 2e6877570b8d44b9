"""Property-based tests: random small programs, rewritten by ``jamp.autocast_transform``.

A program is a tuple of op descriptors applied in order to ``h`` (starting at the float32 input
``x`` of shape (4, 8)); every op maps (4, 8) -> (4, 8) and may read the original input ``x`` and
the float32 weight ``w`` of shape (8, 8). ``jit``/``remat`` ops hold a nested program. Inputs
come from a drawn seed and are kept well conditioned (small magnitudes, ``log(|h| + 1)``,
``exp(-|h|)``, continuous ``where``s, a ``cond`` predicate computed from the untouched float32
input) so that float32 and bfloat16 runs are comparable.

Each property runs per *family*: ``core`` (matmul, conv, elementwise, reductions, softmax, gelu,
concatenate, jit, checkpoint) plus one feature per other family (``consts``: constants built by
broadcasting a Python scalar; ``custom_jvp``: ``jax.nn.relu``; ``custom_vjp``: a user
``custom_vjp`` linear layer; ``scan``: an RNN-like ``lax.scan``; ``cond``: ``lax.cond``), so a
missing rule fails its own family and leaves the others informative. Programs of a non-core
family always contain its feature at least once.

Properties: (1) the rewritten jaxpr passes JAX's type checker, (2) values agree with the float32
program within bfloat16 tolerance, (3) ``jax.jit`` agrees with eager (values and dtypes),
(4) ``jax.grad`` w.r.t. the float32 weight is float32, finite and close to the float32 gradient,
(5) ``jax.vmap`` agrees with a Python loop, (6) every ``dot_general``/``conv_general_dilated`` in
the rewritten jaxpr (sub-jaxprs included) has bfloat16 operands and output, (7) the output dtype
follows the DESIGN.md tables where they decide it unambiguously.

Hypothesis settings come from the profile registered in ``tests/conftest.py`` (``ci`` by default:
derandomized, no example database), so failures reproduce run to run.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from jax import lax

import jamp

try:  # public since jax 0.4.3x; the brief forbids reaching into jax._src here
    from jax.extend.core import check_jaxpr as _check_jaxpr
except ImportError:  # pragma: no cover - both supported JAX versions have it
    _check_jaxpr = None

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
SHAPE = (4, 8)
BATCH = 3
MATMUL_PRIMS = ("dot_general", "conv_general_dilated")

# Tolerances, relative to max(1, max|reference|). bfloat16 keeps 8 significant bits (relative
# rounding 2**-9); a chain of up to ~10 ops, each rounding once or twice, stays well inside 5%.
TOL_VS_F32 = 5e-2
TOL_GRAD = 1e-1     # kinks (abs/max/where) may flip one element's derivative between precisions
TOL_SAME_PRECISION = 2e-2  # jit vs eager, vmap vs loop: same dtypes, only XLA ordering/fusion

# The missing-rule warning is warned once per process, so under the project's "error" filter only
# the first example of a session would fail: the properties below check behaviour instead
# (dtypes of matmuls and outputs), which is deterministic.
pytestmark = pytest.mark.filterwarnings("ignore::jamp.UnsupportedPrimitiveWarning")

PROPERTY_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- the ops -----------------------------------------------------------------------------------

@jax.custom_vjp
def custom_linear(h, w):
    """A user linear layer with a hand-written backward pass."""
    return h @ w


def _custom_linear_fwd(h, w):
    return h @ w, (h, w)


def _custom_linear_bwd(res, g):
    h, w = res
    return g @ w.T, h.T @ g


custom_linear.defvjp(_custom_linear_fwd, _custom_linear_bwd)


def conv1d(h, w):
    # h as (N=1, C=4, W=8); a (O=4, I=4, K=3) kernel taken from w.
    kernel = w.reshape(-1)[:48].reshape(4, 4, 3) * 0.5
    out = lax.conv_general_dilated(h[None], kernel, window_strides=(1,), padding="SAME",
                                   dimension_numbers=("NCH", "OIH", "NCH"))
    return out[0]


def conv2d(h, w):
    # h as (N=1, C=1, H=4, W=8); a (1, 1, 3, 3) kernel taken from w.
    kernel = w[:3, :3][None, None]
    out = lax.conv_general_dilated(h[None, None], kernel, window_strides=(1, 1),
                                   padding="SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return out[0, 0]


UNARY = {
    "tanh": jnp.tanh,
    "exp": lambda h: jnp.exp(-jnp.abs(h)),
    "log": lambda h: jnp.log(jnp.abs(h) + 1.0),
    "gelu": jax.nn.gelu,
    "softmax": lambda h: jax.nn.softmax(h, axis=-1),
}
BINARY = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "maximum": jnp.maximum}


def apply_op(op: tuple, h: Any, x: Any, w: Any) -> Any:
    kind = op[0]
    if kind == "matmul":
        return h @ w
    if kind == "conv1d":
        return conv1d(h, w)
    if kind == "conv2d":
        return conv2d(h, w)
    if kind == "unary":
        return UNARY[op[1]](h)
    if kind == "binary":  # with the float32 input: mixed operands promote
        return BINARY[op[1]](h, x)
    if kind == "affine":  # Python scalars are weakly typed: they adapt to h
        return h * op[1] + op[2]
    if kind == "where":
        if op[1] == "leaky":  # mask from h itself; continuous at the switch
            return jnp.where(h > 0, h, 0.1 * h)
        return jnp.where(x > 0, h, x)  # mask from the float32 input; mixed-dtype select
    if kind == "reduce":
        _, how, axis = op
        if how == "sum":
            return h + 0.1 * jnp.sum(h, axis=axis, keepdims=True)
        if how == "mean":
            return h - jnp.mean(h, axis=axis, keepdims=True)
        return h - jnp.max(h, axis=axis, keepdims=True)
    if kind == "concat":
        if op[1] == "mixed":
            return jnp.concatenate([h[:, :4], x[:, 4:]], axis=1)
        return jnp.concatenate([h[:2], 0.5 * h[2:]], axis=0)
    if kind == "shift":  # causal shift, zero padded: a broadcast Python scalar
        return jnp.concatenate([jnp.zeros((SHAPE[0], 1)), h[:, :-1]], axis=1)
    if kind == "fill":  # an array built from a scalar, combined with h
        return h + jnp.full(SHAPE, 0.25)
    if kind == "relu":
        return jax.nn.relu(h)
    if kind == "custom_linear":
        return custom_linear(h, w)
    if kind == "scan":
        def cell(c, row):
            c = jnp.tanh(c @ w + row)
            return c, c
        init = jnp.zeros((SHAPE[1],)) if op[1] == "zeros" else 0.5 * h[0]
        return lax.scan(cell, init, h)[1]
    if kind == "cond":
        pred = jnp.sum(x) > op[1]  # from the float32 input: same branch in every precision
        return lax.cond(pred, lambda a: a @ w, lambda a: jnp.tanh(a) * 0.5, h)
    if kind == "jit":
        sub = op[1]
        return jax.jit(lambda h, x, w: run_program(sub, h, x, w))(h, x, w)
    if kind == "remat":
        sub = op[1]
        return jax.checkpoint(lambda h, x, w: run_program(sub, h, x, w))(h, x, w)
    raise AssertionError(f"unknown op {op!r}")


def run_program(program: tuple, h: Any, x: Any, w: Any) -> Any:
    for op in program:
        h = apply_op(op, h, x, w)
    return h


def as_function(program: tuple):
    def f(x, w):
        return run_program(program, x, x, w)
    return f


# --- the dtype model (DESIGN.md tables, bfloat16 compute) ------------------------------------

def _promote(a: Optional[np.dtype], b: np.dtype) -> Optional[np.dtype]:
    if a is None:
        return F32 if b == F32 else None  # bf16/f32 with f32 is f32 either way
    return np.dtype(jnp.promote_types(a, b))


def expected_dtype(program: tuple, d: Optional[np.dtype] = F32) -> Optional[np.dtype]:
    """The dtype h has after ``program`` under the default policy; None where undecided."""
    for op in program:
        kind = op[0]
        if kind in ("matmul", "conv1d", "conv2d", "custom_linear"):  # lower (custom_vjp body too)
            d = BF16
        elif kind == "unary":
            d = F32 if op[1] in ("exp", "log", "softmax") else d  # fp32 ops; tanh/gelu follow
        elif kind in ("binary",):
            d = _promote(d, F32)
        elif kind in ("affine", "relu", "shift", "fill"):
            d = d  # weak scalars and broadcast rank-0 constants adapt; relu follows its input
        elif kind == "where":
            d = d if op[1] == "leaky" else _promote(d, F32)
        elif kind == "reduce":
            d = d if op[1] == "max" else F32  # reduce_sum is fp32; its (4,1) result promotes h
        elif kind == "concat":
            d = d if op[1] == "halves" else _promote(d, F32)
        elif kind in ("jit", "remat"):
            d = expected_dtype(op[1], d)
        elif kind == "cond":  # matmul branch is bf16; the other follows h
            d = BF16 if d == BF16 else None
        elif kind == "scan":  # carry fix-up policy is not pinned down by DESIGN.md
            d = None
        else:
            raise AssertionError(op)
    return d


# --- strategies ----------------------------------------------------------------------------------

FAMILIES = ("core", "consts", "custom_jvp", "custom_vjp", "scan", "cond")

_core_ops = st.one_of(
    st.just(("matmul",)),
    st.sampled_from([("conv1d",), ("conv2d",)]),
    st.sampled_from(sorted(UNARY)).map(lambda n: ("unary", n)),
    st.sampled_from(sorted(BINARY)).map(lambda n: ("binary", n)),
    st.tuples(st.just("affine"), st.sampled_from([0.5, -0.75, 1.25]),
              st.sampled_from([0.0, 0.5, -1.0])),
    st.sampled_from([("where", "leaky"), ("where", "mixed")]),
    st.tuples(st.just("reduce"), st.sampled_from(["sum", "mean", "max"]), st.sampled_from([0, 1])),
    st.sampled_from([("concat", "mixed"), ("concat", "halves")]),
)

_family_ops = {
    "consts": st.sampled_from([("shift",), ("fill",)]),
    "custom_jvp": st.just(("relu",)),
    "custom_vjp": st.just(("custom_linear",)),
    "scan": st.sampled_from([("scan", "zeros"), ("scan", "row")]),
    "cond": st.tuples(st.just("cond"), st.sampled_from([-1e3, 0.0, 1e3])),
}


def _ops(family: str, depth: int) -> st.SearchStrategy:
    base = _core_ops if family == "core" else st.one_of(_core_ops, _family_ops[family])
    if depth >= 2:
        return base
    nested = st.tuples(st.sampled_from(["jit", "remat"]), _programs(family, depth + 1, False))
    return st.one_of(base, nested)


def _programs(family: str, depth: int = 0, force: bool = True) -> st.SearchStrategy:
    ops = st.lists(_ops(family, depth), min_size=1, max_size=4 if depth == 0 else 2)
    if family == "core" or not force:
        return ops.map(tuple)

    @st.composite
    def with_feature(draw):
        program = draw(ops)
        where = draw(st.integers(0, len(program)))
        program.insert(where, draw(_family_ops[family]))
        return tuple(program)
    return with_feature()


PROGRAMS = {family: _programs(family) for family in FAMILIES}
seeds = st.integers(0, 2**16)


def make_inputs(seed: int, batch: Optional[int] = None):
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    x = (0.5 * rng.standard_normal(lead + SHAPE)).astype(np.float32)
    w = (rng.standard_normal(lead + (8, 8)) / math.sqrt(8.0) * 0.75).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w)


# --- helpers ------------------------------------------------------------------------------------

def _open(jaxpr: Any) -> Any:
    """The open jaxpr of a closed one (jax 0.10) or of a jaxpr carrying consts (jax 0.12)."""
    return jaxpr if hasattr(jaxpr, "eqns") else jaxpr.jaxpr


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)
    elif hasattr(value, "eqns") or (hasattr(value, "jaxpr") and hasattr(_open(value), "eqns")):
        yield _open(value)


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation, recursing into closed and open sub-jaxprs held in eqn.params."""
    for eqn in _open(jaxpr).eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from iter_eqns(sub)


def type_check(closed: Any) -> None:
    if _check_jaxpr is None:  # pragma: no cover
        pytest.skip("jax.extend.core.check_jaxpr is not available on this JAX version")
    _check_jaxpr(_open(closed))


def assert_close(actual: Any, expected: Any, tol: float, what: str) -> None:
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values {a}"
    scale = max(1.0, float(np.max(np.abs(e))))
    err = float(np.max(np.abs(a - e)))
    assert err <= tol * scale, f"{what}: max abs error {err:.4g} > {tol} * {scale:.4g}"


def _setup(data: Any, family: str):
    program = data.draw(PROGRAMS[family], label="program")
    seed = data.draw(seeds, label="seed")
    note(f"family={family} program={program!r} seed={seed}")
    f = as_function(program)
    return program, f, jamp.autocast_transform(f), make_inputs(seed)


family_param = pytest.mark.parametrize("family", FAMILIES)


# --- the properties --------------------------------------------------------------------------

@family_param
@settings(max_examples=8, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_rewritten_jaxpr_type_checks(family, data):
    program, f, g, (x, w) = _setup(data, family)
    closed = jax.make_jaxpr(g)(x, w)
    type_check(closed)
    type_check(jamp.autocast_jaxpr(jax.make_jaxpr(f)(x, w)))
    (out_aval,) = closed.out_avals
    assert out_aval.shape == SHAPE


@family_param
@settings(max_examples=8, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_agrees_with_float32_program(family, data):
    program, f, g, (x, w) = _setup(data, family)
    expected = jax.jit(f)(x, w)
    actual = g(x, w)
    assert jnp.issubdtype(actual.dtype, jnp.floating)
    assert_close(actual, expected, TOL_VS_F32, "autocast vs float32")


@family_param
@settings(max_examples=8, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_output_dtype_follows_the_tables(family, data):
    program, f, g, (x, w) = _setup(data, family)
    want = expected_dtype(program)
    got = jax.eval_shape(g, x, w).dtype
    if want is None:
        assert got in (BF16, F32), got
    else:
        assert got == want, f"output dtype {got}, DESIGN.md tables give {want}"


@family_param
@settings(max_examples=6, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_jit_matches_eager(family, data):
    program, f, g, (x, w) = _setup(data, family)
    eager = g(x, w)
    jitted = jax.jit(g)(x, w)
    assert jitted.dtype == eager.dtype
    assert_close(jitted, eager, TOL_SAME_PRECISION, "jit vs eager")


@family_param
@settings(max_examples=6, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_grad_wrt_float32_weight(family, data):
    program, f, g, (x, w) = _setup(data, family)

    def loss(fn):
        return lambda w: jnp.sum(fn(x, w).astype(jnp.float32))

    grad = jax.grad(loss(g))(w)
    reference = jax.jit(jax.grad(loss(f)))(w)
    assert grad.dtype == F32, grad.dtype
    assert grad.shape == w.shape
    assert bool(jnp.all(jnp.isfinite(grad))), grad
    assert_close(grad, reference, TOL_GRAD, "autocast grad vs float32 grad")


@family_param
@settings(max_examples=6, **PROPERTY_SETTINGS)
@given(data=st.data(), batch_w=st.booleans())
def test_vmap_matches_loop(family, data, batch_w):
    program, f, g, _ = _setup(data, family)
    xs, ws = make_inputs(data.draw(seeds, label="batch seed"), batch=BATCH)
    if not batch_w:
        ws = ws[0]
    in_axes = (0, 0 if batch_w else None)
    batched = jax.vmap(g, in_axes=in_axes)(xs, ws)
    looped = [g(xs[i], ws[i] if batch_w else ws) for i in range(BATCH)]
    assert batched.dtype == looped[0].dtype
    assert_close(batched, jnp.stack(looped), TOL_SAME_PRECISION, "vmap vs loop")


@family_param
@settings(max_examples=8, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_every_matmul_and_conv_runs_in_bfloat16(family, data):
    program, f, g, (x, w) = _setup(data, family)
    original = [e for e in iter_eqns(jax.make_jaxpr(f)(x, w)) if e.primitive.name in MATMUL_PRIMS]
    rewritten = [e for e in iter_eqns(jax.make_jaxpr(g)(x, w))
                 if e.primitive.name in MATMUL_PRIMS]
    # Nothing dropped, nothing hidden from the walk: the rewrite keeps every matmul/conv.
    assert len(rewritten) == len(original), (len(rewritten), len(original))
    for eqn in rewritten:
        operand_dtypes = [v.aval.dtype for v in eqn.invars]
        out_dtypes = [v.aval.dtype for v in eqn.outvars]
        assert all(d in (BF16, np.float64) for d in operand_dtypes), (eqn, operand_dtypes)
        assert all(d in (BF16, np.float64) for d in out_dtypes), (eqn, out_dtypes)


@family_param
@settings(max_examples=4, **PROPERTY_SETTINGS)
@given(data=st.data())
def test_backward_matmuls_run_in_bfloat16(family, data):
    """DESIGN.md: backward ops run in the dtypes their forward ops used."""
    program, f, g, (x, w) = _setup(data, family)
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(g(x, w).astype(jnp.float32))))(w)
    for eqn in iter_eqns(grad_jaxpr):
        if eqn.primitive.name in MATMUL_PRIMS:
            operand_dtypes = [v.aval.dtype for v in eqn.invars]
            assert all(d in (BF16, np.float64) for d in operand_dtypes), (eqn, operand_dtypes)


# --- the harness itself can fail ----------------------------------------------------------------

def test_dtype_model_and_walker_see_what_they_should():
    """Guards against vacuous properties: the walker finds nested matmuls; tolerances bite."""
    x, w = make_inputs(0)
    program = (("jit", (("remat", (("matmul",),)),)), ("cond", 0.0), ("scan", "row"))
    names = [e.primitive.name for e in iter_eqns(jax.make_jaxpr(as_function(program))(x, w))]
    assert names.count("dot_general") == 3  # inside jit>checkpoint, a cond branch, the scan body
    assert expected_dtype((("matmul",), ("unary", "exp"))) == F32
    assert expected_dtype((("binary", "add"), ("matmul",), ("unary", "tanh"))) == BF16
    with pytest.raises(AssertionError):
        assert_close(x * 1.1, x, TOL_VS_F32, "deliberately off")
