"""Names: defaults derived from class names (managers, plugins), and the known name closest
to a misspelt one (for error messages)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


def snake_case(name: str) -> str:
    """``name`` in snake case: the default name of a manager or plugin from its class.

    Examples:
        >>> from graphmod._core._naming import snake_case
        >>> snake_case("WeightNoise"), snake_case("LoRA")
        ('weight_noise', 'lo_r_a')
    """
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the known name closest to ``name``, or ``""``.

    Examples:
        >>> from graphmod._core._naming import did_you_mean
        >>> did_you_mean("acuracy", ["accuracy", "f1"]), did_you_mean("zzz", ["f1"])
        (" (did you mean 'accuracy'?)", '')
    """
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
