"""Argument checks shared by the built-in bricks."""

from __future__ import annotations

from typing import Any


def check_sizes(owner: str, **sizes: Any) -> None:
    """Raises naming ``owner(argument=value)`` unless every size is a positive int."""
    for argument, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}({argument}={value!r}): must be a positive int")
