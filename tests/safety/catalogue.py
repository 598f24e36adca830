"""The second round of the bad-input catalogue: one shape for every area's cases.

Each area (``tests/safety/test_<area>.py``) lists its cases as :class:`Case` objects in a
module-level ``CASES`` and runs them through :func:`check_refused`, which asserts the
error's class, that its message names the culprit (a regex, and the fix where one exists),
and that nothing changed under the area's folder: every file's bytes, every link's target,
every folder. ``test_catalogue_size.py`` counts the cases of every area.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: ``call(root)`` must raise ``error`` with a message matching ``pattern``
    and change nothing under ``root``."""

    id: str
    call: Callable[[pathlib.Path], Any]
    error: type[BaseException]
    pattern: str


def listing(root: pathlib.Path) -> list[tuple[str, str | None]]:
    """Every path under ``root`` with its content hash (a file), link target (a symlink,
    never followed) or None (a folder)."""
    entries = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            entries.append((str(path.relative_to(root)), "-> " + os.readlink(path)))
        elif path.is_file():
            entries.append((str(path.relative_to(root)),
                            hashlib.sha256(path.read_bytes()).hexdigest()))
        else:
            entries.append((str(path.relative_to(root)), None))
    return entries


def check_refused(case: Case, root: pathlib.Path) -> None:
    """Runs ``case`` against ``root``: its error, its message, and ``root`` unchanged."""
    before = listing(root)
    with pytest.raises(case.error) as caught:
        case.call(root)
    message = str(caught.value.args[0]) if caught.value.args else str(caught.value)
    assert re.search(case.pattern, message, re.S), message
    assert listing(root) == before, f"{case.id}: the files under {root} changed"
