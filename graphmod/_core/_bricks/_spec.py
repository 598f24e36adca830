"""What an application declares, and where its inputs and outputs are in a call.

A brick's ``@application(inputs=[...], outputs=[...])`` names its tagged arguments and
results (:class:`Spec`); a method of an unmodified Flax module tags every array among its
arguments and results (:class:`MethodSpec`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Hashable, Mapping
from typing import TypeAlias, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from graphmod import roles as _roles

# Where a tagged array is inside an argument: the keys into its tuples, lists and dicts.
Keys: TypeAlias = tuple[Hashable, ...]
# A tagged input of a call: (tag name, the argument holding it, the keys into that argument).
Slot: TypeAlias = tuple[str, str, Keys]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What an application declares: its input and output names (``targets``: arguments
    tagged TARGET, e.g. a cost's labels; ``costs``: outputs tagged COST)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    signature: inspect.Signature
    takes_call: bool
    targets: tuple[str, ...] = ()
    costs: tuple[str, ...] = ()

    def input_role(self, name: str) -> _roles.Role:
        return _roles.TARGET if name in self.targets else _roles.INPUT

    def output_role(self, name: str) -> _roles.Role:
        return _roles.COST if name in self.costs else _roles.OUTPUT

    def split_outputs(self, out: object) -> tuple[object, ...]:
        if len(self.outputs) == 1:
            return (out,)
        if not isinstance(out, tuple) or len(out) != len(self.outputs):
            raise ValueError(
                f"application {self.name!r} declares outputs {list(self.outputs)} but "
                f"returned {type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple) else "")
            )
        return out

    def join_outputs(self, values: list[object]) -> object:
        return values[0] if len(self.outputs) == 1 else tuple(values)

    def input_slots(self, arguments: Mapping[str, object]) -> list[Slot]:
        """``(tag name, argument, keys into it)`` of each tagged input of a call's bound
        arguments."""
        return [(name, name, ()) for name in (*self.inputs, *self.targets)
                if name in arguments]

    def output_items(self, out: object) -> list[tuple[str, object]]:
        """``(name, value)`` of each tagged output of a call's result."""
        return list(zip(self.outputs, self.split_outputs(out), strict=True))

    def with_outputs(self, out: object, values: list[object]) -> object:
        """``out`` with its tagged outputs replaced by ``values``."""
        return self.join_outputs(values)


def array_keys(value: object, keys: Keys = ()) -> list[Keys]:
    """The keys of the arrays in ``value``, looking into tuples, lists and dicts."""
    if is_array(value):
        return [keys]
    if isinstance(value, tuple | list):
        items: list[tuple[Hashable, object]] = list(enumerate(value))
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        return []
    return [found for key, item in items for found in array_keys(item, (*keys, key))]


def nested(value: object, keys: Keys) -> object:
    """The item of ``value`` at ``keys`` (found by :func:`array_keys`)."""
    for key in keys:
        value = _item(value, key)
    return value


def replaced(value: object, keys: Keys, new: object) -> object:
    """``value`` with the item at ``keys`` replaced (containers copied, types kept)."""
    if not keys:
        return new
    head, *rest = keys
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], tuple(rest), new)}
    sequence = _sequence(value)
    items, index = list(sequence), _index(head)
    items[index] = replaced(items[index], tuple(rest), new)
    return _rebuilt(sequence, items)


def _item(value: object, key: Hashable) -> object:
    return value[key] if isinstance(value, dict) else _sequence(value)[_index(key)]


def _sequence(value: object) -> tuple[object, ...] | list[object]:
    if not isinstance(value, tuple | list):
        raise TypeError(f"expected a tuple, list or dict holding arrays, got a "
                        f"{type(value).__name__}")
    return value


def _index(key: Hashable) -> int:
    if not isinstance(key, int):
        raise TypeError(f"a tuple or list is indexed by position, not by {key!r}")
    return key


def _rebuilt(like: tuple[object, ...] | list[object], items: list[object]) -> object:
    """``items`` in a container of ``like``'s type (a named tuple's too)."""
    make = getattr(like, "_make", None)  # a named tuple's constructor from an iterable
    return make(items) if callable(make) else type(like)(items)


def is_array(value: object) -> TypeGuard[jax.Array | np.ndarray]:
    """Whether a Flax method's argument or result is a tagged variable (keys are not)."""
    return isinstance(value, jax.Array | np.ndarray) and not jnp.issubdtype(
        value.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class MethodSpec(Spec):
    """An unmodified Flax method: its array arguments are inputs, array results outputs."""

    def input_slots(self, arguments: Mapping[str, object]) -> list[Slot]:
        # Arrays nested in tuples, lists and dicts (an RNN cell's carry, *args, **kwargs)
        # are inputs too: "carry.0", "args.1"; a **kwargs entry by its key.
        slots: list[Slot] = []
        for argument, value in list(arguments.items())[1:]:
            kind = self.signature.parameters[argument].kind
            for keys in array_keys(value):
                if kind is inspect.Parameter.VAR_KEYWORD:
                    name = ".".join(map(str, keys))
                else:
                    name = ".".join(map(str, (argument, *keys)))
                slots.append((name, argument, keys))
        return slots

    def output_items(self, out: object) -> list[tuple[str, object]]:
        if is_array(out):
            return [("output", out)]
        if isinstance(out, tuple):
            return [(f"output_{i}", v) for i, v in enumerate(out) if is_array(v)]
        if isinstance(out, dict):  # DETR's {"pred_logits": ..., "pred_boxes": ...}
            return [(f"output.{k}", v) for k, v in out.items() if is_array(v)]
        return []

    def with_outputs(self, out: object, values: list[object]) -> object:
        if is_array(out):
            return values[0]
        if not isinstance(out, tuple | dict):
            return out  # no tagged output: nothing to replace
        new = iter(values)
        if isinstance(out, dict):
            return type(out)((k, next(new) if is_array(v) else v) for k, v in out.items())
        items = [next(new) if is_array(v) else v for v in out]
        make = getattr(out, "_make", None)  # a named tuple's constructor from an iterable
        return make(items) if callable(make) else tuple(items)

