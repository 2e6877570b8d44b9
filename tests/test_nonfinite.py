"""jamp.find_nonfinite: the first inf/NaN of the mixed-precision program, why, and a remedy."""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from tests import source_lines
from tests.source_lines import file_and_line

BF16 = jamp.Policy(jnp.bfloat16)
F16 = jamp.Policy(jnp.float16)
# The one-pass-variance case needs `square` (and `x ** 2`) in bfloat16, whatever the default table.
SQUARE_IN_BF16 = BF16.replace(fp32=BF16.fp32 - {"square", "integer_pow"})


def line_of(marker: str) -> int:
    return source_lines.line_of(__file__, marker)


def here(marker: str) -> tuple[str, int]:
    return source_lines.here(__file__, marker)


# Checks run and test data is built on the host (data put with jax.device_put, which compiles
# nothing): eager jnp operations, and jnp.asarray of a numpy array, compile a program per shape
# and dtype.
def all_finite(tree) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


# --- one-pass-variance BatchNorm -----------------------------------------------------------------

def one_pass_batch_norm(x, eps=1e-5):
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(jnp.square(x), axis=0) - jnp.square(mean)   # E[x^2] - E[x]^2
    return (x - mean) * jax.lax.rsqrt(var + eps)  # bn-rsqrt


def conv_bn(w, x):
    with jax.named_scope("dense"):
        h = x @ w
    with jax.named_scope("bn"):
        h = one_pass_batch_norm(h)
    return jnp.sum(h * h)


def bn_inputs():
    # Activations of ~3.1 with a tiny spread: bfloat16 rounds E[x^2] below E[x]^2.
    # (built on the host: the same float32 operations, so the same values, as jnp's)
    x = np.float32(1.0) + np.float32(1e-4) * np.arange(32, dtype=np.float32).reshape(8, 4)
    return jax.device_put(np.eye(4, dtype=np.float32) * np.float32(3.1)), jax.device_put(x)


def test_one_pass_variance_batch_norm_is_localised_to_rsqrt_and_fixed_by_square_in_fp32():
    w, x = bn_inputs()
    assert all_finite(conv_bn(w, x))
    with jax.disable_jit():  # eager calls compile; XLA on the CPU may keep bf16 values in f32
        assert not all_finite(jamp.autocast_transform(conv_bn, SQUARE_IN_BF16)(w, x))

    found = jamp.find_nonfinite(conv_bn, w, x, policy=SQUARE_IN_BF16)

    assert found.primitive == "rsqrt" and found.dtype == "float32"
    assert file_and_line(found.source) == here("bn-rsqrt")
    assert found.scope == "bn" and found.backward_of is None and found.iterations == ()
    assert found.decision.startswith("fp32 table")
    assert found.operands[0].max < 0                     # the variance came out negative
    assert found.output[0].nan == 4
    assert found.float32_finite is False                 # rsqrt itself is not the culprit...
    assert found.remedy.kind == "fp32-table entry"       # ...the bfloat16 square upstream is
    assert "square" in found.remedy.policy.fp32
    assert all_finite(jamp.autocast_transform(conv_bn, found.remedy.policy)(w, x))
    text = str(found)
    assert "rsqrt" in text and "bn" in text and "square" in text


# --- float16 overflow in an MLP ------------------------------------------------------------------

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)  # mlp-head


def mlp_setup():
    model = MLP()
    x = jnp.ones((2, 8))
    params = model.init(jax.random.PRNGKey(0), x)
    return model, jax.tree.map(lambda p: jax.device_put(np.abs(np.asarray(p)) * np.float32(100)),
                               params), x


def test_float16_overflow_in_an_mlp_is_localised_to_the_head_matmul():
    model, params, x = mlp_setup()
    assert all_finite(model.apply(params, x))                   # ~1e5: fine in float32
    assert not all_finite(jamp.autocast_transform(model.apply, F16)(params, x))

    found = jamp.find_nonfinite(model.apply, params, x, policy=F16)

    assert (found.primitive, found.dtype) == ("dot_general", "float16")
    assert found.scope.endswith("Dense_1")
    assert file_and_line(found.caller) == here("mlp-head")    # the source line is Flax's Dense
    assert "flax" in found.source
    assert found.decision.startswith("lower table") and "float16" in found.decision
    assert found.output[0].inf > 0 and found.float32_finite is True
    assert found.remedy.kind == "rule"
    pattern, dtype = found.remedy.policy.rules[-1]
    assert pattern.endswith("Dense_1") and dtype == np.dtype(jnp.float32)
    assert all_finite(jamp.autocast_transform(model.apply, found.remedy.policy)(params, x))


def test_find_nonfinite_leaves_the_caller_params_untouched():
    model, params, x = mlp_setup()
    before = jax.tree.map(np.array, params)
    jamp.find_nonfinite(model.apply, params, x, policy=F16)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), before, params)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


# --- NaN inside a scan body ----------------------------------------------------------------------

def normalize_steps(w, xs):
    def step(total, x):
        x = x @ w
        with jax.named_scope("norm"):
            mean = jnp.mean(x)
            var = jnp.mean(jnp.square(x)) - jnp.square(mean)
            y = (x - mean) * jax.lax.rsqrt(var + 1e-5)  # scan-rsqrt
        return total + jnp.sum(y), y
    return jax.lax.scan(step, 0.0, xs)


def scan_inputs():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(5, 16)).astype(np.float32)
    xs[3] = 1.0 + 1e-4 * np.arange(16)                # one step whose spread bfloat16 loses
    return jax.device_put(np.eye(16, dtype=np.float32) * np.float32(3.1)), jax.device_put(xs)


def test_nan_inside_a_scan_body_reports_the_iteration():
    w, xs = scan_inputs()
    assert all_finite(normalize_steps(w, xs))
    found = jamp.find_nonfinite(normalize_steps, w, xs, policy=SQUARE_IN_BF16)

    assert found.primitive == "rsqrt"
    assert found.iterations == (("scan", 3),)
    assert file_and_line(found.source) == here("scan-rsqrt")
    assert found.scope == "norm"
    assert found.remedy is not None
    assert all_finite(jamp.autocast_transform(normalize_steps, found.remedy.policy)(w, xs))


def test_nan_inside_while_and_cond_bodies_and_jit():
    @jax.jit
    def inner(x):
        return jnp.log(x)  # jit-log

    def f(x):
        def body(carry):
            i, v = carry
            v = jax.lax.cond(i == 2, lambda u: inner(u - 5.0), lambda u: u + 1.0, v)
            return i + 1, v
        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1]

    found = jamp.find_nonfinite(f, jnp.ones(3))
    assert found.primitive == "log"
    assert found.iterations == (("while", 2),)
    assert file_and_line(found.source) == here("jit-log")
    assert found.float32_finite is False and found.remedy is None   # log of a negative number


def test_first_in_program_order_wins():
    def f(x):
        a = jnp.log(x - 2.0)  # first-bad
        b = jnp.sqrt(x - 3.0)
        return a + b
    found = jamp.find_nonfinite(f, jnp.ones(2))
    assert found.primitive == "log" and file_and_line(found.source) == here("first-bad")


def test_nan_inside_a_custom_jvp_body():
    @jax.custom_jvp
    def safe_log(x):
        return jnp.log(x)  # custom-body

    safe_log.defjvp(lambda p, t: (safe_log(p[0]), t[0] / p[0]))
    found = jamp.find_nonfinite(lambda x: jnp.sum(safe_log(x)), -jnp.ones(2))
    assert found.primitive == "log" and file_and_line(found.source) == here("custom-body")


def test_custom_vjp_backward_rule_is_covered():
    @jax.custom_vjp
    def f(x):
        return x * 2.0

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (g * jnp.log(x),)

    f.defvjp(fwd, bwd)

    def loss(x):
        return jnp.sum(f(x))  # vjp-call

    found = jamp.find_nonfinite(loss, jnp.zeros(2), grad=True)
    assert found.primitive == "log" and found.backward_of is not None
    # JAX traces a custom_vjp's bwd under the call's source info: the line calling f.
    assert file_and_line(found.source) == here("vjp-call")


# --- the backward pass ---------------------------------------------------------------------------

def scaled_loss(w, x):
    with jax.named_scope("layer"):
        h = jnp.tanh(x @ w)
    return 2.0 ** 19 * jnp.mean(h * h)  # scaled-mean


def test_float16_overflow_in_the_backward_pass_is_fixed_by_a_loss_scale():
    w, x = jnp.eye(3), jnp.ones((2, 3))
    grad_fn = jax.grad(jamp.autocast_transform(scaled_loss, F16))
    assert all_finite(jamp.autocast_transform(scaled_loss, F16)(w, x))
    assert not all_finite(grad_fn(w, x))

    assert jamp.find_nonfinite(scaled_loss, w, x, policy=F16) is None    # the forward is finite
    found = jamp.find_nonfinite(scaled_loss, w, x, policy=F16, grad=True)

    assert found.backward_of is not None and found.dtype == "float16"
    assert file_and_line(found.source) == here("scaled-mean")
    assert str(found).splitlines()[1].strip().startswith("backward of")
    assert found.float32_finite is True
    assert found.remedy.kind == "loss scale"
    scale = found.remedy.loss_scale
    scaled_grads = jax.grad(lambda *a: scale * jamp.autocast_transform(scaled_loss, F16)(*a))(w, x)
    assert all_finite(scaled_grads)


def test_backward_of_sqrt_at_zero_is_reported_with_no_remedy():
    def loss(w, x):
        return jnp.sum(jnp.sqrt(jnp.maximum(x @ w, 0.0)))  # sqrt-line

    found = jamp.find_nonfinite(loss, jnp.eye(3), -jnp.ones((2, 3)), grad=True)
    assert found.backward_of.startswith("`sqrt`")
    assert file_and_line(found.source) == here("sqrt-line")
    assert found.float32_finite is False        # d/dx sqrt(x) at 0 is inf in any precision
    assert found.remedy is None and found.tried


# --- finite programs, and bad input --------------------------------------------------------------

def test_a_finite_program_reports_nothing():
    model, params, x = mlp_setup()
    assert jamp.find_nonfinite(model.apply, params, x) is None               # bfloat16: fine
    w, x2 = bn_inputs()
    assert jamp.find_nonfinite(conv_bn, w, x2, policy=BF16.replace(
        fp32=BF16.fp32 | {"square"})) is None
    assert jamp.find_nonfinite(scaled_loss, jnp.eye(3), jnp.ones((2, 3)), grad=True) is None


def test_static_arguments_and_kwargs_pass_through():
    def f(x, *, train: bool, shift):
        return jnp.log(x + shift) if train else x
    assert jamp.find_nonfinite(f, jnp.ones(2), train=False, shift=jnp.float32(-5)) is None
    assert jamp.find_nonfinite(f, jnp.ones(2), train=True, shift=jnp.float32(-5)).primitive == "log"


def test_an_effect_token_argument_passes_through():
    def f(x, token):
        jax.lax.after_all(token)
        return jnp.log(x)
    token = jax.lax.create_token()
    assert jamp.find_nonfinite(f, jnp.ones(2), token) is None
    assert jamp.find_nonfinite(f, jnp.zeros(2) - 1, token).primitive == "log"


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="find_nonfinite expects a callable"):
        jamp.find_nonfinite(3, jnp.ones(2))
    with pytest.raises(TypeError, match="grad must be"):
        jamp.find_nonfinite(jnp.sum, jnp.ones(2), grad="yes")
    with pytest.raises(ValueError, match="names argument 1"):
        jamp.find_nonfinite(jnp.sum, jnp.ones(2), grad=1)


def test_debugging_guide_worked_example_runs_as_written(capsys):
    guide = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                         "guides", "debugging-precision.md")
    with open(guide) as f:
        text = f.read()
    section = text.split("## Why did my loss go NaN?", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, guide, "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == "nan"
    assert "remedy (verified" in printed and '{"square"}' in printed


def test_a_non_finite_argument_is_named_by_its_path():
    params = {"w": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}
    with pytest.raises(ValueError, match=r"argument args\[0\]\['b'\] already holds inf or NaN"):
        jamp.find_nonfinite(lambda p, x: jnp.sum(p["w"] * x + p["b"]), params, jnp.ones(2))
    with pytest.raises(ValueError, match=r"kwargs\['x'\]"):
        jamp.value_ranges(lambda x: x, x=jnp.array([jnp.inf]))


def test_decision_names_the_region_or_rule_that_set_the_dtype():
    def f(x, w):
        h = x @ w                                   # float16 by the policy
        with jamp.autocast(enabled=False):          # runs as traced: your float16 cast
            return h.astype(jnp.float16) * 1e4

    found = jamp.find_nonfinite(f, jnp.full((1, 2), 10.0), jnp.eye(2), policy=F16)
    assert found.primitive == "mul" and found.dtype == "float16"
    assert "autocast is off here (region)" in found.decision
    assert found.float32_finite is True

    def g(x, w):
        with jax.named_scope("blk"):
            return x @ w
    by_rule = jamp.Policy(jnp.bfloat16, rules=(("blk", jnp.float16),))
    found = jamp.find_nonfinite(g, jnp.full((1, 2), 7e4), jnp.eye(2), policy=by_rule)
    assert found.scope == "blk"
    assert "set by rule 'blk'" in found.decision
    assert found.remedy.kind == "rule" and found.remedy.policy.rules[-1][0] == "blk"


def test_nested_loops_report_every_iteration_and_remat_bodies_are_entered():
    def f(xs):
        def outer(c, x):
            def inner(carry):
                j, v = carry
                return j + 1, jax.checkpoint(lambda u: jnp.log(u - 1.0))(v)  # nested-log
            return c, jax.lax.while_loop(lambda carry: carry[0] < 3, inner, (0, x))[1]
        return jax.lax.scan(outer, 0.0, xs)[1]

    # 1e6 -> 13.8 -> 2.55 -> 0.44 stays finite; 2.5 -> 0.405 -> log(-0.595) is NaN at j = 1.
    xs = jnp.array([[1e6], [1e6], [2.5], [1e6]])
    found = jamp.find_nonfinite(f, xs)
    assert found.primitive == "log"
    assert found.iterations == (("scan", 2), ("while", 1))
    assert file_and_line(found.source) == here("nested-log")


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test extra
    given = None

if given is not None:
    def product(x, w):
        return x @ w

    @settings(max_examples=25, deadline=None)
    @given(st.floats(-1e5, 1e5, width=32), st.floats(-1e5, 1e5, width=32))
    def test_found_exactly_when_the_float16_program_overflows(a, b):
        """Agrees with numpy's float16: the casts of a and b, then their product, rounded."""
        x, w = jnp.full((1, 1), a, jnp.float32), jnp.full((1, 1), b, jnp.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            product16 = np.float32(np.float16(a)) * np.float32(np.float16(b))
            expected = np.isfinite(np.float16(product16))
        found = jamp.find_nonfinite(product, x, w, policy=F16)
        assert (found is None) == bool(expected)
        if found is not None:
            assert found.primitive in ("convert_element_type", "dot_general")
            assert found.remedy is not None


def test_grad_of_a_loss_aux_pair_or_a_non_scalar_says_what_to_pass():
    """A (loss, aux) pair met ``loss * scale`` inside the probe: "unsupported operand type(s)
    for *: 'tuple' and 'DynamicJaxprTracer'"."""
    def loss_with_aux(w):
        return jnp.sum(w @ w), {"acc": 1.0}

    w = jnp.ones((4, 4))
    for tool in (jamp.find_nonfinite, jamp.value_ranges):
        with pytest.raises(TypeError, match=r"grad=True differentiates loss_with_aux's output, "
                                            r"which must be a scalar loss; it returned a tuple "
                                            r"of 2.*lambda \*args: loss_with_aux\(\*args\)\[0\]"):
            tool(loss_with_aux, w, grad=True)
        with pytest.raises(TypeError, match=r"returned a bfloat16\[4, 4\] array") as info:
            tool(lambda w: w @ w, w, grad=True)
        assert "(loss, aux)" not in str(info.value)
    assert jamp.find_nonfinite(lambda w: loss_with_aux(w)[0], w, grad=True) is None  # as said


def test_a_literal_operand_is_shown_in_its_traced_dtype():
    found = jamp.find_nonfinite(lambda x: x * 1e30, jnp.full(2, 1e10))
    assert found.primitive == "mul" and found.output[0].inf == 2
    assert [r.dtype for r in found.operands] == ["float32", "float32"]  # not numpy's float64
    assert "operand 1: float32[] finite values in [1e+30, 1e+30]" in str(found)


def test_decision_says_the_dtype_that_ran_where_a_rule_kept_it_out_of_float32():
    def cubed(w, x):
        return jnp.mean(jax.nn.gelu(x @ w, approximate=True))  # x ** 3, unsummed: float16
    found = jamp.find_nonfinite(cubed, jnp.eye(8) * 100.0, jnp.ones((2, 8)), policy=F16)
    assert (found.primitive, found.dtype) == ("integer_pow", "float16")
    assert "computes in float32" not in found.decision
    assert "only where its result is summed" in found.decision and "float16" in found.decision

    with jax.enable_x64(True):                                 # float64 is never narrowed
        found = jamp.find_nonfinite(lambda w: jnp.exp(w * 1000), jnp.ones(2, jnp.float64))
    assert (found.primitive, found.dtype) == ("exp", "float64")
    assert "computes in float32" not in found.decision and "float64" in found.decision


def test_an_equation_inside_a_jnp_helper_is_placed_at_the_users_line():
    def leaky(w, x):
        h = jnp.where(x @ w > 0, x @ w, 0.01 * (x @ w))  # leaky-line
        return jnp.mean(h)
    ranges = jamp.value_ranges(leaky, jnp.full((8, 8), 900.0), jnp.ones((2, 8)), policy=F16)
    selected = next(e for e in ranges.entries if e.primitive == "select_n")  # in jnp's `_where`
    assert file_and_line(selected.source) == here("leaky-line")


def test_the_float32_remedy_of_a_policy_accumulating_in_float16_drops_that_accumulation():
    """``Policy(float16, accumulate_dtype=float16)``: the last-resort remedy was
    ``policy.replace(compute_dtype=float32)``, which a float32 policy with a float16
    accumulation refuses, so find_nonfinite raised instead of reporting."""
    model, params, x = mlp_setup()
    policy = jamp.Policy(jnp.float16, accumulate_dtype=jnp.float16)
    found = jamp.find_nonfinite(model.apply, params, x, policy=policy)  # (raised ValueError)
    assert found.remedy is not None and found.remedy.policy.accumulate_dtype == jnp.float16
    assert all_finite(jamp.autocast_transform(model.apply, found.remedy.policy)(params, x))
