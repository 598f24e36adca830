"""Rebuilds crafted records in a fresh process, for ``test_rebuild_safety``.

Usage:
    python crafted_rebuild.py CASES.json RESULTS.json

CASES.json holds ``{"legit": record, "cases": {name: record}, "targets": [module, ...]}``.
The legit record is rebuilt first, so that rebuild's own imports are done; then each crafted
record is rebuilt. RESULTS.json gets, per case, the error's type and message and the modules
the attempt imported, and which target modules were loaded before and after all cases.
"""

from __future__ import annotations

import json
import pathlib
import sys

import graphmod as gm


def main(cases_file: str, results_file: str) -> None:
    cases = json.loads(pathlib.Path(cases_file).read_text())
    gm.rebuild(gm.Provenance.from_dict(cases["legit"]))
    targets = cases["targets"]
    results: dict = {"targets_before": [t for t in targets if t in sys.modules], "cases": {}}
    for name, record in cases["cases"].items():
        before = set(sys.modules)
        try:
            gm.rebuild(gm.Provenance.from_dict(record))
            outcome = {"error": None, "message": ""}
        except Exception as error:  # reported, and judged by the test
            outcome = {"error": type(error).__name__, "message": str(error)}
        outcome["imported"] = sorted(set(sys.modules) - before)
        results["cases"][name] = outcome
    results["targets_after"] = [t for t in targets if t in sys.modules]
    pathlib.Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
