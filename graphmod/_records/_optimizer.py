"""Recording optax optimizers: ``graphmod.provenance.optimizer(name, ...)``."""

from __future__ import annotations

import inspect
import json
import types
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optax

from graphmod._core._bricks._construction import CONFIG, Encoder, encode_arguments
from graphmod.typing import JSON


class _Recorded:
    """The recorded configuration, kept as JSON text in the instance's ``__dict__``."""

    @property
    def config(self) -> dict[str, Any]:  # JSON read back, navigated by its known keys
        """``{"name": ..., "arguments": ..., "defaults": ...}`` as recorded."""
        return json.loads(vars(self)[CONFIG])

    @property
    def _graphmod_optimizer(self) -> str:
        return vars(self)[CONFIG]


class RecordedTransformation(_Recorded, optax.GradientTransformationExtraArgs):
    """An optax transformation that remembers how it was made (see :func:`optimizer`)."""


class RecordedSchedule(_Recorded):
    """An optax schedule (or any optax function's callable result) that remembers how it
    was made; calls the schedule."""

    def __init__(self, schedule: Callable[..., object], record: Mapping[str, JSON]) -> None:
        self._schedule = schedule
        self.__dict__[CONFIG] = json.dumps(record)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # optax's: what the schedule takes
        return self._schedule(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RecordedSchedule({self.config['name']!r})"


def optax_factory(name: object) -> Callable[..., object]:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"optimizer({name!r}): expected the name of an optax function, "
                         "e.g. 'adam' or 'sgd'")
    factory = getattr(optax, name, None)
    if factory is None or not callable(factory) or isinstance(factory, type):
        raise ValueError(f"optimizer({name!r}): optax has no function {name!r} (see "
                         "https://optax.readthedocs.io/en/latest/api/optimizers.html)")
    return factory


def optimizer(name: str, *args: object, **kwargs: object) -> Any:  # its type: by the name
    """``optax.<name>(*args, **kwargs)``, with its name and arguments recorded.

    :func:`graphmod.optimize` puts the record in the training provenance, and
    ``graphmod.rebuild`` makes the same optimizer again. Arguments may be numbers, strings,
    other recorded optimizers (``optimizer("chain", optimizer(...), ...)``) or public
    public functions; anything else is recorded as opaque. Schedules are recorded the same
    way: ``optimizer("exponential_decay", 0.1, 100, 0.5)`` returns a recorded schedule to
    pass as a learning rate. An optimizer made without this helper is recorded by type
    only, unless ``optimize(..., config=)`` describes it.

    Args:
        name: an optax function returning a gradient transformation (``"adam"``, ``"sgd"``,
            ``"chain"``, ``"clip_by_global_norm"``, ...).
        *args, **kwargs: its arguments.

    Returns:
        The optax transformation (an ``optax.GradientTransformationExtraArgs``), or the
        schedule, with a ``config`` property.

    Examples:
        >>> import optax, graphmod as gm
        >>> tx = gm.provenance.optimizer("adam", learning_rate=1e-3)
        >>> isinstance(tx, optax.GradientTransformation), tx.config["arguments"]
        (True, {'learning_rate': 0.001})
        >>> gm.provenance.optimizer("chain", gm.provenance.optimizer("clip", 1.0), tx
        ...                         ).config["arguments"]["args"][0]["$optimizer"]["name"]
        'clip'
    """
    factory = optax_factory(name)
    made = factory(*args, **kwargs)
    record = config_record(name, factory, args, kwargs)
    if not isinstance(made, optax.GradientTransformation):
        if not callable(made):
            raise TypeError(f"optimizer({name!r}): optax.{name} returned "
                            f"{type(made).__name__}, neither a gradient transformation nor "
                            "a schedule")
        return RecordedSchedule(made, record)
    # Recorded as one taking extra arguments (optax.chain passes them on): a plain one's
    # update gets optax's wrapper that drops them.
    made = optax.with_extra_args_support(made)
    out = RecordedTransformation(made.init, made.update)
    object.__setattr__(out, CONFIG, json.dumps(record))
    return out


def config_record(name: str, factory: Callable[..., object], args: tuple[object, ...],
                  kwargs: Mapping[str, object]) -> dict[str, JSON]:
    """The recorded configuration of ``factory(*args, **kwargs)`` named ``name``."""
    encode = Encoder(by_path=False)
    try:
        bound = inspect.signature(factory).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {"name": name, "arguments": {"args": [encode(a) for a in args],
                                            **{k: encode(v) for k, v in kwargs.items()}}}
    arguments, defaults = encode_arguments(
        list(inspect.signature(factory).parameters.values()), bound, encode, encode)
    return {"name": name, "arguments": arguments, "defaults": defaults}


def optimizer_record(tx: object, config: Mapping[str, object] | None) -> dict[str, JSON]:
    """What the training provenance says about ``tx``: its recorded configuration, the
    explicit ``config``, or its type alone."""
    if config is not None:
        name = config.get("name") if isinstance(config, Mapping) else None
        if not isinstance(name, str):
            raise TypeError("optimize(config=...): expected a dict with the optimizer's "
                            "'name' and its hyperparameters, e.g. {'name': 'adam', "
                            f"'learning_rate': 1e-3}}; got {config!r}")
        encode = Encoder(by_path=False)
        return {"name": name, "source": "explicit",
                "arguments": {k: encode(v) for k, v in config.items() if k != "name"}}
    recorded = vars(tx).get(CONFIG) if hasattr(tx, "__dict__") else None
    if recorded is not None:
        return {**json.loads(recorded), "source": "graphmod.provenance.optimizer"}
    return {"name": None, "source": "unrecorded",
            "type": f"{type(tx).__module__}.{type(tx).__qualname__}",
            "structure": structure(tx)}


_DEEPEST = 12  # closures nested deeper than this are cut ("...")
_LONGEST = 2000  # a longer description is cut, and ends with its full text's CRC-32


def structure(tx: object) -> str:
    """What an optax transformation made without :func:`optimizer` is, read from its
    functions' closures: each optax function by name with the numbers, strings and
    transformations it closed over, wrappers that only pass on another transformation
    left out. Not a record to rebuild from: it tells two optimizers apart (another learning
    rate, adam against adamw), so that a run resumed with another one says so.

    Examples:
        >>> import optax
        >>> from graphmod._records._optimizer import structure
        >>> structure(optax.sgd(0.1))
        'chain(update_fns=[identity(), scale(step_size=-0.1)])'
        >>> structure(optax.adam(1e-2)) == structure(optax.adam(1e-1))
        False
    """
    text = _described(tx, 0)
    if len(text) <= _LONGEST:
        return text
    return f"{text[:_LONGEST]}... (crc32 {zlib.crc32(text.encode()):08x})"


def _described(value: object, depth: int) -> str:
    """One value closed over by an optax function, described for :func:`structure`."""
    if depth > _DEEPEST:
        return "..."
    if isinstance(value, optax.GradientTransformation):
        return _described(value.update, depth + 1)  # its update closes over what it uses
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_described(v, depth + 1) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_described(v, depth + 1)}"
                               for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))\
            + "}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # an array: small ones by value
        array = np.asarray(value)
        return f"{array.dtype}{array.tolist() if array.size <= 16 else list(array.shape)}"
    if inspect.isfunction(value):
        return _function(value, depth)
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _function(fn: types.FunctionType, depth: int) -> str:
    """An optax function by name with what it closed over; another by its import path."""
    if not (fn.__module__ or "").startswith("optax"):
        return f"{fn.__module__}.{fn.__qualname__}"
    closed = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            closed.append((name, cell.cell_contents))
        except ValueError:  # a cell not filled yet
            continue
    if len(closed) == 1 and (inspect.isfunction(closed[0][1])
                             or isinstance(closed[0][1], optax.GradientTransformation)):
        return _described(closed[0][1], depth + 1)  # a wrapper (with_extra_args_support)
    arguments = ", ".join(f"{name}={_described(value, depth + 1)}" for name, value in closed)
    return f"{fn.__qualname__.split('.<locals>')[0]}({arguments})"
