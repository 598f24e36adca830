"""Default names derived from class names (managers, plugins)."""

from __future__ import annotations

import re


def snake_case(name: str) -> str:
    """``name`` in snake case: the default name of a manager or plugin from its class.

    Examples:
        >>> from graphmod._core._naming import snake_case
        >>> snake_case("WeightNoise"), snake_case("LoRA")
        ('weight_noise', 'lo_r_a')
    """
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
