"""The bad-input catalogue: every case gets graphmod's own error, naming the culprit and
the fix, raised before anything changes.

One world (a model with managers, its program and variables, a train step and its state, a
data source and a run directory holding a checkpoint) is built once; each case makes one
bad call against it. Each case asserts the error's type, that its message matches a
pattern naming the culprit (argument, path, field, plugin, schedule...) and, where one
exists, the fix, and that nothing changed: the model's arrays, the variables, the train
state, and the run directory's listing and bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import plugins, roles
from graphmod._cli import main as cli
from graphmod._train._checkpoint import Checkpointer
from graphmod.data import ArraySource


@dataclasses.dataclass
class World:
    mlp: Any
    program: Any
    variables: dict
    step: Any
    state: Any
    data: Any
    x: np.ndarray
    y: np.ndarray
    directory: pathlib.Path
    crafted: pathlib.Path  # a checkpoint whose record says the run was started with -c
    tmp: pathlib.Path


def _cost(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _dict_step(w: World) -> Any:
    """A train step over a function that returns the model's outputs, not a cost."""
    program = gm.compile(lambda m, x, y: {"logits": m(x)}, w.mlp)
    step = gm.optimize(program, optax.sgd(0.1))
    return step(step.init(program.init(w.x[:2], w.y[:2]), jax.random.key(0)), w.x, w.y)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("catalogue")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=32).astype(np.int32)
    mlp = gm.bricks.MLP([4, 5, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(_cost, mlp, managers=[
        managers.Dropout(0.1, bricks=mlp.linear_layers, roles=[roles.INPUT]),
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT])])
    variables = program.init(x[:2], y[:2])
    step = gm.optimize(program, optax.adam(1e-2))
    data = ArraySource((x, y), 8, shuffle=True, seed=1)
    directory = tmp / "run"
    loop = gm.Loop(step, data, steps=4, plugins=[
        plugins.Checkpoint(directory, every=gm.On("step", step=gm.each(2)))])
    loop.run(step.init(variables, jax.random.key(0)))
    state = step.init(variables, jax.random.key(0))
    crafted = tmp / "crafted"
    writer = Checkpointer(crafted, keep=None)
    writer.save(3, {"w": jnp.ones(3)}, {"command": {
        "kind": "script", "args": [], "cwd": str(tmp),
        "script": f"-cimport pathlib;pathlib.Path({str(tmp / 'pwned')!r}).touch()#.py"}})
    writer.close()
    return World(mlp, program, variables, step, state, data, x, y, directory, crafted, tmp)


def _leaves(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _snapshot(w: World) -> dict[str, Any]:
    files = sorted(p for p in w.tmp.rglob("*"))
    return {
        "model": _leaves(nnx.state(w.mlp)),
        "variables": _leaves(w.variables),
        "state": _leaves(w.state),
        "files": [(str(p.relative_to(w.tmp)),
                   hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
                  for p in files],
    }


class CommandFailed(Exception):
    """The ``graphmod`` command exited non-zero; the message is what it printed to stderr."""


def _command(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli(list(argv))
        except SystemExit as exit:  # argparse exits on a bad command line
            code = exit.code
    if code != 0:
        raise CommandFailed(f"exit {code}: {err.getvalue()}")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[World], Any]
    error: type[BaseException]
    pattern: str  # a regex the message must match: the culprit and, where one exists, the fix


def _replaced(variables: dict, layer: int, name: str, value: Any) -> dict:
    """A copy of ``variables`` with one leaf of the model replaced."""
    model = jax.tree.map(lambda leaf: leaf, variables["model"])
    model["linear_layers"][layer][name] = value
    return {"model": model, "managers": variables["managers"]}


def _wider(w: World) -> dict:
    """The variables of a [4, 16, 3] MLP, under the same managers."""
    mlp = gm.bricks.MLP([4, 16, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(_cost, mlp, managers=[
        managers.Dropout(0.1, bricks=mlp.linear_layers, roles=[roles.INPUT]),
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT])])
    return program.init(w.x[:2], w.y[:2])


def _donated(w: World) -> Any:
    """A state a step call took over (a copy of the world's, so the world's stays)."""
    state = jax.tree.map(jnp.copy, w.state)
    w.step(state, w.x[:8], w.y[:8])
    return state


def _loop(w: World, *plugs: Any, **settings: Any) -> gm.Loop:
    return gm.Loop(w.step, w.data, steps=2, plugins=plugs, **settings)


class FailingSetup(gm.Plugin):
    """A plugin whose setup raises."""

    def setup(self, loop: Any) -> None:
        raise OSError("the log server is down")


def _record(field: str, value: Any) -> str:
    """A program record (JSON) with ``value`` in the root brick's ``field`` argument."""
    program = gm.compile(lambda m, x: m(x).sum(), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
    program.init(np.ones((1, 2), np.float32))
    record = program.provenance.to_dict()
    record["inputs"]["bricks"]["/"]["arguments"][field] = value
    return json.dumps(record)


class _Holding(nnx.Module):
    """A model of one variable, which scales the input."""

    def __init__(self, variable: nnx.Variable) -> None:
        self.held = variable

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.held[...]


def _train_held(variable: nnx.Variable) -> Any:
    program = gm.compile(lambda m, x: m(x).sum(), _Holding(variable))
    step = gm.optimize(program, optax.sgd(0.1))
    return step.init(program.init(np.ones(3, np.float32)), jax.random.key(0))


def _after_compile(change: Callable[[_Holding], None]) -> Any:
    """Compiles a one-variable model, changes it with ``change``, then inits the program."""
    model = _Holding(nnx.Param(jnp.ones(3)))
    program = gm.compile(lambda m, x: m(x).sum(), model)
    change(model)
    return program.init(np.ones(3, np.float32))


_PICKLE = {"$call": {"function": "jax._src.pickle_util.loads", "kwargs": {"data": {"$array": {
    "dtype": "uint8", "shape": [3], "data": [128, 4, 46]}}}}}


CASES = [
    # -- managers and filters ---------------------------------------------------------------
    Case("a train step over a function returning a dict", lambda w: _dict_step(w),
         TypeError, r"optimize: <lambda> returned a dict, not a cost: a "
        r"train step needs a float scalar, or \(cost, \{'name': metric"),
    Case("one manager where a list goes", lambda w: gm.compile(_cost, w.mlp,
                                                               managers=managers.L2(1e-4)),
         TypeError, r"compile\(managers=\.\.\.\): expected a list of managers, got one "
         r"\(L2\(.*pass managers=\[L2\(\.\.\.\)\]"),
    Case("a filter field misspelled", lambda w: managers.Dropout(0.1, role=[roles.INPUT]),
         TypeError, r"Dropout: no argument role= \(did you mean roles=\?\); it takes rate, "),
    Case("dropout rate above 1", lambda w: managers.Dropout(2.0), ValueError,
         r"Dropout\(rate=2\.0\).*\[0, 1\]"),
    Case("dropout rate a string", lambda w: managers.Dropout("half"), ValueError,
         r"Dropout\(rate='half'\).*float"),
    Case("negative weight noise", lambda w: managers.WeightNoise(-1.0), ValueError,
         r"WeightNoise\(std=-1\.0\).*>= 0"),
    Case("batch norm momentum above 1", lambda w: managers.BatchNorm(momentum=2.0), ValueError,
         r"BatchNorm\(momentum=2\.0\).*\[0, 1\]"),
    Case("batch norm epsilon negative", lambda w: managers.BatchNorm(epsilon=-1.0), ValueError,
         r"BatchNorm\(epsilon=-1\.0\).*> 0"),
    Case("a role given as a string", lambda w: managers.Dropout(0.5, roles=["weight"]),
         TypeError, r"'weight' is not a role.*WEIGHT"),
    Case("a filter path that is not a string", lambda w: gm.VariableFilter(path=3), TypeError,
         r"VariableFilter\(path=3\).*string.*path="),
    Case("a call id that is not an int", lambda w: gm.VariableFilter(call_id="a"), TypeError,
         r"VariableFilter\(call_id='a'\).*ints"),
    Case("an invalid name regex", lambda w: gm.VariableFilter(name_regex="("), ValueError,
         r"VariableFilter\(name_regex='\('\).*regular expression"),
    Case("a filter brick given by name", lambda w: gm.VariableFilter(bricks=["linear"]),
         TypeError, r"bricks=.*'linear'.*Brick instance nor a brick class.*path='/linear\.\*' "
         r"\(its own\) or path='/linear\*'"),
    Case("a variable given as a brick", lambda w: gm.VariableFilter(
        bricks=[nnx.Param(jnp.ones((64, 64)))]), TypeError, r"got a Param variable, not a "
         r"brick: select variables by name \(name='kernel'\) or path"),
    Case("a Variable type given as a brick class", lambda w: gm.VariableFilter(
        bricks=[nnx.Param]), TypeError, r"Param is a Variable type, not a brick class: select "
         r"its variables by role"),
    Case("a filter brick given as a path glob", lambda w: managers.Remat(bricks=["/layers/*"]),
         TypeError, r"'/layers/\*' is neither.*to select by path, give path='/layers/\*'"),
    Case("an unknown dynamic hyperparameter",
         lambda w: managers.Dropout(gm.dynamic(0.5)).hparam("p"), KeyError,
         r"Dropout has no hyperparameter 'p'.*'rate'"),
    Case("a dynamic value that is not a number", lambda w: gm.dynamic("a"), TypeError,
         r"dynamic\(value\).*float.*'a'"),
    Case("a role parent that is not a role", lambda w: roles.add_role("MINE", "weight"),
         TypeError, r"add_role: parent of 'MINE' must be a Role"),
    # -- compile, programs, bricks ----------------------------------------------------------
    Case("compile of a non-callable", lambda w: gm.compile(3, w.mlp), TypeError,
         r"compile\(fn, model\): fn must be callable, got 3"),
    Case("compile of a non-module", lambda w: gm.compile(_cost, 3), TypeError,
         r"model must be a flax.nnx.Module.*got int"),
    Case("a manager list holding a string", lambda w: gm.compile(_cost, w.mlp, managers=["x"]),
         TypeError, r"managers\[0\]: 'x' is not a graphmod.Manager"),
    Case("two managers with one name", lambda w: gm.compile(
        _cost, w.mlp, managers=[managers.Dropout(0.1), managers.Dropout(0.2)]), ValueError,
        r"two managers are named 'dropout'.*name=\.\.\."),
    Case("a monitor that is not a filter", lambda w: gm.compile(_cost, w.mlp, monitor=3),
         TypeError, r"monitor=: expected a VariableFilter or a dict of them, got 3"),
    Case("a variable holding a dict", lambda w: gm.compile(_cost, _Holding(nnx.Variable(
        {"n": jnp.zeros(3)}))), TypeError,
        r"variable /\.held holds a dict, not an array.*one Variable per array"),
    Case("a model of hijax variables", lambda w: gm.compile(_cost, _Holding(nnx.Param(
        jnp.zeros(3), hijax=True))), TypeError,
        r"variable /\.held is a hijax variable.*nnx\.with_vars\(model, hijax=False\)"),
    Case("a model of ref variables", lambda w: gm.compile(_cost, _Holding(nnx.Param(
        jnp.zeros(3), ref=True))), TypeError,
        r"variable /\.held is a ref variable.*nnx\.with_vars\(model, ref=False\)"),
    Case("a variable replaced after compile", lambda w: _after_compile(
        lambda m: setattr(m, "held", nnx.Param(jnp.ones(3)))), ValueError,
        r"program.init: the model changed since it was compiled: /\.held is another Param"
        r".*compile again"),
    Case("a variable reshaped after compile", lambda w: _after_compile(
        lambda m: m.held.set_value(jnp.ones(4))), ValueError,
        r"/\.held has shape \(4,\).*expected \(3,\).*compile again"),
    Case("variables without their layout", lambda w: w.program.infer({"a": 1}, w.x, w.y),
         ValueError, r"variables must be the dict made by program.init.*\['a'\]"),
    Case("update_model with an empty model", lambda w: w.program.update_model(
        {"model": {}, "managers": {}}), ValueError,
        r"variables\['model'\].*missing linear_layers/0/W"),
    Case("an input with the wrong feature size", lambda w: w.program.infer(
        w.variables, np.ones((8, 5), np.float32), w.y), ValueError,
        r"argument 'x': expected shape \(batch, 4\).*got shape \(8, 5\)"),
    Case("one example instead of a batch", lambda w: w.program.infer(
        w.variables, w.x[0], w.y), ValueError,
        r"got shape \(4,\).*one example rather than a batch\? Batch the data, e\.g\. "
        r"graphmod\.data\.ArraySource"),
    Case("an input with the wrong dtype", lambda w: w.program.infer(
        w.variables, w.x, w.y.astype(np.float32)), ValueError,
        r"argument 'y'.*dtype int32.*float32"),
    Case("a string argument to train", lambda w: w.program.train(
        w.variables, w.x, "labels", rng=jax.random.key(0)), TypeError,
        r"program.train: argument 'y' is 'labels' \(str\), not an array.*functools.partial"),
    Case("a string argument to init", lambda w: w.program.init(w.x, "labels"), TypeError,
         r"program.init: argument 'y' is 'labels' \(str\)"),
    Case("a step given a field its function lacks", lambda w: w.step(
        w.state, x=w.x[:4], label=w.y[:4]), TypeError,
        r"the train step: _cost\(model, x, y\) cannot take keyword arguments \['label', 'x'\]"
        r".*name the data's fields after _cost's arguments"),
    Case("split by a string role", lambda w: w.program.split(w.variables, "weight"), TypeError,
         r"program.split\(variables, \*roles\): 'weight' is not a role"),
    Case("graph in an unknown mode", lambda w: w.program.graph(w.x, w.y, mode="eval"),
         ValueError, r"graph\(mode='eval'\): mode must be 'train' or 'infer'"),
    Case("a linear layer of width 0", lambda w: gm.bricks.Linear(0, 3, rngs=nnx.Rngs(0)),
         ValueError, r"Linear\(in_features=0\): must be a positive int"),
    Case("an MLP with one size", lambda w: gm.bricks.MLP([4], rngs=nnx.Rngs(0)), ValueError,
         r"MLP\(dims=\[4\]\): needs at least an input and an output size"),
    Case("an MLP with a zero width", lambda w: gm.bricks.MLP([4, 0, 2], rngs=nnx.Rngs(0)),
         ValueError, r"MLP\(dims\[1\]=0\): must be a positive int"),
    Case("a convolution with kernel size 0", lambda w: gm.bricks.Conv(
        3, 4, kernel_size=0, rngs=nnx.Rngs(0)), ValueError,
        r"Conv\(kernel_size=0\): must be a positive int"),
    Case("an empty embedding table", lambda w: gm.bricks.Embedding(0, 4, rngs=nnx.Rngs(0)),
         ValueError, r"Embedding\(num_embeddings=0\): must be a positive int"),
    # -- optimize -----------------------------------------------------------------------------
    Case("optimize with no optax transformation", lambda w: gm.optimize(w.program, 3),
         TypeError, r"optimize\(program, tx\): tx must be an optax GradientTransformation"),
    Case("optimize of a non-program", lambda w: gm.optimize(3, optax.sgd(0.1)), TypeError,
         r"optimize\(program, tx\): expected a graphmod Program, got int"),
    Case("an integer parameter to train", lambda w: _train_held(nnx.Param(jnp.arange(3))),
         TypeError, r"parameters model/held \(int32\) are not floating-point.*nnx\.Variable"
         r".*trainable="),
    # -- the loop, schedules, templates, plugins, data ---------------------------------------
    Case("a loop over no step", lambda w: gm.Loop(None, w.data), TypeError,
         r"Loop\(step, data\): step must be callable, got None"),
    Case("a loop over an int", lambda w: gm.Loop(w.step, 3), TypeError,
         r"Loop\(step, data\): data must be iterable, got int"),
    Case("a loop of zero epochs", lambda w: gm.Loop(w.step, w.data, epochs=0), ValueError,
         r"Loop\(epochs=0\): must be a positive int"),
    Case("zero steps per call", lambda w: gm.Loop(w.step, w.data, steps_per_call=0),
         ValueError, r"Loop\(steps_per_call=0\): must be a positive int"),
    Case("an empty data source", lambda w: gm.Loop(w.step, []), ValueError,
         r"Loop\(step, data\): the data source is empty"),
    Case("each(0)", lambda w: gm.each(0), ValueError, r"each\(n\): n must be > 0, got 0"),
    Case("a template field that is no timeline", lambda w: gm.On("step", stpe=gm.each(2)),
         ValueError, r"On\('step', stpe=\.\.\.\).*one of step, epoch"),
    Case("a template type that is not a name", lambda w: gm.On(3), TypeError,
         r"On\(type\): expected an event type name, got 3"),
    Case("keep=0 checkpoints", lambda w: plugins.Checkpoint(w.tmp / "other", keep=0),
         ValueError, r"Checkpoint\(keep=0\): must be a positive int or None"),
    Case("early stopping with negative patience", lambda w: plugins.EarlyStopping(
        "loss", patience=-1), ValueError, r"EarlyStopping\(patience=-1\): must be a positive"),
    Case("anneal of something that is no hyperparameter", lambda w: plugins.Anneal(
        3, lambda t: 0.1), TypeError, r"Anneal\(hparam\).*manager.hparam\(name\)"),
    Case("validation of a non-program", lambda w: plugins.Validation(3, w.data), TypeError,
         r"Validation\(program\).*program.derive"),
    Case("a batch size of 0", lambda w: ArraySource((w.x, w.y), 0), ValueError,
         r"ArraySource\(batch_size=0\): must be a positive int"),
    Case("a data source of nothing", lambda w: ArraySource((), 2), ValueError,
         r"ArraySource\(arrays\): no arrays given"),
    Case("an unknown metric", lambda w: gm.evaluate(w.program, w.variables, w.data,
                                                    metrics=["acc"]), ValueError,
         r"unknown metric 'acc'.*accuracy"),
    Case("a misspelt metric", lambda w: gm.evaluate(w.program, w.variables, w.data,
                                                     metrics=["acuracy"]), ValueError,
         r"unknown metric 'acuracy' \(did you mean 'accuracy'\?\): use a "
         r"graphmod.metrics.Metric"),
    Case("a non-callable to derive", lambda w: w.program.derive(3), TypeError,
         r"program.derive\(fn\): fn must be callable"),
    # -- variables against the layout, keys and batches --------------------------------------
    Case("the variables of a wider MLP", lambda w: w.program.train(
        _wider(w), w.x, w.y, rng=jax.random.key(0)), ValueError,
        r"/linear_layers/0.W has shape \(4, 16\).*expected \(4, 5\).*program.init"),
    Case("a bias of shape (1,)", lambda w: w.program.infer(
        _replaced(w.variables, 0, "b", jnp.zeros(1)), w.x, w.y), ValueError,
        r"/linear_layers/0.b has shape \(1,\).*expected \(5,\)"),
    Case("a bfloat16 weight", lambda w: w.program.update_model(_replaced(
        w.variables, 1, "W", w.variables["model"]["linear_layers"][1]["W"].astype(
            jnp.bfloat16))), ValueError, r"/linear_layers/1.W .*bfloat16; expected .*float32"),
    Case("wider variables to evaluate", lambda w: gm.evaluate(
        w.program, _wider(w), w.data, metrics=["accuracy"]), ValueError,
        r"/linear_layers/0.W has shape \(4, 16\)"),
    Case("wider variables to a train step", lambda w: w.step.init(
        _wider(w), jax.random.key(0)), ValueError, r"/linear_layers/1.W has shape \(16, 3\)"),
    Case("an int as the key of train", lambda w: w.program.train(w.variables, w.x, w.y, rng=0),
         TypeError, r"rng must be one JAX random key, e.g. rng=jax.random.key\(0\).*got 0"),
    Case("an int as the key of a train state", lambda w: w.step.init(w.variables, 0),
         TypeError, r"step.init\(variables, rng\): rng must be one JAX random key"),
    Case("an int as the key of init", lambda w: w.program.init(w.x, w.y, rng=0), TypeError,
         r"program.init\(\.\.\., rng=key\): rng must be one JAX random key"),
    Case("x with 8 rows and y with 5", lambda w: w.program.infer(w.variables, w.x[:8],
                                                                  w.y[:5]), ValueError,
         r"argument 'x' has 8 rows, argument 'y' has 5 rows.*same number of rows"),
    Case("a data source with 8 and 5 rows", lambda w: ArraySource((w.x[:8], w.y[:5]), 2),
         ValueError, r"arrays\[0\] has 8 rows; arrays\[1\] has 5 rows"),
    # -- the loop, its plugins and resumes ---------------------------------------------------
    Case("at(1.5) on the step timeline", lambda w: gm.On("step", step=gm.at(1.5)), ValueError,
         r"at\(1\.5\).*step timeline.*Use integers on step"),
    Case("each(2.5) on the epoch timeline", lambda w: gm.On("epoch_end", epoch=gm.each(2.5)),
         ValueError, r"each\(2\.5\).*epoch timeline"),
    Case("a misspelt event type", lambda w: _run_with(w, gm.On("stpe")), ValueError,
         r"'stpe'.*\(did you mean 'step'\?\)"),
    Case("a loop run on no state", lambda w: _loop(w).run(None), TypeError,
         r"Loop.run\(state\): state is None.*step.init"),
    Case("a loop run on variables", lambda w: _loop(w).run(w.variables), TypeError,
         r"Loop.run\(state\).*TrainState, got dict.*step.init"),
    Case("a loop run on a state an earlier step took", lambda w: _loop(w).run(
        _donated(w)), ValueError, r"Loop.run\(state\): the state's arrays were donated to an "
        r"earlier step call \(state\.opt_state\[0\]\.count, and 22 more\).*start from the "
        r"state that run or call returned.*jnp.copy"),
    Case("data of another feature size to a loop", lambda w: gm.Loop(
        w.step, ArraySource((w.x[:, :3], w.y), 8), steps=2).run(w.state), ValueError,
        r"Loop.run: the data's batches do not fit the program: argument 'x': expected shape "
        r"\(batch, 4\)"),
    Case("a plugin whose setup raises", lambda w: _loop(w, FailingSetup()).run(w.state),
         gm.PluginError, r"plugin 'failing_setup' raised in setup: OSError"),
    Case("a resume from a missing directory", lambda w: gm.Loop.resume(
        w.tmp / "missing", w.step, w.data), FileNotFoundError,
        r"Loop.resume: no checkpoint in .*missing.*nothing was created"),
    Case("a resume on other data", lambda w: gm.Loop.resume(
        w.directory, w.step, ArraySource((w.x, w.y), 8, shuffle=True, seed=2)), ValueError,
        r"data differ.*seed.*allow_data_change=True"),
    Case("a fresh run into another run's directory", lambda w: _loop(
        w, plugins.Checkpoint(w.directory)).run(w.state), gm.PluginError,
        r"holds checkpoints this run did not write.*resume=True.*overwrite=True"),
    Case("resume and overwrite at once", lambda w: plugins.Checkpoint(
        w.directory, resume=True, overwrite=True), ValueError,
        r"Checkpoint\(resume=True, overwrite=True\): pick one"),
    # -- provenance ---------------------------------------------------------------------------
    Case("rebuild of a non-record", lambda w: gm.rebuild(3), TypeError,
         r"rebuild: expected a Provenance, got int"),
    Case("a record that is not JSON", lambda w: gm.Provenance.from_json("{"),
         gm.provenance.ProvenanceError, r"from_json: the text is not JSON.*line 1"),
    Case("a record calling a private loader", lambda w: gm.rebuild(
        _record("kernel_init", _PICKLE)), gm.provenance.RebuildError,
        r"bricks\['/'\]\.arguments\.kernel_init.*jax\._src\.pickle_util\.loads"),
    Case("a record calling the command line", lambda w: gm.rebuild(_record("kernel_init", {
        "$call": {"function": "graphmod._cli.main", "kwargs": {"argv": ["run", "x.py"]}}})),
        gm.provenance.RebuildError, r"kernel_init.*graphmod\._cli\.main"),
    Case("a record calling os.system", lambda w: gm.rebuild(_record("bias_init", {
        "$call": {"function": "os.system", "kwargs": {"command": "true"}}})),
        gm.provenance.RebuildError, r"bias_init.*os\.system.*allow"),
    # -- the command --------------------------------------------------------------------------
    Case("inspect of a missing directory", lambda w: _command("inspect", str(w.tmp / "none")),
         CommandFailed, r"exit 2: .*no run directory at .*none"),
    Case("resume of a missing directory", lambda w: _command("resume", str(w.tmp / "none")),
         CommandFailed, r"exit 2: .*none"),
    Case("resume of a run recorded as python -c", lambda w: _command("resume", str(w.crafted)),
         CommandFailed, r"exit 2: .*graphmod.Loop.resume\("),
    Case("a bad flag", lambda w: _command("--badflag"), CommandFailed,
         r"exit 2: .*unrecognized arguments: --badflag"),
    Case("run with no script", lambda w: _command("run"), CommandFailed,
         r"exit 2: .*script"),
]


def _run_with(w: World, template: Any) -> Any:
    """Runs a loop with a listener for ``template``."""
    loop = _loop(w)
    loop.on(template, lambda event: None)
    return loop.run(w.state)


def test_the_catalogue_holds_at_least_sixty_cases() -> None:
    assert len(CASES) >= 60
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_naming_the_culprit_and_nothing_changes(
        case: Case, world: World) -> None:
    before = _snapshot(world)
    with pytest.raises(case.error) as caught:
        case.call(world)
    message = str(caught.value.args[0]) if caught.value.args else str(caught.value)
    assert re.search(case.pattern, message, re.S), message
    after = _snapshot(world)
    for part in before:
        assert after[part] == before[part], f"the {part} changed"
