"""The path a reader follows from ``graphmod.compile`` to ``jax.jit`` for one train step is
short: at most 8 of graphmod's files (issue 46), each time ``jax.jit`` is called while a
program is compiled and trained for the first time, plus the file of ``compile`` itself."""

from __future__ import annotations

import inspect
import pathlib
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers

PACKAGE = pathlib.Path(gm.__file__).resolve().parent
MOST = 8


def _graphmod_files() -> list[str]:
    """The graphmod source files on the Python call stack, outermost first."""
    files = []
    frame = sys._getframe(1)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(PACKAGE):
            files.append(str(path.relative_to(PACKAGE.parent)))
        frame = frame.f_back
    return files[::-1]


def test_compile_reaches_jax_jit_through_at_most_eight_files(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stacks: list[list[str]] = []
    jit = jax.jit

    def recording(fun: Callable[..., object], *args: object, **kwargs: object) -> object:
        stacks.append(_graphmod_files())
        return jit(fun, *args, **kwargs)

    mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))

    def loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
        return ((model(x) - y) ** 2).mean()

    x, y = jnp.ones((5, 3)), jnp.ones((5, 2))
    dropout = managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[gm.roles.INPUT])
    with monkeypatch.context() as patch:
        patch.setattr(jax, "jit", recording)
        program = gm.compile(loss, mlp, managers=[dropout])
    compiled = len(stacks)
    variables = program.init(x, y)
    with monkeypatch.context() as patch:
        patch.setattr(jax, "jit", recording)
        program.train(variables, x, y, rng=jax.random.key(0))

    assert compiled >= 1, "compile made no jitted function: the path was not observed"
    source = inspect.getsourcefile(gm.compile)
    assert source is not None
    files = [str(pathlib.Path(source).resolve().relative_to(PACKAGE.parent))]
    for stack in stacks:
        files += [f for f in stack if f not in files]
    print("compile -> jax.jit:", *files, sep="\n  ")
    assert len(files) <= MOST, f"{len(files)} files from compile to jax.jit: {files}"
