"""What ``import graphmod`` loads: the core and the loop, never orbax (opened on first save
or restore)."""

from __future__ import annotations

import subprocess
import sys


def _printed_by(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (nothing imported yet)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout


def test_importing_graphmod_loads_no_orbax() -> None:
    out = _printed_by("import sys, graphmod, managers; "
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('orbax', 'tensorstore')))")
    assert out.strip() == "[]", out


def test_a_checkpointer_loads_orbax_when_it_is_made() -> None:
    out = _printed_by("import sys, tempfile; from graphmod._checkpoint import Checkpointer; "
                      "before = 'orbax.checkpoint' in sys.modules; "
                      "Checkpointer(tempfile.mkdtemp()); "
                      "print(before, 'orbax.checkpoint' in sys.modules)")
    assert out.split() == ["False", "True"], out
