"""Haiku functions with a region inside, where Haiku is installed (the zoo job): what
docs/migration/from-jmp.md and the Regions table of docs/reference/dtypes.md say of them."""
import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import jamp
from tests.jaxpr_utils import eqns_named

X = jnp.ones((8, 16))


def dtypes_of(tree):
    return {"/".join([module, name]): leaf.dtype
            for module, leaves in tree.items() for name, leaf in leaves.items()}


def mlp_with_a_region(region):
    def net(x):
        with region():
            return hk.LayerNorm(-1, True, True)(hk.nets.MLP([32, 32, 10], name="mlp")(x))
    return hk.transform(net)


def test_haiku_makes_biases_and_norm_scales_in_their_inputs_dtype_in_a_region_at_init():
    """Haiku creates a bias (and a norm's scale and offset) in its input's dtype, which a region
    entered inside the function makes bfloat16 at ``init`` (jmp's policies kept parameters
    float32): the documented remedy turns the region off while Haiku initializes."""
    made = dtypes_of(mlp_with_a_region(jamp.autocast).init(jax.random.key(0), X))
    assert made["mlp/~/linear_1/b"] == jnp.bfloat16 and made["layer_norm/scale"] == jnp.bfloat16

    remedy = mlp_with_a_region(lambda: jamp.autocast(enabled=not hk.running_init()))
    params = remedy.init(jax.random.key(0), X)
    assert set(dtypes_of(params).values()) == {jnp.dtype(jnp.float32)}
    grads = jax.grad(lambda p: jnp.sum(remedy.apply(p, None, X)))(params)
    assert set(dtypes_of(grads).values()) == {jnp.dtype(jnp.float32)}
    products = eqns_named(jax.make_jaxpr(lambda p: remedy.apply(p, None, X))(params),
                          "dot_general")
    assert products and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in products)


@pytest.mark.parametrize("form", ["region", "transform"])
def test_haiku_module_names_are_the_scopes_policy_rules_match(form):
    """``hk.mixed_precision.set_policy(module, ...)``'s jamp form: a rule on the module's name
    (``mlp/linear_2``, Haiku's ``~`` left out), no ``jax.named_scope`` needed."""
    policy = jamp.Policy(rules=(("mlp/linear_2", None),))
    net = hk.transform(lambda x: hk.nets.MLP([32, 32, 10], name="mlp")(x))
    params = net.init(jax.random.key(0), X)

    def apply(p):
        if form == "region":
            with jamp.autocast(policy):
                return net.apply(p, None, X)
        return jamp.autocast_transform(lambda p: net.apply(p, None, X), policy)(p)

    products = eqns_named(jax.make_jaxpr(apply)(params), "dot_general")
    assert [e.outvars[0].aval.dtype for e in products] == [jnp.bfloat16] * 2 + [jnp.float32]
