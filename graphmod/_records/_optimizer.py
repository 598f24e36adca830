"""Recording optax optimizers: ``graphmod.provenance.optimizer(name, ...)``."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

import optax

from graphmod._core._construction import CONFIG, Encoder, encode_arguments


class _Recorded:
    """The recorded configuration, kept as JSON text in the instance's ``__dict__``."""

    @property
    def config(self) -> dict[str, Any]:
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

    def __init__(self, schedule: Any, record: dict[str, Any]) -> None:
        self._schedule = schedule
        self.__dict__[CONFIG] = json.dumps(record)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._schedule(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RecordedSchedule({self.config['name']!r})"


def optax_factory(name: Any) -> Any:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"optimizer({name!r}): expected the name of an optax function, "
                         "e.g. 'adam' or 'sgd'")
    factory = getattr(optax, name, None)
    if factory is None or not callable(factory) or isinstance(factory, type):
        raise ValueError(f"optimizer({name!r}): optax has no function {name!r} (see "
                         "https://optax.readthedocs.io/en/latest/api/optimizers.html)")
    return factory


def optimizer(name: str, *args: Any, **kwargs: Any) -> Any:
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


def config_record(name: str, factory: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict:
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


def optimizer_record(tx: Any, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the training provenance says about ``tx``: its recorded configuration, the
    explicit ``config``, or its type alone."""
    if config is not None:
        if not isinstance(config, Mapping) or not isinstance(config.get("name"), str):
            raise TypeError("optimize(config=...): expected a dict with the optimizer's "
                            "'name' and its hyperparameters, e.g. {'name': 'adam', "
                            f"'learning_rate': 1e-3}}; got {config!r}")
        encode = Encoder(by_path=False)
        return {"name": config["name"], "source": "explicit",
                "arguments": {k: encode(v) for k, v in config.items() if k != "name"}}
    recorded = vars(tx).get(CONFIG) if hasattr(tx, "__dict__") else None
    if recorded is not None:
        return {**json.loads(recorded), "source": "graphmod.provenance.optimizer"}
    return {"name": None, "source": "unrecorded",
            "type": f"{type(tx).__module__}.{type(tx).__qualname__}"}
