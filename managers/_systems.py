"""Systems managers: ``Remat`` (recompute in the backward pass) and ``StopGradient``
(the precision policies, ``MixedPrecision`` and ``Precision``, have a module of their own).

Sharp edges
    ``Remat`` wraps the matched application calls in ``graphmod.remat`` (``jax.checkpoint``
    carrying the program's state): what the region writes (Flax's ``BatchNorm`` statistics,
    a ``BatchNorm`` manager's, an RNG stream's count) and monitors comes out of it; give
    ``Remat`` the outermost place (it is, when entered first), so the managers of the call
    run inside the recomputed region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias, Unpack

import jax
import numpy as np

import graphmod as gm
from graphmod.typing import HookContext, PyTree, WrapContext
from managers._checks import ManagerOptions


class StopGradient(gm.Manager):
    """``jax.lax.stop_gradient`` on the selected inputs, outputs or parameters: the
    forward pass is unchanged, no gradient flows back through them (freeze a layer by its
    parameters, or cut a branch).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x).sum(), lin,
        ...                      managers=[managers.StopGradient(roles=[gm.roles.WEIGHT])])
        >>> x = jnp.ones((1, 2))
        >>> variables = program.init(x)
        >>> grads = jax.grad(lambda v: program.train(v, x, rng=jax.random.key(0))[0])(
        ...     variables)
        >>> float(jnp.abs(grads["model"]["W"]).sum()), float(grads["model"]["b"].sum())
        (0.0, 1.0)
    """

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(value)

    def rewrite_parameter(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(value)


def _policy(name: str | None) -> Callable[..., bool] | None:
    if name is None:
        return None
    known = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
    policy: Callable[..., bool] | None = (
        getattr(jax.checkpoint_policies, name, None) if name in known else None)
    if policy is None or not callable(policy) or name.startswith(("save_", "offload")):
        plain = [n for n in known if not n.startswith(("save_", "offload"))]
        raise ValueError(f"Remat(policy={name!r}): expected the name of one of JAX's "
                         f"checkpoint policies: {', '.join(plain)}")
    return policy


Arrays: TypeAlias = list[jax.Array | np.ndarray]
Arguments: TypeAlias = tuple[tuple[PyTree, ...], dict[str, PyTree]]  # a call's (args, kwargs)


def _split_arrays(args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                  ) -> tuple[Arrays, Callable[[Arrays], Arguments]]:
    """The array leaves of ``(args, kwargs)`` and a function putting new ones back (other
    leaves, such as flags, stay Python values)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array | np.ndarray)]

    def rebuild(arrays: Arrays) -> Arguments:
        new = list(leaves)
        for i, array in zip(where, arrays, strict=True):
            new[i] = array
        return jax.tree.unflatten(tree, new)

    return [leaves[i] for i in where], rebuild


class Remat(gm.Manager):
    """Rematerialization: ``jax.checkpoint`` around each matched application call, so its
    activations are recomputed in the backward pass instead of stored (less memory, more
    compute). ``policy`` names one of ``jax.checkpoint_policies`` (e.g.
    ``"dots_saveable"``: keep matrix products, recompute the rest); None saves nothing.

    With no filter it matches every application; name the blocks to rematerialize, e.g.
    ``Remat(bricks=[TransformerBlock])`` or, on a Flax model, ``Remat(bricks=[model.layers])``
    (an ``nnx.List`` stands for its modules). ``path=`` globs the call's path
    (``/layers/0.apply``), and ``*`` crosses ``/``: ``path="/layers/*"`` also wraps every call
    nested in those layers. It rewrites no value: ``program.rewrites`` lists the calls it
    wrapped (role ``CALL``), and a filter that matches no call raises when the program
    traces.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 8, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> with managers.Remat(bricks=mlp.linear_layers, policy="dots_saveable"):
        ...     program = gm.compile(lambda m, x: m(x).sum(), mlp)
        >>> x = jnp.ones((2, 3))
        >>> variables = program.init(x)
        >>> grads = jax.grad(lambda v: program.train(v, x, rng=jax.random.key(0))[0])(
        ...     variables)
        >>> grads["model"]["linear_layers"][0]["W"].shape
        (3, 8)
    """

    def __init__(self, *, policy: str | None = None, **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        _policy(policy)
        self.policy = policy

    def wrap(self, call: WrapContext, next: Callable[..., PyTree], args: tuple[PyTree, ...],
             kwargs: dict[str, PyTree]) -> PyTree:
        arrays, rebuild = _split_arrays(args, kwargs)

        def region(*arrays: jax.Array | np.ndarray) -> PyTree:
            inner_args, inner_kwargs = rebuild(list(arrays))
            return next(*inner_args, **inner_kwargs)

        return gm.remat(region, policy=_policy(self.policy))(*arrays)
