"""``nnx.Rngs`` arguments of a program's function, as Flax's tutorials pass them to a loss
that draws its own noise (``loss_fn(model, x, rngs)``: timesteps and noise of a diffusion
model).

An argument that was an ``nnx.Rngs`` in ``init``'s example is a random stream argument. In
training (``program.train``, a train step, the loop) it may be left out: graphmod passes an
``nnx.Rngs`` with the example's streams, each keyed by ``fold_in(key, crc32(...))`` of the
call's key and the argument's and stream's names, so every step draws fresh numbers, set
by ``step.init``'s key and the same on a resumed run, and a loop's batches need only hold
the data.

Sharp edges
    An ``nnx.Rngs`` that is passed is used as it is, rebuilt inside the trace (drawing
    counts, and the count of an object from outside a differentiated function cannot
    change): passing the same one to every call draws the same numbers, as under
    ``jax.jit``, and its count is not advanced outside. ``infer`` has no key: there it
    must be passed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax
from flax import nnx

from graphmod._core._tracing._frame import crc32
from graphmod.typing import AxisName, PyTree

__all__ = ["with_random_streams"]

T = TypeVar("T")


def with_random_streams(fn: Callable[..., object], examples: Mapping[str, PyTree],
                        args: tuple[PyTree, ...], kwargs: dict[str, PyTree],
                        key: jax.Array | None, where: str, axis_name: AxisName | None = None
                        ) -> tuple[tuple[PyTree, ...], dict[str, PyTree]]:
    """``(args, kwargs)`` with each ``nnx.Rngs`` argument left out made from ``key`` and
    each given one rebuilt in the current trace; a ``TypeError`` naming ``where`` and the
    argument when one is left out and there is no key (``infer``). With ``axis_name``
    (``compile(axis_name=...)``, under ``shard_map`` or ``pmap``) each device's index is
    folded in too, as ``call.rng()`` folds it: every device draws its own numbers.

    Examples:
        >>> import jax
        >>> from flax import nnx
        >>> def cost(model, x, rngs): ...
        >>> _, kwargs = with_random_streams(cost, {"rngs": nnx.Rngs(0)}, (1.0,), {},
        ...                                 jax.random.key(0), "program.train")
        >>> type(kwargs["rngs"]).__name__, kwargs["rngs"].default.count[...].item()
        ('Rngs', 0)
    """
    streams = {name: _stream_names(example) for name, example in examples.items()
               if isinstance(example, nnx.Rngs) and _takes(fn, name)}
    if not streams:  # none, or a derived function that takes none of them
        return args, kwargs
    args, kwargs = _rebuilt((args, kwargs))
    try:
        bound = inspect.signature(fn).bind_partial(None, *args, **kwargs).arguments
    except (TypeError, ValueError):  # check_binds names what does not bind
        return args, kwargs
    missing = {name: names for name, names in streams.items() if name not in bound}
    if not missing:
        return args, kwargs
    if key is None:
        raise TypeError(f"{where}: argument {next(iter(missing))!r} (an nnx.Rngs in init's "
                        "example) is made from the key only in training; pass one here, "
                        "e.g. nnx.Rngs(0), or None if the function draws nothing then")
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return args, {**kwargs, **{name: nnx.Rngs(**{
        stream: jax.random.fold_in(key, crc32(f"argument|{name}|{stream}"))
        for stream in names}) for name, names in missing.items()}}


def _takes(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` has an argument ``name`` (or ``**kwargs``): a function derived from
    the compiled one may drop the compiled function's ``rngs``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: passed as the example was
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _stream_names(rngs: nnx.Rngs) -> tuple[str, ...]:
    return tuple(sorted(name for name, value in vars(rngs).items()
                        if isinstance(value, nnx.RngStream)))


def _rebuilt(tree: T) -> T:
    """``tree`` with its Flax objects made anew here: an ``nnx.Rngs`` made in an outer
    trace (the step's ``jax.jit``) cannot count its draws in an inner one (its
    ``jax.grad``); Flax refuses with ``TraceContextError``."""
    return jax.tree.map(lambda leaf: leaf, tree)
