"""Automatic capture of constructor configuration for bricks and managers.

``Brick.__new__`` and ``Manager.__new__`` call :func:`record_construction`: each
construction records the class's public import path, the arguments as passed (bound to
the parameter names of its ``__init__``) and the defaults of the others, as JSON. The
record is stored on the instance as a plain string attribute — no NNX variable, so
``nnx.state`` is unchanged, and ``nnx.clone``/``copy.deepcopy`` keep it.

Values are encoded as JSON, tagged where JSON has no type of its own: ``{"$tuple": [...]}``,
``{"$role": ...}``, ``{"$dynamic": 0.5}``, ``{"$callable": "jax.nn.relu"}``,
``{"$call": {"function": "jax.nn.initializers.variance_scaling", "kwargs": ...}}`` (an
initializer made by a factory), ``{"$rngs": ...}`` (each stream's key data and count as they
were at construction), ``{"$brick": <config>}`` (a brick argument of a brick),
``{"$brick_instance": i}`` (a brick named by a manager: recorded by path at compile), and
``{"$opaque": ...}`` for what cannot be rebuilt (lambdas, traced values, large arrays).
Each tag is one class of :mod:`graphmod._core._codec`; :class:`Encoder` offers a value to
them in order.
"""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.core import Tracer

from graphmod._core._codec import ENCODERS, SKIP, class_path, key_data_record, opaque
from graphmod._core._program._arguments import is_key

if TYPE_CHECKING:
    from graphmod.typing import JSON

CONFIG = "_graphmod_config"
BRICK_REFS = "_graphmod_config_bricks"


def key_record(value: object) -> dict[str, JSON] | None:
    """``{"impl": ..., "data": [...]}`` of a typed key or raw uint32 key data, or None.

    Examples:
        >>> import jax
        >>> from graphmod._core._bricks._construction import key_record
        >>> key_record(jax.random.key(0))
        {'impl': 'threefry2x32', 'data': [0, 0]}
    """
    if value is None or isinstance(value, Tracer):
        return None
    if isinstance(value, jax.Array) and is_key(value):
        return key_data_record(value)
    data = np.asarray(value)
    if data.dtype == np.uint32:
        return key_data_record(jax.random.wrap_key_data(jnp.asarray(data)))
    return None


class Encoder:
    """Encodes constructor arguments as tagged JSON (see the module docstring).

    ``by_path=True`` (managers) records brick instances as ``{"$brick_instance": i}``,
    keeping the instances in :attr:`bricks` to be resolved to paths at compile.

    Examples:
        >>> import jax
        >>> from graphmod._core._bricks._construction import Encoder
        >>> Encoder(by_path=False)((1, jax.nn.relu, None))
        {'$tuple': [1, {'$callable': 'jax.nn.relu'}, None]}
    """

    def __init__(self, *, by_path: bool) -> None:
        self.by_path = by_path
        self.bricks: list[object] = []

    def __call__(self, value: object) -> JSON:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int) and not isinstance(value, enum.Enum):
            return int(value)
        if isinstance(value, list | nnx.List):
            return [self(v) for v in value]
        for tag in ENCODERS:
            encoded = tag.encode(value, self)
            if encoded is not SKIP:
                return encoded
        return opaque("callable" if callable(value) else "value", value)

    def brick(self, brick: object) -> JSON:
        """A brick given as a value: by its place (managers) or its recorded construction."""
        if self.by_path:
            for index, seen in enumerate(self.bricks):
                if seen is brick:
                    return {"$brick_instance": index}
            self.bricks.append(brick)
            return {"$brick_instance": len(self.bricks) - 1}
        config = vars(brick).get(CONFIG)
        if config is None:
            return opaque("brick", brick, reason="its construction was not recorded")
        return {"$brick": json.loads(config)}


def construction_config(cls: type, init: Callable[..., object], instance: object,
                        args: tuple[object, ...], kwargs: dict[str, object], *,
                        by_path: bool) -> tuple[str, tuple[object, ...]]:
    """``(config JSON, brick instances)`` of the call ``cls(*args, **kwargs)`` whose
    ``__init__`` is ``init``."""
    encode = Encoder(by_path=by_path)
    record: dict[str, JSON] = {"class": class_path(cls)}
    try:
        signature = inspect.signature(init)
        bound = signature.bind(instance, *args, **kwargs)
    except (TypeError, ValueError) as error:  # the call itself will raise
        record["error"] = f"{type(error).__name__}: {error}"
        return json.dumps(record), ()
    record["arguments"], record["defaults"] = encode_arguments(
        list(signature.parameters.values())[1:], bound, encode, Encoder(by_path=by_path))
    return json.dumps(record), tuple(encode.bricks)


def encode_arguments(parameters: list[inspect.Parameter], bound: inspect.BoundArguments,
                     encode: Callable[[object], JSON], encode_default: Callable[[object], JSON]
                     ) -> tuple[dict[str, JSON], dict[str, JSON]]:
    """``(arguments, defaults)``: the call's arguments (``*args`` as a list, ``**kwargs``
    spread) and the defaults it left, each encoded for a record."""
    arguments: dict[str, JSON] = {}
    defaults: dict[str, JSON] = {}
    for parameter in parameters:
        if parameter.name in bound.arguments:
            value = bound.arguments[parameter.name]
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments.update({k: encode(v) for k, v in value.items()})
            elif parameter.kind is parameter.VAR_POSITIONAL:
                arguments[parameter.name] = [encode(v) for v in value]
            else:
                arguments[parameter.name] = encode(value)
        elif parameter.default is not parameter.empty:
            defaults[parameter.name] = encode_default(parameter.default)
    return arguments, defaults


def record_construction(instance: object, args: tuple[object, ...], kwargs: dict[str, object],
                        *, by_path: bool) -> None:
    """Notes on ``instance`` the configuration of ``type(instance)(*args, **kwargs)``.

    Called from ``__new__``, which sees every construction's arguments once, whatever
    defines ``__init__`` (a dataclass-generated one included) and before ``__init__``
    consumes any of them (an ``nnx.Rngs`` is recorded with its counts as passed).
    """
    cls = type(instance)
    try:
        config, bricks = construction_config(cls, cls.__init__, instance, args, kwargs,
                                             by_path=by_path)
    except Exception as error:  # recording must never break construction
        config = json.dumps({"class": class_path(cls),
                             "error": f"{type(error).__name__}: {error}"})
        bricks = ()
    object.__setattr__(instance, CONFIG, config)
    if by_path:
        object.__setattr__(instance, BRICK_REFS, bricks)


def config_of(obj: object) -> dict[str, JSON] | None:
    """The configuration recorded when ``obj`` (a brick or manager) was constructed.

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._core._bricks._construction import config_of
        >>> config = config_of(gm.bricks.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0)))
        >>> config["class"], config["arguments"]["use_bias"]
        ('graphmod.bricks.Linear', False)
    """
    text = vars(obj).get(CONFIG) if hasattr(obj, "__dict__") else None
    return None if text is None else json.loads(text)
