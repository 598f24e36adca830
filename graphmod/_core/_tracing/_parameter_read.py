"""The parameter read: a model variable read while a program traces, as the application call
in progress sees it (what Haiku's ``get_parameter`` and its custom getters do).

:func:`read_parameter` is the whole read, top to bottom; every read of a model variable in a
program comes here (``Tracked.get_value``, ``graphmod._core._tracing._variables``). The frame
holds what it reads (the program's values, the calls in progress, the rewrites made in this
trace); the innermost call's chain runs a manager's hook (``Chain.rewrite``, as for inputs and
outputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphmod import roles as _roles
from graphmod._core._tracing._context import current_frame

if TYPE_CHECKING:
    import jax
    from flax import nnx

__all__ = ["read_parameter"]


def read_parameter(variable: nnx.Variable) -> jax.Array | None:
    """Model variable ``variable`` as the innermost application call in progress reads it;
    None outside a program's trace or for a variable that is not the program's (Flax reads
    the variable's own value then, as it does one holding None: no array to rewrite).

    1. The frame of the program's trace in progress.
    2. Not a model variable of the program, nor a copy an NNX lifted transform made of one:
       not found.
    3. The base value: the program's; a transform's copy reads its own (a layer's slice
       inside ``nnx.scan``), rewritten like the original's.
    4. No application call in progress, or a variable that persists in no way managers
       rewrite (``CARRIED``: an RNG count): the base value.
    5. Once per call, variable and JAX trace: what this call read of it in this trace
       already (a value rewritten inside an inner trace, a scan body, must not leak out).
    6. Recorded for the computation graph, before any rewrite.
    7. Each manager of the call with a ``rewrite_parameter`` hook, outermost first (where
       its filter selects the variable); model state (``STATE``: running statistics) only
       for a manager whose ``roles=`` names it: noise, dropout or a cast of BatchNorm's
       statistics, chosen by ``path=``, would spoil them.
    8. Monitored as the call reads it.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._core._tracing._parameter_read import read_parameter
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> read_parameter(lin.W) is None  # no program traces
        True
        >>> class Double(gm.Manager):
        ...     def rewrite_parameter(self, call, name, value):
        ...         return 2 * value
        >>> program = gm.compile(lambda m, x: m(x), lin,
        ...                      managers=[Double(roles=[gm.roles.WEIGHT])])
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> W, b = variables["model"]["W"], variables["model"]["b"]
        >>> bool(jnp.allclose(program.infer(variables, jnp.ones((1, 2))),
        ...                   jnp.ones((1, 2)) @ (2 * W) + b))
        True
    """
    frame = current_frame()  # 1. (the steps of the docstring)
    info = None if frame is None else frame.variable_info(variable)
    if frame is None or info is None:  # 2. not the program's
        return None
    base = frame.stored(variable) if frame.holds(variable) else variable.get_raw_value()  # 3.
    call = frame.calls[-1] if frame.calls else None
    if call is None or not info.role.is_a(_roles.PERSISTENT):  # 4. no rewrite
        return base
    key = (call.path, call.application, call.call_id, info.identity)
    before = frame.read_before(key)  # 5. once per call, variable and JAX trace
    if before is not None:
        return before
    tag = call.tag(info.role, info.name, info.path, info.aliases)
    frame.record(tag, base, None)  # 6. recorded
    value = base
    state = info.role.is_a(_roles.STATE)
    for manager in call.managers:  # 7. the managers' hooks, outermost first
        if manager.has_hook("rewrite_parameter") and (
                not state or manager.filter.names_role(_roles.STATE)):
            value = call.rewrite(manager, "rewrite_parameter", tag, value, (info.path, base))
    if frame.monitor:  # 8. monitored as the call reads it
        frame.collect(tag, value, call.monitor_key(info.name))
    frame.note_read(key, value)
    return value
