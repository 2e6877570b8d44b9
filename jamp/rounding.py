"""Stochastic rounding to bfloat16, float16 and float8, done on the bits.

``stochastic_round(x, dtype, key)`` rounds each element of ``x`` to one of its two neighbours in
``dtype``, up with probability ``(x - down) / (up - down)``, so ``E[result] = x``. It works on the
float32 bit pattern: random bits of the width the target drops are added to the magnitude and the
dropped bits are cleared (a carry moves the value to the next representable one). For bfloat16,
which shares float32's exponent range, the dropped width is always 16 bits. For float16 and the
float8 types, whose exponents stop earlier, the width grows by one bit per binade below the
target's smallest normal (the target's subnormals are evenly spaced), so the same add-and-truncate
lands on the target's grid there too. Below the target's smallest subnormal ``s`` a value rounds
to ``0`` or ``±s`` with probability ``|x| / s``, drawn from the same 32 random bits: exact for
``|x| >= s * 2**-9``, within ``2**-32`` below that.

Why on the bits: adding float noise and rounding to nearest is biased by the rounding of the
noisy sum; adding integer bits below the kept ones is exact (each of the ``2**k`` outcomes has
the same probability and the carry happens for exactly the right fraction of them).

Where the bits come from: a keyed hash of each element's index in the whole array,
``lowbias32((index ^ w1) * 0x9E3779B9 + w0)``, with ``w0, w1`` two words drawn from the key with
``jax.random.bits`` (``hashed_bits``). For a fixed element, ``w0`` to bits is a bijection of
uint32, so with uniform key words each element's bits are exactly uniform and independent from
key to key (step to step in ``jamp.optim``) whatever the hash's quality: unbiasedness rests on
the key draw, not on the mix. The one round of lowbias32 (a bijective multiply-xorshift
finalizer with near-ideal avalanche) only makes neighbouring elements' bits unrelated within one
draw; ``tests/test_rounding.py`` checks both 16-bit halves for uniformity and lag-1 / next-row
correlation. The index comes from ``broadcasted_iota`` (made with the value's sharding on a mesh
of explicit axes), so under ``jit`` a sharded array is hashed shard by shard with no
communication and the bits do not depend on the number of devices. Inside ``shard_map`` the
body sees its shard alone and the index is the shard's own: with one key every shard draws the
same bits (each element is still rounded without bias, but the shards' errors are the same
draws and do not average out). There, fold the shard's position into the key for values split
across the axis (``jax.random.fold_in(key, jax.lax.axis_index("data"))``) and keep it for
values replicated across it, which must round alike on every device. Cost:
``jax.random.bits`` per element (threefry) made a stochastically rounded optimizer update 9-18x
the nearest one on the CPU; two rounds of the hash 1.9x; one round, with the bfloat16 result
taken as the word's top half (a shift, where ``astype`` is an emulated round-to-nearest on the
CPU) and one key draw for all of a step's leaves (``stochastic_round_many``), about 1.2x
(``benchmarks/optim_state.py``).

Edge values follow ``astype``: NaN stays NaN, ±inf stays ±inf, and a finite value rounds up past
the largest finite value of ``dtype`` (with probability proportional to the distance, as if the
next value existed) to what ``astype`` makes of an overflow: inf for bfloat16, float16 and
float8_e5m2, NaN for the float8 types without inf (``float8_e4m3fn``). Values already
representable in ``dtype`` come back unchanged whatever the bits. float64 inputs are rounded to
float32 (to nearest) first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from ._compat import under_staging

F32 = np.dtype(np.float32)

# Target formats stochastic_round supports: (mantissa bits, exponent of the smallest normal).
# float8_e8m0fnu is left out: it has no sign, no zero and no mantissa to round.
_FORMAT_NAMES = (
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e3m4",
)
FORMATS: dict[np.dtype, tuple[int, int]] = {
    np.dtype(getattr(jnp, name)): (
        int(ml_dtypes.finfo(getattr(jnp, name)).nmant),
        int(ml_dtypes.finfo(getattr(jnp, name)).minexp),
    )
    for name in _FORMAT_NAMES
    if hasattr(jnp, name)
}


def is_narrow(dtype: Any) -> bool:
    """A floating dtype narrower than float32 that stochastic rounding can target."""
    try:
        return np.dtype(dtype) in FORMATS
    except TypeError:
        return False


def check_target(dtype: Any, where: str) -> np.dtype:
    """``dtype`` as a numpy dtype if it is float32 or a format in ``FORMATS``; otherwise an error
    naming ``where`` (the argument in the caller's terms)."""
    if dtype is None:  # np.dtype(None) is float64: it would be reported as too wide
        raise TypeError(f"{where} must be a dtype such as jnp.bfloat16, got None")
    try:
        target = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"{where} must be a dtype such as jnp.bfloat16, got {dtype!r}") from err
    if target in FORMATS or target == F32:
        return target
    names = ", ".join(d.name for d in FORMATS)
    if target == np.float64:
        why = "float64 is wider than float32, not a narrower storage dtype"
    elif not jnp.issubdtype(target, jnp.floating):
        why = f"{target.name} is not a floating dtype"
    else:
        why = f"{target.name} is not supported"
    raise ValueError(f"{where} must be a narrow floating dtype ({names}) or float32; {why}")


def _default_prng_impl() -> str:
    # jax.config's flags are attributes its stubs do not list
    return str(cast(Any, jax.config).jax_default_prng_impl)


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of ``jax.random.PRNGKey(0)`` under the configured ``jax_default_prng_impl``:
    uint32[2] for threefry, uint32[4] for rbg (the raw keys ``jax.random.bits`` then takes)."""
    return _raw_key_shape_of(_default_prng_impl())


@functools.cache
def _raw_key_shape_of(impl: str) -> tuple[int, ...]:
    # A new lambda: eval_shape caches by function, not by the PRNG implementation in force.
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def _key_error(key: Any) -> TypeError:
    shape = getattr(key, "shape", None)
    dtype = getattr(key, "dtype", None)
    got = f"{dtype}{list(shape)}" if shape is not None else type(key).__name__
    raw = list(_raw_key_shape())
    return TypeError(
        "stochastic_round(key=...) must be one PRNG key: a typed key such as jax.random.key(0) "
        f"(shape ()) or a raw key such as jax.random.PRNGKey(0) (uint32{raw} under "
        f"jax_default_prng_impl={_default_prng_impl()!r}), got {got}; under "
        "jax.vmap pass a batch of keys (jax.random.split(key, n)) to give every example its "
        "own bits"
    )


def _check_key(key: Any) -> Any:
    if not hasattr(key, "dtype") or not hasattr(key, "shape"):
        raise _key_error(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise _key_error(key)
        return key
    # a raw jax.random.PRNGKey, whose shape depends on the default PRNG implementation
    if key.dtype != jnp.uint32 or tuple(key.shape) != _raw_key_shape():
        raise _key_error(key)
    return key


def stochastic_round(x: Any, dtype: Any, key: Any) -> jax.Array:
    """Round floating ``x`` to ``dtype``, up or down at random, so that ``E[result] = x``.

    Each element goes to one of its two neighbours in ``dtype`` (bfloat16, float16 or a float8
    type), up with probability proportional to its distance from the lower one. Values already
    representable come back unchanged; NaN, ±inf and overflow follow ``astype`` (overflow: inf,
    or NaN for float8 types without inf); see the module docstring for how the bits are used.
    ``dtype=jnp.float32`` is the plain cast (nothing to round for inputs of 32 bits or fewer).

    The bits are a hash of each element's index keyed by ``key`` (two words of
    ``jax.random.bits``; far cheaper than threefry for every element on the CPU): the
    same key gives the same result, under ``jit`` and on sharded arrays alike (each device
    hashes the indices of its own shard, and the result does not depend on the number of
    devices). Under ``jax.vmap``, batch the key too (``jax.random.split``): one key shared by
    the batch gives every example the same bits. Inside ``jax.shard_map`` the index is the
    shard's own, so one key gives every shard the same bits: for a value split across an axis,
    pass ``jax.random.fold_in(key, jax.lax.axis_index(axis))`` (a value replicated across it
    keeps ``key``, and rounds alike everywhere). The derivative is 1 (straight-through): the
    tangent is cast to ``dtype``.

    Example::

        x = jnp.full((10000,), 1.0 + 2.0**-10)         # between two bfloat16 values
        y = jamp.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
        # y is 1.0 or 1.0078125 (a bfloat16 step up), and its mean is close to 1.0009765625
    """
    target = check_target(dtype, "stochastic_round(dtype=...)")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"stochastic_round(x=...) must be a floating array, got {x.dtype}{list(x.shape)}"
        )
    key = _check_key(key)
    if target == F32:
        if x.dtype == np.float64:
            raise ValueError(
                "stochastic_round: rounding float64 to float32 is not supported; pick a "
                "16- or 8-bit dtype, or cast with x.astype(jnp.float32)"
            )
        return x.astype(F32)
    return _rounded(x, random_bits(key, x.shape, _explicit_sharding(x)), target)


def _mix(h: jax.Array) -> jax.Array:
    """lowbias32 (Chris Wellons' hash-prospector): a bijection of uint32 with near-ideal
    avalanche (flipping an input bit flips each output bit with probability close to 1/2;
    measured bias 0.17 on his scale, where the best known 32-bit hashes score about 0.02)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def _explicit_sharding(x: jax.Array) -> Any:
    """``x``'s sharding while a jaxpr is being built (``jax.jit``) and its type carries one over
    a mesh of explicit axes (``jax.make_mesh``'s default) that splits it, else None (no mesh,
    ``Auto`` axes, inside ``shard_map``, or eager: an eager op cannot take a mesh's sharding
    outside ``jax.set_mesh``). The bits are made with it: made replicated, they were hashed
    whole on every device and then sliced."""
    if not under_staging():
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and any(a is not None for a in sharding.spec):
        return sharding
    return None


def _global_index(shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
    """Each element's row-major index in the whole array (wrapping at 2**32), from
    ``broadcasted_iota`` (made with ``sharding``, an explicit-axes one, when given): computed
    shard by shard with no communication."""
    index = None
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis, out_sharding=sharding)
        term = iota * np.uint32(stride % (1 << 32))
        index = term if index is None else index + term
        stride *= shape[axis]
    return jnp.zeros((), jnp.uint32) if index is None else index


def hashed_bits(words: jax.Array, shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
    """One uint32 of random bits an element of ``shape``, keyed by two uint32 ``words``:
    ``lowbias32((index ^ words[1]) * 0x9E3779B9 + words[0])``, sharded like ``sharding`` (an
    explicit-axes sharding, see ``_explicit_sharding``) when given.

    One round of the hash on a keyed Weyl sequence: the xor and the addend make a key choose its
    own bijection of the indices (not a shifted copy of another key's sequence) and the odd
    multiplier spreads neighbouring indices across the word before the mix. Rounding needs
    each element's bits uniform and unrelated to its neighbours' and to other keys', not a
    cryptographic stream (llm.c rounds with a similar hash); ``tests/test_rounding.py`` checks
    the low and high 16 bits for uniformity and neighbour correlation.
    """
    index = _global_index(shape, sharding)
    return _mix((index ^ words[1]) * np.uint32(0x9E3779B9) + words[0])


def random_bits(key: Any, shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
    """One uint32 of random bits an element of ``shape``: a hash of the element's index in the
    whole array, keyed by two words drawn from ``key`` with ``jax.random.bits``.

    Why not ``jax.random.bits(key, shape)`` for every element: its threefry costs about 12x a
    simple elementwise op on the CPU, which made a stochastically rounded optimizer update 9-18x
    the cost of the same update rounded to nearest (``benchmarks/optim_state.py``). Built from
    the global index, the bits of a sharded array are computed shard by shard with no
    communication and do not depend on the number of devices (``sharding``: an explicit-axes
    sharding to make them with, see ``_explicit_sharding``). (Indices wrap at 2**32 elements.)
    """
    return hashed_bits(jax.random.bits(key, (2,), jnp.uint32), shape, sharding)


def stochastic_round_many(
    xs: Sequence[jax.Array],
    targets: Sequence[Any],
    key: Any,
    salts: Sequence[tuple[int, int]] | None = None,
) -> list[jax.Array]:
    """``stochastic_round(xs[i], targets[i], ...)`` for every i, with bits from one ``key``:
    one ``jax.random.bits`` draw gives every array its two key words (array i hashes with
    ``words[i]``, xored with ``salts[i]`` when given), instead of a key split and a draw an
    array. Same properties as ``stochastic_round``: unbiased, exact on representable values,
    deterministic per key, computed shard by shard, straight-through.

    ``salts`` (two uint32 constants an array) tell apart arrays that two calls with the same
    key would otherwise hash alike (``jamp.optim``: a hash of each leaf's pytree path, so two
    wrappers with one seed, one per ``optax.multi_transform`` group, draw unrelated bits). A
    constant xored into uniform key words leaves them uniform, and two different constants
    relate two arrays' words as two keys' words are related: not at all, through the hash.

    (Arrays of one shape do not share a hashed word, although bfloat16 uses 16 of its 32 bits:
    XLA recomputes an elementwise producer inside each consumer's fusion, so sharing saved no
    work on the CPU, and materializing the word costs more memory traffic than the hash.)"""
    words = jax.random.bits(key, (max(1, len(xs)), 2), jnp.uint32)
    if salts:  # (None, or no arrays)
        words = words ^ jnp.asarray(np.asarray(salts, np.uint32).reshape(len(xs), 2))
    out = []
    for i, (x, target) in enumerate(zip(xs, targets)):
        x, target = jnp.asarray(x), np.dtype(target)
        if target == F32:
            out.append(x.astype(F32))
        else:
            bits = hashed_bits(words[i], tuple(x.shape), _explicit_sharding(x))
            out.append(_rounded(x, bits, target))
    return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _rounded(x: jax.Array, bits: jax.Array, target: np.dtype) -> jax.Array:
    return round_with_bits(x, bits, target)


@_rounded.defjvp
def _rounded_jvp(target: np.dtype, primals: Any, tangents: Any) -> Any:
    x, bits = primals
    x_dot, _ = tangents
    return _rounded(x, bits, target), x_dot.astype(target)  # straight-through


def round_with_bits(x: jax.Array, bits: jax.Array, target: np.dtype) -> jax.Array:
    """Stochastically round ``x`` to ``target`` with the given uint32 random ``bits`` (one word
    an element). ``target`` must be in ``FORMATS``."""
    nmant, minexp = FORMATS[np.dtype(target)]
    x32 = x.astype(F32)  # exact for 16-bit inputs; float64 rounds to nearest first (documented)
    word = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    sign = word & np.uint32(0x80000000)
    magnitude = word & np.uint32(0x7FFFFFFF)
    kept_drop = 23 - nmant  # float32 mantissa bits the target has no room for
    if minexp <= -126:
        # bfloat16: float32's exponent range, so the dropped width is the same everywhere, and
        # the result is the top half of the word: taken by a shift, not a convert (which on
        # the CPU is an emulated round-to-nearest). A NaN keeps its sign and is made quiet, as
        # astype does; its payload must not carry into the exponent.
        # Adding to the whole word adds to the magnitude: only a NaN's can carry into the sign.
        stochastic = word + (bits & np.uint32((1 << kept_drop) - 1))
        quiet = word | np.uint32(0x00400000)
        half = jnp.where(jnp.isnan(x32), quiet, stochastic) >> np.uint32(16)
        return jax.lax.bitcast_convert_type(half.astype(jnp.uint16), target)
    else:
        biased = (magnitude >> np.uint32(23)).astype(jnp.int32)
        exponent = jnp.maximum(biased, 1) - 127  # float32 subnormals share the lowest binade's step
        # One more dropped bit per binade below the target's smallest normal (its subnormals
        # are evenly spaced, 2**(minexp - nmant) apart).
        drop = kept_drop + jnp.clip(minexp - exponent, 0, 40)
        small = drop <= 23
        shift = jnp.where(small, drop, 0).astype(jnp.uint32)
        mask = (np.uint32(1) << shift) - np.uint32(1)
        on_grid = (magnitude + (bits & mask)) & ~mask
        # Below the smallest subnormal s: up to s with probability |x| / s = M / 2**drop, M the
        # 24-bit significand; compared on the top `drop` random bits (all 32, scaled, past 32).
        # (Arithmetic, not a where between two scalars: under jax 0.12, vmap over an array split
        # over explicit mesh axes made such a where fail to find the mesh.)
        normal = (biased > 0).astype(jnp.uint32)
        significand = (magnitude & np.uint32(0x7FFFFF)) | (normal << np.uint32(23))
        fits = drop <= 32
        # Past 32 dropped bits the shift is 0 and top_bits is all the bits: no select between
        # them and bits, which JAX refused on an explicit-axes mesh when the two were sharded
        # differently.
        top_bits = bits >> jnp.where(fits, 32 - drop, 0).astype(jnp.uint32)
        threshold = jnp.where(
            fits,
            significand,
            significand >> jnp.clip(drop - 32, 0, 31).astype(jnp.uint32),
        )
        up = top_bits < threshold
        smallest = np.uint32((minexp - nmant + 127) << 23)  # s as float32 bits (a normal)
        out = jnp.where(small, on_grid, up.astype(jnp.uint32) * smallest)  # (as for `normal`)
    rounded = jax.lax.bitcast_convert_type(sign | out, F32)
    rounded = jnp.where(jnp.isnan(x32), x32, rounded)  # a NaN's low payload bits must not carry
    return rounded.astype(target)
