"""pytest plugin for ``identity_policy.py``: runs JAX's own tests with ``jax.jit`` patched to
apply an identity policy (``Policy(jnp.float32)``) to every jitted function, and records every
test's outcome.

Loaded with ``-p identity_jit_plugin`` (``benchmarks/`` on ``PYTHONPATH``) before the test modules
are imported, so their ``from jax import jit`` picks up the patch. Environment:

- ``JAMP_IDENTITY_PATCH=1``: patch ``jax.jit`` (otherwise the run is the baseline);
- ``JAMP_IDENTITY_FORM=transform|region`` (default ``transform``): which front end the patch uses,

  - ``transform``: ``jax.jit(f, ...)`` becomes ``jax.jit(jamp.autocast_transform(f, policy), ...)``
    (front end 1: trace, then rewrite);
  - ``region``: ``jax.jit(f, ...)`` becomes ``jax.jit(g, ...)`` where ``g(*a, **k)`` runs
    ``f(*a, **k)`` inside ``with jamp.autocast(policy):`` (front end 2: a region trace that
    applies the policy to every bind in the block);
  - ``eager-region``: nothing is patched; every test's body runs inside ``with
    jamp.autocast(policy):``, its eager operations and its jits alike (``with jamp.autocast():``
    anywhere, as a torch user writes it around a whole step);

- ``JAMP_IDENTITY_HELPERS=1``: also patch the ``jit`` of JAX's test helpers
  (``jtu._CompileAndCheck``, which most of ``lax_test``, ``lax_numpy_*_test`` and
  ``lax_autodiff_test`` check compiled results with): it calls ``jax._src.api.jit``, not the public
  one. Only the helpers' view of that module is changed (``test_util.api``), so JAX's own
  internal jits stay as they are;
- ``JAMP_IDENTITY_VMAP=1``: also patch ``jax.vmap``: ``jax.vmap(f, ...)`` becomes
  ``jax.vmap(g, ...)`` with ``g`` as for a jit in the chosen form (``f``'s body in a region, or
  ``autocast_transform(f, policy)``), so that tests that batch without compiling
  (``lax_vmap_test``, ``lax_vmap_op_test``, ``ann_test``) run their batched side through jamp
  under JAX's batching trace, and compare it with their own unbatched reference;
- ``JAMP_IDENTITY_CAST_BACK=1``: every patched function's outputs are cast back to the dtypes
  the function returns without jamp (``jax.eval_shape`` of it, after the patched call), so a
  16-bit program that the float32 policy computes in float32 is checked on its values, with the
  test's own tolerances, instead of failing on the dtype it returns by design. Where an operand
  is 16-bit and an output float32, the function is traced once more for it (Python side effects
  run twice);
- ``JAMP_IDENTITY_OUT=path.json``: where the outcomes and the patch counters go.

Static arguments (``static_argnums``/``static_argnames``): in transform form they are bound
before the function reaches ``autocast_transform`` (a ``functools.partial``-style wrapper per
static values), so they stay Python values; in region form ``jax.jit`` itself handles them, as
``g`` has ``f``'s signature (``functools.wraps``). Such jits are counted either way. The wrapper
for a function is reused while its jitted function lives, so ``jax.jit(f)`` twice shares JAX's
trace cache as it would without the patch. Only the public ``jax.jit`` is patched: JAX-internal
``api.jit`` uses (``jnp`` functions jitted at import) run unchanged.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import weakref
from typing import Any

import pytest

FORM = os.environ.get("JAMP_IDENTITY_FORM", "transform")
if FORM not in ("transform", "region", "eager-region"):
    raise ValueError(
        f"JAMP_IDENTITY_FORM must be 'transform', 'region' or 'eager-region', got {FORM!r}"
    )
COUNTS = {"jit_calls": 0, "with_static_args": 0, "wrap_failed": 0, "vmap_calls": 0,
          "cast_back": 0}
OUTCOMES: dict[str, dict[str, Any]] = {}


def _install() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src import api_util  # benchmark only: resolve static args as jax.jit does

    import jamp
    from jamp import _compat  # benchmark only

    # The wrappers below are the harness's, not the user's: library frames, as jamp's own are, so
    # JAX's traceback tests (errors_test) check what a user sees under jamp.
    _compat.register_library_frames(__file__)
    real_jit = jax.jit
    policy = jamp.Policy(jnp.float32)
    # One wrapper per jitted function and static arguments, kept on the function itself
    # (``fun.__dict__``): JAX keys its trace cache on the function, so `jit(f)(2); jit(f)(3)` must
    # find the first wrapper, and the wrapper must live no longer than ``f`` (JAX's tests check
    # that jit keeps no reference alive).
    attribute = "_jamp_identity_wrappers"

    def static_positions(fun: Any, kw: dict) -> tuple[tuple[int, ...], tuple[str, ...]]:
        nums, names = kw.get("static_argnums"), kw.get("static_argnames")
        if nums is None and names is None:
            return (), ()
        try:
            sig = inspect.signature(fun)
        except (TypeError, ValueError):
            sig = None
        nums, names = api_util.infer_argnums_and_argnames(sig, nums, names)
        return tuple(nums), tuple(names)

    def own_wrappers(fun: Any) -> dict | None:
        """``fun``'s wrappers by static positions, None where ``fun`` has no ``__dict__`` (bound
        methods, slotted objects). A function wrapping ``fun`` (``jax.vmap(fun)``,
        ``functools.wraps``) copies ``fun.__dict__``, this entry included: the entry names its
        owner, so ``jax.jit(jax.vmap(f))`` does not find ``jax.jit(f)``'s wrapper."""
        attrs = getattr(fun, "__dict__", None)
        if not isinstance(attrs, dict) or inspect.ismethod(fun):
            # (a bound method's __dict__ is its function's, shared by every instance: an entry
            # there would keep the instance alive)
            return None
        own = attrs.get(attribute)
        if own is None or own["owner"] is not fun:
            own = attrs[attribute] = {"owner": fun}
        return own

    def identity_wrap(fun: Any, kw: dict) -> Any:
        # What jax.jit refuses (not callable, a generator function, a staticmethod, a callable
        # that cannot be weakly referenced) raises here, and patched_jit lets jax.jit refuse it.
        api_util.check_callable(fun)
        weakref.ref(fun)
        nums, names = static_positions(fun, kw)
        key = (nums, names)
        own = own_wrappers(fun)
        if own is not None and key in own:
            return own[key]
        if nums or names:
            COUNTS["with_static_args"] += 1
        make = region_wrapper if FORM == "region" else transform_wrapper
        wrapper = make(fun, nums, names)
        if own is not None:
            own[key] = wrapper
        return wrapper

    cast_back = os.environ.get("JAMP_IDENTITY_CAST_BACK") == "1"

    sixteen_bit = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}

    def might_be_16_bit(args: tuple, kwargs: dict, outs: Any) -> bool:
        """Whether a float32 output may be one the policy widened: some operand is 16-bit. (Only
        then is the function traced again: a test that counts its function's traces or side
        effects is left alone otherwise.)"""
        dtypes = lambda tree: {getattr(x, "dtype", None) for x in jax.tree.leaves(tree)}
        return bool(dtypes((args, kwargs)) & sixteen_bit) and np.dtype(jnp.float32) in dtypes(outs)

    def as_traced(fun: Any, args: tuple, kwargs: dict, outs: Any) -> Any:
        """``outs`` in the dtypes ``fun`` returns without jamp (with ``JAMP_IDENTITY_CAST_BACK``)."""
        if not cast_back or not might_be_16_bit(args, kwargs, outs):
            return outs
        try:
            plain = jax.eval_shape(lambda: fun(*args, **kwargs))
        except Exception:  # (outputs that are not JAX types: the test checks what vmap says)
            return outs

        def back(out: Any, want: Any) -> Any:
            dtype = getattr(want, "dtype", None)
            if dtype is None or getattr(out, "dtype", dtype) == dtype:
                return out
            COUNTS["cast_back"] += 1
            return jnp.asarray(out).astype(dtype)

        try:
            return jax.tree.map(back, outs, plain)
        except ValueError:  # (another structure: leave it for the test to see)
            return outs

    def region_wrapper(fun: Any, nums: tuple, names: tuple) -> Any:
        # jax.jit binds the static arguments itself: `g` has `fun`'s signature (__wrapped__).
        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with jamp.autocast(policy):
                outs = fun(*args, **kwargs)
            return as_traced(fun, args, kwargs, outs)

        return wrapper

    def transform_wrapper(fun: Any, nums: tuple, names: tuple) -> Any:
        plain = jamp.autocast_transform(fun, policy)
        per_static: dict[Any, Any] = {}

        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return as_traced(fun, args, kwargs, transformed(*args, **kwargs))

        def transformed(*args: Any, **kwargs: Any) -> Any:
            if not (nums or names):
                return plain(*args, **kwargs)
            fixed_pos = {}
            for i in nums:
                i = i if i >= 0 else i + len(args)
                if 0 <= i < len(args):
                    fixed_pos[i] = args[i]
            fixed_kw = {k: v for k, v in kwargs.items() if k in names}
            dyn_args = [a for i, a in enumerate(args) if i not in fixed_pos]
            dyn_kw = {k: v for k, v in kwargs.items() if k not in names}
            try:
                # typed, as jax.jit's static-argument cache: 1, True and 1.0 are different keys
                skey = (
                    tuple((i, type(v), v) for i, v in sorted(fixed_pos.items())),
                    tuple((k, type(v), v) for k, v in sorted(fixed_kw.items())),
                )
                hash(skey)
            except TypeError:
                skey = None
            inner = per_static.get(skey) if skey is not None else None
            if inner is None:
                def bound(*d_args: Any, **d_kw: Any) -> Any:
                    it = iter(d_args)
                    full = [fixed_pos[i] if i in fixed_pos else next(it)
                            for i in range(len(d_args) + len(fixed_pos))]
                    return fun(*full, **d_kw, **fixed_kw)
                inner = jamp.autocast_transform(functools.wraps(fun)(bound), policy)
                if skey is not None:
                    per_static[skey] = inner
            return inner(*dyn_args, **dyn_kw)

        return wrapper

    @functools.wraps(real_jit)
    def patched_jit(fun: Any = None, /, **kw: Any) -> Any:
        if fun is None:  # @jax.jit(static_argnums=...) decorator-factory form
            return lambda f: patched_jit(f, **kw)
        if getattr(fun, "__module__", "").split(".")[0] in ("jamp", "tracing"):
            return real_jit(fun, **kw)  # jamp's own jit (its compiled eager path): not a test's
        COUNTS["jit_calls"] += 1
        try:
            wrapped = identity_wrap(fun, kw)
        except Exception:  # let jax.jit raise its own error for bad arguments
            COUNTS["wrap_failed"] += 1
            return real_jit(fun, **kw)
        return real_jit(wrapped, **kw)

    jax.jit = patched_jit
    if os.environ.get("JAMP_IDENTITY_VMAP") == "1":
        real_vmap = jax.vmap

        @functools.wraps(real_vmap)
        def patched_vmap(fun: Any, /, *args: Any, **kw: Any) -> Any:
            if not callable(fun) or getattr(fun, "__module__", "").split(".")[0] == "jamp":
                return real_vmap(fun, *args, **kw)  # (let vmap refuse what it refuses)
            COUNTS["vmap_calls"] += 1
            make = region_wrapper if FORM == "region" else transform_wrapper
            return real_vmap(make(fun, (), ()), *args, **kw)  # (no static arguments)

        jax.vmap = patched_vmap
    if os.environ.get("JAMP_IDENTITY_HELPERS") == "1":
        from jax._src import test_util  # benchmark only: the helpers' own reference to api

        test_util.api = _WithJit(test_util.api, patched_jit)
        # Imported here, before pytest's capture replaces sys.stdout for the tests, the module's
        # capture_stdout would hold the wrong stream (and miss every jax.debug.print): bind the
        # stream when a test asks, as importing the module from the test file does.
        for name, stream in (("capture_stdout", "stdout"), ("capture_stderr", "stderr")):
            setattr(test_util, name, _capture_current(test_util, stream))


def _capture_current(test_util: Any, stream: str) -> Any:
    import sys

    return lambda: test_util._capture_output(getattr(sys, stream))


class _WithJit:
    """A module seen through another ``jit``: every other name is the module's own."""

    def __init__(self, module: Any, jit: Any) -> None:
        self._module, self.jit = module, jit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("JAMP_IDENTITY_PATCH") == "1" and FORM != "eager-region":
        _install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """eager-region: the test method runs in a region; its ``setUp`` and ``tearDown`` do not
    (JAX's ``tearDown`` checks that no trace is left open: the region would be one)."""
    if os.environ.get("JAMP_IDENTITY_PATCH") != "1" or FORM != "eager-region":
        return
    if not isinstance(item, pytest.Function):
        return
    import jax.numpy as jnp

    import jamp

    COUNTS["jit_calls"] += 1  # (here: tests run in a region)
    # (pytest binds ``item.obj`` as the test case's method before unittest runs it: JAX's tests
    # are unittest test cases; a plain test function is ``item.obj`` too)
    method = item.obj

    @functools.wraps(method)
    def in_region(*args: Any, **kwargs: Any) -> Any:
        with jamp.autocast(jamp.Policy(jnp.float32)):
            return method(*args, **kwargs)

    item.obj = in_region


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.failed or report.skipped):
        return
    entry = OUTCOMES.setdefault(report.nodeid, {"outcome": "pending"})
    if entry["outcome"] not in ("pending", "passed"):
        return  # keep the first non-pass (a setup error before its teardown)
    entry["outcome"] = report.outcome
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = (crash.message if crash is not None else str(report.longrepr))[:2000]
        entry["when"] = report.when
        text = str(report.longrepr)
        entry["jamp_frames"] = "jamp/" in text
        entry["tail"] = text[-3000:]
    OUTCOMES[report.nodeid] = entry
    if len(OUTCOMES) % 20 == 0:  # a run stopped early still leaves its results so far
        _dump(finished=False)


def pytest_warning_recorded(warning_message: Any, when: str, nodeid: str, location: Any) -> None:
    category = getattr(warning_message, "category", None)
    if category is not None and category.__module__.startswith("jamp") and nodeid:
        entry = OUTCOMES.setdefault(nodeid, {"outcome": "pending"})
        entry.setdefault("jamp_warnings", []).append(str(warning_message.message)[:300])


def _dump(finished: bool) -> None:
    out = os.environ.get("JAMP_IDENTITY_OUT")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        # Under xdist the controller gathers every outcome and writes the results; a worker
        # writes only the jits it patched, beside them, for identity_policy.py to add up. (Both
        # writing the one file raced: a run stopped with pytest's INTERNALERROR part way.)
        out, data = f"{out}.counts-{worker}", {"counts": COUNTS}
    else:
        data = {"patched": os.environ.get("JAMP_IDENTITY_PATCH") == "1", "form": FORM,
                "finished": finished, "counts": COUNTS, "outcomes": OUTCOMES}
    with open(f"{out}.tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(f"{out}.tmp", out)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _dump(finished=True)
