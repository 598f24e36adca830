"""Argument checks shared by the built-in bricks."""

from __future__ import annotations

from graphmod._core._number_checks import is_whole_number


def check_sizes(owner: str, **sizes: object) -> None:
    """Raises naming ``owner(argument=value)`` unless every size is a positive int."""
    for argument, value in sizes.items():
        if not is_whole_number(value, least=1):
            raise ValueError(f"{owner}({argument}={value!r}): must be a positive int")
