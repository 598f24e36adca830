"""Checks on ``optimize(trainable=...)`` that concern the program's managers.

A manager among ``trainable`` must be one the program was compiled with, and a manager
left out keeps its parameters as initialized: both are told before the first step.

Example:
    >>> import jax.numpy as jnp, graphmod as gm
    >>> from flax import nnx
    >>> lin = gm.bricks.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> program = gm.compile(lambda m, x: m(x), lin)
    >>> parameter_owners(program, program.init(jnp.ones((1, 4))))  # no manager owns any
    []
"""

from __future__ import annotations

import jax

from graphmod import roles as _roles
from graphmod._core._managers._manager import Manager
from graphmod._core._selection._selection import Selector
from graphmod._core._warn import warn
from graphmod._train._program import Program
from graphmod.typing import Variables


def parameter_owners(program: Program, variables: Variables) -> list[str]:
    """The names of the program's managers that hold PARAMETER leaves in ``variables``."""
    owned = program.split(variables, _roles.PARAMETER)[0]["managers"]
    return [name for name, leaves in owned.items() if jax.tree.leaves(leaves)]


def check_own_managers(selectors: tuple[Selector, ...], program: Program) -> None:
    """Refuses a manager among ``trainable`` that the program was not compiled with (one
    of the same name would otherwise stand in for it)."""
    for selector in selectors:
        if isinstance(selector, Manager) and not any(selector is m for m in program.managers):
            names = ", ".join(m.name for m in program.managers) or "none"
            raise ValueError(
                f"optimize(trainable=...): {type(selector).__name__} {selector.name!r} is not "
                f"one of the program's managers (its managers: {names}); pass the manager "
                "object the program was compiled with")


def warn_frozen_managers(variables: Variables, selectors: tuple[Selector, ...] | None,
                         program: Program) -> None:
    """Warns of managers whose parameters ``trainable=`` leaves out: LoRA's adapters, a
    weight norm's gains stay as initialized (LoRA's zero ``B``: without effect)."""
    if not selectors:
        return
    chosen = {s.name for s in selectors if isinstance(s, Manager)}
    frozen = [name for name in parameter_owners(program, variables) if name not in chosen]
    if frozen:
        warn(
            f"optimize(trainable=...) leaves out the parameters of the managers {frozen}: "
            "they stay as initialized. Add the managers to trainable= to train them "
            f"(trainable=[..., {frozen[0]}])")
