"""A short autocast walkthrough: what runs in which dtype, regions, rules and gradients.

Run with `.venv/bin/python examples/walkthrough.py` (./scripts/demo runs the training demo,
examples/digits.py).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

import jamp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="hidden")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(10, name="head")(x)


def dtypes(tree):
    return jax.tree.map(lambda a: a.dtype.name, tree)


def dot_dtypes(fn, *args):
    """Output dtype of every matmul in the (rewritten) program, in program order."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.outvars[0].aval.dtype.name for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


def main():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 20))
    labels = jax.random.randint(jax.random.PRNGKey(1), (32,), 0, 10)
    params = model.init(jax.random.PRNGKey(2), x)

    def loss_fn(params, x, labels):
        logits = model.apply(params, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    print("1. Ops decided one by one (default policy: bfloat16 compute)")
    f = jamp.autocast_transform(lambda a, b: (a @ b, jnp.sum(a @ b), jnp.log(jnp.abs(a) + 1)))
    out = f(x, x.T)
    print(f"   a @ b -> {out[0].dtype}, sum(a @ b) -> {out[1].dtype}, log -> {out[2].dtype}")

    print("2. A Flax model: matmuls in bfloat16, the loss in float32")
    mixed_apply = jamp.autocast_transform(model.apply)
    print(f"   logits: {mixed_apply(params, x).dtype}; matmuls: {dot_dtypes(mixed_apply, params, x)}")
    loss = jamp.autocast_transform(loss_fn)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, labels)
    print(f"   loss {float(value):.4f} ({value.dtype}); grads: {sorted(set(jax.tree.leaves(dtypes(grads))))}")

    print("3. Regions inside the function")

    def with_regions(a):
        with jamp.autocast(enabled=False):
            full = a @ a.T
        with jamp.autocast(dtype=jnp.float16):
            half = a @ a.T
        return full, half, a @ a.T

    print("   off / float16 / default:", [o.dtype.name for o in jamp.autocast_transform(with_regions)(x)])

    print("4. Per-module rules on Flax module paths: keep the head in float32")
    policy = jamp.Policy(rules=(("*/head", None),))
    head_fp32 = jamp.autocast_transform(model.apply, policy)
    print(f"   matmuls (hidden, head): {dot_dtypes(head_fp32, params, x)}")

    print("5. jit, grad and vmap compose in any order")
    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:4, None], labels[:4, None])
    print(f"   per-example grads: {jax.tree.leaves(per_example)[0].shape}, "
          f"{sorted(set(jax.tree.leaves(dtypes(per_example))))}")


if __name__ == "__main__":
    main()
