"""``Sharding``: ``jax.lax.with_sharding_constraint`` on selected activations.

Sharp edges
    The constraint is placed on the program's mesh (``graphmod.compile(..., mesh=...)``);
    a program without one refuses the manager at its first trace, naming it. A spec longer
    than the selected value's rank is refused, naming the variable and its shape. It
    constrains how XLA lays the value out, never what it computes: results equal those of
    the program without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import jax
from jax.sharding import NamedSharding, PartitionSpec

import graphmod as gm
from managers._checks import ManagerOptions


class Sharding(gm.Manager):
    """Constrains the selected inputs or outputs to ``spec`` on the program's mesh, as
    ``jax.lax.with_sharding_constraint`` would (e.g. attention outputs split by heads).

    Args:
        spec: a ``PartitionSpec`` or a sequence of mesh axis names (None: that dimension
            whole), one per leading dimension of the selected values.
        **kwargs: the filter (``roles=``, ``bricks=``, ``applications=``, ...) and the
            base manager's options.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)),
        ...                      mesh=mesh, batch_axis="data",
        ...                      managers=[managers.Sharding(("data", None),
        ...                                                  roles=[gm.roles.OUTPUT])])
        >>> program.infer(program.init(jnp.ones((2, 2))), jnp.ones((2, 2))).shape
        (2, 4)
    """

    def __init__(self, spec: PartitionSpec | Sequence[str | tuple[str, ...] | None],
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        if isinstance(spec, str) or not isinstance(spec, Sequence) or not all(
                entry is None or isinstance(entry, str) or (
                    isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))
                for entry in spec):
            raise TypeError(f"Sharding(spec={spec!r}): expected a PartitionSpec or a sequence "
                            "of mesh axis names and None, e.g. ('data', None, 'model')")
        self.spec = tuple(spec)

    # A gm.ApplicationCall: its mesh, which HookContext does not name.
    def _constrained(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        mesh = call.mesh
        if mesh is None:
            raise ValueError(f"Sharding {self.name!r} constrains {name!r} of "
                             f"{call.path}.{call.application} on a device mesh, and this "
                             "program has none: compile it with mesh=jax.make_mesh(...)")
        shape = jax.numpy.shape(value)
        why = gm.sharding.misfit(self.spec, shape, mesh)
        if why is not None:
            raise ValueError(f"Sharding {self.name!r}: spec {self.spec} does not fit {name!r} "
                             f"of {call.path}.{call.application}, of shape {shape}: {why}; "
                             "narrow the filter or fix the spec")
        return jax.lax.with_sharding_constraint(value,
                                                NamedSharding(mesh, PartitionSpec(*self.spec)))

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        return self._constrained(call, name, value)

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array
                       ) -> jax.Array:
        return self._constrained(call, name, value)
