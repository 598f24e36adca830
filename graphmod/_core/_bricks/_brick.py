"""``Brick``: a Flax NNX module whose ``@application`` methods are tagged and rewritable."""

from __future__ import annotations

from typing import Any, Self

from flax import nnx

from graphmod._core._bricks._construction import record_construction
from graphmod._core._bricks._intercept import assign_in_program, sow_in_program


class Brick(nnx.Module):
    """Base class of bricks: an ``nnx.Module`` with tagged applications.

    Bricks hold their parameters as NNX variables (graphmod's role-carrying types or plain
    Flax ones), display in notebooks, run eagerly, and may contain any Flax NNX layer.
    Calling a brick calls its ``apply`` application. Constructing a brick records its
    configuration (class, arguments, the RNG key data it was given) for provenance, with
    no code of yours: ``graphmod.rebuild`` constructs it again from that record.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> class Affine(gm.Brick):
        ...     def __init__(self, n, *, rngs):
        ...         self.W = gm.Weight(jnp.ones((n, n)))
        ...         self.b = gm.Bias(jnp.zeros(n))
        ...     @gm.application(inputs=["input_"], outputs=["output"])
        ...     def apply(self, input_):
        ...         return input_ @ self.W + self.b
        >>> Affine(2, rngs=nnx.Rngs(0))(jnp.ones((1, 2))).tolist()
        [[2.0, 2.0]]
    """

    __graphmod_brick__ = True

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        brick = super().__new__(cls)
        record_construction(brick, args, kwargs, by_path=False)  # for provenance
        return brick

    def __init__(self) -> None:
        pass

    def sow(self, variable_type: type[nnx.Variable] | str, name: str, value: object,
            *args: Any, **kwargs: Any) -> bool:  # Flax's reduce_fn, init_fn: forwarded
        """``nnx.Module.sow``; inside a program each array of ``value`` is also a monitorable
        auxiliary variable of the current application call (what the function leaves on
        the brick is dropped when the trace ends).

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Twice(gm.Brick):
            ...     @gm.application(inputs=["x"], outputs=["y"])
            ...     def apply(self, x):
            ...         self.sow(nnx.Intermediate, "doubled", 2 * x)
            ...         return 2 * x
            >>> monitor = gm.VariableFilter(roles=[gm.roles.AUXILIARY])
            >>> program = gm.compile(lambda m, x: m(x), Twice(), monitor=monitor)
            >>> variables = program.init(jnp.ones(2))
            >>> _, _, monitored = program.train(variables, jnp.ones(2), rng=jax.random.key(0))
            >>> monitored["/.apply.doubled"].tolist()
            [2.0, 2.0]
        """
        return sow_in_program(self, variable_type, name, value, *args, **kwargs)

    def __setattr__(self, name: str, value: object) -> None:
        # A new attribute inside a program's trace: Flax's intermediates idiom (see there).
        assign_in_program(self, nnx.Module.__setattr__, name, value)

    def __call__(self, *args: object, **kwargs: object) -> Any:  # what `apply` returns
        apply = getattr(self, "apply", None)
        if apply is None:
            raise TypeError(f"{type(self).__name__} has no `apply` application to call")
        return apply(*args, **kwargs)
