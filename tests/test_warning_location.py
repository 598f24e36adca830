"""graphmod's warnings name the user's line (graphmod._core._warn), not one of graphmod's
own files: where a program is compiled or called, where a trace raised it, where a manager
was made (past a user's subclass's ``__init__``)."""

from __future__ import annotations

import functools
import inspect
import threading
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._warn import warn

X = np.random.RandomState(0).randn(10, 3).astype(np.float32)


def _line_below() -> int:
    """The line after the caller's."""
    return inspect.currentframe().f_back.f_lineno + 1  # type: ignore[union-attr]


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def test_a_warning_of_compile_names_the_line_that_compiled() -> None:
    model = _mlp()
    with managers.Dropout(0.1, roles=[roles.INPUT]), pytest.warns(
            UserWarning, match="are not among them and are ignored") as caught:
        line = _line_below()
        gm.compile(lambda m, x: m(x), model, managers=[])
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_a_warning_raised_while_a_program_traces_names_the_line_that_called_it() -> None:
    program = gm.compile(lambda m, x: m(x), _mlp(), mesh=jax.make_mesh((8,), ("data",)),
                         batch_axis="data")
    variables = program.init(X[:8])
    with pytest.warns(UserWarning, match=r"\(10, 3\) is not split over the 8 devices") as caught:
        line = _line_below()
        program.infer(variables, X)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_a_plugin_warning_names_the_line_that_ran_the_loop(tmp_path) -> None:
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), _mlp())
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(X[:2]), jax.random.key(0))
    loop = gm.Loop(step, gm.data.ArraySource((X,), 5), steps=2)
    with (tmp_path / "printed.txt").open("w") as printed, \
            pytest.warns(UserWarning, match="no_such_metric") as caught:
        loop.on(gm.On("step"), gm.plugins.Print("no_such_metric", file=printed))
        line = _line_below()
        loop.run(state)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


class _Named(managers.WeightNoise):
    """A user's manager passing the deprecated name= on to its base."""

    def __init__(self) -> None:
        super().__init__(0.1, roles=[roles.WEIGHT], name="noisy")


def test_a_deprecation_names_the_line_that_made_the_manager_past_its_subclass() -> None:
    with pytest.warns(DeprecationWarning, match="name= is deprecated") as caught:
        line = _line_below()
        _Named()
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_a_warning_with_only_library_frames_around_it_is_still_raised() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=functools.partial(warn, "from a thread", RuntimeWarning))
        thread.start()
        thread.join()
    assert [str(w.message) for w in caught] == ["from a thread"]
    assert caught[0].category is RuntimeWarning


def test_graphmods_warnings_are_filtered_by_their_category() -> None:
    program = gm.compile(lambda m, x: m(x), _mlp(), mesh=jax.make_mesh((8,), ("data",)),
                         batch_axis="data")
    variables = program.init(X[:8])
    with pytest.warns(UserWarning) as caught:  # a UserWarning, as before it had a category
        program.infer(variables, X)
    assert caught[0].category is gm.errors.GraphmodWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=gm.errors.GraphmodWarning)
        program.infer(variables, X[:9])  # another trace, its warning filtered


def test_the_managers_warn_in_graphmods_category_at_the_users_line() -> None:
    with pytest.warns(gm.errors.GraphmodWarning, match="without roles=") as caught:
        line = _line_below()
        managers.Dropout(0.1)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
