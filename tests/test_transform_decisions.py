"""``autocast_transform`` decides an equation once per signature and replays it (issue 33).

The rewrite keeps what each rule decided for an equation (its casts, parameters and the tags of
its outputs) under the equation's signature: primitive, parameters, the operands' types as
traced and as they arrive, their tags, and what else the rule reads (``TransformDecisions``).
The replay must give exactly what deciding again gives: every test here compares a program with
the one deciding every equation gives (``decided_every_time``), on programs whose decisions
depend on more than the operand types: bias adds against residual adds, a softmax's shift,
masks of Python constants under float16, squares summed or not, module rules, samples.
Property (11) in test_properties.py checks random programs.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import interpreter
from jamp.interpreter import Rewriter
from tests.jaxpr_utils import decided_every_time, fresh_region_caches, program_record

_RNG = np.random.default_rng(0)
X = jax.device_put(_RNG.standard_normal((2, 8, 16), dtype=np.float32))


class Block(nn.Module):
    """A pre-LN transformer block: dense layers with biases (the bias add), a residual add,
    causal attention (a softmax, a mask of Python constants), layer norms (squares summed),
    gelu (a cube, not summed)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        return x + nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class Stack(nn.Module):
    blocks: int = 3

    @nn.compact
    def __call__(self, x):
        for _ in range(self.blocks):
            x = Block()(x)
        return nn.Dense(4)(x)


MODEL = Stack()
PARAMS = MODEL.init(jax.random.key(0), X)


def forward(params, x):
    return MODEL.apply(params, x)


def masked_scores(w, x):
    """A mask of a Python constant twice (cast at rewrite time, clipped under float16), a
    square summed (a variance) and one that is not."""
    s = x @ w
    s = jnp.where(s > 0, s, -1e9) + jnp.where(s < 1, s, -1e9)
    variance = jnp.mean(jnp.square(s), axis=-1, keepdims=True)
    return jax.nn.softmax(s, axis=-1) * jnp.square(s) / (variance + 1e-6)


def initialized(key, x):
    """Samples scaled by constants (an initializer's arithmetic stays in the asked dtype), next
    to the model's own products."""
    w = jax.random.normal(key, (16, 16)) * 0.02
    b = jax.random.uniform(key, (16,)) * 0.1 - 0.05
    return (x @ w + b) @ w + b


def _programs(fn, *args, policy=None):
    """The program and input-gradient program of ``autocast_transform(fn)``, as recorded by
    ``program_record`` (text, name stacks, source lines, contexts)."""
    g = jamp.autocast_transform(fn, policy) if policy is not None else jamp.autocast_transform(fn)

    def loss(*a):
        return jnp.sum(g(*a).astype(jnp.float32))

    gradient = jax.grad(loss, argnums=1)  # (the input: the first argument may be a PRNG key)
    return program_record(jax.make_jaxpr(g)(*args)), program_record(jax.make_jaxpr(gradient)(*args))


def _replayed_and_decided(fn, *args, policy=None):
    with fresh_region_caches():
        replayed = _programs(fn, *args, policy=policy)
        again = _programs(fn, *args, policy=policy)  # (the table kept from the first trace)
    with decided_every_time():
        decided = _programs(fn, *args, policy=policy)
    return replayed, again, decided


CASES = {
    "transformer": (forward, (PARAMS, X), None),
    "transformer_float16": (forward, (PARAMS, X), jamp.Policy(compute_dtype=jnp.float16)),
    # a module rule: the second block's dense layers in float32, the same signatures elsewhere
    "transformer_module_rule": (
        forward,
        (PARAMS, X),
        jamp.Policy(rules=(("Stack/Block_1/Dense_*", jnp.float32),)),
    ),
    "transformer_disabled_block": (
        forward,
        (PARAMS, X),
        jamp.Policy(rules=(("Stack/Block_0", None),)),
    ),
    "masked_scores_float16": (
        masked_scores,
        (jnp.ones((16, 16)) * 0.1, X[0]),
        jamp.Policy(compute_dtype=jnp.float16),
    ),
    "initialized": (initialized, (jax.random.key(1), X[0]), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_decisions_build_the_program_deciding_builds(case):
    fn, args, policy = CASES[case]
    replayed, again, decided = _replayed_and_decided(fn, *args, policy=policy)
    assert replayed == decided
    assert again == decided


def test_under_vmap_and_jit_the_replay_builds_what_deciding_builds():
    """Under vmap the rewrite binds on a batch trace (no equation staged directly); under jit it
    stages into the caller's program: the replay's casts and parameters are the same."""

    def record():
        g = jamp.autocast_transform(forward)
        batched = jax.make_jaxpr(jax.vmap(g, in_axes=(None, 0)))(PARAMS, jnp.stack([X, X]))
        jitted = jax.jit(g).trace(PARAMS, X).jaxpr
        return program_record(batched), program_record(jitted)

    with fresh_region_caches():
        replayed = record()
    with decided_every_time():
        decided = record()
    assert replayed == decided


def shifted_twice(w, x):
    """``s - max(s)``, a softmax's shift, and ``t - max(s)`` of the same types, which is not."""
    s = x @ w
    t = (x * 2.0) @ w
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    return jnp.exp(s - m) + jnp.exp(t - m)


def test_a_shift_is_replayed_by_what_its_max_is_of():
    """The facts a tracker keeps (which value is the max of which) are keyed relative to the
    operands and set again by a replay: the shift ``s - max(s)`` runs in float32, ``t - max(s)``
    of the same types does not, whether decided or replayed."""
    w = jnp.full((16, 16), 0.1)
    policy = jamp.Policy(compute_dtype=jnp.float16)
    replayed, again, decided = _replayed_and_decided(shifted_twice, w, X[0], policy=policy)
    assert replayed == decided
    assert again == decided
    program = jax.make_jaxpr(jamp.autocast_transform(shifted_twice, policy))(w, X[0]).jaxpr
    subs = [str(e.outvars[0].aval.dtype) for e in program.eqns if e.primitive.name == "sub"]
    assert subs == ["float32", "float16"], subs


def test_a_rule_reading_a_literal_decides_per_value(monkeypatch):
    """A literal's value is part of an equation's signature: a rule that reads it (a test rule
    running a product by a large constant in float32) decides each value, as deciding every
    time does, though both products have the same types."""
    rules = interpreter.RULES["mul"]

    def by_value(step):
        source = step.env.source(step.eqn.invars[1])
        if source is not None and abs(float(np.asarray(source.base))) > 100:
            return step.bind(step.with_cast({0: jnp.float32, 1: jnp.float32}))
        return rules.rewrite(step)

    monkeypatch.setitem(interpreter.RULES, "mul", dataclasses.replace(rules, rewrite=by_value))
    w = jnp.full((16, 16), 0.1)

    def scaled(w, x):
        h = x @ w
        return h * 2.0 + h * 300.0 + h * 3.0

    replayed, again, decided = _replayed_and_decided(scaled, w, X[0])
    assert replayed == decided
    assert again == decided
    program = jax.make_jaxpr(jamp.autocast_transform(scaled))(w, X[0]).jaxpr
    products = [str(e.outvars[0].aval.dtype) for e in program.eqns if e.primitive.name == "mul"]
    assert products == ["bfloat16", "float32", "bfloat16"], products


def _rules_run(monkeypatch):
    """The equations whose rule ran in the transform's rewrite (not a region's)."""
    ran = []
    apply = Rewriter.apply

    def counted(self, step):
        if not self.region:
            ran.append(step.eqn.primitive.name)
        return apply(self, step)

    monkeypatch.setattr(Rewriter, "apply", counted)
    return ran


def test_repeated_blocks_are_decided_once(monkeypatch):
    """Each block of the stack has the signatures of the first: their rules run for the first
    block only (the softmax's shift too, keyed by what its max is of and how it was computed,
    which a replay computes again in float32), and a new function traced under the policy
    replays them all but those decided every time."""
    ran = _rules_run(monkeypatch)
    with fresh_region_caches():
        closed = jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)
        first = len(ran)
        del ran[:]
        jax.make_jaxpr(jamp.autocast_transform(lambda p, x: forward(p, x)))(PARAMS, X)
        second = len(ran)
    # (the traced program's equations, which the rules decide: the rewrite's has the casts, and
    # a bias reshaped after its cast, interpreter.ParameterView, on top)
    equations = len(jax.make_jaxpr(forward)(PARAMS, X).jaxpr.eqns)
    assert len(closed.jaxpr.eqns) > equations
    assert first < equations / 2, (first, equations)
    # (decided every time: the mask's jitted calls and what they compute from constants)
    assert second < first / 2, (second, first)
    assert not {"reduce_max", "stop_gradient", "sub"} & set(ran), ran
    with decided_every_time():
        del ran[:]
        jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)
    assert len(ran) > equations * 0.8  # (the reference does decide every one)


def test_a_report_decides_every_equation(monkeypatch):
    """``jamp.explain`` counts every equation: its rewrite decides each one, replaying none."""
    ran = _rules_run(monkeypatch)
    with fresh_region_caches():
        jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)  # (a table to replay)
        del ran[:]
        report = jamp.explain(forward, PARAMS, X)
    counted = sum(sum(by_dtype.values()) for by_dtype in report.ops.values())
    assert len(ran) >= counted > len(jax.make_jaxpr(forward)(PARAMS, X).jaxpr.eqns) / 2


def test_the_tables_are_kept_per_policy_and_bounded():
    """One table per policy, equal policies sharing one; a table past its bound starts again."""
    with fresh_region_caches():
        jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)
        jax.make_jaxpr(jamp.autocast_transform(forward, jamp.Policy()))(PARAMS, X)
        jax.make_jaxpr(jamp.autocast_transform(forward, jnp.float16))(PARAMS, X)
        tables = interpreter._TRANSFORM_DECISIONS
        assert len(tables) == 2
        table = tables[jamp.Policy()]
        assert 0 < len(table.table) < len(jax.make_jaxpr(forward)(PARAMS, X).jaxpr.eqns)
        table.table.update(
            {("filler", i): None for i in range(interpreter.TransformDecisions._KEPT)}
        )
        assert interpreter.TransformDecisions.of(jamp.Policy()) is not table
        # and so does one past its bound of states (one per state scopes are entered from)
        kept = interpreter.TransformDecisions.of(jamp.Policy(compute_dtype=jnp.float16))
        assert kept._states  # (the model's scopes, entered from the policy's state)
        kept._states.update({i: {} for i in range(interpreter.TransformDecisions._KEPT)})
        assert interpreter.TransformDecisions.of(jamp.Policy(compute_dtype=jnp.float16)) is not kept


def _collector_states_during_rewrites(monkeypatch):
    """Whether the garbage collector was enabled, per equation the transform's rewrite ran."""
    import gc

    seen = []
    apply = Rewriter.apply

    def observed(self, step):
        if not self.region:
            seen.append(gc.isenabled())
        return apply(self, step)

    monkeypatch.setattr(Rewriter, "apply", observed)
    return seen


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_during_a_rewrite_and_left_as_found(monkeypatch, enabled):
    """The rewrite runs with the collector paused (it would scan and age the program it builds);
    after it, and after one that raised, the collector is as the caller left it."""
    import gc

    seen = _collector_states_during_rewrites(monkeypatch)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with decided_every_time():  # (rules run for every equation: each one is observed)
            jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)
        assert seen and not any(seen)
        assert gc.isenabled() is enabled

        def failing(step):
            raise ValueError("a rule failed")

        monkeypatch.setattr(Rewriter, "apply", lambda self, step: failing(step))
        with pytest.raises(ValueError, match="a rule failed"):
            jax.make_jaxpr(jamp.autocast_transform(forward))(PARAMS, X)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_rewrites_in_threads_enable_the_collector_after_the_last(monkeypatch):
    """Rewrites running at once in several threads pause the collector once; it is enabled
    again when the last one ends, not when the first does."""
    import gc
    import threading

    from jamp import transform

    first_inside, release = threading.Event(), threading.Event()
    seen_by_second = []

    def slow_first():
        with transform.collection_paused():
            first_inside.set()
            release.wait(timeout=30)

    assert gc.isenabled()
    thread = threading.Thread(target=slow_first)
    thread.start()
    first_inside.wait(timeout=30)
    with transform.collection_paused():
        seen_by_second.append(gc.isenabled())
    seen_by_second.append(gc.isenabled())  # (the first still runs)
    release.set()
    thread.join(timeout=30)
    assert seen_by_second == [False, False]
    assert gc.isenabled()
