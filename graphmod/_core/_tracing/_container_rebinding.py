"""A container of model variables rebound while a program traces: its updates are writes.

Flax's ``nnx.bridge.ToNNX`` keeps a Linen module's collections as dicts of NNX variables
and, after an ``apply(..., mutable=["batch_stats"])``, rebinds each updated collection to a
new dict (its unchanged variables and new ones in place of the updated). Inside a program
the module keeps its own dict and variables: each new variable's value is written to the
program's value of the variable at its place, as ``variable.value = x`` would be.

Sharp edges
    Only a dict, list or tuple attribute holding model variables is taken so; the new
    container must hold a variable at each place of the old one and nowhere else, with the
    same shape and dtype, and may not give a parameter a new value (a forward pass writes
    none): a parameter holding the value the call read, as Linen returns its parameters
    under ``mutable=True`` (rewritten by managers or not), is left as it is. Rebinding any
    other attribute stays Flax's to refuse.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
from flax import nnx

from graphmod._core._program._arguments import spec
from graphmod._core._tracing._parameter_read import read_parameter

if TYPE_CHECKING:
    from graphmod._core._tracing._frame import Frame


def _variables_by_place(container: object) -> dict[str, nnx.Variable]:
    leaves = jax.tree_util.tree_flatten_with_path(
        container, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {jax.tree_util.keystr(key): leaf for key, leaf in leaves
            if isinstance(leaf, nnx.Variable)}


def write_rebound(frame: Frame, owner: str, held: object, value: object) -> bool:
    """Writes the variables of ``value``, rebinding attribute ``owner`` (its path) that
    holds container ``held`` of model variables, to the program; False (nothing written)
    if ``held`` is no such container. Raises naming the place a new container differs."""
    if not isinstance(held, dict | list | tuple):
        return False
    old = _variables_by_place(held)
    if not old or not all(frame.holds(variable) for variable in old.values()):
        return False
    if isinstance(value, dataclasses.Field):  # nnx.data(value), as ToNNX assigns
        value = value.metadata.get("nnx_value", value)
    new = _variables_by_place(value)
    fix = ("rebind it only with a container holding a variable of the same shape and dtype "
           "at each place of the old one (Flax's ToNNX does after apply(..., mutable=...)), "
           "or keep the value elsewhere, e.g. in a variable's .value")
    if new.keys() != old.keys():
        raise TypeError(f"{owner} was rebound in a program to a container with variables at "
                        f"{', '.join(sorted(new)) or 'no place'} in place of "
                        f"{', '.join(sorted(old))}: {fix}")
    writes = {}
    for place, variable in old.items():
        replacement = new[place]
        if replacement is variable:
            continue
        written = replacement.get_raw_value()
        parameter = not frame.carries(variable)
        if parameter and written is read_parameter(variable):
            continue  # as the call read it: apply(..., mutable=True) returns its parameters
        was, now = spec(frame.stored(variable)), spec(written)
        if parameter or now != was:
            raise TypeError(
                f"{owner}{place} was rebound in a program to {type(replacement).__name__} "
                f"{now[0]} {now[1]} in place of {type(variable).__name__} {was[0]} {was[1]}"
                + (", a parameter, which a forward pass does not write" if parameter else "")
                + f": {fix}")
        writes[place] = written
    for place, written in writes.items():  # checked first: nothing written on an error
        frame.write(old[place], written)
    return True
