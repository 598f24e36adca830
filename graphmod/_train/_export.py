"""``export``: a program's inference function serialised with ``jax.export``, to run where
graphmod is not installed.

The exported function is ``program.infer`` traced once more, as StableHLO, with a
symbolic batch axis: the leading axis of every array argument is the dimension variable
``batch`` (any size at call time; ``batch=None`` keeps the example's shapes). Managers run
in inference mode as in ``program.infer``, and a program's fitted input transformations
(``compile(..., transforms=)``) are inside it. The variables are an input of the function,
not constants in it: the file stays small and the same function runs other variables of the
layout. The files ``ExportedProgram.save`` writes, and the loader that needs only JAX and
NumPy (copied beside them as ``load.py``), are described in the guide's "Export" section.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from graphmod._core._program._program_core import ProgramCore
from graphmod._records._record import Provenance
from graphmod._train import _export_loader
from graphmod.typing import JSON, ArrayLike, PyTree, Variables

_FUNCTION, _VARIABLES, _MANIFEST, _PROVENANCE, _LOADER = (
    "function.jaxexport", "variables.npz", "manifest.json", "provenance.json", "load.py")


class ExportedProgram:
    """An inference function exported by :func:`export`: call it, or ``save`` it.

    Attributes:
        exported: JAX's ``jax.export.Exported`` of ``(variables, *args) -> out``.
        variables: the variables' arrays, in the order the function takes them.
        names: each variable's path in the program's variables (``['model']['W']``).
        provenance: the program's provenance record (None: loaded without one).

    Examples:
        >>> import tempfile, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> exported = gm.export(program, variables, jnp.ones((1, 2)))
        >>> exported(jnp.ones((5, 2))).shape
        (5, 3)
        >>> directory = tempfile.mkdtemp()
        >>> exported.save(directory)
        >>> again = gm.ExportedProgram.load(directory)
        >>> bool((again(jnp.ones((5, 2))) == exported(jnp.ones((5, 2)))).all())
        True
    """

    def __init__(self, exported: jax.export.Exported, variables: Sequence[np.ndarray],
                 names: Sequence[str], provenance: Provenance | None) -> None:
        self.exported = exported
        self.variables = list(variables)
        self.names = list(names)
        self.provenance = provenance

    def __call__(self, *args: ArrayLike) -> Any:
        """Runs the exported function on :attr:`variables` and ``args``."""
        return self.exported.call(self.variables, *args)

    def __repr__(self) -> str:
        arguments = ", ".join(map(str, self.exported.in_avals[len(self.variables):]))
        outputs = ", ".join(map(str, self.exported.out_avals))
        return (f"ExportedProgram(({arguments}) -> ({outputs}), {len(self.variables)} "
                f"variables, platforms={self.exported.platforms})")

    def save(self, directory: str | os.PathLike) -> None:
        """Writes the function, its variables, a manifest, the provenance and ``load.py``
        (a loader needing only JAX and NumPy) into ``directory`` (created when missing;
        refused when it holds an export already)."""
        directory = os.fspath(directory)
        if os.path.exists(os.path.join(directory, _MANIFEST)):
            raise FileExistsError(f"ExportedProgram.save({directory!r}): holds an export "
                                  "already; save to a new directory or delete that one")
        blob = self.exported.serialize()  # first: nothing is written when it fails
        os.makedirs(directory, exist_ok=True)
        stored = {name: _storable(array) for name, array in zip(self.names, self.variables,
                                                                strict=True)}
        np.savez(os.path.join(directory, _VARIABLES), **stored)  # type: ignore[arg-type]
        with open(os.path.join(directory, _FUNCTION), "wb") as f:
            f.write(blob)
        with open(os.path.join(directory, _PROVENANCE), "w", encoding="utf-8") as f:
            f.write(self.provenance.to_json() if self.provenance is not None else "{}")
        shutil.copyfile(_export_loader.__file__, os.path.join(directory, _LOADER))
        with open(os.path.join(directory, _MANIFEST), "w", encoding="utf-8") as f:
            json.dump(self._manifest(), f, indent=1)  # last: its presence marks an export

    def _manifest(self) -> dict[str, JSON]:
        exported, count = self.exported, len(self.variables)
        return {
            "format": _export_loader.FORMAT,
            "variables": [{"name": n, "dtype": str(np.asarray(a).dtype),
                           "shape": list(np.shape(a))}
                          for n, a in zip(self.names, self.variables, strict=True)],
            "arguments": [_aval(a) for a in exported.in_avals[count:]],
            "outputs": [_aval(a) for a in exported.out_avals],
            "platforms": list(exported.platforms),
            "jax_version": jax.__version__,
            "calling_convention_version": exported.calling_convention_version,
        }

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ExportedProgram:
        """Reads what :meth:`save` wrote (with the loader saved beside it, which needs no
        graphmod)."""
        directory = os.fspath(directory)
        if not os.path.exists(os.path.join(directory, _MANIFEST)):
            raise FileNotFoundError(f"ExportedProgram.load({directory!r}): no {_MANIFEST}; "
                                    "is it a directory ExportedProgram.save wrote?")
        exported, variables, manifest, record = _export_loader.read(directory)
        names = [v["name"] for v in manifest["variables"]]
        return cls(exported, variables, names, Provenance.from_dict(record) if record else None)


def export(program: ProgramCore, variables: Variables, *example_args: PyTree,
           batch: str | None = "batch", platforms: Sequence[str] | None = None
           ) -> ExportedProgram:
    """Exports ``program.infer`` with ``variables`` as StableHLO (``jax.export``), with a
    symbolic batch axis, to run without graphmod.

    The function takes the variables and arguments shaped as ``example_args``; with
    ``batch`` (a dimension name), the leading axis of each argument of rank 1 or more is
    symbolic, so any batch size runs, and gives the outputs ``program.infer`` gives
    (bitwise on the platform it was exported on). ``ExportedProgram.save(directory)``
    writes it with its variables, its provenance and a loader needing only JAX and NumPy.

    Args:
        program: a compiled (or derived) program; its inference mode is exported.
        variables: the program's variables (``program.init``, or trained ones).
        *example_args: arrays (or ``jax.ShapeDtypeStruct``) shaped like the arguments
            after the model; only their shapes and dtypes are used.
        batch: the name of the symbolic leading axis, or None for the examples' shapes.
        platforms: the platforms to compile for (``("cpu", "cuda")``; default: this one).

    Returns:
        An :class:`ExportedProgram`.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([2, 8, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), mlp)
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> exported = gm.export(program, variables, jnp.ones((1, 2)))
        >>> exported.exported.in_avals[-1]
        ShapedArray(float32[batch,2])
        >>> bool((exported(jnp.ones((7, 2))) == program.infer(variables, jnp.ones((7, 2)))).all())
        True
    """
    if not isinstance(program, ProgramCore):
        raise TypeError(f"graphmod.export(program, ...): expected a program made by "
                        f"graphmod.compile (or derive), got {type(program).__name__}")
    if batch is not None and (not isinstance(batch, str) or not batch.isidentifier()):
        raise ValueError(f"graphmod.export(batch={batch!r}): must be a dimension name such "
                         "as 'batch', or None for the examples' fixed shapes")
    symbols = jax.export.symbolic_shape(batch) if batch is not None else ()
    arguments = [jax.tree.map(functools.partial(_spec, symbols=symbols, index=i), arg)
                 for i, arg in enumerate(example_args)]
    program.infer.lower(variables, *example_args)  # names a mismatch with the layout
    flat, tree = jax.tree_util.tree_flatten_with_path(variables)
    leaves = [leaf for _, leaf in flat]
    keys = [_is_key(leaf) for leaf in leaves]
    impls = [jax.random.key_impl(leaf) if key else None for leaf, key in zip(leaves, keys,
                                                                            strict=True)]

    def infer(stored: list[jax.Array], *args: PyTree) -> object:
        # Key arrays travel as their data (a file holds no key type), wrapped back here.
        values = [jax.random.wrap_key_data(v, impl=impl) if impl is not None else v
                  for v, impl in zip(stored, impls, strict=True)]
        return program.infer(jax.tree.unflatten(tree, values), *args)

    arrays = [np.asarray(jax.random.key_data(leaf) if key else leaf)
              for leaf, key in zip(leaves, keys, strict=True)]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    try:
        exported = jax.export.export(jax.jit(infer), platforms=platforms)(specs, *arguments)
    except Exception as error:
        if batch is not None:
            error.add_note(f"graphmod.export: the function was traced with a symbolic batch "
                           f"axis {batch!r}; a model that needs its batch size as a number "
                           "exports with batch=None (fixed shapes)")
        raise
    names = [jax.tree_util.keystr(path) for path, _ in flat]
    return ExportedProgram(exported, arrays, names, getattr(program, "provenance", None))


def _spec(leaf: object, *, symbols: Sequence[object], index: int) -> jax.ShapeDtypeStruct:
    """The abstract argument for ``leaf``: its shape, the leading axis symbolic."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        leaf = np.asarray(leaf)
        shape, dtype = leaf.shape, leaf.dtype
    if dtype == np.dtype(object):
        raise TypeError(f"graphmod.export: example argument {index} holds {leaf!r}, not an "
                        "array; pass arrays (or jax.ShapeDtypeStruct) shaped like the inputs")
    shape = tuple(shape)
    if symbols and shape:
        shape = (symbols[0], *shape[1:])
    return jax.ShapeDtypeStruct(shape, dtype)


def _is_key(leaf: object) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _storable(array: np.ndarray) -> np.ndarray:
    """``array`` as NumPy stores it: a dtype NumPy lacks (bfloat16) as uint bits."""
    return array if array.dtype.isbuiltin else array.view(f"u{array.dtype.itemsize}")


def _aval(aval: ShapedArray) -> dict[str, JSON]:
    return {"shape": [d if isinstance(d, int) else str(d) for d in aval.shape],
            "dtype": str(aval.dtype)}
