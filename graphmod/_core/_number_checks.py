"""What counts as a number in an argument: to Python a bool is an int, never to graphmod.

Only Python's own ints and floats count: an argument graphmod keeps may be written to JSON
(a provenance record, a checkpoint's meta), which takes no NumPy scalar. (Schedules and
``Anneal`` compare NumPy step counts and values too, and check them themselves.)

Examples:
    >>> from graphmod._core._number_checks import is_real_number, is_whole_number
    >>> is_whole_number(3, least=1), is_whole_number(True), is_whole_number(0, least=1)
    (True, False, False)
    >>> is_real_number(0.5), is_real_number(False), is_real_number("1")
    (True, False, False)
"""

from __future__ import annotations


def is_whole_number(value: object, least: int | None = None) -> bool:
    """Whether ``value`` is an int, not a bool, and at least ``least`` (when given)."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (least is None or value >= least))


def is_real_number(value: object) -> bool:
    """Whether ``value`` is an int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
