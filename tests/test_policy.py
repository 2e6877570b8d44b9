"""Policy validation, immutability and scope-rule matching."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.policy import FP32, LOWER, PROMOTE, RegionState


def test_defaults_follow_the_design_tables():
    policy = jamp.Policy()
    assert policy.compute_dtype == jnp.bfloat16
    assert {"dot_general", "conv_general_dilated"} <= policy.lower
    assert {"exp", "log", "reduce_sum", "cumsum", "rsqrt", "erf_inv"} <= policy.fp32
    assert {"add", "mul", "select_n", "concatenate", "dynamic_update_slice"} <= policy.promote
    assert not (LOWER & FP32 or LOWER & PROMOTE or FP32 & PROMOTE)


def test_policy_is_hashable_and_usable_as_static_jit_argument():
    a, b = jamp.Policy(jnp.float16), jamp.Policy(np.float16)
    assert a == b and hash(a) == hash(b)
    seen = []
    run = jax.jit(lambda x, p: seen.append(p) or x * 2, static_argnums=1)
    run(jnp.ones(2), a)
    run(jnp.ones(2), b)  # equal policy: no retrace
    assert seen == [a]


def test_replace_changes_fields_and_rejects_unknown_ones():
    policy = jamp.Policy().replace(compute_dtype=jnp.float16, output_dtype=jnp.float32)
    assert policy.compute_dtype == jnp.float16 and policy.output_dtype == jnp.float32
    with pytest.raises(TypeError, match="no field 'compute'"):
        jamp.Policy().replace(compute=jnp.float16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        jamp.Policy(bogus=1)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, "int8"])
def test_non_floating_compute_dtype_is_a_value_error(dtype):
    with pytest.raises(ValueError, match="compute_dtype"):
        jamp.Policy(dtype)


def test_table_overlap_and_bad_rules_are_rejected():
    with pytest.raises(ValueError, match="overlap on \\['exp'\\]"):
        jamp.Policy(lower=LOWER | {"exp"})
    with pytest.raises(TypeError, match="rules\\[0\\]"):
        jamp.Policy(rules=("Dense_0",))
    with pytest.raises(ValueError, match="rules\\[0\\]\\[1\\]"):
        jamp.Policy(rules=(("Dense_0", jnp.int32),))
    with pytest.raises(TypeError, match="set of primitive names"):
        jamp.Policy(fp32="exp")


def test_category_lookup():
    policy = jamp.Policy()
    assert policy.category("dot_general") == "lower"
    assert policy.category("log") == "fp32"
    assert policy.category("add") == "promote"
    assert policy.category("tanh") is None


BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _walk(path, rules):
    state = RegionState(enabled=True, dtype=BF16)
    for name in path:
        state = state.enter_scope(name, rules)
    return state


def test_rules_innermost_scope_wins_and_later_rule_breaks_ties():
    rules = (("*", None), ("*/Dense_0", F16))
    assert not _walk(["M"], rules).enabled
    inner = _walk(["M", "Dense_0"], rules)
    assert inner.enabled and inner.dtype == F16
    tie = (("M", F16), ("M", None))
    assert not _walk(["M"], tie).enabled


def test_rule_matched_outside_does_not_reapply_deeper():
    # "Block*" also matches "Block_0/attn"; it applied at "Block_0" and must not override what
    # happened in between (here: a deeper rule disabling autocast for the attention).
    rules = (("Block*", F16), ("*/attn", None))
    state = _walk(["Block_0", "attn", "inner"], rules)
    assert not state.enabled
