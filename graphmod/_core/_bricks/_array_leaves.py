"""Flax's array leaves: plain arrays kept as module attributes are model variables too.

Flax NNX lets a module hold arrays directly (``self.w = jax.random.normal(...)``,
``self.count = jnp.array(0)``; Flax's ``examples/nnx_toy_examples/07_array_leaves.py``):
they are leaves of ``nnx.split``'s state like the values of variables. In a program each one
is a model variable with a path like any other (``/linear1.w``); its role comes from its
dtype and name: a floating-point array is a parameter (``WEIGHT`` for ``kernel`` and
``embedding``, ``BIAS`` for ``bias``, else ``PARAMETER``), any other array is ``CARRIED``
state (a counter).

How: while a program traces — and only then — the attribute holds an :class:`ArrayLeaf`, a
variable that reads the program's value (managers rewrite it as any parameter), and a
rebinding (``self.count += 1``, ``self.w = w2``) writes the program's value; the trace's end
puts the module's own array back.

Sharp edges
    Inside a trace the attribute is a Flax variable, not an array: arithmetic, indexing,
    ``.shape``, ``.T`` and ``jnp`` functions work as on the array, but
    ``isinstance(self.w, jax.Array)`` is False. Only arrays that are attributes of a module
    or an ``nnx.Pytree`` (Flax's pytree guide) are variables: an array inside a list or dict
    attribute is refused at compile (wrap it in ``nnx.Param`` or ``nnx.Variable``). An
    ``nnx.Pytree``'s methods are no applications: its arrays are read as parameters of the
    application calling them (a program over a bare ``nnx.Pytree`` has none to rewrite).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import TypeAlias

import jax.numpy as jnp
from flax import nnx
from flax.nnx import graphlib
from flax.typing import is_key_like

from graphmod import roles
from graphmod._core._tracing._variables import Tracked, mark_variable, parameter_role, store_raw
from graphmod.typing import ArrayLike

Key: TypeAlias = tuple[Hashable, ...]  # a path in nnx.state (the layout's, which imports this)


def _rebinding(op: Callable[..., object]) -> Callable[[Tracked, object], object]:
    # ``self.count += 1`` is ``self.count = self.count.__iadd__(1)``: a new array, which
    # the module's ``__setattr__`` writes to the program (Flax's variables refuse ``+=``).
    def rebind(self: Tracked, other: object) -> object:
        return op(self.get_value(), other)

    return rebind


class ArrayLeaf(Tracked, nnx.Variable):
    """What a module's array attribute holds while a program traces (module docstring).

    Examples:
        >>> import jax.numpy as jnp
        >>> leaf = ArrayLeaf(jnp.arange(3))
        >>> leaf += 1  # a new array, as for the attribute it stands for
        >>> leaf.tolist()
        [1, 2, 3]
    """



# Set on the class, not in its body: Flax types a variable's in-place operators as giving back
# the variable, and these give back the new array.
for _name, _op in (("__iadd__", operator.add), ("__isub__", operator.sub),
                   ("__imul__", operator.mul), ("__itruediv__", operator.truediv),
                   ("__ifloordiv__", operator.floordiv), ("__imod__", operator.mod),
                   ("__ipow__", operator.pow), ("__imatmul__", operator.matmul)):
    setattr(ArrayLeaf, _name, _rebinding(_op))
del _name, _op


def leaf_role(array: ArrayLike, name: str) -> roles.Role:
    """The role of array attribute ``name``: by name if floating-point, else ``CARRIED``.

    Examples:
        >>> import jax.numpy as jnp
        >>> leaf_role(jnp.zeros(3), "bias"), leaf_role(jnp.array(0), "count")
        (BIAS, CARRIED)
    """
    if jnp.issubdtype(jnp.result_type(array), jnp.inexact):
        return parameter_role(name)
    return roles.CARRIED


def array_leaves(model: nnx.Pytree, flat: Sequence[tuple[Key, object]]
                 ) -> dict[Key, tuple[nnx.Pytree, str, ArrayLeaf]]:
    """``key -> (module, attribute, stand-in)`` for every array leaf of ``model``'s state
    (``flat``: ``nnx.to_flat_state``'s pairs); raises for arrays that are not attributes."""
    out: dict[Key, tuple[nnx.Pytree, str, ArrayLeaf]] = {}
    for key, value in flat:
        if isinstance(value, nnx.Variable):
            continue
        owner: object = model
        for part in key[:-1]:
            impl = graphlib.get_node_impl(owner)
            assert impl is not None and is_key_like(part), "nnx.state's: graph nodes, Flax keys"
            owner = impl.node_dict(owner)[part]
        name = str(key[-1])  # an attribute's name (an index is refused below)
        if not isinstance(owner, nnx.Pytree) or vars(owner).get(name) is not value:
            raise TypeError(
                f"compile(fn, model): the array at {'/'.join(map(str, key))} is inside a "
                f"container attribute of a {type(owner).__name__}; graphmod takes arrays "
                "that are attributes of a module or nnx.Pytree (self.w = ...) and variables: "
                "wrap it in nnx.Param (trainable) or nnx.Variable (state)")
        out[key] = (owner, name, ArrayLeaf(value))
    return out


def mark_array_leaf(module: nnx.Pytree, name: str, leaf: ArrayLeaf, identity: str
                    ) -> Callable[[], None]:
    """Puts ``leaf`` (holding the module's array, marked with ``identity``) in the module's
    attribute for one trace; returns the function that puts the array back."""
    array = vars(module)[name]
    store_raw(leaf, array)
    unmark = mark_variable(leaf, identity)
    object.__setattr__(module, name, leaf)

    def unmark_leaf() -> None:
        object.__setattr__(module, name, array)
        unmark()

    return unmark_leaf
