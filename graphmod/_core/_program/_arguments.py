"""Checks of what users pass to programs, with errors that name the culprit."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from graphmod._core._model._layout import Key
from graphmod.typing import PyTree, Shape

Spec = tuple[tuple[int, ...], str]  # (shape, canonical dtype name)
K = TypeVar("K")  # how leaves are keyed: a key path, an identity


def flat_leaves(tree: object, prefix: Key = ()) -> dict[Key, object]:
    """The leaves of a nested dict by key path."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    leaves: dict[Key, object] = {}
    for key, value in tree.items():
        leaves.update(flat_leaves(value, (*prefix, key)))
    return leaves


def flat_keys(tree: object) -> set[Key]:
    """The key paths of the leaves of a nested dict."""
    return set(flat_leaves(tree))


def tree_difference(expected: set[Key], actual: set[Key]) -> tuple[list[str], list[str]]:
    """``(missing, extra)`` key paths, as readable strings, sorted."""
    show = lambda keys: sorted("/".join(map(str, k)) for k in keys)
    return show(expected - actual), show(actual - expected)


@functools.lru_cache(maxsize=256)  # a trace checks every variable: a few dtypes, many times
def canonical_dtype(dtype: DTypeLike) -> str:
    """The name of the dtype a value of ``dtype`` has inside ``jit`` (float64 becomes
    float32 without x64; weak types count as their dtype; '' stays unknown)."""
    if dtype == "":
        return ""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:  # an extended dtype's name, e.g. 'key<fry>'
        return str(dtype)
    return str(jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True))


def dtype_of(value: object) -> DTypeLike:
    """The dtype of an array, a tracer, a ShapeDtypeStruct (its own, read directly) or a
    Python number (``jnp.result_type``'s)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and (isinstance(dtype, np.dtype)
                              or jnp.issubdtype(dtype, jax.dtypes.extended)):
        return dtype
    return jnp.result_type(value)


def shape_of(value: object) -> Shape:
    """``np.shape(value)``: the shape of an array, a tracer or a ShapeDtypeStruct (its
    own), else of what NumPy makes of it (``()`` for a number)."""
    if isinstance(value, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return tuple(value.shape)
    return np.asarray(value).shape


def spec(value: object) -> Spec:
    """The shape and canonical dtype of an array, a tracer or a ShapeDtypeStruct."""
    return shape_of(value), canonical_dtype(dtype_of(value))


def spec_differences(found: Mapping[K, object], expected: Mapping[K, Spec],
                     name: Callable[[K], str]) -> list[str]:
    """One line per leaf of ``found`` whose shape or dtype differs from ``expected``'s
    (leaves ``expected`` lacks are not compared; a '' dtype is not compared)."""
    lines = []
    for key, value in found.items():
        if key not in expected:
            continue
        (want_shape, want_dtype), (shape, dtype) = expected[key], spec(value)
        want_dtype = canonical_dtype(want_dtype)
        if shape != tuple(want_shape) or (want_dtype and dtype != want_dtype):
            lines.append(f"{name(key)} has shape {shape} and dtype {dtype}; expected "
                         f"{tuple(want_shape)} and {want_dtype or 'any dtype'}")
    return lines


def is_key(value: object) -> bool:
    """Whether ``value`` (an array, a tracer, an abstract value) holds typed PRNG keys.

    Examples:
        >>> import jax
        >>> from graphmod._core._program._arguments import is_key
        >>> is_key(jax.random.key(0)), is_key(jax.random.key_data(jax.random.key(0)))
        (True, False)
    """
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def as_key(rng: object, where: str, args: tuple[PyTree, ...] = ()) -> jax.Array:
    """``rng`` as one typed PRNG key (a key, or its ``jax.random.key_data``), else an error
    naming ``rng`` and the fix (``args``: the call's positional arguments, a key among
    them passed where ``rng=`` was meant)."""
    if rng is None:
        slip = next((i for i, a in enumerate(args) if isinstance(a, jax.Array) and is_key(a)
                     and a.ndim == 0), None)
        raise TypeError(f"{where}: rng is required, e.g. rng=jax.random.key(0)" + (
            f"; the function's argument {slip + 1} is a key: pass it as rng=key instead"
            if slip is not None else ""))
    try:
        dtype = jnp.result_type(rng)
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            key = rng if isinstance(rng, jax.Array) else None  # typed keys are JAX arrays
        elif dtype == jnp.uint32:
            key = jax.random.wrap_key_data(jnp.asarray(rng))
        else:
            raise TypeError
    except (TypeError, ValueError):
        key = None
    if key is None or np.shape(key) != ():
        raise TypeError(
            f"{where}: rng must be one JAX random key, e.g. rng=jax.random.key(0) (or its "
            f"jax.random.key_data), got {_describe(rng)}")
    return key


def has_shape(value: object) -> bool:
    """Whether ``value`` is array-like: a tuple ``shape`` and a ``dtype`` (an ``nnx.Rngs``
    answers any attribute, ``shape`` with a stream)."""
    return isinstance(getattr(value, "shape", None), tuple) and hasattr(value, "dtype")


def _describe(value: object) -> str:
    """A short description of a value for error messages."""
    if has_shape(value):
        shape, dtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        return f"an array of shape {tuple(shape)} and dtype {dtype}"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def check_arguments(examples: Mapping[str, PyTree], actual: Mapping[str, PyTree],
                    own: bool = True) -> None:
    """Compares traced arguments with ``init``'s examples: ranks, feature sizes, dtypes,
    and the leading (batch) sizes of the arguments that shared one in the examples.
    Examples of another function (not ``own``: a derived program's, checked against the
    cost's) are skipped where the structure differs: an argument of the same name that is
    another thing (the cost's ``batch`` a pair, the predictor's the inputs).

    The leading (batch) dimension and the middle ones (time, space) may differ; the rank,
    the last (feature) dimension and the canonical dtype must match. Integer and boolean
    arguments (token ids, labels, indices, masks) have no feature axis: any length fits.
    """
    batched: dict[int, list[tuple[str, int]]] = {}  # init's leading size → (where, size)
    for name, example in examples.items():
        if name not in actual or (actual[name] is None and isinstance(example, nnx.Rngs)):
            continue  # rngs=None: Flax's way to say a call draws nothing (evaluation)
        got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(actual[name])
        want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(example)
        if got_tree != want_tree:
            if not own:
                continue
            raise ValueError(
                f"argument {name!r}: expected {_structure(example, want_tree)} as in "
                f"init's example, got {_structure(actual[name], got_tree)}; pass the same "
                "structure (only array shapes along the batch may change)")
        # Another program's variables (a model another loop step reads) are not batched.
        variables = isinstance(example, Mapping) and set(example) == {"model", "managers"}
        for (path, got), (_, want) in zip(got_leaves, want_leaves, strict=True):
            where = f"argument {name!r}{jax.tree_util.keystr(path)}"
            (got_shape, got_dtype), want_shape = spec(got), tuple(want.shape)
            want_dtype = canonical_dtype(want.dtype)
            features = _has_features(want_dtype)
            fits = (len(got_shape) == len(want_shape) and got_dtype == want_dtype
                    and (len(want_shape) < 2 or not features
                         or got_shape[-1] == want_shape[-1]))
            if not fits:
                expected = _expected_shape(want_shape, features)
                raise ValueError(
                    f"{where}: expected shape {expected} and dtype {want_dtype} (as in "
                    f"init's example), got shape {got_shape} and dtype {got_dtype}"
                    + _mismatch_hint(got_shape, got_dtype, want_shape, want_dtype))
            if want_shape and not variables:
                batched.setdefault(want_shape[0], []).append((where, got_shape[0]))
    for size, group in batched.items():
        check_leading_sizes(group, f"init's example gave them all {size}")


def _structure(value: object, tree: object) -> str:
    """A tree's structure in a line: its container and leaves, or what the value is."""
    if isinstance(value, Mapping | list | tuple):
        text = str(tree).removeprefix("PyTreeDef(")[:-1]
        return f"a {type(value).__name__} {text[:100]}{'...' if len(text) > 100 else ''}"
    return "an nnx.Rngs" if isinstance(value, nnx.Rngs) else _describe(value)


def _mismatch_hint(got_shape: Shape, got_dtype: str, want_shape: Shape, want_dtype: str
                   ) -> str:
    """The likely slip behind a mismatch: a raw key for a typed one, one example for a
    batch."""
    if str(want_dtype).startswith("key<") and tuple(got_shape[-1:]) == (2,):
        return ("; a raw uint32 key (jax.random.PRNGKey): pass jax.random.key(seed), or "
                "jax.random.wrap_key_data(raw)")
    if tuple(got_shape) == tuple(want_shape[1:]):
        return ("; one example rather than a batch? Batch the data, e.g. "
                "graphmod.data.ArraySource((x, y), batch_size=64)")
    return ""


def check_leading_sizes(group: list[tuple[str, int]], why: str) -> None:
    """Raises when the leading sizes of ``group`` (``(where, size)`` pairs) disagree."""
    if len({size for _, size in group}) > 1:
        shown = ", ".join(f"{where} has {size} rows" for where, size in group)
        raise ValueError(
            f"the arguments disagree on their leading (batch) dimension: {shown} ({why}). "
            "Pass the same number of rows in each. If one of them is not batched (e.g. a "
            "per-feature array as long as init's batch), call init with another batch size")


def _has_features(dtype: str) -> bool:
    """Whether arrays of ``dtype`` have a feature axis (floats do; integers, booleans and
    keys hold ids, labels, indices, masks: any length fits)."""
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.inexact))
    except TypeError:  # an extended dtype (a typed PRNG key)
        return False


def _expected_shape(shape: tuple[int, ...], features: bool = True) -> str:
    """``(batch, *, 4)``: the leading and middle dimensions may vary, the last (feature)
    one may not; ``(batch, *)`` where there is no feature axis."""
    if not shape:
        return "()"
    if not features:
        return "(batch" + ", *" * (len(shape) - 1) + ")"
    middle = ", *" * (len(shape) - 2)
    last = f", {shape[-1]}" if len(shape) >= 2 else ""
    return f"(batch{middle}{last})"


def argument_names(fn: Callable[..., object]) -> list[str]:
    """The names of a model function's positional arguments after the model.

    Examples:
        >>> argument_names(lambda model, x, y=0: None)
        ['x', 'y']
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[1:]


def check_traceable(bound: Mapping[str, PyTree], where: str) -> None:
    """Raises a TypeError naming the first leaf of ``bound`` (``bind_arguments``' dict)
    that jit cannot trace (a string, an object), and the fix.

    Examples:
        >>> check_traceable({"x": [1.0, 2]}, "program.init")
        >>> try:
        ...     check_traceable({"x": 1.0, "mode": "fast"}, "program.init")
        ... except TypeError as error:
        ...     print(str(error)[:59])
        program.init: argument 'mode' is 'fast' (str), not an array
    """
    for name, value in bound.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            try:
                jax.typeof(leaf)
            except TypeError:
                raise TypeError(
                    f"{where}: argument {name!r}{jax.tree_util.keystr(path)} is "
                    f"{_describe(leaf)}, not an array or a number: a program traces its "
                    "arguments as arrays. Pass Python values (flags, options, names) in "
                    "the function instead: compile(functools.partial(fn, "
                    f"{name}=...), model), or program.derive(lambda model, x: fn(model, x, "
                    f"{name}=...)) for one program per value") from None


def check_binds(fn: Callable[..., object], args: tuple[PyTree, ...],
                kwargs: Mapping[str, PyTree], where: str) -> None:
    """Raises a TypeError naming ``fn``'s signature, what it was given and the fix, unless
    ``fn(model, *args, **kwargs)`` binds (a dict batch's keys that are not its arguments).

    Examples:
        >>> def cost(model, x, y): ...
        >>> check_binds(cost, (), {"x": 1, "y": 2}, "step")
        >>> try:
        ...     check_binds(cost, (), {"x": 1, "label": 2}, "step")
        ... except TypeError as error:
        ...     print(str(error)[:72])
        step: cost(model, x, y) cannot take keyword arguments ['label', 'x'] (mi
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (a builtin): the call will tell
        return
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__name__", type(fn).__name__)
        names = ", ".join({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
                          for p in signature.parameters.values())
        given = " and ".join(part for part in (
            f"{len(args)} positional arguments" if args else "",
            f"keyword arguments {sorted(kwargs)}" if kwargs else "") if part) or "no arguments"
        raise TypeError(
            f"{where}: {name}({names}) cannot take {given} ({error}). A dict batch is "
            f"passed by name and a tuple by position: name the data's fields after "
            f"{name}'s arguments after the model, or give {name} a **kwargs argument for "
            "fields it does not use") from None


def bind_arguments(names: list[str], args: tuple, kwargs: dict,
                   leaf: Callable[[object], object]) -> dict[str, PyTree]:
    """``{argument name: leaf mapped over its value}`` of a call (``args[i]`` past the
    named ones).

    Examples:
        >>> bind_arguments(["x"], (1, 2), {"y": 3}, lambda v: v * 10)
        {'x': 10, 'args[1]': 20, 'y': 30}
    """
    bound: dict[str, PyTree] = {}
    for index, value in enumerate(args):
        name = names[index] if index < len(names) else f"args[{index}]"
        bound[name] = jax.tree.map(leaf, value)
    for name, value in kwargs.items():
        bound[name] = jax.tree.map(leaf, value)
    return bound
