"""Loads an exported graphmod inference function with JAX and NumPy alone (no graphmod).

``graphmod.export(...).save(directory)`` copies this file into the directory as
``load.py``, so an export travels with its loader. The directory holds:

- ``function.jaxexport``: the function serialised by ``jax.export`` (StableHLO with its
  calling convention); it takes ``(variables, *args)``, ``variables`` a list of arrays;
- ``variables.npz``: those arrays, named by their path in graphmod's variables (arrays of
  a dtype NumPy lacks, such as bfloat16, stored as unsigned integers of the same width);
- ``manifest.json``: the format, the variables' names and dtypes in the order the function
  takes them, the arguments' and outputs' shapes (the batch axis by its symbol) and dtypes;
- ``provenance.json``: the program's provenance record.

As a script: ``python load.py DIRECTORY`` prints the signature; ``python load.py DIRECTORY
INPUTS.npz OUTPUTS.npz`` runs the function on the arrays ``arg0``, ``arg1``, ... of
``INPUTS.npz`` and writes the outputs' leaves as ``out0``, ``out1``, ... to ``OUTPUTS.npz``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

FORMAT = "graphmod.export/1"


def read(directory: str) -> tuple[jax.export.Exported, list[np.ndarray], dict, dict]:
    """``(exported, variables, manifest, provenance)`` as ``save`` wrote them."""
    def text(name: str) -> str:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            return f.read()

    manifest = json.loads(text("manifest.json"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: manifest format {manifest.get('format')!r}, "
                         f"this loader reads {FORMAT!r}")
    with open(os.path.join(directory, "function.jaxexport"), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    with np.load(os.path.join(directory, "variables.npz")) as stored:
        variables = [_as(stored[v["name"]], v["dtype"]) for v in manifest["variables"]]
    return exported, variables, manifest, json.loads(text("provenance.json"))


def load(directory: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(infer, provenance)``: ``infer(*args)`` runs the exported function on the saved
    variables; ``provenance`` is the program's record as a dict."""
    exported, variables, _, provenance = read(directory)
    return (lambda *args: exported.call(variables, *args)), provenance


def _as(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` read as ``dtype`` (the bits of a dtype NumPy lacks were stored as uint)."""
    wanted = jax.numpy.dtype(dtype)
    return array if array.dtype == wanted else array.view(wanted)


def _main(argv: list[str]) -> None:
    if len(argv) not in (1, 3):
        raise SystemExit("usage: python load.py DIRECTORY [INPUTS.npz OUTPUTS.npz]")
    exported, variables, manifest, _ = read(argv[0])
    if len(argv) == 1:
        print(json.dumps({k: manifest[k] for k in ("arguments", "outputs")}, indent=1))
        return
    with np.load(argv[1]) as inputs:
        args = [inputs[f"arg{i}"] for i in range(len(inputs.files))]
    leaves = jax.tree.leaves(exported.call(variables, *args))
    np.savez(argv[2], **{f"out{i}": np.asarray(leaf)  # type: ignore[arg-type]
                         for i, leaf in enumerate(leaves)})


if __name__ == "__main__":
    _main(sys.argv[1:])
