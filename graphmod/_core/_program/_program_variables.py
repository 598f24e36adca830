"""A program's variables by role: ``roles``, ``split``, ``merge`` and ``update_model``.

Read from the layout and the roles ``init`` gave the managers' variables: no trace runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from graphmod import roles as _roles
from graphmod._core._display._show import remember_roles
from graphmod._core._model import _owned_layout as owned_layout
from graphmod._core._model._role_tree import is_one_of, merge, role_tree, select
from graphmod._core._program._program_record import Shared
from graphmod._core._warn import warn
from graphmod.typing import Variables

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager

__all__ = ["VariablesByRole"]


class VariablesByRole:
    """What a program does with variables by their roles (a base of ``ProgramCore``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> weights, rest = program.split(program.init(jnp.ones((1, 2))), gm.roles.WEIGHT)
        >>> list(weights["model"]), list(rest["model"])
        (['W'], ['b'])
    """

    _shared: Shared
    _managers: tuple[Manager, ...]
    _unpack: Callable[[Variables], tuple[dict, dict, dict]]  # ProgramCore's: checked, split

    def update_model(self, variables: Variables) -> None:
        """Writes ``variables["model"]`` (copies) into the model's NNX variables.

        Checks every path, shape and dtype, and that the model's modules and variables are
        the ones compiled (:class:`~graphmod.errors.ModelChanged`) first; nothing is written
        if one does not fit. Managers do nothing outside a program: a manager that can fold
        its variables into the model's (``lora.merge``, ``ema.merge``) and whose entries
        ``variables`` still hold gets a warning naming the fix.
        """
        values, _, _ = self._unpack(variables)
        unmerged = [m.name for m in self._managers if callable(getattr(m, "merge", None))
                    and jax.tree.leaves(variables["managers"].get(m.name, {}))]
        if unmerged:
            warn(
                f"program.update_model writes the model's own arrays, and the model called "
                f"eagerly runs without managers: the variables of {unmerged} would be left "
                f"out. Fold them in first: program.update_model({unmerged[0]}.merge(variables))")
        layout = self._shared.layout
        layout.check_unchanged("program.update_model(variables)")
        for identity, value in values.items():
            layout.store(identity, jnp.array(value, copy=True))

    def roles(self, variables: Variables) -> dict:
        """The tree of roles of ``variables`` (same nesting, a Role per leaf).

        Read from the layout, and for manager-owned variables from the ``init`` of any
        program over it: no trace runs.
        """
        owned = self._shared.owned_roles
        if owned is None and owned_layout.decode(variables["managers"])[0]:
            raise RuntimeError(
                "this program has not been initialised: call program.init(*example_args) "
                "(or init a program it was derived from) first"
            )
        # Remembered for displays of a tree like it (a TrainState's carries no roles).
        return remember_roles(variables, role_tree(variables, self._shared.layout, owned or {}))

    def split(self, variables: Variables, *roles: _roles.Role) -> tuple[dict, dict]:
        """``(selected, rest)``: leaves whose role is one of ``roles`` (or a sub-role), and
        the others, each in the original nesting (a module with no leaf on one side keeps
        an empty dict there, so :meth:`merge` restores the whole nesting). With no role
        given, ``roles`` is ``PARAMETER``: ``params, rest = program.split(variables)``
        splits off what an optimizer trains, as ``graphmod.optimize`` does."""
        wanted = _roles.as_roles(roles or (_roles.PARAMETER,),
                                 argument="program.split(variables, *roles)")
        tree = self.roles(variables)
        test = is_one_of(wanted)
        return select(variables, tree, test, True), select(variables, tree, test, False)

    @staticmethod
    def merge(selected: dict, rest: dict) -> dict:
        """The inverse of :meth:`split`: one nested dict from two disjoint ones."""
        return merge(selected, rest)

