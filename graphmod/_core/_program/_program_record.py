"""What a program records of how it came to be (:class:`ProgramRecord`, read by
provenance) and what programs derived from one another share (:class:`Shared`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
from jax.extend.core import ClosedJaxpr

from graphmod import roles as _roles
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._model._owned import OwnedKey
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._sharding import Placement
from graphmod.typing import AxisName, InputTransforms, PyTree, Variables

__all__ = ["ProgramRecord", "Shared", "abstract"]


@dataclasses.dataclass(frozen=True)
class ProgramRecord:
    """What a program knows of how it came to be: read by provenance, never written.

    ``examples`` (init's example arguments as shapes, by argument name, ``positional`` the
    names passed by position), ``variables`` (init's variables as shapes) and ``init_key``
    are None before ``init``; ``inits`` counts the ``init`` calls, so a record made before
    the last one is known to be stale.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> _ = program.init(jnp.ones((1, 2)))
        >>> record = program.record
        >>> record.inits, record.variables["model"]["W"].shape
        (1, (2, 3))
    """

    fn: Callable[..., object]
    layout: Layout
    managers: tuple[Manager, ...]
    monitor: Mapping[str, VariableFilter]
    axis_name: AxisName | None
    created: str
    examples: dict[str, PyTree] | None
    positional: list[str] | None
    variables: Variables | None
    init_key: dict | None  # the key's record (``key_record``): its implementation and data
    inits: int
    training_jaxpr: Callable[[], ClosedJaxpr | None] = dataclasses.field(repr=False,
                                                                         compare=False)
    placement: Placement | None = None  # compile(mesh=, rules=, batch_axis=)
    transforms: InputTransforms | None = None  # compile(transforms=)


class Shared:
    """What programs derived from one another share: layout, owned variables, examples."""

    def __init__(self, layout: Layout, placement: Placement | None = None,
                 transforms: InputTransforms | None = None) -> None:
        self.layout = layout
        self.placement = placement  # where arrays live on a mesh (None: one device)
        self.transforms = transforms  # applied to the arguments before the function runs
        self.owned_roles: dict[OwnedKey, _roles.Role] | None = None
        self.examples: dict[str, PyTree] = {}
        # Whether an inner trace of this layout's programs reads the frame (see _context).
        self.isolated = False


def abstract(value: object) -> jax.ShapeDtypeStruct:
    """The shape and dtype of ``value`` (weak type kept), as a program records them."""
    aval = jax.typeof(value)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
