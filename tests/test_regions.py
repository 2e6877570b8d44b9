"""Regions, rules over Flax module paths, the decorator and trace-time queries."""
import asyncio
import contextlib
import functools
import threading
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import _compat as compat
from tests.jaxpr_utils import operand_dtypes

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# (made on the host: jax.device_put hands it over without compiling, where jnp's ops compile)
A = jax.device_put(np.full((4, 4), 0.5, np.float32))


def test_disabled_and_other_dtype_regions():
    def f(a):
        with jamp.autocast(enabled=False):
            off = a @ a
        with jamp.autocast(dtype=F16):
            half = a @ a
        return off, half, a @ a
    assert [o.dtype for o in jamp.autocast_transform(f)(A)] == [F32, F16, BF16]


def test_disabled_region_runs_as_traced_under_the_transform_as_arriving_in_a_region():
    """Under the transform a disabled region runs the program as traced: ``b`` was traced
    float32, so its ops take it in float32 (a ``b.astype(jnp.float32)`` the user wrote, as torch
    asks, left nothing in the program). A region outside a transform runs the user's Python on
    the 16-bit value, as torch: ``log`` stays bfloat16 unless the code casts."""
    def f(a):
        b = a @ a  # bf16
        with jamp.autocast(enabled=False):
            return jnp.log(b), b @ a, jnp.log(b.astype(F32))
    jaxpr = jax.make_jaxpr(jamp.autocast_transform(f))(A)
    assert [o.aval.dtype for o in jaxpr.jaxpr.outvars] == [F32, F32, F32]
    logs = [e for e in jaxpr.eqns if e.primitive.name == "log"]
    assert [str(e.invars[0].aval.dtype) for e in logs] == ["float32", "float32"]
    with jamp.autocast():
        assert [o.dtype for o in f(A)] == [BF16, F32, F32]


def test_disabled_region_bias_add_promotes_as_jax_in_both_forms():
    """A bias (a parameter broadcast over the batch) added to a matmul's bfloat16 output is
    cast to bfloat16 where autocast is on (torch's linear includes it); in a disabled region
    nothing is cast: the add runs in float32, as JAX promotes bf16 + f32. The transform cast
    the bias all the same."""
    w = jax.device_put(np.ones((4, 4), np.float32))
    b = jax.device_put(np.linspace(0, 1, 4, dtype=np.float32))

    def f(a):
        y = a @ w  # bf16
        with jamp.autocast(enabled=False):
            off = y + b
        return off, y + b

    def in_region(a):
        with jamp.autocast():
            return f(a)

    for form in (jamp.autocast_transform(f), in_region, jax.jit(in_region)):
        off, on = form(A)
        assert (off.dtype, on.dtype) == (F32, BF16), form
    adds = [e for e in jax.make_jaxpr(jamp.autocast_transform(f))(A).jaxpr.eqns
            if e.primitive.name == "add"]
    assert [e.outvars[0].aval.dtype for e in adds] == [F32, BF16]


def test_nesting_innermost_wins_and_implicit_nesting():
    def f(a):
        with jamp.autocast(enabled=False):
            e = a @ a
            with jamp.autocast(enabled=True):
                g = e @ a
                with jamp.autocast(enabled=False):
                    h = e @ a
        with jamp.autocast(enabled=False), jamp.autocast(enabled=True):
            i = a @ a
        return e, g, h, i
    assert [o.dtype for o in jamp.autocast_transform(f)(A)] == [F32, BF16, F32, BF16]


@pytest.mark.parametrize("jitted", [False, True])
def test_a_transformed_function_keeps_its_own_policy_inside_a_region_or_a_transform(jitted):
    """Innermost wins for ``autocast_transform`` too: its program is not decided again by the
    enclosing region's or transform's policy (it ran bfloat16, rules lost, while the queries in
    it answered float16)."""
    seen = []

    def f(a):
        seen.append(jamp.get_autocast_dtype())
        return a @ a

    def g(a):
        with jax.named_scope("head"):
            return a @ a

    half = jamp.autocast_transform(f, F16)
    head_off = jamp.autocast_transform(g, jamp.Policy(rules=(("head", None),)))
    call = jax.jit if jitted else (lambda fn: fn)

    def in_region(a):
        with jamp.autocast():
            return half(a), head_off(a), (a @ a)

    assert [o.dtype for o in call(in_region)(A)] == [F16, F32, BF16]
    assert seen[-1] == F16
    outer = jamp.autocast_transform(lambda a: (half(a), head_off(a), a @ a))
    assert [o.dtype for o in call(outer)(A)] == [F16, F32, BF16]
    grads = jax.grad(lambda a: jnp.sum(in_region(a)[0]).astype(F32))(A)
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, jax.jit(jax.grad(lambda a: jnp.sum(a @ a)))(A), rtol=1e-2)


@pytest.mark.parametrize("cast", ["astype", "asarray", "lax"])
def test_a_float32_cast_the_code_asks_for_sticks_in_a_region(cast):
    """torch's ``.float()``: what is computed from ``h.astype(jnp.float32)`` is float32 (it ran
    bfloat16 again, ``h32 + 1e-3`` giving 1.0), eagerly, under jax.jit and in a jitted callee
    given the 16-bit value; jnp's own promotions (a bias add) are still read as the 16-bit
    value. (A callee given ``x`` traces ``x @ w`` float32: its cast to float32 leaves nothing
    in its program, as under the transform, dtypes.md.)"""
    widen = {"astype": lambda h: h.astype(F32), "asarray": lambda h: jnp.asarray(h, F32),
             "lax": lambda h: jax.lax.convert_element_type(h, F32)}[cast]
    x = jax.device_put(np.ones((2, 4), np.float32))
    w = jnp.full((4, 4), 0.25)  # x @ w == 1.0 exactly

    def tail(h):
        h32 = widen(h)
        return jnp.tanh(h32), -h32, h32 + 1e-3, jnp.maximum(h32, 0.5), h + jnp.zeros(4)

    def in_region(x):
        with jamp.autocast():
            return tail(x @ w)

    def in_region_callee(x):
        with jamp.autocast():
            return jax.jit(tail)(x @ w)

    for form in (in_region, jax.jit(in_region), in_region_callee):
        *wide, bias_add = form(x)
        assert [o.dtype for o in wide] == [F32] * 4 and bias_add.dtype == BF16
        np.testing.assert_allclose(wide[2], 1.001, rtol=1e-7)


def test_one_instance_entered_repeatedly_and_nested():
    off = jamp.autocast(enabled=False)

    def f(a):
        with off:
            x = a @ a
            with off:
                y = a @ a
            z = a @ a
        with off:
            w = a @ a
        return x, y, z, w, a @ a
    assert [o.dtype for o in jamp.autocast_transform(f)(A)] == [F32] * 4 + [BF16]


def test_exiting_a_region_twice_or_out_of_order_is_a_clear_error_and_closes_it_in_order():
    """Entered and exited by hand (a notebook, an ExitStack kept by an object): exiting twice was
    an IndexError from jamp's internals, and exiting the outer region first silently turned
    autocast off under the inner one still open. Exited out of order, a region stays open under
    the ones entered after it and closes when they have: nothing else would ever exit it."""
    region = jamp.autocast()
    region.__enter__()
    region.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match=r"__exit__ of a region that is not open here"):
        region.__exit__(None, None, None)
    outer, inner = jamp.autocast(), jamp.autocast(dtype=F16)
    outer.__enter__()
    inner.__enter__()
    try:
        with pytest.raises(RuntimeError, match=r"entered after it is still open.*reverse order"):
            outer.__exit__(None, None, None)
        assert (A @ A).dtype == F16 and jamp.get_autocast_dtype() == F16  # both still open
        with pytest.raises(RuntimeError, match=r"not open here"):  # (its exit is under way)
            outer.__exit__(None, None, None)
    finally:
        inner.__exit__(None, None, None)
    assert (A @ A).dtype == F32 and not jamp.is_autocast_enabled()  # the outer one closed too
    assert compat._routing_users == 0  # JAX's differentiation methods are back
    elsewhere = jamp.autocast()
    elsewhere.__enter__()
    try:
        thread_error = []

        def exit_here():
            try:
                elsewhere.__exit__(None, None, None)
            except RuntimeError as err:
                thread_error.append(err)

        worker = threading.Thread(target=exit_here)
        worker.start()
        worker.join()
        assert "entered in another thread" in str(thread_error[0])
    finally:
        elsewhere.__exit__(None, None, None)


def test_one_autocast_object_entered_by_two_threads_at_once_closes_in_each():
    """A module-level ``amp = jamp.autocast()`` used by a server's worker threads: the first
    thread to leave was told its region was "entered in another thread" and kept it open for
    good, and later tasks with no region ran in bfloat16 on that thread."""
    amp = jamp.autocast()
    inside, leave = threading.Barrier(2), threading.Event()
    seen: dict = {}

    def request(name, leaves_first):
        try:
            with amp:
                inside.wait(timeout=60)
                if not leaves_first:
                    leave.wait(timeout=60)
                seen[name] = (A @ A).dtype
        finally:
            if leaves_first:
                leave.set()
        seen[name + " after"] = ((A @ A).dtype, jamp.is_autocast_enabled())

    threads = [threading.Thread(target=request, args=(name, name == "first"))
               for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"first": BF16, "second": BF16,
                    "first after": (F32, False), "second after": (F32, False)}
    assert compat._routing_users == 0


def test_regions_of_interleaved_asyncio_tasks_and_a_collected_generator_all_close():
    """A region around an ``await`` shares the thread's state with the tasks the loop runs
    meanwhile (as torch's and JAX's own per-thread state): the task leaving first is told, and
    after both have left, nothing stays in a region. A generator holding a region, collected
    inside another region, left it open for good."""
    async def task(dtype, delay):
        with jamp.autocast(dtype=dtype):
            await asyncio.sleep(delay)

    async def both():
        return await asyncio.gather(task(F16, 0.01), task(BF16, 0.05), return_exceptions=True)

    first, second = asyncio.run(both())
    assert isinstance(first, RuntimeError) and "another asyncio task" in str(first)
    assert second is None
    assert (A @ A).dtype == F32 and not jamp.is_autocast_enabled()

    def batches():
        with jamp.autocast():
            while True:
                yield A @ A

    held = batches()
    next(held)
    with jamp.autocast(dtype=F16):
        with pytest.raises(RuntimeError, match="entered after it is still open"):
            held.close()  # (a collection says the same as "Exception ignored")
        assert (A @ A).dtype == F16
    assert (A @ A).dtype == F32 and not jamp.is_autocast_enabled()
    assert compat._routing_users == 0


def test_one_autocast_object_decorating_two_functions_runs_each():
    """``amp = jamp.autocast()`` then ``@amp`` on two functions: called outside a region, the
    second ran the first (its transform was kept on the object, found by policy alone)."""
    amp = jamp.autocast()
    double = amp(lambda x: x @ x * 2.0)
    negate = amp(lambda x: -(x @ x))
    np.testing.assert_allclose(double(A), 2 * np.asarray(A @ A), rtol=1e-2)
    np.testing.assert_allclose(negate(A), -np.asarray(A @ A), rtol=1e-2)
    assert double(A).dtype == negate(A).dtype == BF16


def test_enabled_region_without_dtype_inherits_the_enclosing_dtype():
    def f(a):
        with jamp.autocast(dtype=F16):
            with jamp.autocast(enabled=False):
                with jamp.autocast():
                    return a @ a
    assert jamp.autocast_transform(f)(A).dtype == F16


@pytest.mark.parametrize("jit_helper", [False, True])
def test_callees_inherit_the_region_and_their_own_regions_apply(jit_helper):
    wrap = jax.jit if jit_helper else (lambda fn: fn)
    plain = wrap(lambda a, b: a @ b)

    @wrap
    def helper_off(a, b):
        with jamp.autocast(enabled=False):
            return a @ b

    def f(a):
        with jamp.autocast(enabled=False):
            x = plain(a, a)
        y = plain(a, a)
        z = helper_off(a, a)
        with jamp.autocast(enabled=False):
            with jamp.autocast(dtype=F16):
                w = plain(a, a)
        return x, y, z, w
    assert [o.dtype for o in jamp.autocast_transform(f)(A)] == [F32, BF16, F32, F16]


def test_is_autocast_enabled_and_get_autocast_dtype_at_trace_time():
    seen = []

    def f(a):
        seen.append((jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        with jamp.autocast(enabled=False):
            seen.append((jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        with jamp.autocast(dtype=F16):
            seen.append((jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        return a
    jamp.autocast_transform(f)(A)
    assert seen == [(True, BF16), (False, BF16), (True, F16)]
    assert not jamp.is_autocast_enabled()


@pytest.mark.parametrize("transform_first", [False, True])
def test_a_jitted_function_reading_the_queries_is_traced_per_state(transform_first):
    """A jitted function whose Python asks ``is_autocast_enabled()`` at trace time sees the state
    it is called under, in whatever order: JAX caches a jit's trace, so the state is part of its
    cache key (before, the program traced inside a transform answered outside it, and back)."""

    @jax.jit
    def scale(a):
        if jamp.is_autocast_enabled():
            return a * 2.0 if jamp.get_autocast_dtype() == F16 else a * 3.0
        return a * 5.0

    def transformed(a):
        with jamp.autocast(enabled=False):
            off = scale(a)
        with jamp.autocast(dtype=F16):
            half = scale(a)
        return scale(a), off, half

    def outside():
        return scale(A)

    def inside():
        return jamp.autocast_transform(transformed)(A)

    order = (inside, outside) if transform_first else (outside, inside)
    results = {fn.__name__: fn() for fn in order}
    a = np.asarray(A)
    np.testing.assert_array_equal(results["outside"], a * 5.0)
    for got, factor in zip(results["inside"], (3.0, 5.0, 2.0)):
        np.testing.assert_array_equal(got, a * factor)
    with jamp.autocast():  # the region form too
        np.testing.assert_array_equal(scale(A), a * 3.0)
    np.testing.assert_array_equal(scale(A), a * 5.0)


def test_region_outside_a_transform_takes_effect():
    with jamp.autocast():
        assert (A @ A).dtype == BF16
    assert (A @ A).dtype == A.dtype


def test_decorator_is_a_region_inside_and_a_transform_outside():
    @jamp.autocast(dtype=F16)
    def half(a):
        return a @ a

    @jamp.autocast(enabled=False)
    def full(a):
        return a @ a

    assert half(A).dtype == F16  # outside: applies autocast_transform itself
    assert full(A).dtype == F32
    out = jamp.autocast_transform(lambda a: (half(a), full(a), a @ a))(A)
    assert [o.dtype for o in out] == [F16, F32, BF16]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        half(A)  # the decorator never warns


def test_decorator_outside_a_region_takes_a_python_int_as_the_function_sees_it():
    """A head count, an axis or a loop count given as an int: the decorated function called
    outside a region failed with JAX's tracer errors where it runs undecorated."""
    traces = []

    @jamp.autocast()
    def split_heads(x, num_heads, scale=1.0):
        traces.append(num_heads)
        h = (x @ x) * scale
        for _ in range(num_heads):
            h = h + 1
        return h.reshape(h.shape[0], num_heads, -1)

    out = split_heads(A, 2, scale=0.5)
    assert out.shape == (4, 2, 2) and out.dtype == BF16
    a = np.asarray(A)
    np.testing.assert_allclose(np.asarray(out).reshape(4, 4), (a @ a) * 0.5 + 2, rtol=1e-2)
    assert split_heads(A, num_heads=4).shape == (4, 4, 1)
    split_heads(A, 2, scale=0.25)  # a float stays traced: no new trace
    assert traces == [2, 4]


def test_decorator_cast_inputs_runs_the_function_in_float32():
    @jamp.autocast(enabled=False, cast_inputs=F32)
    def sensitive(x):
        return x @ x

    f = jamp.autocast_transform(lambda a: sensitive(a @ a))  # arrives bf16, runs in f32
    assert f(A).dtype == F32
    dots = operand_dtypes(jax.make_jaxpr(f)(A), "dot_general")
    assert dots == [("bfloat16", "bfloat16"), ("float32", "float32")]
    with pytest.raises(ValueError, match="decorated functions only"):
        with jamp.autocast(cast_inputs=F32):
            pass


@jamp.autocast(enabled=False, cast_inputs=F32)
def _sensitive(x, squared=True, scale=2.0):
    return (x @ x if squared else x) * scale


class _Layer:
    def __init__(self, scale):
        self.scale = scale

    @jamp.autocast(enabled=False, cast_inputs=F32)
    def __call__(self, x, *, transpose=False):
        return (x.T if transpose else x) @ x * self.scale


def test_decorator_cast_inputs_applies_inside_a_region_eagerly_and_jitted():
    """torch's custom_fwd inside ``with jamp.autocast():``: on jax 0.12 the region took the
    decorated function's jit for one of jnp's and skipped its cast (the opposite dtypes came
    back); only the transform's path was tested."""
    @jamp.autocast(enabled=False, cast_inputs=F32)
    def sensitive(x):
        return x @ x

    @jamp.autocast(cast_inputs=BF16)
    def narrow(x):
        return x + 1

    def f(v):
        with jamp.autocast():
            return sensitive(v @ v), narrow(v)

    for form in (f, jax.jit(f), jamp.autocast_transform(lambda v: (sensitive(v @ v), narrow(v)))):
        assert [o.dtype for o in form(A)] == [F32, BF16], form


@pytest.mark.parametrize("call", [
    lambda a: _sensitive(a @ a, True),                     # a Python bool argument
    lambda a: _sensitive(a @ a, squared=False, scale=3),   # keyword bool and int
    lambda a: _Layer(0.5)(a @ a),                          # a method: `self` is no array
    lambda a: _Layer(0.5)(a @ a, transpose=True),
], ids=["bool", "keywords", "method", "method-keyword"])
def test_decorator_cast_inputs_passes_non_array_arguments_through(call):
    f = jamp.autocast_transform(call)
    assert f(A).dtype == F32
    assert jax.jit(f)(A).dtype == F32


@pytest.mark.parametrize("call", [
    lambda a: _sensitive(a.astype(BF16)),
    lambda a: _Layer(1.0)(a.astype(F16)),
], ids=["function", "method"])
def test_decorator_cast_inputs_overrides_a_cast_the_program_made(call):
    """torch's custom_fwd(cast_inputs=float32): a bf16 input runs, and returns, in float32 even
    where the program cast it itself (the matmul's traced preferred_element_type is bf16)."""
    f = jamp.autocast_transform(call)
    assert f(A).dtype == F32
    assert operand_dtypes(jax.make_jaxpr(f)(A), "dot_general") == [("float32", "float32")]
    np.testing.assert_allclose(f(A), call(A).astype(F32), rtol=2e-2, atol=2e-2)


def test_decorator_cast_inputs_body_reads_the_cast_dtype():
    """torch's custom_fwd casts before the body runs: a body reading its input's dtype
    (jnp.finfo(p.dtype), jnp.zeros_like) saw the caller's bfloat16 and computed log(1e-4) as
    -4.85 (clipped at bfloat16's eps), or failed with JAX's fori_loop carry error."""
    @jamp.autocast(enabled=False, cast_inputs=F32)
    def safe_log(p):
        assert p.dtype == F32, p.dtype
        return jnp.log(jnp.clip(p, jnp.finfo(p.dtype).eps, 1.0))

    @jamp.autocast(enabled=False, cast_inputs=F32)
    def accumulate(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + x @ w, jnp.zeros_like(x))

    x, w = jnp.full((2, 4), 1e-4), jax.device_put(np.eye(4, dtype=np.float32))

    def f(x):
        with jamp.autocast():
            p = x @ w  # bfloat16
            return safe_log(p), accumulate(p, w), safe_log(p.astype(F16))

    for form in (f, jax.jit(f), jamp.autocast_transform(lambda x: (
            safe_log(x @ w), accumulate(x @ w, w), safe_log((x @ w).astype(F16))))):
        logs, sums, logs16 = form(x)
        np.testing.assert_allclose(logs, np.log(1e-4), rtol=1e-3)
        np.testing.assert_allclose(logs16, np.log(1e-4), rtol=1e-3)
        assert sums.dtype == F32


def test_disabled_region_matmul_returns_at_least_its_traced_type():
    def f(a):
        b = a @ a  # bf16
        with jamp.autocast(enabled=False):
            # traced float32 x float32 (the astype is a no-op in the trace); both arrive bf16
            return b.astype(F32) @ b.astype(F32)
    assert jamp.autocast_transform(f)(A).dtype == F32


def test_enabled_must_be_known_at_trace_time():
    def f(a, flag):
        with jamp.autocast(enabled=flag):
            return a @ a
    with pytest.raises(TypeError, match="Python bool known at trace time"):
        jamp.autocast_transform(f)(A, jnp.asarray(True))  # a traced value, not a Python bool


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="proj")(x)
        return nn.Dense(4, name="head")(x)


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Block(name="block")(x)


@functools.cache
def _model_params():
    """_Model's parameters, initialised in one program (not op by op), for every policy."""
    return jax.jit(_Model().init)(jax.random.PRNGKey(0), A)


def _dense_output_dtypes(policy):
    model = _Model()
    params = _model_params()
    jaxpr = jax.make_jaxpr(jamp.autocast_transform(model.apply, policy))(params, A)
    return [e.outvars[0].aval.dtype for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


def test_rules_match_flax_module_paths():
    assert _dense_output_dtypes(jamp.Policy()) == [BF16, BF16]
    assert _dense_output_dtypes(jamp.Policy(rules=(("*/head", None),))) == [BF16, F32]
    assert _dense_output_dtypes(jamp.Policy(rules=(("*/block", F16), ("*/proj", None)))) == [F32, F16]
    # Later rules win at the same scope.
    assert _dense_output_dtypes(jamp.Policy(rules=(("*/head", None), ("*/head", F16)))) == [BF16, F16]


def test_regions_inside_win_over_rules():
    def f(a):
        with jax.named_scope("encoder"):
            x = a @ a
            with jamp.autocast(dtype=F16):
                y = a @ a
        return x, y
    out = jamp.autocast_transform(f, jamp.Policy(rules=(("encoder", None),)))(A)
    assert [o.dtype for o in out] == [F32, F16]


def test_a_disabled_regions_dtype_is_the_one_a_nested_region_and_the_decorator_take():
    """torch's autocast(enabled=False, dtype=float16) sets the autocast dtype: a nested
    autocast() computed float16 but get_autocast_dtype() answered bfloat16, and a @autocast()
    function called there computed bfloat16."""
    @jamp.autocast()
    def decorated(x):
        return x @ x

    with jamp.autocast(enabled=False, dtype=F16):
        assert jamp.get_autocast_dtype() == F16 and not jamp.is_autocast_enabled()
        with jamp.autocast():
            assert jamp.get_autocast_dtype() == F16
            assert (A @ A).dtype == F16
        assert decorated(A).dtype == F16
    assert decorated(A).dtype == BF16  # outside, the default again (one transform per dtype)


def test_a_regions_unmatched_rule_warning_names_the_users_line():
    # It named contextlib.py: the region's exit goes through contextlib's frames.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jamp.autocast(jamp.Policy(rules=(("haed", None),))):
            A @ A
    found = [w for w in caught if issubclass(w.category, jamp.UnmatchedRuleWarning)]
    assert found and all(w.filename == __file__ for w in found), [w.filename for w in found]


def test_a_whole_policy_in_a_region_explain_traces_names_what_differs_and_policy_arg():
    """The error named tables, rules and accumulate_dtype for a Policy(reduce_dtype=...) and
    advised autocast(dtype=...), silently dropping reduce_dtype."""
    policy = jamp.Policy(BF16, reduce_dtype=F32)

    def loss(w, x):
        with jamp.autocast(policy):
            return jnp.mean(jnp.tanh(x @ w) ** 2)

    with pytest.raises(ValueError, match=r"beyond that dtype: reduce_dtype\)") as error:
        jamp.explain(jax.grad(loss), A, A)
    assert "as policy=" in str(error.value) and "accumulate_dtype" not in str(error.value)


def test_cast_inputs_function_returns_non_array_outputs_as_they_were_in_a_region():
    """It ran inside a jax.jit: a string output raised JAX's "not a valid JAX type" naming
    jamp's function, and a Python int came back as an Array."""

    @jamp.autocast(enabled=False, cast_inputs=F32)
    def sensitive(a, b):
        return a @ b, 3, "ok", jnp.float16

    for where in (contextlib.nullcontext(), jamp.autocast()):
        with where:
            product, count, label, kind = sensitive(A @ A, A)
        assert product.dtype == F32
        assert (type(count), count, label, kind) == (int, 3, "ok", jnp.float16)


def test_casts_inside_bodies_jax_traces_first_and_input_typed_norms_as_documented():
    """dtypes.md, Regions: a float32 cast of a value computed inside a checkpointed body (traced
    by JAX before the region sees it, with float32 operands) converts nothing there; entering the
    region inside the body, with none around the call, keeps it. A normalization casting back to
    its input's dtype returns the 16-bit dtype in a region, float32 under the transform."""
    x, w = jax.device_put(np.ones((2, 4), np.float32)), jnp.full((4, 4), 0.25)

    def body(x):
        return (x @ w).astype(F32) + 1e-3

    def body_in_region(x):
        with jamp.autocast():
            return body(x)

    def around(x):
        with jamp.autocast():
            return jax.checkpoint(body)(x)

    assert around(x).dtype == BF16
    inside = jax.checkpoint(body_in_region)(x)
    assert inside.dtype == F32
    np.testing.assert_allclose(inside, 1.001, rtol=1e-7)

    def rms_norm(h):
        h32 = h.astype(F32)
        return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)).astype(h.dtype)

    def layer(x):
        return rms_norm(x @ w)

    with jamp.autocast():
        assert layer(x).dtype == BF16
    assert jamp.autocast_transform(layer)(x).dtype == F32
