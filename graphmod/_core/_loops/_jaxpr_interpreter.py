"""A jaxpr evaluated equation by equation, each by a given rule: the skeleton of
``jax.core.eval_jaxpr`` shared by init's abstract evaluation (``_abstract_init``) and the
resolution of loop keys (``_loop_keys``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

# An equation's outputs from its input values. A value is an array (a tracer while traced),
# or a literal's scalar, which JAX's primitives take as one.
Rule = Callable[[JaxprEqn, list[jax.Array]], list[jax.Array]]


def interpret(jaxpr: Jaxpr, consts: Sequence[jax.Array], args: Sequence[jax.Array],
              rule: Rule) -> list[jax.Array]:
    """The outputs of ``jaxpr`` on ``args``, each equation's outputs computed by
    ``rule(equation, input values)``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
        >>> interpret(closed.jaxpr, closed.consts, [0.0], bind)
        [Array(0., dtype=float32, weak_type=True)]
    """
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom: Var | Literal) -> jax.Array:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, rule(eqn, [read(v) for v in eqn.invars]), strict=True))
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: JaxprEqn, invals: list[jax.Array]) -> list[jax.Array]:
    """The equation's primitive applied to ``invals``, as it stands (a list of outputs)."""
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]
