"""`with jamp.autocast():` anywhere (issue 21): eagerly, inside jit/grad/vmap/scan/checkpoint,
around jitted callees, control flow, custom derivatives and Flax apply, with the same decisions
as autocast_transform."""
import collections
import copy
import functools
import gc
import pickle
import sys
import threading
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen.dtypes import promote_dtype
from jax import lax

import jamp
from jamp import _compat as compat
from jamp import region_trace
from tests.jaxpr_utils import (
    count_compiles,
    dtype_signatures,
    eqns_named,
    fresh,
    in_region,
    iter_eqns,
    operand_dtypes,
)

BF16, F16, F32, F64 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))
KEY = jax.random.PRNGKey(0)  # (the models' init key)
# Test data made on the host: jax.device_put hands it over as a device array without compiling
# (jnp.asarray of a numpy array, or a jax.random call, compiles a program per shape).
_RNG = np.random.default_rng(0)
X = jax.device_put(_RNG.standard_normal((8, 16), dtype=np.float32))
W = jax.device_put(_RNG.standard_normal((16, 16), dtype=np.float32) * np.float32(0.25))
B = jax.device_put(np.linspace(-1.0, 1.0, 16, dtype=np.float32))
X16, W16 = (jax.device_put(np.asarray(a).astype(BF16)) for a in (X, W))


def block(x, w, b):
    h = jnp.tanh(x @ w + b)
    return h, jnp.exp(h), jnp.sum(h)


def dtypes(tree):
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


# --- eagerly at top level -------------------------------------------------------------------


def test_eager_region_runs_the_policy_and_returns_its_dtypes():
    with jamp.autocast():
        y = X @ W
        e = jnp.exp(y)
        assert jamp.is_autocast_enabled() and jamp.get_autocast_dtype() == BF16
    assert (y.dtype, e.dtype) == (BF16, F32)
    assert not jamp.is_autocast_enabled()
    assert (X @ W).dtype == F32  # the state is gone after the block


def test_float64_integers_and_explicit_float32_blocks_are_untouched():
    with jax.enable_x64(True):
        x64 = jax.device_put(np.ones((4, 4), np.float64))
        ints = jax.device_put(np.arange(16, dtype=np.int64).reshape(4, 4))
        with jamp.autocast():
            assert (x64 @ x64).dtype == F64
            assert (ints @ ints).dtype == ints.dtype
            with jamp.autocast(enabled=False):
                assert (X @ W).dtype == F32


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_eager_region_equals_autocast_transform(dtype):
    expected = jamp.autocast_transform(block, dtype)(X, W, B)
    got = in_region(block, dtype=dtype)(X, W, B)
    assert dtypes(got) == dtypes(expected)
    # Eagerly each op rounds to its dtype; the transform's compiled program fuses them.
    chex.assert_trees_all_close(got, expected, rtol=2e-2, atol=2e-2)


# --- inside transformations, with no wrapper ---------------------------------------------------


def test_inside_jit_same_program_decisions_as_autocast_transform():
    region = jax.make_jaxpr(in_region(block))(X, W, B)
    transform = jax.make_jaxpr(jamp.autocast_transform(block))(X, W, B)
    for name in ("dot_general", "tanh", "exp", "reduce_sum", "add"):
        got = [tuple(v.aval.dtype for v in e.outvars) for e in eqns_named(region, name)]
        want = [tuple(v.aval.dtype for v in e.outvars) for e in eqns_named(transform, name)]
        assert got == want, name
    chex.assert_trees_all_close(jax.jit(in_region(block))(X, W, B), jamp.autocast_transform(block)(X, W, B))


def test_bias_add_after_a_matmul_stays_in_the_compute_dtype():
    """jnp promotes the bf16 matmul output to add the float32 bias; the region reads that as the
    float32 program's view (a bias add, as torch's linear), so the add runs in bfloat16."""
    with jamp.autocast():
        y = X @ W + B
        residual = X @ W + X  # a full-size float32 operand promotes, as under autocast_transform
    assert y.dtype == BF16
    assert residual.dtype == F32


def test_jnp_reductions_return_float32_in_a_region():
    with jamp.autocast():
        h = X @ W
        assert (jnp.sum(h).dtype, jnp.mean(h).dtype) == (F32, F32)
    assert jnp.sum(h).dtype == BF16  # jnp's own rule outside the region


CONTRACTIONS = {
    "@": lambda a, b: a @ b,
    "jnp.dot": jnp.dot,
    "jnp.matmul": jnp.matmul,
    "jnp.tensordot": lambda a, b: jnp.tensordot(a, b, 1),
    "jnp.inner": lambda a, b: jnp.inner(a, b.T),
}


@functools.cache
def _transformed_contraction(name, policy, dtype):
    """autocast_transform's product under jax.jit: one program for the eager and jitted region."""
    fn = CONTRACTIONS[name]
    transform = jamp.autocast_transform(fn, policy) if policy else jamp.autocast_transform(fn)
    return jax.jit(transform)(*((X, W) if dtype == F32 else (X16, W16)))


@pytest.mark.parametrize("name", list(CONTRACTIONS))
@pytest.mark.parametrize(
    "policy, dtype",
    [(None, F32), (F32, BF16), (F16, BF16)],
    ids=["bf16 policy, float32 inputs", "float32 policy, bf16 inputs", "f16 policy, bf16 inputs"],
)
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_every_jnp_contraction_returns_the_dtype_the_policy_gave_its_product(
    name, policy, dtype, jitted
):
    # jnp.tensordot ends by converting its product to the dtype its operands would give it: in a
    # region that convert undid the policy (float32 from a bfloat16 region, the inputs' 16-bit
    # dtype from a float32 one) where `@` and autocast_transform keep the policy's dtype.
    fn, (x, w) = CONTRACTIONS[name], ((X, W) if dtype == F32 else (X16, W16))
    region = in_region(fn, dtype=policy)
    got = (jax.jit(region) if jitted else region)(x, w)
    want = _transformed_contraction(name, policy, dtype)
    assert got.dtype == want.dtype == (policy or BF16)
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=2e-2)


@functools.partial(jax.jit, inline=True)  # (a callee the region walks from its jaxpr, as jnp's)
def product_of_products(x, w):
    return (x @ w) @ (x @ w).T


@functools.partial(jax.jit, inline=True)
def asks_for_float32(x, w):
    return lax.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32)


@pytest.mark.parametrize(
    "fn, dtype",
    [(product_of_products, BF16), (asks_for_float32, F32)],
    ids=["products of products", "an explicit float32 product"],
)
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_walked_callee_keeps_only_the_product_types_its_program_asked_for(fn, dtype, jitted):
    # Walking a callee's jaxpr, a region compared a product's traced preferred_element_type
    # (float32: the callee was traced on float32 values) with the types its operands arrived
    # in (bfloat16: the policy made them), took it for one the program asked for, and returned
    # float32 where autocast_transform returns bfloat16. The callee's own operand types decide.
    region = in_region(fn)
    got = (jax.jit(region) if jitted else region)(X, W)
    want = jax.jit(jamp.autocast_transform(fn))(X, W)
    assert got.dtype == want.dtype == dtype
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "transform",
    [jax.vmap, lambda f: jax.jit(jax.vmap(f)), lambda f: jax.checkpoint(f)],
    ids=["vmap", "jit-vmap", "checkpoint"],
)
def test_region_inside_vmap_and_checkpoint(transform):
    def f(x):
        with jamp.autocast():
            return jnp.exp(x @ W)

    out = transform(f)(X)
    assert out.dtype == F32
    expected = jax.vmap(jamp.autocast_transform(lambda x: jnp.exp(x @ W)))(X)
    chex.assert_trees_all_close(out, expected, rtol=2e-2)


def test_region_inside_a_scan_body():
    def body(carry, x):
        with jamp.autocast():
            y = x @ W
        return carry + y.astype(F32), y

    carry, ys = lax.scan(body, jnp.zeros(16), X)
    assert ys.dtype == BF16 and carry.dtype == F32


def test_grad_of_a_function_with_a_region():
    def loss(w, x):
        with jamp.autocast():
            return jnp.mean((x @ w) ** 2)

    grads = jax.grad(loss)(W, X)
    assert grads.dtype == F32
    program = jax.make_jaxpr(jax.grad(loss))(W, X)
    assert {v.aval.dtype for e in eqns_named(program, "dot_general") for v in e.outvars} == {BF16}
    chex.assert_trees_all_close(
        grads, jax.grad(jamp.autocast_transform(lambda w, x: jnp.mean((x @ w) ** 2)))(W, X), rtol=2e-2
    )


def test_grad_called_inside_a_region_runs_forward_and_backward_under_the_policy():
    def loss(w):
        return jnp.sum(jnp.tanh(X @ w))

    with jamp.autocast():
        grads = jax.jit(jax.grad(loss))(W)
    # As autocast_transform(jax.grad(loss)): the gradient is the rewritten program's output.
    assert grads.dtype == jamp.autocast_transform(jax.grad(loss))(W).dtype
    expected = jax.grad(jamp.autocast_transform(loss))(W)
    chex.assert_trees_all_close(grads.astype(F32), expected, atol=3e-2)
    # (jax.make_jaxpr inside a region traces with a trace of its own, as jax.jit does: it shows
    # the program before the region's rewrite. The region around the traced function shows it.)
    program = jax.make_jaxpr(in_region(jax.jit(jax.grad(loss))))(W)
    assert {v.aval.dtype for e in eqns_named(program, "dot_general") for v in e.outvars} == {BF16}


EXACT_GELU = functools.partial(jax.nn.gelu, approximate=False)  # erfc: its JVP rule calls a
# custom_jvp function (jax 0.12), which JAX binds on the region while it differentiates


@functools.cache
def _transformed_grad(act):
    """jax.grad of the test below's loss under autocast_transform, once for both its steps."""
    return jax.grad(jamp.autocast_transform(lambda w: jnp.sum(act(X @ w + B))))(W)


@pytest.mark.parametrize("act", [jnp.exp, jnp.tanh, jnp.square, jax.nn.gelu, EXACT_GELU,
                                 jax.nn.log_softmax])
@pytest.mark.parametrize("jitted", [False, True])
def test_unjitted_grad_called_inside_a_region_is_grad_of_the_function_under_the_policy(act, jitted):
    """An unjitted ``jax.grad`` (here inside a jitted step, and eagerly) called in a region: the
    policy decides the forward ops before JAX differentiates them, so it is ``jax.grad`` of the
    function with the region inside it: backward ops in the forward ops' dtypes, gradients in
    the parameters' dtypes, the same values."""

    def loss(w):
        return jnp.sum(act(X @ w + B))

    def step(w):
        with jamp.autocast():
            return jax.value_and_grad(loss)(w)

    run = jax.jit if jitted else (lambda fn: fn)  # (XLA fuses a jitted program: compare alike)
    value, grads = run(step)(W)
    expected_value, expected = run(jax.value_and_grad(in_region(loss)))(W)
    assert (value.dtype, grads.dtype) == (expected_value.dtype, expected.dtype) == (F32, F32)
    chex.assert_trees_all_close((value, grads), (expected_value, expected), rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(grads, _transformed_grad(act), rtol=0.02,
                                atol=0.02 * float(np.max(np.abs(grads))))
    program = jax.make_jaxpr(step)(W)
    # the forward product and the backward one (the pullback is called in the region too: its
    # transposes run as the forward decided them) compute in bfloat16
    products = operand_dtypes(program, "dot_general")
    assert len(products) == 2 and set(products) == {("bfloat16", "bfloat16")}


def test_vjp_jvp_vmap_of_grad_and_hessian_called_inside_a_region():
    def loss(w, b):
        return jnp.sum(jax.nn.log_softmax(jnp.tanh(X @ w + b) @ w))

    plain_vjp = jax.vjp(in_region(loss), W, B)
    with jamp.autocast():
        out, pullback = jax.vjp(loss, W, B)
        grads = pullback(jnp.ones_like(out))
        tangent_out = jax.jvp(loss, (W, B), (W, B))
        per_example = jax.vmap(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), (None, 0))(W, X)
        hessian = jax.hessian(lambda b: loss(W, b))(B)
    assert dtypes(grads) == [F32, F32] and dtypes(tangent_out) == [F32, F32]
    chex.assert_trees_all_close(grads, plain_vjp[1](jnp.ones_like(out)), rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(tangent_out, jax.jvp(in_region(loss), (W, B), (W, B)),
                                rtol=1e-6, atol=1e-6)
    assert per_example.shape == (8, 16, 16) and per_example.dtype == F32
    chex.assert_trees_all_close(
        per_example,
        jax.vmap(jax.grad(in_region(lambda w, x: jnp.sum(jnp.tanh(x @ w)))), (None, 0))(W, X),
        rtol=1e-6, atol=1e-6)
    assert hessian.shape == (16, 16) and hessian.dtype == F32
    assert bool(jnp.all(jnp.isfinite(hessian)))


def test_a_pullback_made_outside_and_called_in_a_region_runs_as_its_forward_decided():
    """torch's backward runs in the forward's dtypes, whatever autocast says when it runs."""
    out, pullback = jax.vjp(lambda w: jnp.sum(jnp.tanh(X @ w)), W)
    with jamp.autocast():
        (grads,) = pullback(jnp.ones_like(out))
        program = jax.make_jaxpr(in_region(pullback))(jnp.ones_like(out))
    assert grads.dtype == F32
    chex.assert_trees_all_close(grads, pullback(jnp.ones_like(out))[0])
    assert set(operand_dtypes(program, "dot_general")) == {("float32", "float32")}


def test_grad_inside_a_region_follows_nested_regions_and_rules_inside_the_function():
    def loss(w):
        h = X @ w
        with jamp.autocast(enabled=False):
            h = h.astype(F32) @ w
        with jamp.autocast(dtype=jnp.float16):
            h = h @ w
        return jnp.sum(h)

    def step(w):
        with jamp.autocast():
            return jax.grad(loss)(w)

    program = jax.make_jaxpr(step)(W)
    forward = operand_dtypes(program, "dot_general")[:3]
    assert forward == [("bfloat16",) * 2, ("float32",) * 2, ("float16",) * 2]
    assert step(W).dtype == F32
    chex.assert_trees_all_close(step(W), jax.grad(in_region(loss))(W), rtol=1e-6, atol=1e-6)


def test_grad_inside_a_region_of_a_shard_map_body():
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def loss(w):
        body = jax.shard_map(lambda x, w: jnp.tanh(x @ w), mesh=mesh,
                             in_specs=(PartitionSpec("d"), PartitionSpec()),
                             out_specs=PartitionSpec("d"))
        return jnp.sum(body(X, w))

    def around(w):
        with jamp.autocast():
            return jax.grad(loss)(w)

    program = jax.make_jaxpr(around)(W)
    products = operand_dtypes(program, "dot_general")
    assert len(products) == 2 and set(products) == {("bfloat16", "bfloat16")}
    grads = around(W)
    assert grads.dtype == F32
    chex.assert_trees_all_close(grads, jax.grad(in_region(loss))(W), rtol=1e-6, atol=1e-6)


def test_grad_inside_a_region_leaves_other_threads_and_later_code_to_jax():
    from jax._src.interpreters import ad

    def methods():
        names = ("process_primitive", "process_custom_jvp_call", "process_custom_vjp_call")
        return [cls.__dict__[n] for cls in (ad.JVPTrace, ad.LinearizeTrace) for n in names] + [
            ad.backward_pass3]

    jax_own, seen = methods(), []

    def other_thread():  # a grad in a thread without a region, while one is open here
        seen.append(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(X @ w)))(W))

    with jamp.autocast():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert methods() != jax_own  # routed while a region is open
    assert set(operand_dtypes(seen[0], "dot_general")) == {("float32", "float32")}
    assert methods() == jax_own  # JAX's own again after the last region
    with pytest.raises(ZeroDivisionError):  # also when the block raises
        with jamp.autocast():
            jax.grad(lambda w: jnp.sum(X @ w))(W)
            raise ZeroDivisionError
    assert methods() == jax_own
    program = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(X @ w)))(W)
    assert set(operand_dtypes(program, "dot_general")) == {("float32", "float32")}


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_grad_of_a_jitted_or_checkpointed_loss_inside_a_region(wrap):
    """JAX's own wrappers called by jax.grad (no user frame between): the policy still decides."""

    def loss(w):
        return jnp.sum(jnp.tanh(X @ w))

    def around(w):
        with jamp.autocast():
            return jax.grad(wrap(loss))(w)

    products = operand_dtypes(jax.make_jaxpr(around)(W), "dot_general")
    assert products and set(products) == {("bfloat16", "bfloat16")}
    chex.assert_trees_all_close(around(W), jax.grad(wrap(in_region(loss)))(W), rtol=1e-6, atol=1e-6)


def test_a_custom_vjp_bwd_of_a_pullback_made_outside_runs_as_its_forward_decided():
    @jax.custom_vjp
    def linear(x, w):
        return x @ w

    linear.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    out, pullback = jax.vjp(lambda w: jnp.sum(jnp.tanh(linear(X, w))), W)

    def called_in_region(ct):
        with jamp.autocast():
            return pullback(ct)[0]

    assert set(operand_dtypes(jax.make_jaxpr(called_in_region)(1.0), "dot_general")) == {
        ("float32", "float32")}
    assert called_in_region(1.0).dtype == F32
    chex.assert_trees_all_close(called_in_region(1.0), pullback(1.0)[0])

    # a region written inside a bwd still applies there (torch's custom_bwd with autocast)
    @jax.custom_vjp
    def linear_bf16_bwd(x, w):
        return x @ w

    def bwd(r, g):
        with jamp.autocast():
            return ((g @ r[1].T).astype(F32), (r[0].T @ g).astype(F32))

    linear_bf16_bwd.defvjp(lambda x, w: (x @ w, (x, w)), bwd)
    program = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(linear_bf16_bwd(X, w))))(W)
    assert ("bfloat16", "bfloat16") in operand_dtypes(program, "dot_general")


# --- around calls that carry programs ----------------------------------------------------------


def test_already_jitted_callee_follows_the_region():
    matmul = jax.jit(lambda x, w: x @ w)
    assert matmul(X, W).dtype == F32  # compiled once outside
    with jamp.autocast():
        assert matmul(X, W).dtype == BF16
        with jamp.autocast(enabled=False):
            assert matmul(X, W).dtype == F32
    assert matmul(X, W).dtype == F32  # the cached float32 program is still what runs outside


def test_a_jitted_callee_is_traced_once_for_regions_of_equal_policies():
    traced = []

    @jax.jit
    def matmul(x, w):
        traced.append(x.dtype)
        return x @ w

    for _ in range(3):  # every `jamp.autocast()` makes a new, equal Policy
        with jamp.autocast():
            assert matmul(X, W).dtype == BF16
    assert len(traced) == 1
    with jamp.autocast(jnp.float16):
        assert matmul(X, W).dtype == jnp.float16
    with jamp.autocast(jamp.Policy(fp32=("tanh",))):  # other tables: traced again
        assert matmul(X, W).dtype == BF16
    assert len(traced) == 3
    # The regions key JAX's caches by one object per distinct policy (found by identity).
    assert region_trace._canonical(jamp.Policy()) is region_trace._canonical(jamp.Policy())
    assert region_trace._canonical(jamp.Policy(jnp.float16)) is not region_trace._canonical(
        jamp.Policy()
    )


def test_a_jitted_callee_is_found_again_after_the_policies_start_over(monkeypatch):
    traced = []

    @jax.jit
    def matmul(x, w):
        traced.append(x.dtype)
        return x @ w

    with jamp.autocast():
        matmul(X, W)
    monkeypatch.setattr(region_trace, "_CANONICAL", {})  # as past _CANONICAL_KEPT policies
    with jamp.autocast():  # an equal policy, another object and jit-cache context: equal
        assert matmul(X, W).dtype == BF16
    assert len(traced) == 1


def _trace_blocks_in_region(blocks, policy=None):
    """Trace ``blocks`` blocks of a jnp matmul, tanh and mean inside one region."""

    def model(x):
        with jamp.autocast(policy):
            for _ in range(blocks):
                x = jnp.tanh(jnp.matmul(x, x)) + jnp.mean(x)
        return x

    jax.make_jaxpr(model)(jnp.ones((4, 4)))


def test_jax_looks_up_its_caches_in_a_region_without_hashing_the_policy(monkeypatch):
    # JAX hashes its jit-cache context (which holds the region's) at every cache lookup while
    # tracing, several times an operation; a Policy hashes its ten fields each time.
    policy = jamp.Policy()
    hashed = []
    policy_hash = jamp.Policy.__hash__
    monkeypatch.setattr(jamp.Policy, "__hash__", lambda p: hashed.append(p) or policy_hash(p))

    def hashes_tracing(blocks):
        hashed.clear()
        _trace_blocks_in_region(blocks, policy)
        return len(hashed)

    hashes_tracing(10), hashes_tracing(40)  # (the callees' rewrites made: per new callee)
    assert hashes_tracing(40) == hashes_tracing(10)  # per region, not per operation


def test_a_replayed_operation_is_staged_without_evaluating_its_types_again(monkeypatch):
    # A replay's key fixes its operands' types and parameters: the abstract evaluation made at
    # its first staging (and a cast's, per type and dtype) is used again, where JAX's cache
    # of it would hash them at every operation. Operations bound as they came (no floating
    # operand) and the jnp callees' inlined programs are staged by JAX, as without a region.
    evaluated = []
    cached = compat._pe._cached_abstract_eval
    monkeypatch.setattr(
        compat._pe,
        "_cached_abstract_eval",
        lambda primitive, *avals, **params: evaluated.append(primitive.name)
        or cached(primitive, *avals, **params),
    )

    def model(x, w):
        with jamp.autocast():
            for _ in range(blocks):
                x = lax.dot_general(x, w, (((1,), (0,)), ((), ())))  # w cast, x too at first
                x = lax.reshape(x, (8, 4)).reshape(4, 8)
                x = lax.dot_general(x, w.T, (((1,), (0,)), ((), ())))
        return x

    def evaluations_tracing(n):
        nonlocal blocks
        blocks, evaluated[:] = n, []
        jaxpr = jax.make_jaxpr(lambda x, w: model(x, w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
        assert len(eqns_named(jaxpr, "dot_general")) == 2 * n  # (every block traced)
        return collections.Counter(evaluated)

    blocks = 0
    evaluations_tracing(2), evaluations_tracing(2)  # (the decisions made, then replayed once)
    few, many = evaluations_tracing(2), evaluations_tracing(20)
    assert many == few, (few, many)
    assert many["dot_general"] == 0 and many["convert_element_type"] == 0


def test_jax_finds_the_regions_cache_context_without_calling_into_jamp():
    # Hashing the context's value is a C call (an int's hash), not a Python one per lookup; it
    # still equals only the context of an equal policy, never the int it is.
    calls = []

    def profile(frame, event, arg):
        code = frame.f_code
        if (
            event == "call"
            and code.co_name in ("__hash__", "__eq__", "__ne__")
            and code.co_filename == region_trace.__file__
        ):
            calls.append(code.co_name)

    def calls_tracing(blocks):
        calls.clear()
        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            _trace_blocks_in_region(blocks)
        finally:
            sys.setprofile(previous)
        return len(calls)

    calls_tracing(10)
    assert calls_tracing(40) == calls_tracing(10)
    key, equal = region_trace._jit_key(jamp.Policy()), region_trace._JitKey(jamp.Policy())
    assert key == equal and hash(key) == hash(equal) and not key != equal
    assert key != int(key) and int(key) != key
    assert key != region_trace._JitKey(jamp.Policy(compute_dtype=jnp.float16))
    for copied in (copy.copy(key), copy.deepcopy(key), pickle.loads(pickle.dumps(key))):
        assert copied == key and hash(copied) == hash(key)


@jax.custom_jvp
def _users_relu(x):
    return jnp.maximum(x, 0)


_users_relu.defjvp(lambda p, t: (_users_relu(p[0]), jnp.where(p[0] > 0, t[0], 0)))


def test_jax_custom_jvp_functions_run_eagerly_as_one_rewritten_call(monkeypatch):
    """Eagerly, jax.nn's custom_jvp functions (relu) run their body walked once per operand type
    and region state, as a jnp function does; the decisions are those of the body op by op (a
    user's function with the same body, which runs op by op) and of the same region under jit."""

    def net(x, w):
        h = x @ w  # bfloat16
        return jax.nn.relu(h), jax.nn.relu(x), jax.nn.relu(h) @ w, jax.nn.relu(x) + 1

    def users(x, w):
        h = x @ w
        return _users_relu(h), _users_relu(x), _users_relu(h) @ w, _users_relu(x) + 1

    def bodies():
        return {k for k in region_trace._STAGED if k[0] == "body"}

    monkeypatch.setattr(region_trace, "_STAGED", {})  # (other tests traced relu's body too)
    eager = in_region(net)(X, W)
    traced = bodies()
    assert len(traced) == 2  # relu of a bfloat16 and of a float32 operand
    for _ in range(2):
        again = in_region(net)(X, W)
    assert bodies() == traced  # traced once: the later calls reuse the body and its rewrite
    for got, want in zip(eager, again):
        chex.assert_trees_all_equal(got, want)
    for got, op_by_op, jitted in zip(eager, in_region(users)(X, W), jax.jit(in_region(net))(X, W)):
        assert got.dtype == op_by_op.dtype == jitted.dtype
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(op_by_op, F32))
        np.testing.assert_allclose(np.asarray(got, F32), np.asarray(jitted, F32), rtol=1e-2)


def test_a_users_custom_jvp_function_runs_op_by_op_eagerly():
    """A user's custom_jvp function may branch on its operands' values or have effects in
    Python: eagerly in a region it runs as JAX runs it, every call, op by op."""
    calls = []

    @jax.custom_jvp
    def clipped(x):
        calls.append(1)
        if float(jnp.max(x)) > 100.0:  # reads the value: eager code may
            return jnp.clip(x, -100.0, 100.0)
        return x * 2

    clipped.defjvp(lambda p, t: (clipped(p[0]), t[0] * 2))
    with jamp.autocast():
        small = clipped(X @ W)
        large = clipped((X @ W) * 1e4)
    assert len(calls) == 2
    assert small.dtype == large.dtype == BF16
    np.testing.assert_allclose(np.asarray(small, F32), np.asarray((X @ W).astype(BF16) * 2, F32),
                               rtol=2e-2, atol=2e-2)
    assert float(jnp.max(jnp.abs(large.astype(F32)))) <= 100.0


def test_a_jax_custom_jvp_body_that_cannot_be_traced_runs_op_by_op_eagerly():
    """Were one of JAX's own custom_jvp functions to read its operand's value, tracing its body
    fails; eagerly the region then runs it op by op, as JAX does (the failed trace leaves the
    function callable again)."""

    def doubled_if_positive(x):
        return x * 2 if float(jnp.max(x)) > 0 else x

    doubled_if_positive.__module__ = "jax._src.nn.functions"  # (as if it were jax.nn's)
    f = jax.custom_jvp(doubled_if_positive)
    f.defjvp(lambda p, t: (f(p[0]), t[0] * 2))
    with jamp.autocast():
        out = f(X @ W)
        want = (X @ W) * 2
    assert out.dtype == want.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(want, F32))


def test_control_flow_bodies_follow_the_region():
    with jamp.autocast():
        c = lax.cond(True, lambda x: x @ W, lambda x: x @ W * 2, X)
        w = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.tanh(s[1] @ W)), (0, X))
        _, s = lax.scan(lambda c, x: (c, x @ W), 0.0, X)
    assert c.dtype == BF16
    assert w[1].dtype == F32  # a loop carry keeps its traced type
    assert s.dtype == BF16


def test_custom_jvp_and_custom_vjp_functions_follow_the_region():
    @jax.custom_jvp
    def f(x, w):
        return x @ w

    f.defjvp(lambda p, t: (f(*p), t[0] @ p[1] + p[0] @ t[1]))

    @jax.custom_vjp
    def g(x, w):
        return jnp.tanh(x @ w)

    g.defvjp(lambda x, w: (g(x, w), (x, w)), lambda r, ct: (ct @ r[1].T, r[0].T @ ct))

    def loss(w):
        with jamp.autocast():
            return jnp.sum(f(X, w)) + jnp.sum(g(X, w))

    with jamp.autocast():
        assert f(X, W).dtype == BF16
    assert jax.grad(loss)(W).dtype == F32
    # Sums of 128 bf16 products that nearly cancel: compare at the scale of the terms.
    expected = jamp.autocast_transform(lambda w: jnp.sum(f(X, w)) + jnp.sum(g(X, w)))(W)
    chex.assert_trees_all_close(loss(W), expected, atol=0.1)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


@functools.cache
def mlp_params():
    """MLP's parameters for X, initialised in one program (not op by op), shared by the tests."""
    return jax.jit(MLP().init)(KEY, X)


def test_flax_apply_in_a_region_equals_autocast_transform_inside_jit():
    model = MLP()
    params = mlp_params()

    @jax.jit
    def region(params, x):
        with jamp.autocast():
            return model.apply(params, x)

    transform = jax.jit(jamp.autocast_transform(model.apply))
    a, b = jax.make_jaxpr(region)(params, X), jax.make_jaxpr(transform)(params, X)
    decisions = lambda p: [  # noqa: E731
        (e.primitive.name, tuple(v.aval.dtype for v in e.outvars))
        for e in iter_eqns(p)
        if e.primitive.name in ("dot_general", "reduce_sum", "rsqrt", "add")
    ]
    assert decisions(a) == decisions(b)
    chex.assert_trees_all_close(region(params, X), transform(params, X), rtol=0, atol=0)
    assert region(params, X).dtype == BF16


def test_flax_rules_match_module_paths_in_a_region():
    model = MLP()
    params = mlp_params()
    policy = jamp.Policy(jnp.bfloat16, rules=(("*/Dense_1", None),))
    with jamp.autocast(policy):
        out = model.apply(params, X)
    assert out.dtype == F32  # the last layer is kept in float32 by the rule


# --- state: nesting, exceptions, threads, decorator ---------------------------------------------


def test_nesting_and_exceptions_restore_the_state():
    with jamp.autocast():
        with jamp.autocast(dtype=jnp.float16):
            assert (X @ W).dtype == F16 and jamp.get_autocast_dtype() == F16
            with jamp.autocast(enabled=False):
                assert (X @ W).dtype == F32 and not jamp.is_autocast_enabled()
        with pytest.raises(RuntimeError):
            with jamp.autocast(enabled=False):
                raise RuntimeError("boom")
        assert (X @ W).dtype == BF16 and jamp.is_autocast_enabled()
    assert not jamp.is_autocast_enabled() and (X @ W).dtype == F32


def test_state_is_per_thread():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["other"] = ((X @ W).dtype, jamp.is_autocast_enabled())
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with jamp.autocast():
        entered.set()
        release.wait(timeout=60)
        seen["main"] = ((X @ W).dtype, jamp.is_autocast_enabled())
    thread.join()
    assert seen == {"main": (BF16, True), "other": (F32, False)}


def test_decorator_on_a_plain_function_and_inside_a_region():
    @jamp.autocast(dtype=jnp.float16)
    def half(x, w):
        return x @ w

    assert half(X, W).dtype == F16
    with jamp.autocast():
        assert half(X, W).dtype == F16
        assert jax.jit(half)(X, W).dtype == F16


def test_a_square_in_a_region_runs_in_float32_only_where_a_sum_reads_it():
    """A square of a 16-bit value runs in that dtype; where a sum reads it (also reshaped or
    converted on the way), the region recomputes it in float32 from its operand, as the
    transform decides looking ahead (docs/reference/dtypes.md, "Squares")."""
    with jamp.autocast():
        h = X @ W
        assert (h**2).dtype == BF16 and (h**3).dtype == BF16 and lax.mul(h, h).dtype == BF16
        assert jax.nn.gelu(h).dtype == BF16  # its x ** 3 feeds a product, not a sum
        assert jnp.square(h).dtype == F32  # a jnp function returning its square: a sum may
        summed = [
            jnp.sum(h**2),
            lax.reduce_sum(h**2, (0, 1)),
            jnp.sum((h**2).reshape(-1).astype(jnp.float32)),
            jnp.sum(lax.mul(h, h)),
        ]
    exact = np.sum(np.asarray(h, np.float32) ** 2)  # h's float32 squares, summed
    for value in summed:
        assert value.dtype == F32
        np.testing.assert_allclose(value, exact, rtol=1e-6)
    rounded = np.sum(np.asarray(h**2, np.float32))  # (bfloat16 squares would give this)
    assert abs(rounded - exact) > 1e-5 * exact
    transformed = jamp.autocast_transform(lambda x: jax.nn.gelu(x @ W))(X)
    assert transformed.dtype == BF16


@pytest.mark.parametrize(
    "fn, summed",
    [
        (lambda h: h**2, False),
        (lambda h: jnp.sum(h**2), True),
        (lambda h: jnp.mean(jnp.square(h), axis=-1), True),
        (lambda h: jnp.mean(h**2) - jnp.mean(h) ** 2, True),
        (lambda h: jax.nn.gelu(h), False),
        # jnp.cumsum is a jit call: the region recomputes a square for any call that may sum
        # it; the transform does not look into the call and keeps it bfloat16
        (lambda h: jnp.sum(jnp.cumsum(h**2, axis=0)), True),
        (lambda h: (lambda s: jnp.sum(s) + jnp.max(s * 2))(h**2), True),
        # a square of a float32 promotion of h (Flax's BatchNorm statistics): float32, from it
        (lambda h: jnp.mean(lax.square(h.astype(jnp.float32))), True),
    ],
    ids=[
        "square",
        "sum",
        "mean-square",
        "variance",
        "gelu",
        "cumsum",
        "summed-and-not",
        "promoted-then-summed",
    ],
)
def test_a_jitted_region_squares_as_the_transform_decides(fn, summed):
    """Under ``jax.jit`` a region's program squares in float32 where the transform does (a sum
    reads the square) and in bfloat16 where it does not, and computes the same values (the
    16-bit square that no other operation reads is left for XLA to drop)."""

    def in_region(x):
        with jamp.autocast():
            return fn(x @ W)

    def float32_squares(fn):
        return [
            e
            for e in jax.make_jaxpr(fn)(X).jaxpr.eqns
            if e.primitive.name in ("square", "integer_pow")
            and e.outvars[0].aval.dtype == F32
            and not isinstance(e.outvars[0], compat.DropVar)
        ]

    transformed = jamp.autocast_transform(lambda x: fn(x @ W))
    assert bool(float32_squares(in_region)) == summed
    if summed and float32_squares(transformed):
        assert len(float32_squares(in_region)) == len(float32_squares(transformed))
    region = jax.jit(in_region)(X)
    assert region.dtype == transformed(X).dtype
    chex.assert_trees_all_close(region, transformed(X), rtol=2e-2)


class _ConvBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        return nn.relu(nn.BatchNorm(use_running_average=False)(x))


def test_a_value_jnp_promotes_twice_is_cast_once_as_under_the_transform():
    """Flax's BatchNorm promotes its bfloat16 input (a conv's output) to float32 for the
    statistics, then again inside ``jnp.subtract`` for ``x - mean``: a region reuses the first
    promotion, so the value has one float32 cast, as under the transform, and its cotangents add
    up in float32 before one cast back (two casts would add them in bfloat16): the gradients are
    the transform's."""
    model = _ConvBatchNorm()
    x = jax.device_put(np.random.default_rng(1).standard_normal((2, 8, 8, 3), dtype=np.float32))
    variables = jax.jit(model.init)(KEY, x)

    def loss(params):
        out, _ = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            mutable=["batch_stats"],
        )
        return jnp.mean(out.astype(F32) ** 2)

    def in_region(params):
        with jamp.autocast():
            return loss(params)

    def conv_output_casts(fn):
        eqns = list(iter_eqns(jax.make_jaxpr(fn)(variables["params"]).jaxpr))
        conv = [e.outvars[0] for e in eqns if e.primitive.name == "conv_general_dilated"]
        return [
            e for e in eqns if e.primitive.name == "convert_element_type" and e.invars[0] in conv
        ]

    transformed = jamp.autocast_transform(loss)
    assert len(conv_output_casts(in_region)) == len(conv_output_casts(transformed)) == 1
    grad = jax.grad(in_region)
    bf16_sums = [
        e
        for e in iter_eqns(jax.make_jaxpr(grad)(variables["params"]).jaxpr)
        if e.primitive.name == "add_any" and e.outvars[0].aval.dtype == BF16
    ]
    assert not bf16_sums
    expected = jax.jit(jax.grad(transformed))(variables["params"])
    chex.assert_trees_all_close(jax.jit(grad)(variables["params"]), expected, rtol=1e-6)
    # eagerly (op by op, rounded per op: not bit for bit) the region runs the same program
    chex.assert_trees_all_close(in_region(variables["params"]), transformed(variables["params"]),
                                rtol=1e-3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_rules_float32_cast_does_not_stand_in_for_jnps_promotion(jit):
    """Only jnp's own promotion of a 16-bit value is reused for a later one: the float32 cast a
    rule made (``exp``, fp32 table) is a plain float32 value to the rules, and a bias add given
    it would promote, where the bias add of the matmul output runs in its 16-bit dtype."""

    def fn(x):
        with jamp.autocast():
            h = x @ W
            return lax.exp(h), h + B

    e, y = (jax.jit(fn) if jit else fn)(X)
    assert e.dtype == F32
    assert y.dtype == BF16 == jamp.autocast_transform(lambda x: x @ W + B)(X).dtype


def test_eager_loop_reuses_the_rewritten_jitted_callee():
    calls = []

    @jax.jit
    def step(x, w):
        calls.append(1)  # runs once per trace
        return x @ w

    for _ in range(3):
        with jamp.autocast():
            assert step(X, W).dtype == jnp.bfloat16  # the rewritten callee each time
    assert len(calls) <= 2  # traced for the region once, not once per entry


# --- what the zoo found: vmapped bias adds, NNX state, loop carries, an explicit float32 cast ----


def test_vmapped_layer_bias_add_stays_in_the_compute_dtype():
    """Under vmap, jnp promotes ``x @ w`` (bfloat16) to float32 for the bias add and the batching
    rule moves the promoted value before the add: the add still runs as the float32 program's
    bias add does, in bfloat16 (Equinox's Linear, applied with jax.vmap)."""

    def layer(x, w, b):
        return w @ x + b

    def in_vmap(x, w, b):
        with jamp.autocast():
            return jax.vmap(layer, in_axes=(0, None, None))(x, w, b)

    got = jax.jit(in_vmap)(X, W, B)
    expected = jax.jit(jamp.autocast_transform(jax.vmap(layer, in_axes=(0, None, None))))(X, W, B)
    assert got.dtype == expected.dtype == BF16
    chex.assert_trees_all_close(got, expected, rtol=0, atol=0)


def test_nnx_batchnorm_updates_its_statistics_inside_a_region_under_nnx_jit():
    """A region looks like the trace it runs in to Flax NNX, which refuses to update a Variable
    from another trace level: BatchNorm's statistics update in place as without the region,
    and an already-jitted function called in the region is still traced again under it."""
    from flax import nnx

    model = nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), nnx.BatchNorm(16, rngs=nnx.Rngs(0)))
    reference = nnx.clone(model)

    @nnx.jit
    def forward(model, x):
        with jamp.autocast():
            return model(x)

    out = forward(model, X)
    # float32, without a region (jitted: one program, not op by op): the statistics it sets
    # are float32's
    expected = nnx.jit(lambda model, x: model(x))(reference, X)
    assert out.dtype == F32  # BatchNorm normalises in float32 (rsqrt, mean: the fp32 table)
    stats, ref_stats = model.layers[1].mean[...], reference.layers[1].mean[...]
    assert stats.dtype == F32 and not np.allclose(stats, 0.0)
    chex.assert_trees_all_close(stats, ref_stats, atol=0.05)
    chex.assert_trees_all_close(out, expected, atol=0.1)


def test_nnx_value_and_grad_called_inside_a_region_eagerly_and_under_nnx_jit():
    """``nnx.value_and_grad`` in a region is ``nnx.value_and_grad`` of the loss with the region
    inside: float32 gradients, the same values, BatchNorm's statistics updated as there."""
    from flax import nnx

    def make():
        return nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
                              nnx.BatchNorm(16, rngs=nnx.Rngs(0)),
                              nnx.Linear(16, 4, rngs=nnx.Rngs(1)))

    def loss(model, x):
        return jnp.mean(jnp.tanh(model(x)) ** 2)

    def region_loss(model, x):
        with jamp.autocast():
            return loss(model, x)

    def around(model, x):
        with jamp.autocast():
            return nnx.value_and_grad(loss)(model, x)

    for run in (lambda f: f, nnx.jit):
        model, reference = make(), make()
        value, grads = run(around)(model, X)
        expected_value, expected = run(nnx.value_and_grad(region_loss))(reference, X)
        leaves, expected_leaves = jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(expected))
        assert {x.dtype for x in leaves} == {F32} and len(leaves) == len(expected_leaves) == 6
        chex.assert_trees_all_close((value, leaves), (expected_value, expected_leaves),
                                    rtol=1e-5, atol=1e-6)
        stats = model.layers[1].mean[...]
        assert not np.allclose(stats, 0.0)
        chex.assert_trees_all_close(stats, reference.layers[1].mean[...], rtol=1e-5, atol=1e-6)


def test_a_loop_carry_the_region_made_16_bit_gets_an_error_that_says_what_to_do():
    """JAX traces a loop body with its initial carry's type before jamp sees the loop: a carry
    the region computed in bfloat16 meets a body traced without the policy. The error says why
    and what to do; casting the carry to float32 first runs the body under the policy."""

    def carried(x, cast):
        with jamp.autocast():
            h = x @ W
            h = h.astype(jnp.float32) if cast else h
            return lax.scan(lambda c, _: (c @ W, None), h, None, length=2)[0]

    for fn in (carried, jax.jit(carried, static_argnums=1)):
        with pytest.raises(TypeError) as raised:
            fn(X, False)
        notes = "".join(getattr(raised.value, "__notes__", ()))
        assert "inside a jamp.autocast region: the loop's initial carry is bfloat16" in notes
        assert "x.astype(jnp.float32)" in notes
    jaxpr = jax.make_jaxpr(carried, static_argnums=1)(X, True)
    assert [d for d in operand_dtypes(jaxpr, "dot_general")] == [("bfloat16", "bfloat16")] * 2
    assert jax.jit(carried, static_argnums=1)(X, True).dtype == F32  # the carry keeps its type


@pytest.mark.parametrize("nested", ["with", "decorator"])
def test_the_loop_carry_note_names_a_nested_regions_dtype(nested):
    """The note was added only when the error named the outermost region's dtype: a float16
    region (or decorated helper) inside a bfloat16 one raised JAX's error alone."""

    def rnn(x):
        h = jnp.tanh(x @ W)
        return lax.scan(lambda c, _: (jnp.tanh(c @ W), None), h, None, length=2)[0]

    helper = jamp.autocast(dtype=F16)(rnn)

    def run(x):
        with jamp.autocast():
            if nested == "decorator":
                return helper(x)
            with jamp.autocast(dtype=F16):
                return rnn(x)

    with pytest.raises(TypeError) as raised:
        run(X)
    notes = "".join(getattr(raised.value, "__notes__", ()))
    assert "inside a jamp.autocast region: the loop's initial carry is float16" in notes


@pytest.mark.parametrize("switch", [False, True])
def test_cond_branches_that_promote_a_16_bit_operand_get_an_error_that_says_what_to_do(switch):
    """JAX traces a cond's branches with the operand's type before jamp sees the cond: a matmul
    with a float32 weight promotes the bfloat16 operand, tanh keeps it, and JAX refuses the
    cond. The error says why and what to do; casting the operand first decides both branches
    as autocast_transform does."""
    branches = (lambda a: a @ W, jnp.tanh)

    def branchy(x, cast):
        with jamp.autocast():
            h = x @ W
            h = h.astype(jnp.float32) if cast else h
            if switch:
                return lax.switch(jnp.argmax(x[0]) % 2, branches, h)
            return lax.cond(jnp.sum(x) > 0, *branches, h)

    with pytest.raises(TypeError, match="branches must have equal output types") as raised:
        branchy(X, False)
    notes = "".join(getattr(raised.value, "__notes__", ()))
    assert "inside a jamp.autocast region: an operand of the cond is bfloat16" in notes
    assert "x.astype(jnp.float32)" in notes
    jaxpr = jax.make_jaxpr(branchy, static_argnums=1)(X, True)
    assert operand_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")] * 2
    assert branchy(X, True).dtype == F32  # (the cast asked for is kept: tanh's is float32)


def test_a_lax_op_given_a_16_bit_value_it_cannot_mix_gets_an_error_that_says_what_to_do():
    """A jax.jit function's body is traced by JAX with the bfloat16 argument the region made,
    before the region sees the call; so is an operation under autocast(enabled=False). A lax
    operation taking one dtype refuses bfloat16 with float32 there; the error says why and
    what to do, and a cast to float32 first runs the call under the policy."""
    square = jax.device_put(np.ones((16, 16), np.float32))

    @jax.jit
    def mixes(h, w):
        return lax.add(h, w)

    def in_jit(x, cast):
        with jamp.autocast():
            h = x @ square
            return mixes(h.astype(jnp.float32) if cast else h, square)

    def autocast_off(x):
        with jamp.autocast():
            h = x @ square
            with jamp.autocast(enabled=False):
                return lax.add(h, square)

    for call in (lambda: in_jit(square, False), lambda: autocast_off(square)):
        with pytest.raises(TypeError, match="requires arguments to have the same dtypes") as raised:
            call()
        notes = "".join(getattr(raised.value, "__notes__", ()))
        assert "inside a jamp.autocast region: an operand is bfloat16" in notes
        assert "x.astype(jnp.float32)" in notes
    as_transformed = jamp.autocast_transform(lambda x: mixes(x @ square, square))(square)
    assert in_jit(square, True).dtype == as_transformed.dtype  # the add decided as any other

    def unrelated(x):
        with jamp.autocast():
            return lax.add(x, jnp.ones(x.shape, jnp.int32))

    def another_dtype(x):  # bfloat16 the user's own, in a float16 region: not the region's doing
        with jamp.autocast(dtype=jnp.float16):
            return mixes(x.astype(jnp.bfloat16), x)

    for call in (unrelated, another_dtype):
        with pytest.raises(TypeError, match="same dtypes") as raised:
            call(X)
        assert not any("jamp.autocast region" in n for n in getattr(raised.value, "__notes__", ()))


def test_an_unrelated_cond_type_error_gets_no_region_note():
    def wrong(x):
        with jamp.autocast():
            return lax.cond(jnp.sum(x) > 0, lambda a: a.astype(jnp.int32), lambda a: a, x)

    with pytest.raises(TypeError, match="branches") as raised:
        wrong(X)
    assert not any("jamp.autocast region" in n for n in getattr(raised.value, "__notes__", ()))


def test_an_unrelated_loop_type_error_gets_no_region_note():
    def wrong(x):
        with jamp.autocast(enabled=True):
            return lax.scan(lambda c, _: (c.astype(jnp.int32), None), x, None, length=2)[0]

    with pytest.raises(TypeError) as raised:
        wrong(X)
    assert not any("jamp.autocast region" in n for n in getattr(raised.value, "__notes__", ()))


def test_a_float32_only_function_given_a_value_the_region_made_16_bit_gets_a_note():
    """``jnp.fft.rfft`` checks its input's dtype in Python (and on jax 0.12 ``svd``, ``qr`` and
    ``eigh`` as JAX traces ``jnp.linalg``): a matmul's bfloat16 output is refused before the
    region sees the call. The note says why; the cast it names runs in float32."""
    x = jax.device_put(np.ones((4, 8), np.float32))
    w = jax.device_put(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8))
    note = "inside a jamp.autocast region: the value is bfloat16 because the region computed it"

    def rfft(x, cast):
        with jamp.autocast():
            h = x @ w
            return jnp.fft.rfft(h.astype(jnp.float32) if cast else h)

    with pytest.raises(ValueError, match="RFFT input must be float32") as raised:
        rfft(x, False)
    notes = "".join(getattr(raised.value, "__notes__", ()))
    assert note in notes and "x.astype(jnp.float32)" in notes
    assert rfft(x, True).dtype == jnp.complex64
    np.testing.assert_allclose(rfft(x, True), np.fft.rfft(np.asarray(x) @ np.asarray(w)),
                               rtol=2e-2, atol=2e-2)

    def singular_values(x):
        with jamp.autocast():
            return jnp.linalg.svd(x @ w, compute_uv=False)

    try:  # jax 0.12 checks svd's dtype as it traces jnp's function; 0.10 lets the region cast
        values = singular_values(x)
    except TypeError as err:
        assert "does not accept dtype bfloat16" in str(err)
        assert note in "".join(getattr(err, "__notes__", ()))
    else:
        assert values.dtype == jnp.float32
    def expm(x):  # jax.scipy's check: "A.dtype=bfloat16 is not supported" (no note before)
        with jamp.autocast():
            return jax.scipy.linalg.expm((x @ w)[:, :4] / 8)

    with pytest.raises(TypeError, match="dtype=bfloat16 is not supported") as raised:
        expm(x)
    assert note in "".join(getattr(raised.value, "__notes__", ()))
    def inverse(a):  # dtypes.md, Regions: 16-bit solves on jax 0.10, refused on 0.12
        with jamp.autocast():
            h = a @ jnp.eye(4)
            return jnp.linalg.inv(h), jnp.linalg.inv(h.astype(jnp.float32))

    try:
        narrow, wide = inverse(jax.device_put(2 * np.eye(4, dtype=np.float32) + np.float32(0.1)))
    except TypeError as err:
        assert note in "".join(getattr(err, "__notes__", ()))
    else:
        assert (narrow.dtype, wide.dtype) == (jnp.bfloat16, jnp.float32)
    with pytest.raises(ValueError, match="RFFT") as raised:  # the user's own bfloat16
        with jamp.autocast(dtype=jnp.float16):
            jnp.fft.rfft(x.astype(jnp.bfloat16))
    assert not any("jamp.autocast region" in n for n in getattr(raised.value, "__notes__", ()))


def test_an_explicit_float32_cast_of_the_result_is_honoured_in_a_region():
    """A model that ends with ``jnp.asarray(x, jnp.float32)`` (Flax's ResNet) returns float32
    from a region, as torch does; autocast_transform traced that cast as a no-op of a float32
    value and returns bfloat16 (docs/reference/dtypes.md, "Regions")."""

    def model(x, w):
        return jnp.asarray(x @ w, jnp.float32)

    def in_region(x, w):
        with jamp.autocast():
            return model(x, w)

    region, transform = jax.jit(in_region)(X, W), jax.jit(jamp.autocast_transform(model))(X, W)
    assert (region.dtype, transform.dtype) == (F32, BF16)
    assert operand_dtypes(jax.make_jaxpr(in_region)(X, W), "dot_general") == [("bfloat16",) * 2]
    # (XLA may keep the bfloat16 product unrounded before the cast: equal to bfloat16's precision)
    chex.assert_trees_all_close(region, transform.astype(F32), rtol=2.0**-8)


# --- found by JAX's own tests with every jit body in an identity-policy region --------------
# (benchmarks/identity_policy.py --form region)


def test_custom_vjp_staged_as_a_high_level_primitive_keeps_its_rule_in_a_region():
    """Under ``jax_custom_vjp3`` a custom_vjp binds a "high" primitive that jit, grad and vmap
    take whole; the region took it as a base trace does, expanding it to its body first, so the
    user's bwd was dropped (the gradient was cos, not 2 cos) and jvp no longer refused it."""
    previous = jax.config.jax_custom_vjp3
    jax.config.update("jax_custom_vjp3", True)  # read when jax.custom_vjp decorates
    try:

        @jax.custom_vjp
        def f(x):
            return jnp.sin(x)

        f.defvjp(lambda x: (f(x), jnp.cos(x)), lambda c, g: (2.0 * c * g,))
        region_f = in_region(f)
        expected = 2.0 * jnp.cos(3.0)  # the user's rule, not sin's derivative
        chex.assert_trees_all_close(jax.grad(jax.jit(region_f))(3.0), expected)
        chex.assert_trees_all_close(jax.grad(region_f)(3.0), expected)
        chex.assert_trees_all_close(
            jax.vmap(jax.grad(region_f))(jnp.full(2, 3.0)), jnp.full(2, expected)
        )
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            jax.jvp(jax.jit(region_f), (3.0,), (1.0,))
    finally:
        jax.config.update("jax_custom_vjp3", previous)


def test_custom_derivative_bodies_get_concrete_values_where_jax_runs_them_directly():
    """Eagerly, and under ``jax.ensure_compile_time_eval`` inside a jit, JAX calls a custom_jvp
    or custom_vjp function's body with its concrete values; the region staged the call to a
    jaxpr first, so a body branching on a value raised TracerBoolConversionError. The body's
    operations still follow the region."""

    @jax.custom_jvp
    def f(x, w):
        assert bool(jnp.all(x == 0.0))  # needs the concrete value
        return x @ w

    f.defjvp(lambda p, t: (f(*p), t[0] @ p[1] + p[0] @ t[1]))

    @jax.custom_vjp
    def g(x, w):
        assert bool(jnp.all(x == 0.0))
        return x @ w

    g.defvjp(lambda x, w: (g(x, w), (x, w)), lambda r, ct: (ct @ r[1].T, r[0].T @ ct))
    zeros = jax.device_put(np.zeros(X.shape, np.float32))

    def at_compile_time(fn):
        def run():
            with jamp.autocast(), jax.ensure_compile_time_eval():
                return fn(zeros, W)

        return run

    for fn in (f, g):
        with jamp.autocast():
            assert fn(zeros, W).dtype == BF16
        assert jax.jit(at_compile_time(fn))().dtype == BF16


def test_policy_fields_a_region_cannot_honour_are_refused_not_ignored():
    with pytest.raises(ValueError, match="output_dtype"):
        jamp.autocast(jamp.Policy(output_dtype=jnp.float32))
    with jamp.autocast():
        with pytest.raises(ValueError, match="outermost region"):
            with jamp.autocast(jamp.Policy(jnp.float16, accumulate_dtype=jnp.float32)):
                pass
        assert jamp.get_autocast_dtype() == BF16 and (X @ W).dtype == BF16  # state unchanged
        with jamp.autocast(jamp.Policy(jnp.float16)):  # only a compute dtype: as dtype=
            assert (X @ W).dtype == F16


def test_a_rule_no_region_of_its_policy_matched_warns_once_when_the_block_ends():
    """Once per region's line (a training loop's region warns at its first step), naming the
    line; a region elsewhere with the same typo is another place to fix and warns too."""
    policy = jamp.Policy(rules=(("*/haed", None), ("*/Dense_1", None)))
    model, params = MLP(), mlp_params()

    def step():
        with jamp.autocast(policy):
            return model.apply(params, X)

    with pytest.warns(jamp.UnmatchedRuleWarning, match="haed") as caught:
        step()
    assert not any("Dense_1" in str(w.message) for w in caught)  # that one matched
    assert all("region at test_region_trace.py:" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same line and scopes again: no second warning
        step()
    with pytest.warns(jamp.UnmatchedRuleWarning, match="haed"):
        with jamp.autocast(policy):
            model.apply(params, X)


def test_flax_nn_scan_partial_evaluation_is_not_taken_for_differentiation():
    """Flax's ``nn.scan`` partially evaluates its body (to find loop invariants) over the
    region: that is no jax.grad above the region and must not be refused (the sst2 example)."""
    model = nn.RNN(nn.LSTMCell(8))
    xs = jax.device_put(np.asarray(X).reshape(2, 4, 16))
    params = jax.jit(model.init)(KEY, xs)

    @jax.jit
    def forward(params, xs):
        with jamp.autocast():
            return model.apply(params, xs)

    out = forward(params, xs)
    expected = jax.jit(jamp.autocast_transform(model.apply))(params, xs)
    assert out.dtype == expected.dtype
    chex.assert_trees_all_close(out, expected, atol=2e-2)


def test_jnp_functions_in_a_region_pass_jax_enable_checks(monkeypatch):
    """jnp's functions are jits JAX inlines, which the region evaluated with JAX's eval_jaxpr:
    under ``jax_enable_checks`` that asserts every value has the type it was traced with, which
    the policy changes by design (AssertionError for any jnp.matmul in a bfloat16 region)."""
    from jamp import region_trace

    monkeypatch.setattr(region_trace, "_CALLS", {})  # (walked here, not reused from other tests)
    with jax.enable_checks(True):
        with jamp.autocast():
            assert jnp.matmul(X, W).dtype == BF16
        assert jax.jit(in_region(jnp.matmul))(X, W).dtype == BF16
        with jamp.autocast(jamp.Policy(jnp.float32)):
            assert jnp.exp(jnp.bfloat16(1.0)).dtype == F32  # the fp32 table, also here


def test_grad_of_a_jitted_function_with_a_region_leaks_no_tracer():
    """The region's check for a differentiation above it read ``frame.f_locals`` of JAX's
    ``partial_eval.trace_to_jaxpr`` frame: on Python 3.11/3.12 that snapshot of the frame's
    locals (the jit's tracers) outlived the trace, and JAX's leak checker raised."""
    a = jax.random.normal(KEY, (16, 16))

    @jax.jit
    def loss(a, x):
        with jamp.autocast(jamp.Policy(jnp.float32)):
            return jnp.sum((jax.nn.sigmoid(a * x) - x) ** 2)

    with jax.checking_leaks():
        assert jax.grad(loss)(a, X[:1]).shape == a.shape


def test_eval_jaxpr_bound_in_a_region_runs_its_body_under_the_policy():
    """jax 0.10 has an ``eval_jaxpr`` primitive of its own (body in ``jaxpr``) that a jaxpr trace
    stages as ``closed_call``: autocast_transform never sees it, a region sees it bound and had
    no rule for it (UnsupportedPrimitiveWarning, the body ran in float32)."""
    closed = jax.make_jaxpr(lambda x, w: [x @ w])(X, W)

    def f(x, w):
        with jamp.autocast():
            return compat.bind_eval_jaxpr(closed, x, w)[0]

    assert f(X, W).dtype == BF16
    assert jax.jit(f)(X, W).dtype == BF16


@pytest.mark.parametrize("jitted", [False, True])
def test_debug_nans_and_infs_in_an_eager_region_raise_floating_point_error(jitted):
    """Eagerly a region runs a jnp function's rewrite as one compiled call; under
    ``jax.debug_infs`` JAX re-runs a failing call op by op itself, which on jax 0.12 found no
    current trace inside the region's operation (an AttributeError, not the FloatingPointError;
    JAX's ``lax_scipy_special_functions_test``, ``testNdtriDebugInfs``)."""
    ndtri = jax.jit(jax.scipy.special.ndtri) if jitted else jax.scipy.special.ndtri
    region = in_region(ndtri, dtype=jamp.Policy(jnp.float32))
    with jax.debug_infs(True):
        assert float(region(0.5)) == 0.0  # (the infinite branch jnp.where drops: no error)
        with pytest.raises(FloatingPointError, match=r"invalid value \(inf\)"):
            region(1.0)
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match=r"invalid value \(nan\)"):
            region(2.0)
    assert np.isnan(region(2.0))  # (and without the checks, as outside a region)


def test_a_typed_prng_key_reaches_jnp_functions_in_a_region_as_it_does_outside():
    """A region keys its reuse of an inline jit's rewrite on the values of small concrete
    operands, read through numpy; a typed key (``jax.random.key``) has none, and on jax 0.12
    every eager region call of ``jax.random`` with one raised numpy's TypeError (the key array
    cannot be converted), also under ``vmap`` and ``grad`` (JAX's ``random_lax_test``,
    ``testIssue1789``, with ``jax.vmap``'s function in a region)."""

    def sample(x):
        return x * jax.random.normal(jax.random.key(1), x.shape) + jax.random.uniform(
            jax.random.key(0), x.shape
        )

    region = in_region(sample, dtype=jamp.Policy(jnp.float32))
    x = jax.device_put(np.array([1.0, 2.5], np.float32))
    cases = {
        "eager": lambda f: f(x),
        "vmap": lambda f: jax.vmap(f)(x),
        "grad": lambda f: jax.grad(lambda y: f(y).sum())(x),
        "grad of vmap": lambda f: jax.grad(lambda y: jax.vmap(f)(y).sum())(x),
        "jit": lambda f: jax.jit(f)(x),
    }
    for name, run in cases.items():
        chex.assert_trees_all_equal(run(region), run(sample), custom_message=name)


# --- reused rewrites of inline jits; the check of what the routing of grad replaces (issue 33) --


def _op_by_op(monkeypatch):
    """Make the region walk every inline jit equation by equation, as it did before issue 33."""
    from jamp import region_trace

    monkeypatch.setattr(region_trace.RegionTrace, "_operand_knowledge", lambda self, args: None)


def _count_walks(monkeypatch):
    from jamp import region_trace

    walks = []
    walk = region_trace.RegionTrace._walk_once

    def counted(self, closed, *rest):
        walks.append({e.primitive.name for e in compat.open_and_consts(closed)[0].eqns})
        return walk(self, closed, *rest)

    monkeypatch.setattr(region_trace.RegionTrace, "_walk_once", counted)
    return walks


def test_an_inline_jit_is_walked_once_per_types_state_and_operand_knowledge(monkeypatch):
    """jnp's functions (inline jits) are decided once per callee jaxpr, operand types (weak types
    too), region state and what the region knows about the operands, then bound as one call."""
    add = jax.jit(lambda y, b: jnp.tanh(y + b), inline=True)
    x16 = X16
    walks = _count_walks(monkeypatch)

    def f(x, x16, w, b):
        with jamp.autocast():
            lowered = [add(x @ w, b) for _ in range(3)]  # a matmul's output: the bias adapts
            arrived = add(x16, b)  # a bfloat16 input with the same types: a residual, promotes
            with jamp.autocast(enabled=False):
                off = add(x @ w, b)
            weak = add(x @ w, 2.0)
        return lowered, arrived, off, weak

    for run in (f, jax.jit(f)):
        walks.clear()
        lowered, arrived, off, weak = run(X, x16, W, B)
        assert dtypes(lowered) == [BF16] * 3 and dtypes([arrived, off, weak]) == [F32, F32, BF16]
        # lowered once, arrived, off, weak: not once per call (x @ w is jnp's inline jit too)
        assert len([w for w in walks if "tanh" in w]) <= 4
    # The same decisions (and values) as the walk op by op. A new function object every time:
    # jax.jit and make_jaxpr share a trace cache keyed by the function.
    for jitted in (False, True):
        expected = (jax.jit(fresh(f)) if jitted else f)(X, x16, W, B)
        with monkeypatch.context() as m:
            _op_by_op(m)
            walked = (jax.jit(fresh(f)) if jitted else f)(X, x16, W, B)
            chex.assert_trees_all_close(walked, expected)
    # Every operation in the same dtypes. (The programs differ in their casts: op by op, the
    # region's cast cache shares one cast of x among the calls, and jnp's float32 promotions the
    # rules read through stay, unused; a reused rewrite carries its own casts, and left the
    # promotions out once. XLA removes both differences.)
    def decided(name):  # (jax 0.12 binds a reused rewrite as a call: its equations count)
        return name not in ("convert_element_type", "jit", "pjit")

    reused = dtype_signatures(jax.make_jaxpr(fresh(f))(X, x16, W, B), decided)
    _op_by_op(monkeypatch)
    walked = dtype_signatures(jax.make_jaxpr(fresh(f))(X, x16, W, B), decided)
    assert walked == reused and reused[("dot_general", ("bfloat16",) * 2, ("bfloat16",))] == 4


def test_an_inline_jit_on_constants_is_keyed_by_how_they_cast(monkeypatch):
    """A small constant operand (a concrete rank-0 or weak value) is cast saturating: eagerly
    its rewrite is reused for the values that cast alike (1e6 saturates in float16, 2.0 fits:
    two rewrites; below, values that share one). jnp's float32 promotion of a 16-bit value (the
    rules use the 16-bit value, not an operand) is walked op by op every time."""
    scale = jax.jit(lambda y, c: jnp.sin(y) * c, inline=True)
    walks = _count_walks(monkeypatch)
    with jamp.autocast(jnp.float16):
        zero = (X @ W) * 0
        big = [scale(zero, np.float32(1e6)) for _ in range(2)]  # 0 * 65504, not 0 * inf = nan
        small = scale(zero + np.pi / 2, np.float32(2.0))
        promoted = scale(promote_dtype(X @ W, jnp.ones(()))[0], jnp.ones(()))  # (as Dense)
    assert len([w for w in walks if "sin" in w]) == 2  # one per value; the promotion op by op
    assert dtypes([*big, small]) == [F16] * 3
    assert not np.asarray(big[1], np.float32).any() and (np.asarray(small, np.float32) == 2).all()
    with monkeypatch.context() as m:
        _op_by_op(m)
        with jamp.autocast(jnp.float16):
            up = promote_dtype(X @ W, jnp.ones(()))[0]
            assert scale(up, jnp.ones(())).dtype == promoted.dtype


# Loops an eager step calls (module-level bodies: a new function at every call is traced and
# compiled again by plain JAX too).
def _scan_body(c, w):
    return jnp.tanh(c @ w), jnp.sum(c)


def _fori_body(i, c):
    return jnp.tanh(c @ W) + i


def _while_cond(c):
    return c[1] < 3


def _while_body(c):
    return jnp.tanh(c[0] @ W), c[1] + 1


def _grows(a):
    return jnp.exp(a @ W)


def _shrinks(a):
    return a @ W


EAGER_LOOPS = {
    "scan": lambda x: lax.scan(_scan_body, x, jnp.stack([W, W])),
    "fori_loop": lambda x: lax.fori_loop(0, 3, _fori_body, x),
    "while_loop": lambda x: lax.while_loop(_while_cond, _while_body, (x, 0))[0],
    "cond": lambda x: lax.cond(x[0, 0] > 0, _grows, _shrinks, x),
    "cond on a Python bool": lambda x: lax.cond(True, _grows, _shrinks, x),
    "switch": lambda x: lax.switch(1, [_grows, _shrinks, jnp.sin], x),
}


@pytest.mark.parametrize("loop", EAGER_LOOPS)
def test_an_eager_loop_in_a_region_compiles_its_control_flow_once(monkeypatch, loop):
    """Eagerly, a region rewrote ``lax.scan``/``while_loop``/``cond`` at every call, and JAX
    compiled the rebuilt loop at every call (its body a new jaxpr each time), where plain JAX
    compiles it once: an eager training loop paid a compile per step. The equation is now
    rewritten once per equation, operand types, region state and operand knowledge, and runs
    as one compiled call: the same decisions and values as the way it went before."""
    step = EAGER_LOOPS[loop]
    x = jax.device_put(np.asarray(X)[:, :16] * np.float32(0.5))
    with jamp.autocast():
        first = step(x)
        with count_compiles() as compiles:
            later = [step(x) for _ in range(3)]
    assert compiles[0] == 0
    chex.assert_trees_all_equal(later[-1], first)
    monkeypatch.setattr(region_trace.RegionTrace, "_eager_program", lambda self, *a: None)
    with jamp.autocast():
        before = step(x)
    assert dtypes(first) == dtypes(before)
    chex.assert_trees_all_close(first, before, rtol=1e-2, atol=1e-2)
    assert dtypes(first) == dtypes(jax.jit(in_region(step))(x))  # as the program decides


def test_an_eager_loop_under_disable_jit_runs_as_without_jamp():
    """Under ``jax.disable_jit()`` nothing compiles: a ``while`` that ``vmap``'s batching rule
    binds (JAX's ``test_disable_jit_while_loop_with_vmap`` in an eager region) runs op by op, as
    the rules rebuild it; running it as one compiled call failed there on jax 0.12."""

    def trivial_while(y):
        return lax.while_loop(lambda x: x < 10.0, lambda x: x + 1.0, y)

    with jamp.autocast(jamp.Policy(jnp.float32)), jax.disable_jit():
        out = jax.vmap(trivial_while)(jnp.array([3.0, 4.0]))
    np.testing.assert_array_equal(out, [10.0, 10.0])


@pytest.mark.parametrize("outside", ["grad", "vjp"])
def test_a_concrete_value_converted_to_its_own_type_comes_back_unbound(outside):
    """Under an eager ``jax.grad`` the values are concrete tracers, for which JAX binds
    ``jnp.asarray(x)`` as a convert of ``x`` to its own type (for any other value it returns
    ``x``), and differentiates that convert by tracing its JVP. Flax's ``promote_dtype`` calls
    it on every operand of every layer: it was most of what an eager train step with a region
    cost more than without one. A region returns the value itself; what it computes and
    differentiates is the same."""
    w = jax.random.normal(jax.random.key(0), (8, 4))
    x = jax.random.normal(jax.random.key(1), (2, 8))
    returned_itself = []

    def loss(w, asarray):
        with jamp.autocast():
            v = jnp.asarray(w) if asarray else w
            if asarray:
                returned_itself.append(v is w)
            return jnp.sum(jnp.tanh(x @ v))

    def differentiated(asarray):
        if outside == "grad":
            return jax.value_and_grad(loss)(w, asarray)
        value, pullback = jax.vjp(lambda w: loss(w, asarray), w)
        return value, pullback(jnp.ones_like(value))[0]

    value, grad = differentiated(asarray=True)
    assert returned_itself == [True]
    expected_value, expected_grad = differentiated(asarray=False)
    np.testing.assert_array_equal(value, expected_value)
    np.testing.assert_array_equal(grad, expected_grad)
    assert grad.dtype == w.dtype


def test_jvp_of_asarray_in_a_region_returns_arrays():
    """JAX binds ``jnp.asarray`` of a concrete tracer so that a tracer of a Python number
    comes out as an array (JAX's ``test_jvp_asarray_returns_array``): a region returns only
    a tracer of an array unbound (the test above)."""
    with jamp.autocast():
        primal, tangent = jax.jvp(jnp.asarray, (1.0,), (2.0,))
    assert isinstance(primal, jax.Array) and isinstance(tangent, jax.Array)
    assert (float(primal), float(tangent)) == (1.0, 2.0)


@pytest.mark.parametrize("outside", ["grad", "jit of grad"])
def test_a_device_array_constant_in_a_region_under_grad(outside):
    """A region casts a constant operand from its value (saturating) when a rule reads it:
    a device array (``jnp.asarray(2.0)``, multiplying a bfloat16 value) at once, on JAX's eval
    trace. Inside a trace's ``process_primitive`` jax 0.12 leaves no trace current, so the
    cast, bound under ``jax.ensure_compile_time_eval`` (a constant-folding switch, not a trace),
    failed under an eager ``jax.grad`` with "'NoneType' object has no attribute
    'process_primitive'"."""
    w = jax.random.normal(jax.random.key(0), (8, 4))
    x = jax.random.normal(jax.random.key(1), (2, 8))

    def loss(w, scale):
        with jamp.autocast():
            return jnp.sum(jnp.tanh(x @ w) * scale)

    grad = jax.grad(loss) if outside == "grad" else jax.jit(jax.grad(loss))
    got = grad(w, jnp.asarray(2.0))
    assert got.dtype == jnp.float32
    # a Python float is a literal the rules cast the same way
    np.testing.assert_array_equal(got, grad(w, 2.0))
    np.testing.assert_allclose(
        got, jax.jit(jax.grad(lambda w: 2.0 * jnp.sum(jnp.tanh(x @ w))))(w), rtol=2e-2
    )


@pytest.mark.parametrize("fn", [jax.nn.relu, jnp.i0, lambda x: jnp.hypot(x, 2.0 * x)])
def test_a_custom_jvp_function_under_disable_jit_in_an_eager_region(fn):
    """``jax.nn.relu``, ``jnp.i0`` and ``jnp.hypot`` are ``custom_jvp`` functions, which an eager
    region runs as one rewritten call. Under ``jax.disable_jit()`` that call's ``jax.jit``
    evaluates the rewritten jaxpr in Python, binding on the current trace, and inside the
    region's operation jax 0.12 leaves none current: it failed with "'NoneType' object has no
    attribute 'process_primitive'" (JAX's ``array_extensibility_test`` in an eager region)."""
    x = jax.device_put(np.linspace(-2.0, 2.0, 8, dtype=np.float32))
    with jax.disable_jit():
        expected = fn(x)
        with jamp.autocast(jamp.Policy(jnp.bfloat16)):
            got = fn(x)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


def _below_three(c):
    return c[1] < 3


DROPPED_BODIES = {  # a loop whose body, made per step, closes over an array
    "scan": lambda w: lambda x: lax.scan(lambda c, _: (c @ w, None), x, None, length=2)[0],
    # the condition a module's function, kept: the loop's rewrite still goes with the body
    "while_loop": lambda w: lambda x: lax.while_loop(
        _below_three, lambda c: (c[0] @ w, c[1] + 1), (x, 0)
    )[0],
}


@pytest.mark.parametrize("loop", DROPPED_BODIES)
def test_an_eager_region_does_not_keep_what_a_dropped_loop_body_closed_over(loop):
    """A loop's rewrite is kept by the loop's programs, weakly: a body closing over an array
    and dropped by the step frees the array while the region is still open."""
    import weakref

    with jamp.autocast():
        w = jnp.ones((16, 16))
        body = DROPPED_BODIES[loop](w)
        gone = weakref.ref(w)
        del w
        out, out2 = body(X), body(X)
        assert gone() is not None  # still closed over by body
        del body
        assert gone() is None
    assert out.dtype == out2.dtype == F32  # (a loop carry keeps its traced dtype)


def test_a_loops_rewrite_goes_when_any_of_its_programs_goes(monkeypatch):
    """An eager loop's rewrite is stored under its first program (a while_loop's condition),
    weakly, and goes when another of its programs (the body) goes: a condition kept alive (a
    module's function) keeps no rewrite, nor its compiled program, for each body a step made."""
    anchors = []
    program_key = region_trace._program_key

    def recorded(params):
        found = program_key(params)
        anchors.append(found[0])
        return found

    monkeypatch.setattr(region_trace, "_program_key", recorded)
    x = X[:, :16]
    with jamp.autocast():
        for _ in range(3):
            body = (lambda w: lambda c: (c[0] @ w, c[1] + 1))(W)
            lax.while_loop(_below_three, body, (x, 0))
            del body
    assert len(anchors) == 3 and all(a is anchors[0] for a in anchors)  # JAX traced it once
    gc.collect()  # (a body JAX traced may die in a reference cycle: whenever it goes, its entry)
    stored = [calls[anchors[0]] for calls in region_trace._CALLS.values() if anchors[0] in calls]
    assert len(stored) == 1 and len(stored[0]) == 0


SMALL_CONSTANTS = {
    "Python float": lambda i: 0.5 * i,
    "Python int": lambda i: i,
    "numpy float32": lambda i: np.float32(0.5 * i),
    "rank-0 jax array": lambda i: jnp.float32(0.5 * i),
}


@pytest.mark.parametrize("make", SMALL_CONSTANTS)
def test_an_eager_region_compiles_once_for_every_value_of_a_small_constant(monkeypatch, make):
    """A small constant operand of a ``jnp`` function or of ``lax.cond`` (a learning rate, a
    step count) keyed the reuse of the call's rewrite by its value: an eager loop passing a new
    one at every step compiled at every step (up to 64 programs a callee). The rules read a
    constant only to cast it, so every value the cast treats alike shares one program, which
    casts it: the values the rewrite kept by value gave."""
    constant = SMALL_CONSTANTS[make]

    def step(i):
        h = X @ W
        # (jnp.clip is a jax.jit of its own, not inline: its rewrite is the region's)
        return h * constant(i), lax.cond(i % 2, jnp.sin, jnp.cos, h), jnp.clip(h, 0, constant(i))

    with jamp.autocast():
        step(1)
        with count_compiles() as compiles:
            shared = [step(i) for i in range(2, 6)]
    assert compiles[0] <= 1  # (a numpy scalar's float32 array: jnp.float32's own convert)
    _op_by_op(monkeypatch)
    with jamp.autocast():
        walked = [step(i) for i in range(2, 6)]
    assert dtypes(shared) == dtypes(walked)
    chex.assert_trees_all_equal(shared, walked)


def test_a_constant_shared_by_its_values_still_saturates_where_it_does_not_fit(monkeypatch):
    """The program casting a shared constant clips it to the target's range where the key's
    bound of its magnitude says it may not fit (float16: 65504, not inf; 0 * 65504 is 0, where
    0 * inf would be nan): 1e6 and 2e6 share that program, 2.0 and 3.0 one without the clip.
    A Python float that float32 cannot hold is keyed by its value, cast from it as before: the
    program would see it as float32's inf."""
    scale = jax.jit(lambda y, c: jnp.sin(y) * c, inline=True)
    full = jax.jit(lambda y, c: y @ jnp.full((16, 16), c), inline=True)  # the rule casts c
    walks = _count_walks(monkeypatch)
    zeros = jnp.zeros((8, 16))
    with jamp.autocast(jnp.float16):
        zero = (X @ W) * 0
        big = [scale(zero, np.float32(c)) for c in (1e6, 2e6)]
        small = [scale(zero + np.pi / 2, np.float32(c)) for c in (2.0, 3.0)]
        huge = [full(zeros, c) for c in (1e39, 2e39)]
    assert len([w for w in walks if "sin" in w]) == 2
    assert len([w for w in walks if "broadcast_in_dim" in w]) == 2  # one per value
    assert dtypes([*big, *small, *huge]) == [F16] * 6
    for out in (*big, *huge):
        assert np.isfinite(np.asarray(out, np.float32)).all() and not np.asarray(out).any()
    assert [float(np.asarray(s, np.float32).max()) for s in small] == [2.0, 3.0]


def test_a_jnp_function_in_an_eager_region_runs_its_rewrite_as_one_call():
    calls = []
    f = jax.jit(lambda x: calls.append(1) or jnp.exp(x @ W), inline=True)
    with jamp.autocast():
        first = f(X)
        assert dtypes([first, f(X), f(X)]) == [F32] * 3
    assert len(calls) == 1  # JAX traced the callee once, and jamp walked that jaxpr once
    with jamp.autocast():
        chex.assert_trees_all_close(f(X), first)


@pytest.mark.parametrize(
    "owner, name",
    [
        ("JVPTrace", "process_primitive"),
        ("LinearizeTrace", "process_custom_vjp_call"),
        (None, "backward_pass3"),
    ],
)
def test_a_jax_without_a_method_the_region_replaces_fails_at_the_first_region(
    monkeypatch, owner, name
):
    """A JAX release renaming a method the routing of jax.grad replaces must fail loudly and
    early, naming the JAX version and the attribute, not break differentiation silently."""
    from jax._src.interpreters import ad

    target = ad if owner is None else getattr(ad, owner)
    jax_own = getattr(target, name)
    monkeypatch.delattr(target, name)
    with pytest.raises(compat.JaxCompatibilityError) as err:
        with jamp.autocast():
            pass
    assert jax.__version__ in str(err.value) and f"{owner or 'ad'}.{name}" in str(err.value)
    assert not jamp.is_autocast_enabled()  # nothing half entered
    assert all(getattr(ad, n, None) is not None for n in ("JVPTrace", "LinearizeTrace"))
    monkeypatch.undo()
    if owner is not None:  # a changed signature is named too
        monkeypatch.setattr(target, name, lambda self, primitive, tracers: None)
        with pytest.raises(compat.JaxCompatibilityError, match=r"expected \(self, primitive"):
            with jamp.autocast():
                pass
        monkeypatch.undo()
    assert getattr(target, name) is jax_own
    with jamp.autocast():  # and the installed JAX's own again: regions work
        assert jax.grad(lambda w: jnp.sum(X @ w))(W).dtype == F32


@pytest.mark.skipif(
    jax.extend.core.primitives.call_p is jax.extend.core.primitives.closed_call_p,
    reason="jax >= 0.11: call_p is closed_call_p, bound with its jaxpr like any primitive",
)
@pytest.mark.filterwarnings("ignore:linear_util.wrap_init is missing a DebugInfo")
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_core_call_runs_its_body_in_the_region(wrap):
    """``call_p`` with its body as a function (jax 0.10; JAX's shard_map tests, older libraries)
    reached a region as JAX's ``process_call``, which a region did not have: it raised
    NotImplementedError. Its body runs in the region, under the policy."""
    import jax.extend.linear_util as lu

    w = jnp.full((4, 4), 0.5)

    def fn(x):
        body = lu.wrap_init(lambda x: [jnp.tanh(x @ w)], debug_info=None)
        return jax.extend.core.primitives.call_p.bind(x, subfuns=(body,))[0]

    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4) / np.float32(16))
    got = wrap(in_region(fn))(x)
    assert got.dtype == jnp.bfloat16
    chex.assert_trees_all_close(got, fn(x).astype(jnp.bfloat16), rtol=2e-2, atol=2e-2)


def test_jitted_calls_taking_and_returning_effect_tokens_in_an_eager_region():
    # A call's outputs were read for their dtypes, which an effect token has none of
    # (AttributeError: 'AbstractToken' object has no attribute 'dtype'); found with JAX's
    # api_test run in an eager region (identity_policy.py --form eager-region)
    token = jax.lax.create_token()

    @jax.jit
    def passes_token(x, tok):
        return x @ x, tok

    x = jax.device_put(np.ones((4, 4), np.float32))
    with jamp.autocast():
        made = jax.jit(jax.lax.create_token)(1.0)
        out, passed = passes_token(x, token)
        closed_over, captured = jax.jit(lambda x: (x + 2, token))(x)
    assert all(compat.is_token(t) for t in (made, passed, captured))
    assert out.dtype == jnp.bfloat16 and closed_over.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.full((4, 4), 4.0))


def test_a_long_region_does_not_keep_what_a_dropped_jitted_function_closed_over():
    # A region's cache of rewritten callees held them strongly for as long as the region was
    # open, and with them the arrays they close over: a training loop inside one `with` block
    # kept every such array alive (found with JAX's api_test::test_jit_reference_dropping in an
    # eager region). Garbage collection stays on: the array must go by reference counting.
    import weakref

    with jamp.autocast():
        x = jnp.ones((4, 4))
        g = jax.jit((lambda x: lambda: x @ x)(x))
        gone = weakref.ref(x)
        del x
        first, second = g(), g()
        assert gone() is not None  # still closed over by g
        del g
        assert gone() is None  # the region is still open
    assert first.dtype == second.dtype == jnp.bfloat16


def test_jnp_reductions_of_16_bit_values_follow_the_policys_fp32_table():
    """A region leaves out jnp's rounding of a reduction's float32 result back to a 16-bit
    input's dtype "as the fp32 table says": it did so for any policy, an empty one too (which
    then was no identity), where autocast_transform keeps it."""
    xb = jax.device_put(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8).astype(BF16))
    empty = jamp.Policy(jnp.float32, lower=(), fp32=(), promote=())
    no_sum = jamp.Policy(fp32=jamp.policy.FP32 - {"reduce_sum"})
    for policy, expected in ((empty, jnp.bfloat16), (no_sum, jnp.bfloat16),
                             (jamp.Policy(), jnp.float32)):
        with jamp.autocast(policy):
            sums = jnp.sum(xb), jnp.mean(xb, axis=0)
        assert [s.dtype for s in sums] == [expected] * 2, policy
    for policy in (empty, no_sum):  # (with reduce_sum in fp32 the forms differ: dtypes.md)
        assert jamp.autocast_transform(jnp.sum, policy)(xb).dtype == jnp.bfloat16
