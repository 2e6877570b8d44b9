"""Policy rules naming source lines ('@file.py:12'): rules for code without scopes."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from tests import source_lines

HERE = "test_line_rules.py"


def line_of(marker):
    return source_lines.line_of(__file__, marker)


def rule(marker, dtype):
    return (f"@{HERE}:{line_of(marker)}", dtype)


def helper(x, w):
    return x @ w  # HELPER


def two_products(x, w):
    a = x @ w  # FIRST
    b = helper(x, w)  # SECOND
    return a, b


def scoped(x, w):
    with jax.named_scope("head"):
        return x @ w  # SCOPED


x = jnp.ones((4, 4))


def dtypes(outs):
    return tuple(np.dtype(o.dtype).name for o in outs)


def test_a_line_rule_applies_to_the_line_and_to_what_it_calls():
    off_first = jamp.Policy(rules=(rule("FIRST", None),))
    assert dtypes(jamp.autocast_transform(two_products, off_first)(x, x)) == (
        "float32", "bfloat16")
    half_second = jamp.Policy(jnp.float32, rules=(rule("SECOND", jnp.float16),))
    assert dtypes(jamp.autocast_transform(two_products, half_second)(x, x)) == (
        "float32", "float16")


def test_the_innermost_line_wins_and_a_full_path_glob_matches():
    policy = jamp.Policy(jnp.float32, rules=(rule("HELPER", jnp.bfloat16),
                                             rule("SECOND", jnp.float16)))
    assert dtypes(jamp.autocast_transform(two_products, policy)(x, x)) == (
        "float32", "bfloat16")
    by_path = jamp.Policy(rules=((f"@*/{HERE}:{line_of('FIRST')}", None),))
    assert dtypes(jamp.autocast_transform(two_products, by_path)(x, x)) == (
        "float32", "bfloat16")


def test_scope_rules_and_regions_win_over_line_rules():
    policy = jamp.Policy(rules=(("head", jnp.float16), rule("SCOPED", None)))
    assert jamp.autocast_transform(scoped, policy)(x, x).dtype == jnp.float16

    def in_region(x, w):
        with jamp.autocast(dtype=jnp.float16):
            return x @ w  # IN_REGION

    policy = jamp.Policy(rules=(rule("IN_REGION", None),))
    assert jamp.autocast_transform(in_region, policy)(x, x).dtype == jnp.float16


def test_the_region_front_end_applies_line_rules():
    def region(x, w):
        with jamp.autocast(jamp.Policy(rules=(rule("REGION_OFF", None),))):
            a = x @ w  # REGION_ON
            b = x @ w  # REGION_OFF
        return a, b

    assert dtypes(region(x, x)) == ("bfloat16", "float32")
    assert dtypes(jax.jit(region)(x, x)) == ("bfloat16", "float32")


def test_a_region_nested_in_the_policys_region_wins_over_line_rules():
    def nested(x, w):
        with jamp.autocast(jamp.Policy(rules=(rule("NESTED_OFF", jnp.float16),
                                              rule("NESTED_BF16", jnp.float16),
                                              rule("NESTED_ON", jnp.float16)))):
            with jamp.autocast(enabled=False):
                a = x @ w  # NESTED_OFF
            with jamp.autocast(dtype=jnp.bfloat16):
                b = x @ w  # NESTED_BF16
            c = x @ w  # NESTED_ON
        return a, b, c

    assert dtypes(nested(x, x)) == ("float32", "bfloat16", "float16")
    assert dtypes(jax.jit(nested)(x, x)) == ("float32", "bfloat16", "float16")

    def inside_disabled(x, w):  # a region outside the policy's does not count as nested
        with jamp.autocast(enabled=False):
            with jamp.autocast(jamp.Policy(rules=(rule("UNDER_OFF", jnp.float16),))):
                return x @ w  # UNDER_OFF

    assert inside_disabled(x, x).dtype == jnp.float16


def test_gradients_follow_the_forward_decision():
    policy = jamp.Policy(rules=(rule("FIRST", None),))
    loss = lambda w, x: sum(jnp.sum(o.astype(jnp.float32)) for o in two_products(x, w))
    grads = jax.grad(jamp.autocast_transform(loss, policy))(x, x)
    assert grads.dtype == jnp.float32
    report = jamp.explain(loss, x, x, policy=policy)
    assert report.ops["dot_general"] == {"float32": 1, "bfloat16": 1}
    assert report.float32_reasons[("dot_general", f"rule '@{HERE}:{line_of('FIRST')}'")] == 1


def test_a_line_rule_that_matches_nothing_warns_with_the_closest_lines():
    policy = jamp.Policy(rules=((f"@{HERE}:1", None),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.autocast_transform(two_products, policy)(x, x)
    messages = [str(w.message) for w in caught if w.category is jamp.UnmatchedRuleWarning]
    assert len(messages) == 1
    assert "matched no source line" in messages[0] and "closest lines seen" in messages[0]
    assert f"@{HERE}:" in messages[0]   # the lines it saw, to compare with


def test_a_malformed_line_rule_is_refused():
    with pytest.raises(ValueError, match=r"names a source line as '@<file>:<line>'"):
        jamp.Policy(rules=(("@model.py", None),))


def test_an_einsum_is_selected_by_its_line_not_by_jnps_subscripts_scope():
    """``jnp.einsum`` opens a scope named by its subscripts (``'bd,dk->bk'``): a glob matching it
    beat an ``@file:line`` rule for an ``nnx.Einsum`` (scopes win over lines), so the line rule
    was silently ignored there while it held for an ``nnx.Linear`` on the next line."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Einsum("bd,dk->bk", (16, 16), (16,), rngs=rngs)
            self.c = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            h = self.a(x)  # EINSUM
            return self.c(h)  # LINEAR

    net, x = Net(nnx.Rngs(0)), jnp.ones((4, 16))
    for marker in ("EINSUM", "LINEAR"):
        policy = jamp.Policy(rules=(rule(marker, None), ("*bk*", jnp.bfloat16)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jamp.UnmatchedRuleWarning)
            report = jamp.explain(lambda m, x: m(x), net, x, policy=policy)
        assert report.ops["dot_general"] == {"float32": 1, "bfloat16": 1}
