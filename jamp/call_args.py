"""Arguments of a transformed call: which are static, which are traced, and their names.

``static_argnums``/``static_argnames`` follow ``jax.jit``: numbers and names are inferred from
each other through the function's signature, negative numbers count from the end, and a static
value must be hashable because it is part of the cache key. Static arguments travel through the
pytree machinery as single opaque leaves (``_Static``), so a static tuple or dict is never split
into traced leaves. Errors name the user's function and parameter, never jamp's wrappers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat as compat

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Static:
    """A static argument's value as one pytree leaf; equal only to a value of the same type
    (``1``, ``1.0`` and ``True`` trace differently, as with ``jax.jit``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __eq__(self, other: Any) -> bool:
        return (
            type(other) is _Static
            and type(other.value) is type(self.value)
            and bool(other.value == self.value)
        )

    def __repr__(self) -> str:
        return f"static({self.value!r})"


def function_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _index_tuple(value: int | Iterable[int], what: str, where: str) -> tuple[int, ...]:
    try:
        return (operator.index(value),)  # type: ignore[arg-type]
    except TypeError:
        pass
    try:
        return tuple(operator.index(v) for v in value)  # type: ignore[union-attr]
    except TypeError as err:
        raise TypeError(
            f"{where}: {what} must be an int or a sequence of ints, got {value!r}"
        ) from err


def _name_tuple(value: str | Iterable[str], what: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        names = (value,)  # type: ignore[assignment]
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(
            f"{where}: {what} must be a parameter name or a sequence of names, got {value!r}"
        )
    return names


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """How calls of one function are split into static and traced arguments."""

    fn: Callable
    signature: inspect.Signature | None
    argnums: tuple[int, ...]  # non-negative unless fn takes *args (resolved per call then)
    argnames: frozenset[str]
    label: str = "autocast_transform"  # the caller's entry point: explain, find_nonfinite, ...
    # The static arguments that are so because ``fn`` is ``jax.jit``-ed with them static.
    jit_argnums: frozenset[int] = frozenset()
    jit_argnames: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        fn: Callable,
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        *,
        label: str = "autocast_transform",
    ) -> CallSignature:
        """``label`` is the public function the user called, named in errors."""
        where = f"{label}({function_name(fn)})"
        argnums = _index_tuple(static_argnums, "static_argnums", where)
        argnames = _name_tuple(static_argnames, "static_argnames", where)
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none: no inference, as in jax.jit
            signature = None
        if signature is not None:
            argnums, argnames = _infer(signature, argnums, argnames, where)
        jit_nums, jit_names = _jit_static_args(fn)
        if signature is not None and (jit_nums or jit_names):
            jit_nums, jit_names = _infer(signature, jit_nums, jit_names, where)
        return cls(
            fn,
            signature,
            tuple(dict.fromkeys(argnums + jit_nums)),
            frozenset(argnames) | frozenset(jit_names),
            label,
            frozenset(jit_nums) - frozenset(argnums),
            frozenset(jit_names) - frozenset(argnames),
        )

    @property
    def where(self) -> str:
        return f"{self.label}({function_name(self.fn)})"

    def parameter_name(self, index: int) -> str:
        """The name of the ``index``-th positional argument, in the user's terms."""
        if self.signature is None:
            return f"args[{index}]"
        params = list(self.signature.parameters.values())
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        if index < len(positional):
            return positional[index]
        varargs = next(
            (p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "args"
        )
        return f"{varargs}[{index - len(positional)}]"

    def mark_static(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``/``kwargs`` with the static arguments wrapped as single hashable leaves."""
        if not self.argnums and not self.argnames:
            return args, kwargs
        at = {i + len(args) if i < 0 else i: i for i in self.argnums}
        jit = "static in your jax.jit"
        args = tuple(
            self._marked(
                a,
                self.parameter_name(i),
                jit if at[i] in self.jit_argnums else "static_argnums",
            )
            if i in at
            else a
            for i, a in enumerate(args)
        )
        kwargs = {
            k: self._marked(v, k, jit if k in self.jit_argnames else "static_argnames")
            if k in self.argnames
            else v
            for k, v in kwargs.items()
        }
        return args, kwargs

    def _marked(self, value: Any, name: str, how: str) -> _Static:
        if compat.is_tracer(value):
            raise TypeError(
                f"{self.where}: static argument '{name}' ({how}) is a traced value "
                f"({getattr(value, 'aval', value)}): an enclosing transformation traced it. "
                "Mark it static there too, e.g. jax.jit(..., static_argnames="
                f"'{name}'), or bind it with functools.partial"
            )
        marked = _Static(value)
        try:
            hash(marked)
        except TypeError as err:
            way_out = (
                # (an array is unhashable, as jax.jit finds too; a list has a hashable form)
                "An array is traced, not static: leave it out of static_argnums/"
                "static_argnames, or pass the Python value the function needs "
                f"(int({name}), tuple({name}.tolist()))"
                if isinstance(value, (jax.Array, np.ndarray))
                else "Pass a tuple instead of a list, or bind it with functools.partial"
            )
            raise TypeError(
                f"{self.where}: static argument '{name}' ({how}) must be hashable, because its "
                f"value is part of the cache key as with jax.jit's static arguments; got "
                f"{type(value).__name__} {short_repr(value)}. {way_out}"
            ) from err
        return marked

    def call_unmarked(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function with the static arguments unwrapped to their values."""
        args, kwargs = unmarked(args, kwargs)
        return self.fn(*args, **kwargs)

    def describe(self, path: Sequence[Any]) -> str:
        """A pytree path into ``(args, kwargs)`` in the user's terms: ``batch['x']``."""
        if len(path) < 2:
            return jax.tree_util.keystr(tuple(path))
        rest = jax.tree_util.keystr(tuple(path[2:]))
        if getattr(path[0], "idx", None) == 0:
            return self.parameter_name(path[1].idx) + rest
        return str(getattr(path[1], "key", path[1])) + rest


def _jit_static_args(fn: Callable) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The static arguments of a ``jax.jit``-wrapped ``fn`` (a bound method of one, or a
    ``functools.partial`` of one), counted as ``fn`` is called: jamp must pass them as Python
    values, or the inner jit would receive the tracers jamp made of them."""
    shift, bound_names = 0, frozenset[str]()
    target = fn
    if inspect.ismethod(target):
        shift, target = 1, target.__func__
    elif isinstance(target, functools.partial):
        shift, bound_names = len(target.args), frozenset(target.keywords)
        target = target.func
    static = compat.jit_static_args(target)
    if static is None:
        return (), ()
    nums, names = static
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        # Negative numbers count from the end, as many arguments as before the binding.
        nums = tuple(i - shift if i >= 0 else i for i in nums if i < 0 or i >= shift)
        return nums, tuple(n for n in names if n not in bound_names)
    # jit's numbers as the target's parameters: those the binding fills (the first ``shift``
    # positionally, a bound method's self; any by keyword) are no longer the caller's to pass.
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    at = sorted({i % len(positional) for i in nums if -len(positional) <= i < len(positional)})
    bound_names |= frozenset(positional[:shift])
    kept = tuple(i - shift for i in at if positional[i] not in bound_names)
    return kept, tuple(n for n in names if n not in bound_names)


def _unmark(value: Any) -> Any:
    return value.value if type(value) is _Static else value


def as_static(value: Any) -> _Static:
    """``value`` marked static, as ``static_argnums`` marks an argument (it is hashable)."""
    return _Static(value)


def unmarked(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` (marked by ``CallSignature.mark_static``) with the static arguments
    unwrapped to their values."""
    return tuple(_unmark(a) for a in args), {k: _unmark(v) for k, v in kwargs.items()}


def _infer(
    signature: inspect.Signature, argnums: tuple[int, ...], argnames: tuple[str, ...], where: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Validate against the signature and infer numbers from names or names from numbers."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params}
    listing = ", ".join(p.name for p in params) or "no parameters"
    if not has_varargs:
        bad = [i for i in argnums if not -len(positional) <= i < len(positional)]
        if bad:
            keyword_only = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
            by_keyword = (
                f"; {', '.join(keyword_only)} "
                f"{'is' if len(keyword_only) == 1 else 'are'} keyword-only: name "
                f"{'it' if len(keyword_only) == 1 else 'them'} in static_argnames"
                if keyword_only
                else ""
            )
            raise ValueError(
                f"{where}: static_argnums={argnums} but the function takes "
                f"{len(positional)} positional argument(s) "
                f"({', '.join(p.name for p in positional) or 'none'}{by_keyword})"
            )
        argnums = tuple(i % len(positional) for i in argnums)
    for name in argnames:
        param = by_name.get(name)
        if param is None and not has_varkw:
            raise ValueError(
                f"{where}: static_argnames names {name!r}, which is not a parameter "
                f"of the function ({listing})"
            )
        if param is not None and param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(
                f"{where}: static_argnames names {name!r}, a positional-only "
                "parameter; use static_argnums"
            )
    # As jax.jit: numbers imply names and names imply numbers, unless both are given.
    inferable = [
        (i, p.name)
        for i, p in enumerate(positional)
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    if argnums and not argnames:
        argnames = tuple(name for i, name in inferable if i in argnums)
    elif argnames and not argnums:
        argnums = tuple(i for i, name in inferable if name in argnames)
    return argnums, argnames


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_traced_leaf(leaf: Any, numbers_are_static: bool, tokens_are_static: bool = False) -> bool:
    """Arrays and effect tokens are traced (as ``jax.jit`` traces them; tokens stay static with
    ``tokens_are_static``); Python numbers too unless ``numbers_are_static``; bools, strings and
    other objects are static."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return True
    if isinstance(leaf, jax.Ref) or (compat.is_tracer(leaf) and compat.is_ref(leaf)):
        return True  # a mutable array reference (jax.new_ref), as jax.jit takes one
    if compat.is_token(leaf):
        return not tokens_are_static
    return (
        not numbers_are_static
        and type(leaf) is not bool
        and isinstance(leaf, (int, float, complex))
    )


@functools.lru_cache(maxsize=256)
def whole_argument_leaves(in_tree: Any) -> frozenset[int]:
    """Indices of the leaves of ``(args, kwargs)`` that are whole arguments (the ``0.1`` of
    ``f(x, 0.1)`` or ``f(x, lr=0.1)``), not parts of a pytree argument."""
    whole, start = [], 0
    for part in jax.tree_util.treedef_children(in_tree):  # args, then kwargs
        arguments: list[Any] = jax.tree_util.treedef_children(part)  # stubs lack num_leaves
        for arg in arguments:
            if arg.num_leaves == 1 and jax.tree_util.treedef_is_leaf(arg):
                whole.append(start)
            start += arg.num_leaves
    return frozenset(whole)


def split_leaves(
    flat: Sequence[Any],
    in_tree: Any,
    signature: CallSignature | None,
    numbers_are_static: bool,
    tokens_are_static: bool = False,
) -> tuple[list[int], tuple[tuple[int, Any], ...]]:
    """Indices of the traced leaves, and the static leaves as ``(index, value)`` pairs.

    A Python number inside a pytree argument (an Equinox module's ``Dropout.p``, a config
    field) is static, as ``equinox.filter_jit`` treats non-array leaves: library code branches
    on such values (``if self.p == 0``). Only a number passed as a whole argument follows
    ``numbers_are_static`` (traced eagerly, as ``jax.jit`` traces a learning rate).
    ``signature`` names an unhashable static leaf in the user's terms (``None``: a pytree path).
    """
    whole = whole_argument_leaves(in_tree)
    traced, static = [], []
    for i, leaf in enumerate(flat):
        if is_traced_leaf(leaf, numbers_are_static or i not in whole, tokens_are_static):
            traced.append(i)
        else:
            static.append((i, leaf))
    try:
        hash(static_key(static))
    except TypeError:
        _raise_unhashable(flat, in_tree, static, signature)
    for i, leaf in static:
        held = array_attributes(leaf)
        if held:
            _raise_holds_arrays(flat, in_tree, i, leaf, held, signature)
    return traced, tuple(static)


def array_attributes(leaf: Any) -> list[str]:
    """The attributes of an object hashed by identity that hold arrays or traced values.

    Such an object is a static leaf (not a pytree), so its arrays would become constants of the
    traced program and the cache would answer by the object's identity: a later change to them
    (``model.w = new_w``) would silently return the old program's result, and a traced value
    would leak. ``jax.jit`` refuses such an argument; a static argument marked as such
    (``static_argnums``) or an object with its own ``__hash__`` is the caller's choice and is
    left alone. Only the object's own attributes are read (one level: cheap on every call)."""
    if getattr(type(leaf), "__hash__", None) is not object.__hash__ or compat.is_token(leaf):
        return []  # (hashed by value; an effect token holds its buffer and stays itself)
    attributes = getattr(leaf, "__dict__", None)
    if not attributes or not isinstance(attributes, dict):
        return []
    return [
        name
        for name, value in attributes.items()
        if isinstance(value, jax.Array)
        or compat.is_tracer(value)
        or (isinstance(value, np.ndarray) and value.dtype.kind in "biufc")
    ]


# Iterators over a list or tuple (what a generator expression loops over: ``(v for v in [y])``
# keeps ``iter([y])``); their pickling form, ``(iter, (sequence,), ...)``, gives the sequence.
_SEQUENCE_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))
_CAPTURE_DEPTH = 4  # functions/generators deep: enough for a closure returning a closure
_FRAME_OF = {
    types.GeneratorType: "gi_frame",
    types.CoroutineType: "cr_frame",
    types.AsyncGeneratorType: "ag_frame",
}
_ITERABLE_NAME = "<iterable>"  # a generator expression's local '.0', the iterable it loops over


def _captured_values(value: Any) -> list[tuple[str, Any]]:
    """What a function, ``functools.partial``, generator or coroutine holds on to, by name: a
    function's closure cells and default arguments, a partial's function and arguments, a
    not-finished generator's (coroutine's) local variables, an iterator's list or tuple."""
    if isinstance(value, types.FunctionType):
        code = value.__code__
        held = []
        for name, cell in zip(code.co_freevars, value.__closure__ or ()):
            try:
                held.append((name, cell.cell_contents))
            except ValueError:  # (a variable not assigned yet)
                continue
        positional = code.co_varnames[: code.co_argcount]
        defaults = value.__defaults__ or ()
        held += zip(positional[len(positional) - len(defaults) :], defaults)
        return held + list((value.__kwdefaults__ or {}).items())
    if isinstance(value, functools.partial):
        arguments = [(f"args[{i}]", a) for i, a in enumerate(value.args)]
        return [("func", value.func), *arguments, *value.keywords.items()]
    frame = getattr(value, _FRAME_OF[type(value)]) if type(value) in _FRAME_OF else None
    if frame is not None:
        return [
            (_ITERABLE_NAME if name == ".0" else name, held)
            for name, held in dict(frame.f_locals).items()
        ]
    if type(value) in _SEQUENCE_ITERATORS:
        return [("", value.__reduce__()[1][0])]
    return []


def is_generator_like(value: Any) -> bool:
    """A generator, coroutine or async generator: a pytree leaf (JAX warns, flattening one)."""
    return type(value) in _FRAME_OF


def _holds_captures(value: Any) -> bool:
    return (
        isinstance(value, (types.FunctionType, functools.partial))
        or type(value) in _FRAME_OF
        or type(value) in _SEQUENCE_ITERATORS
    )


def traced_captures(leaf: Any, is_traced: Callable[[Any], bool]) -> list[str]:
    """The values ``is_traced`` picks that a function or generator ``leaf`` captured, by name
    (``h``, ``cache['k']``, ``inner.y`` for the ``y`` a captured function ``inner`` captured):
    its closure cells, default arguments or frame locals, followed through pytrees and into the
    functions, partials, generators and list iterators they hold, a few levels deep."""
    found: list[str] = []
    seen: set[int] = set()

    def visit(value: Any, where: str, depth: int) -> None:
        if is_traced(value):
            aval = compat.aval_of(value)
            found.append(f"{where}: {aval.dtype.name}{list(aval.shape)}")
        elif _holds_captures(value):
            if depth < _CAPTURE_DEPTH and id(value) not in seen:
                seen.add(id(value))
                for name, held in _captured_values(value):
                    visit(held, f"{where}.{name}" if where and name else where or name, depth + 1)
        elif not isinstance(value, Iterator):  # (JAX warns flattening an iterator: a leaf)
            leaves = jax.tree_util.tree_flatten_with_path(
                value, is_leaf=lambda x: x is not value and isinstance(x, Iterator)
            )[0]
            if not (len(leaves) == 1 and leaves[0][1] is value):  # (else not a container)
                for keys, held in leaves:
                    visit(held, where + jax.tree_util.keystr(keys), depth)

    visit(leaf, "", 0)
    return found


def _raise_holds_arrays(
    flat: Sequence[Any],
    in_tree: Any,
    i: int,
    leaf: Any,
    held: list[str],
    signature: CallSignature | None,
) -> None:
    name = _leaf_name(flat, in_tree, i, signature)
    where = signature.where if signature is not None else "autocast_transform"
    kind = type(leaf).__name__
    attributes = ", ".join(f".{a}" for a in held)
    raise TypeError(
        f"{where}: argument {name} is a {kind} holding arrays ({attributes}) but it is not a "
        f"pytree, so it would be a static value: its arrays baked into the program as "
        f"constants and a later change to them not seen (the cache answers by the object's "
        f"identity). Register {kind} as a pytree (jax.tree_util.register_dataclass, "
        f"register_pytree_node_class, flax.struct.dataclass) or pass its arrays as arguments; "
        f"to keep them constant on purpose, bind it with functools.partial or mark it static "
        f"(static_argnums)"
    )


def static_key(static: Sequence[tuple[int, Any]]) -> tuple[Any, ...]:
    """Static leaves as a cache key; the type is part of it (``1`` and ``1.0`` differ), and a
    float is keyed by its bits: ``0.0 == -0.0`` (one program returned the other's signs), and a
    NaN equals nothing (every call missed the cache and added an entry)."""
    return tuple((i, type(leaf), leaf.hex() if type(leaf) is float else leaf) for i, leaf in static)


def _leaf_name(flat: Sequence[Any], in_tree: Any, i: int, signature: CallSignature | None) -> str:
    """Leaf ``i`` of ``(args, kwargs)`` in the user's terms: ``batch['ids']``."""
    path = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(in_tree, flat))[0][i][0]
    return signature.describe(path) if signature is not None else jax.tree_util.keystr(path)


def _raise_unhashable(
    flat: Sequence[Any],
    in_tree: Any,
    static: Sequence[tuple[int, Any]],
    signature: CallSignature | None,
) -> None:
    for i, leaf in static:
        try:
            hash(leaf)
        except TypeError as err:
            name = _leaf_name(flat, in_tree, i, signature)
            where = signature.where if signature is not None else "autocast_transform"
            raise TypeError(
                f"{where}: argument {name} is a {type(leaf).__name__}, neither an array nor a "
                "hashable static value; pass an array or a hashable value (a tuple instead of "
                "a list), or bind it with functools.partial before transforming"
            ) from err


def check_traceable(
    flat: Sequence[Any],
    in_tree: Any,
    traced_at: Sequence[int],
    signature: CallSignature | None,
    where: str,
) -> None:
    """Refuse, naming the argument, a traced leaf JAX cannot trace: a numpy array of strings or
    Python objects, or a jax.Array of strings (numpy's StringDType, which JAX stores but does
    not run: it traces one, and refuses it when it runs the program). ``jax.jit`` refuses them
    too, without naming the function (nor, for a string jax.Array, the argument). Called where
    JAX would refuse one, not on every call: the arguments' types cost a call per leaf."""
    for i in traced_at:
        leaf = flat[i]
        try:
            dtype = getattr(compat.aval_of(leaf), "dtype", None)
        except TypeError:
            dtype = getattr(leaf, "dtype", None)
        else:
            if not compat.is_string_dtype(dtype):
                continue
        kind = (
            "a jax.Array"
            if isinstance(leaf, jax.Array)
            else f"a {type(leaf).__module__}.{type(leaf).__name__}"
        )
        raise TypeError(
            f"{where}: argument {_leaf_name(flat, in_tree, i, signature)} is {kind} of dtype "
            f"{dtype}, which JAX cannot trace (jax.jit refuses it too): JAX traces arrays of "
            "numbers and booleans. Pass its numeric encoding, or keep it out of the function's "
            "arguments"
        )
