"""``LayerFreezing``: layers from the input side stop training, without recompiling the
step (Composer's Layer Freezing; Brock et al., 2017, "FreezeOut").

The manager holds one dynamic hyperparameter, ``frozen``: how many of its ``bricks``
(listed from the input side) are frozen, a float32 scalar in the variables
(``variables["managers"]["layer_freezing"]["hparams"]["frozen"]``) that a plugin
(:class:`graphmod.plugins.FreezeLayers`, or ``Anneal``) raises between steps. Brick ``i``
is frozen while ``i < frozen``, which is read where it is needed, so freezing more never
retraces:

* in training its application's parameters are read through ``stop_gradient``: no
  gradient reaches them (nor the layers before them through them);
* :func:`graphmod.optimize` leaves them and their optimizer state as they are, bitwise
  (:meth:`graphmod.Manager.frozen_parameters`): with a zero gradient Adam's momentum would
  still move them, and weight decay would shrink them.

Sharp edges
    A brick's own parameters freeze (``bricks=[parent]`` is the parent's own, not its
    children's: list the layers themselves). The backward pass still computes what XLA
    cannot prove unused: freezing saves no time, only the changes. Other managers' own
    parameters of a frozen layer (``LoRA``'s adapters) keep training.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Unpack

import jax
import jax.numpy as jnp
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import OptionsWithoutBricks, roles_by_default


class LayerFreezing(gm.Manager):
    """Freezes the first ``frozen`` of ``bricks`` (from the input side): no gradient, no
    update, their optimizer state left as it was (see the module docstring). ``frozen`` is
    always a dynamic hyperparameter (``manager.hparam("frozen")``), valid from 0 to the
    number of bricks. Unless its filter chooses variables (``roles=``, ...) it freezes
    every ``PARAMETER`` of the bricks' own applications. Named ``"layer_freezing"``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([2, 4, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> freezing = managers.LayerFreezing(mlp.linear_layers, frozen=1)
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), mlp, managers=[freezing])
        >>> step = gm.optimize(program, optax.adam(0.1))
        >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
        >>> before = jax.tree.map(jnp.copy, state.variables["model"])  # the step donates
        >>> state, _ = step(state, jnp.ones((4, 2)))
        >>> after = state.variables["model"]["linear_layers"]
        >>> [bool(jnp.array_equal(after[i]["W"], before["linear_layers"][i]["W"])) for i in (0, 1)]
        [True, False]
    """

    hparams = ("frozen",)
    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, bricks: Sequence[nnx.Module], *, frozen: float | gm.Dynamic = 0,
                 **kwargs: Unpack[OptionsWithoutBricks]) -> None:
        if kwargs.get("filter") is not None:
            raise TypeError("LayerFreezing: the layers are bricks=..., in order from the "
                            "input side; a filter= cannot say their order")
        layers = list(bricks) if not isinstance(bricks, gm.Brick | type) else [bricks]
        if not layers or any(isinstance(b, type) for b in layers):
            raise TypeError(f"LayerFreezing(bricks={bricks!r}): expected the layers "
                            "themselves (brick instances), in order from the input side, "
                            "e.g. LayerFreezing(mlp.linear_layers)")
        if len({id(b) for b in layers}) != len(layers):
            raise ValueError("LayerFreezing(bricks=...): a layer is listed twice")
        super().__init__(**roles_by_default({**kwargs, "bricks": layers}, (roles.PARAMETER,)))
        value = frozen.value if isinstance(frozen, gm.Dynamic) else frozen
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0 <= value <= len(layers):
            raise ValueError(f"LayerFreezing(frozen={frozen!r}): must be a number of layers "
                             f"from 0 to {len(layers)}")
        self.frozen = gm.dynamic(value)  # always dynamic: freezing never recompiles
        self.hparam_ranges = {"frozen": (0.0, float(len(layers)))}

    @property
    def layers(self) -> tuple[nnx.Module, ...]:
        """The bricks, from the input side."""
        # Every one a brick instance (__init__ refuses classes): the test says so to the checker.
        return tuple(b for b in self.filter.bricks or () if not isinstance(b, type))

    def _position(self, call: HookContext) -> int:
        for position, brick in enumerate(self.layers):
            if call.brick is brick:
                return position
        raise ValueError(f"LayerFreezing {self.name!r}: the call of {call.application!r} at "
                         f"{call.path} is of none of its layers (a copy an NNX transform "
                         "made?); list the layers a program calls as they are")

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        position = self._position(call)
        if not call.training:
            return value
        frozen = jnp.float32(position) < self.hp("frozen")
        return jnp.where(frozen, jax.lax.stop_gradient(value), value)

    def frozen_parameters(self, layout: gm.typing.ModelLayout,
                          variables: gm.typing.Variables
                          ) -> dict[str, jax.Array]:
        """The model parameters of each layer, frozen while its position is below
        ``frozen`` (read from ``variables``).

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm, managers
            >>> from flax import nnx
            >>> mlp = gm.bricks.MLP([2, 3, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
            >>> freezing = managers.LayerFreezing(mlp.linear_layers, frozen=1)
            >>> program = gm.compile(lambda m, x: m(x).sum(), mlp, managers=[freezing])
            >>> flags = freezing.frozen_parameters(program.layout,
            ...                                  program.init(jnp.ones((1, 2))))
            >>> {path: bool(flag) for path, flag in flags.items()}["/linear_layers/1.W"]
            False
        """
        count = self.hparam("frozen").get(variables)
        paths = [layout.brick_path(brick) for brick in self.layers]
        chosen = self.filter.roles or (roles.PARAMETER,)
        flags = {}
        for info in layout.variables:
            if not info.role.is_a(roles.PARAMETER) or not any(info.role.is_a(r) for r in chosen):
                continue
            for position, path in enumerate(paths):
                if path is not None and info.path.startswith(f"{path}."):
                    flags[info.path] = jnp.float32(position) < count
        return flags
