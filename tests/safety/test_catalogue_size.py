"""The second round's catalogue holds at least 40 cases, with ids unique in each area."""

from __future__ import annotations

import importlib
import pathlib

AREAS = sorted(path.stem for path in pathlib.Path(__file__).parent.glob("test_*.py")
               if path.stem != "test_catalogue_size")


def test_the_second_round_catalogue_holds_at_least_forty_cases() -> None:
    counts = {}
    for area in AREAS:
        cases = getattr(importlib.import_module(f"tests.safety.{area}"), "CASES", [])
        assert len({case.id for case in cases}) == len(cases), area
        counts[area] = len(cases)
    assert sum(counts.values()) >= 40, counts
