"""rebuild constructs only what a record may name; crafted records are refused, naming the field,
before anything they name is imported (issue 8, item 1)."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._bricks._construction import config_of
from graphmod.plugins import Checkpoint
from graphmod.provenance import DEFAULT_FACTORIES, ProvenanceError, RebuildError
from graphmod.provenance._decoder import RecordDecoder
from graphmod.provenance._names import Rules
from tests.provenance.provenance_workload import build, source

ROOT = pathlib.Path(__file__).parents[2]
WORKER = pathlib.Path(__file__).with_name("crafted_rebuild.py")
# Modules a crafted record names that nothing imports by itself: they must stay unimported.
TARGETS = ["graphmod._cli", "runpy", "evilmod", "jax.experimental.serialize_executable",
           "flax.training.checkpoints"]


class _Payload:
    """Pickles to a call of ``os.system(command)``: never unpickled by these tests."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def _cost(model: Any, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


def _step() -> gm.TrainStep:
    """A step whose record uses every tag: bricks in bricks, a factory-made initializer, a
    function value, brick paths and classes in filters, a monitor, a chained optimizer."""
    rngs = nnx.Rngs(0)
    first = gm.bricks.Linear(3, 4, kernel_init=nnx.initializers.normal(0.1), rngs=rngs)
    model = gm.bricks.Sequence(first, jax.nn.relu, gm.bricks.Linear(4, 2, rngs=rngs))
    program = gm.compile(_cost, model, managers=[
        managers.Dropout(gm.dynamic(0.5), bricks=[first], roles=[roles.OUTPUT]),
        managers.BatchNorm(filter=gm.VariableFilter(bricks=[gm.bricks.Linear],
                                                    roles=[roles.OUTPUT]))],
        monitor={"first": gm.VariableFilter(bricks=[first], roles=[roles.OUTPUT])})
    program.init(np.ones((2, 3), np.float32))
    schedule = gm.provenance.optimizer("cosine_decay_schedule", 0.1, 100)
    return gm.optimize(program, gm.provenance.optimizer(
        "chain", gm.provenance.optimizer("clip_by_global_norm", 1.0),
        gm.provenance.optimizer("adam", schedule)))


@pytest.fixture(scope="module")
def legit() -> dict[str, Any]:
    return _step().provenance.to_dict()


def _bytes(data: bytes) -> dict[str, Any]:
    return {"$array": {"kind": "numpy", "dtype": "uint8", "shape": [len(data)],
                       "data": list(data)}}


def _call(function: str, **kwargs: Any) -> dict[str, Any]:
    return {"$call": {"function": function, "kwargs": kwargs}}


def _partial(function: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"$partial": {"function": function, "args": list(args), "kwargs": kwargs}}


def _set(*keys: Any) -> Callable[[dict, Any], None]:
    """An edit putting a value at ``inputs[keys...]``."""
    def edit(record: dict, value: Any) -> None:
        node = record["inputs"]
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return edit


ROOT_ARG = _set("bricks", "/", "arguments", "kernel_init")
LAYER = _set("bricks", "/", "arguments", "layers", 1)
NESTED_INIT = _set("bricks", "/", "arguments", "layers", 0, "$brick", "arguments",
                   "kernel_init")


def _cases(tmp: pathlib.Path) -> dict[str, tuple[str, Callable[[dict, Any], None], Any]]:
    """name → (the field the refusal must name, edit, value)."""
    marker = tmp / "pwned"
    touch = f"touch {marker}"
    payload = pickle.dumps(_Payload(touch))
    evil_py, evil_npy = str(tmp / "evil.py"), str(tmp / "evil.npy")
    init = "bricks['/'].arguments.kernel_init"
    layer = "bricks['/'].arguments.layers[1]"
    return {
        # the two records of the issue, and the usual suspects, as factories
        "jax_src_pickle_util_loads": (init, ROOT_ARG, _call("jax._src.pickle_util.loads",
                                                            data=_bytes(payload))),
        "graphmod_cli_main": (init, ROOT_ARG, _call("graphmod._cli.main",
                                                    argv=["run", evil_py])),
        "os_system": (init, ROOT_ARG, _call("os.system", command=touch)),
        "subprocess_popen": (init, ROOT_ARG, _call("subprocess.Popen", args=["touch",
                                                                             str(marker)])),
        "builtins_eval": (init, ROOT_ARG, _call("builtins.eval",
                                                source=f"open({str(marker)!r}, 'w')")),
        "importlib_import_module": (init, ROOT_ARG, _call("importlib.import_module",
                                                          name="evilmod")),
        "runpy_run_path": (init, ROOT_ARG, _call("runpy.run_path", path_name=evil_py)),
        "pickle_loads": (init, ROOT_ARG, _call("pickle.loads", data=_bytes(payload))),
        "numpy_load": (init, ROOT_ARG, _call("numpy.load", file=evil_npy, allow_pickle=True)),
        # the same, smuggled through allowed packages
        "jax_numpy_load": (init, ROOT_ARG, _call("jax.numpy.load", file=evil_npy,
                                                 allow_pickle=True)),
        "graphmod_provenance_os_system": (init, ROOT_ARG, _call("graphmod.provenance.os.system",
                                                                command=touch)),
        "flax_graph_os_system": (init, ROOT_ARG, _call("flax.nnx.graph.os.system",
                                                       command=touch)),
        "jax_core_private": (init, ROOT_ARG, _call("jax.core._src.pickle_util.loads",
                                                   data=_bytes(payload))),
        "dunder_chain": (init, ROOT_ARG, _call("jax.nn.relu.__globals__")),
        "public_non_factory": (init, ROOT_ARG, _call("graphmod.rebuild", provenance="{}",
                                                     allow=["os"])),
        "deserialize_and_load": (init, ROOT_ARG, _call(
            "jax.experimental.serialize_executable.deserialize_and_load",
            serialized=_bytes(payload), in_tree=None, out_tree=None)),
        "nested_brick_factory": ("bricks['/'].arguments.layers[0].arguments.kernel_init",
                                 NESTED_INIT, _call("graphmod._cli.main",
                                                    argv=["run", evil_py])),
        # functions given as values
        "callable_os_system": (layer, LAYER, {"$callable": "os.system"}),
        "callable_graphmod_provenance_os": (layer, LAYER,
                                            {"$callable": "graphmod.provenance.os.system"}),
        "callable_jax_numpy_load": (layer, LAYER, {"$callable": "jax.numpy.load"}),
        "callable_jax_debug_callback": (layer, LAYER, {"$callable": "jax.debug.callback"}),
        "callable_restore_checkpoint": (layer, LAYER, {
            "$callable": "flax.training.checkpoints.restore_checkpoint"}),
        "partial_jax_numpy_load": (f"{layer}.function", LAYER, _partial(
            {"$callable": "jax.numpy.load"}, evil_npy, allow_pickle=True)),
        "partial_builtins_exec": (f"{layer}.function", LAYER, _partial(
            {"$callable": "builtins.exec"}, f"open({str(marker)!r}, 'w')")),
        "partial_of_private_call": (f"{layer}.function", LAYER, _partial(
            _call("jax._src.pickle_util.loads", data=_bytes(payload)))),
        # classes, enums and constructor records
        "enum_class": (layer, LAYER, {"$enum": {"class": "subprocess.Popen", "name": "x"}}),
        "brick_class": (f"{layer}.class", LAYER, {"$brick": {
            "class": "subprocess.Popen", "arguments": {"args": ["touch", str(marker)]}}}),
        "nested_brick_class": ("bricks['/'].arguments.layers[0].class",
                               _set("bricks", "/", "arguments", "layers", 0, "$brick",
                                    "class"), "graphmod._cli.main"),
        "root_class": ("bricks['/'].class", _set("bricks", "/", "class"), "runpy.run_path"),
        "manager_class": ("managers.dropout.class", _set("managers", "dropout", "class"),
                          "graphmod._cli.main"),
        "manager_argument": ("managers.dropout.arguments.rate",
                             _set("managers", "dropout", "arguments", "rate"),
                             {"$dynamic": _call("os.system", command=touch)}),
        "filter_class": ("managers.batch_norm.arguments.filter.bricks[0]",
                         _set("managers", "batch_norm", "arguments", "filter", "$filter",
                              "bricks"), {"$tuple": [{"$class": "subprocess.Popen"}]}),
        "monitor_filter": ("monitor['first'].bricks[0]", _set("monitor", "first", "bricks"),
                           [{"$class": "importlib.import_module"}]),
        # optimizer names
        "optimizer_private": ("optimizer.name", _set("optimizer", "name"), "_src.alias.adam"),
        "optimizer_relative": ("optimizer.name", _set("optimizer", "name"), "../x"),
        "optimizer_unlisted": ("optimizer.name", _set("optimizer", "name"), "apply_updates"),
        "optimizer_nested": ("optimizer.arguments.args[1].arguments.learning_rate.name",
                             _set("optimizer", "arguments", "args", 1, "$optimizer",
                                  "arguments", "learning_rate", "$optimizer", "name"),
                             "_src.utils.multi_normal"),
    }


@pytest.fixture(scope="module")
def crafted(legit: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[pathlib.Path, dict[str, Any], dict[str, Any]]:
    """Every crafted record rebuilt in one fresh process: (directory, cases, results)."""
    tmp = tmp_path_factory.mktemp("crafted")
    marker = tmp / "pwned"
    (tmp / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('script')\n")
    (tmp / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('module')\n")
    np.save(tmp / "evil.npy", np.array([_Payload(f"touch {marker}")], dtype=object),
            allow_pickle=True)
    cases = _cases(tmp)
    records = {}
    for name, (_, edit, value) in cases.items():
        record = copy.deepcopy(legit)
        edit(record, value)
        records[name] = record
    (tmp / "cases.json").write_text(json.dumps({"legit": legit, "cases": records,
                                                "targets": TARGETS}))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp)])}
    done = subprocess.run([sys.executable, str(WORKER), str(tmp / "cases.json"),
                           str(tmp / "results.json")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stderr
    return tmp, cases, json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("name", sorted(_cases(pathlib.Path("unused"))))
def test_a_crafted_record_is_refused_naming_the_field_before_any_import(
        name: str, crafted: tuple[pathlib.Path, dict[str, Any], dict[str, Any]]) -> None:
    tmp, cases, results = crafted
    outcome = results["cases"][name]
    where = cases[name][0]
    assert outcome["error"] == "RebuildError", outcome
    assert outcome["message"].startswith(f"rebuild: {where} "), outcome["message"]
    assert outcome["imported"] == [], outcome  # refused before anything was imported
    assert not (tmp / "pwned").exists()


def test_no_crafted_record_loaded_its_target_module(
        crafted: tuple[pathlib.Path, dict[str, Any], dict[str, Any]]) -> None:
    _, _, results = crafted
    assert results["targets_before"] == []  # so the check below means something
    assert results["targets_after"] == []


def test_the_issue_record_runs_nothing_in_process(legit: dict[str, Any],
                                                  tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    record = copy.deepcopy(legit)
    ROOT_ARG(record, _call("jax._src.pickle_util.loads",
                           data=_bytes(pickle.dumps(_Payload(f"touch {marker}")))))
    with pytest.raises(RebuildError, match=r"kernel_init names 'jax\._src\.pickle_util\.loads', "
                                           r"whose part '_src' is private"):
        gm.rebuild(gm.Provenance.from_json(json.dumps(record)))
    assert not marker.exists()


def test_a_tampered_checkpoint_is_refused(tmp_path: pathlib.Path) -> None:
    step, state = build()
    gm.Loop(step, source(), steps=2,
            plugins=[Checkpoint(tmp_path / "run", every=gm.On("end"))]).run(state)
    assert type(gm.rebuild(gm.provenance.read(tmp_path / "run")).model) is gm.bricks.MLP
    metas = [p for p in (tmp_path / "run").rglob("*")
             if p.is_file() and b'"provenance"' in p.read_bytes()]
    assert len(metas) == 1, metas
    marker = tmp_path / "pwned"
    meta = json.loads(metas[0].read_text())
    meta["provenance"]["inputs"]["bricks"]["/"]["arguments"]["activation"] = _call(
        "graphmod._cli.main", argv=["run", str(tmp_path / "evil.py")])
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    metas[0].write_text(json.dumps(meta))
    with pytest.raises(RebuildError, match=r"bricks\['/'\]\.arguments\.activation names "
                                           r"'graphmod\._cli\.main'.*private"):
        gm.rebuild(gm.provenance.read(tmp_path / "run"))
    assert not marker.exists()


def test_the_legitimate_record_rebuilds_to_the_same_program(legit: dict[str, Any]) -> None:
    step = _step()
    again = gm.rebuild(gm.Provenance.from_json(json.dumps(legit)))
    recorded = {k: v for k, v in legit["inputs"]["optimizer"].items() if k != "source"}
    assert again.optimizer.config == recorded and recorded["name"] == "chain"
    assert again.managers[1].filter.bricks == (gm.bricks.Linear,)
    assert again.monitor["first"].bricks == (again.model.layers[0],)
    twin = again.compile(_cost)
    twin.init(*again.example_arguments()[0])
    assert twin.provenance.fingerprint == step.program.provenance.fingerprint


def _references(value: Any) -> list[tuple[str, str]]:
    """Every ``(kind, path)`` a recorded value names."""
    found = []
    if isinstance(value, dict):
        for tag, kind in (("$callable", "function"), ("$class", "class")):
            if tag in value:
                found.append((kind, value[tag]))
        if "$call" in value:
            found.append(("factory", value["$call"]["function"]))
        if "$enum" in value:
            found.append(("class", value["$enum"]["class"]))
        if "$brick" in value:
            found.append(("class", value["$brick"]["class"]))
        for item in value.values():
            found += _references(item)
    elif isinstance(value, list):
        for item in value:
            found += _references(item)
    return found


def _bricks() -> list[Any]:
    rngs = nnx.Rngs(0)
    bricks = gm.bricks
    return [bricks.Linear(2, 3, rngs=rngs), bricks.MLP([2, 3, 1], rngs=rngs),
            bricks.Conv(2, 3, (3, 3), rngs=rngs), bricks.Embedding(5, 3, rngs=rngs),
            bricks.LayerNorm(3, rngs=rngs), bricks.SimpleRecurrent(2, 3, rngs=rngs),
            bricks.LSTM(2, 3, rngs=rngs),
            bricks.Sequence(bricks.Linear(2, 3, rngs=rngs), jax.nn.gelu, jax.numpy.tanh)]


INITIALIZERS = [nnx.initializers.lecun_normal(), nnx.initializers.he_normal(),
                nnx.initializers.glorot_uniform(), nnx.initializers.xavier_normal(),
                nnx.initializers.normal(0.02), nnx.initializers.uniform(),
                nnx.initializers.constant(0.5), nnx.initializers.orthogonal(),
                nnx.initializers.truncated_normal(), nnx.initializers.variance_scaling(
                    2.0, "fan_out", "uniform"), nnx.initializers.zeros_init(),
                nnx.initializers.ones_init(),
                jax.nn.initializers.he_uniform(), jax.nn.initializers.kaiming_normal()]
ACTIVATIONS = [jax.nn.relu, jax.nn.gelu, jax.nn.silu, jax.nn.sigmoid, jax.nn.softplus,
               jax.nn.leaky_relu, jax.nn.elu, jax.nn.tanh, jax.numpy.tanh, jax.nn.softmax,
               nnx.relu, nnx.gelu, nnx.swish, jax.lax.tanh]


def test_what_bricks_record_by_default_is_public_and_rebuildable() -> None:
    rules = Rules()
    seen = []
    for brick in _bricks():
        config = config_of(brick)
        seen += [("class", config["class"]), *_references(config["arguments"]),
                 *_references(config["defaults"])]
    rngs = nnx.Rngs(0)
    for init in INITIALIZERS:
        seen += _references(config_of(gm.bricks.Linear(2, 3, kernel_init=init, rngs=rngs)))
    for activation in ACTIVATIONS:
        seen += _references(config_of(gm.bricks.MLP([2, 3, 1], activation=activation,
                                                    rngs=rngs)))
    assert {kind for kind, _ in seen} == {"class", "function", "factory"}
    for kind, path in seen:
        rules.resolve(path, kind, "recorded")  # raises if not allowed
        assert "._" not in path and not path.startswith("_"), path


def test_bricks_made_with_any_listed_initializer_rebuild_bitwise() -> None:
    rngs = nnx.Rngs(3)
    for init in INITIALIZERS:
        lin = gm.bricks.Linear(3, 4, kernel_init=init, rngs=rngs)
        program = gm.compile(_cost, lin)
        again = gm.rebuild(program.provenance)
        np.testing.assert_array_equal(again.model.W[...], lin.W[...])


def test_every_listed_factory_exists_here() -> None:
    rules = Rules()
    for path in sorted(DEFAULT_FACTORIES):
        module, _, name = path.rpartition(".")
        if module == "optax":  # optimizer names: made by getattr(optax, name)
            rules.check(path, "factory", "DEFAULT_FACTORIES")
            assert callable(getattr(optax, name)), path
        else:
            assert inspect.isfunction(rules.resolve(path, "factory", "DEFAULT_FACTORIES"))


def test_allow_factories_widens_calls_explicitly(tmp_path: pathlib.Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myinits.py").write_text(
        "import jax\n\n"
        "def scaled(scale):\n"
        "    def init(key, shape, dtype=jax.numpy.float32):\n"
        "        return scale * jax.random.normal(key, shape, dtype)\n"
        "    return init\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import myinits

    lin = gm.bricks.Linear(2, 3, kernel_init=myinits.scaled(0.5), rngs=nnx.Rngs(0))
    record = gm.compile(_cost, lin).provenance
    assert record["bricks"]["/"]["arguments"]["kernel_init"]["$call"]["function"] == \
        "myinits.scaled"
    for allow in ([], ["myinits"], ["myinits.scaled"]):  # a call needs allow_factories
        with pytest.raises(RebuildError, match=r"kernel_init calls 'myinits\.scaled', which is "
                                               r"not a factory.*nothing was imported.*"
                                               r"allow_factories=\['myinits\.scaled'\]"):
            gm.rebuild(record, allow=allow)
    again = gm.rebuild(record, allow_factories=["myinits.scaled"])
    np.testing.assert_array_equal(again.model.W[...], lin.W[...])
    assert again.allowed == ("myinits.scaled",)


@pytest.mark.parametrize("allow, allow_factories, error, message", [
    ("mypkg", [], TypeError, r"allow=...\): expected a list of strings, got 'mypkg'"),
    ([], 3, TypeError, r"allow_factories=...\): expected a list of strings, got 3"),
    (["my.pkg"], [], ValueError, r"allow=\['my\.pkg'\]\): no module of it can be imported; "
                                 r"name an importable class or function exactly"),
    (["graphmod.provenance.os"], [], ValueError,
     r"allow=\['graphmod\.provenance\.os'\]\): it does not exist"),
    ([], ["os.system"], ValueError, r"allow_factories=\['os\.system'\]\): it is "
                                    r"builtin_function_or_method, not a Python function"),
    ([], ["optax"], ValueError, r"allow_factories=\['optax'\]\): expected exact dotted names"),
])
def test_widening_arguments_are_checked(legit: dict[str, Any], allow: Any,
                                        allow_factories: Any, error: type,
                                        message: str) -> None:
    with pytest.raises(error, match=message):
        gm.rebuild(gm.Provenance.from_dict(legit), allow=allow,
                   allow_factories=allow_factories)


def test_a_package_the_caller_names_admits_only_the_classes_defined_in_it(
        legit: dict[str, Any], tmp_path: pathlib.Path) -> None:
    with pytest.raises(RebuildError, match=r"'os\.system', which is not a class: "
                                           r"allow=\['os'\] admits only the classes defined"):
        Rules.widened(["os"], []).check("os.system", "function", "here")
    record = copy.deepcopy(legit)
    LAYER(record, {"$callable": "numpy.tanh"})
    with pytest.raises(RebuildError, match=r"layers\[1\] names 'numpy\.tanh', which is not a "
                                           r"class.*allow=\['numpy\.tanh'\]"):
        gm.rebuild(gm.Provenance.from_dict(record), allow=["numpy"])
    again = gm.rebuild(gm.Provenance.from_dict(record), allow=["numpy.tanh"])
    assert again.model.layers[1] is np.tanh
    marker = tmp_path / "pwned"
    np.save(tmp_path / "evil.npy", np.array([_Payload(f"touch {marker}")], dtype=object),
            allow_pickle=True)
    LAYER(record, _partial({"$callable": "numpy.load"}, str(tmp_path / "evil.npy"),
                           allow_pickle=True))
    with pytest.raises(RebuildError, match=r"layers\[1\]\.function names 'numpy\.load', which "
                                           r"is not a class"):
        gm.rebuild(gm.Provenance.from_dict(record), allow=["numpy"])
    assert not marker.exists()


@pytest.mark.parametrize("value, message", [
    # a re-export of another package's module, and a class another package defines
    ({"$class": "tests.provenance.provenance_workload.np.ndarray"},
     r"reached through numpy, outside the packages allowed \(tests\)"),
    ({"$class": "tests.provenance.test_rebuild_safety.Checkpoint"},
     r"not a class defined in tests \(it is graphmod\.plugins.*'s\)"),
    ({"$class": "tests.provenance.test_rebuild_safety.os"},
     r"not a class defined in tests \(it is a module\)"),
])
def test_a_package_class_is_the_packages_own(legit: dict[str, Any], value: Any,
                                            message: str) -> None:
    record = copy.deepcopy(legit)
    LAYER(record, value)
    with pytest.raises(RebuildError, match=r"bricks\['/'\]\.arguments\.layers\[1\].*" + message):
        gm.rebuild(gm.Provenance.from_dict(record), allow=["tests"])


@pytest.mark.parametrize("value, message", [
    ({"$class": "numpy.float32"}, r"not a brick, manager or Flax module class"),
    ({"$class": "jax.nn.relu"}, r"which is not a class"),
    ({"$enum": {"class": "graphmod.bricks.Linear", "name": "W"}}, r"not a member of an enum"),
    ({"$callable": "graphmod.bricks.Linear"}, r"which is not a function"),
])
def test_what_a_listed_name_reaches_is_checked(
        legit: dict[str, Any], value: Any, message: str) -> None:
    record = copy.deepcopy(legit)
    LAYER(record, value)
    with pytest.raises(RebuildError, match=r"bricks\['/'\]\.arguments\.layers\[1\].*" + message):
        gm.rebuild(gm.Provenance.from_dict(record))


@pytest.mark.parametrize("value, message", [
    ({"$call": {"function": "jax.nn.initializers.normal"}}, r"lacks a valid 'kwargs' entry"),
    ({"$call": {"function": 3, "kwargs": {}}}, r"lacks a valid 'function' entry"),
    ({"$array": {"kind": "numpy", "dtype": "O", "shape": [1], "data": [1]}},
     r"dtype 'O'; only numeric"),
    ({"$array": {"kind": "numpy", "dtype": "int8", "shape": [1], "data": [[1]]}},
     r"not numbers"),
    ({"$nope": 1}, r"unknown tag '\$nope'"),
    ({"$partial": {"function": {"$dict": {}}, "args": [], "kwargs": {}}},
     r"must be a recorded function"),
    ({"$opaque": {"kind": "callable", "repr": "<lambda>"}}, r"recorded as opaque"),
    ({"$role": {"name": "WEIGHT", "parents": ["OUTPUT"]}}, r"malformed \$role entry"),
    ({"plain": "mapping"}, r"a mapping without a tag"),
])
def test_malformed_entries_name_their_field(legit: dict[str, Any], value: Any,
                                            message: str) -> None:
    record = copy.deepcopy(legit)
    LAYER(record, value)
    with pytest.raises(RebuildError, match=r"^rebuild: bricks\['/'\]\.arguments\.layers\[1\]"
                                           r".*" + message):
        gm.rebuild(gm.Provenance.from_dict(record))


@pytest.mark.parametrize("text, message", [
    ("{not json", r"not JSON \(Expecting property name .* line 1, column 2\)"),
    ("", r"not JSON \(Expecting value at line 1, column 1\)"),
    ('{"a": 1,\n "b": }', r"line 2, column 7"),
    (b"\xff\xfe{}", r"not UTF-8 text \(byte 0\)"),
    ('{"x": NaN}', r"NaN is not valid JSON"),
    ("[1, 2]", r"not a provenance record: expected the keys .* got tuple"),
    ('{"format": 1}', r"expected the keys format, kind, inputs and derived, got \['format'\]"),
    ('{"format": 1, "kind": "nope", "inputs": {}, "derived": {}}', r"kind='nope'"),
    ('{"format": 99, "kind": "program", "inputs": {}, "derived": {}}', r"format=99"),
    ('{"format": 1, "kind": "program", "inputs": [], "derived": {}}', r"inputs=...\)"),
    ("[" * 100_000, r"nested too deeply"),
])
def test_garbage_text_gives_a_provenance_error(text: str | bytes, message: str) -> None:
    with pytest.raises(ProvenanceError, match=message) as caught:
        gm.Provenance.from_json(text)
    assert not isinstance(caught.value, json.JSONDecodeError)
    error = caught.value  # no raw error chained to it
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    with pytest.raises(ProvenanceError, match=message):
        gm.rebuild(text)


def test_reading_a_garbage_file_names_the_file(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "record.json"
    file.write_bytes(b'{"format": 1, "kind": ')
    with pytest.raises(ProvenanceError, match=rf"{file}: Provenance\.from_json: the text is "
                                              r"not JSON \(Expecting value at line 1"):
        gm.provenance.read(file)


def _locations(node: Any, keys: tuple = ()) -> list[tuple]:
    """The key paths of every value under ``node``."""
    found = [keys] if keys else []
    items = node.items() if isinstance(node, dict) else \
        enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found += _locations(value, (*keys, key))
    return found


def test_any_damaged_entry_gives_a_rebuild_error_never_a_raw_one(
        legit: dict[str, Any]) -> None:
    garbage = [None, 7, "x", [], {}, {"$call": None}]
    inputs = {k: legit["inputs"][k] for k in ("bricks", "managers", "monitor", "optimizer")}
    raw, tried = [], 0
    for keys in _locations(inputs):
        if (keys[0] == "bricks" and keys[1:2] != ("/",)) or "defaults" in keys:
            continue  # not read by rebuild
        for value in garbage:
            record = copy.deepcopy(legit)
            _set(*keys)(record, value)
            try:
                gm.rebuild(gm.Provenance.from_dict(record))
            except RebuildError:
                pass
            except Exception as error:  # collected: each one is a finding
                raw.append((keys, value, f"{type(error).__name__}: {error}"))
            tried += 1
    assert tried > 500 and raw == []


# -- the allow list, judged by the test's own idea of what must never get through ----------
# A deny list is the *test's* oracle here, never rebuild's rule: rebuild admits by membership.
_NEVER_MODULE = re.compile(
    r"^(os|posix|sys|pickle|subprocess|builtins|io|shutil|socket|importlib|runpy|ctypes|"
    r"tempfile|pathlib|multiprocessing|threading|orbax)(\.|$)|^jax\.(monitoring|profiler|"
    r"experimental)|^jax\._src\.(config|monitoring|compilation_cache|profiler|debugging|"
    r"distributed|cache_key|compiler)|^numpy\.lib\.(_npyio_impl|npyio|_datasource)|"
    r"^flax\.training")
_NEVER_PART = {"os", "sys", "pickle", "subprocess", "builtins", "io", "shutil", "config",
               "monitoring", "compilation_cache", "profiler", "debug", "distributed",
               "experimental", "checkpoints", "serialization"}
_NEVER_WORD = {"register", "unregister", "listener", "listeners", "configure", "cache", "caches",
               "clear", "load", "loads", "loadtxt", "save", "savez", "savetxt", "genfromtxt",
               "fromfile", "tofile", "fromregex", "read", "write", "open", "print",
               "printoptions", "callback", "profile", "flags", "environ", "exec", "eval",
               "system", "spawn", "popen", "dump", "dumps", "pickle", "dir", "memmap", "exit",
               "abort"}
_SPACES = ("jax", "jax.nn", "jax.nn.initializers", "jax.numpy", "jax.random", "jax.lax",
           "jax.monitoring", "jax.config", "jax.experimental",
           "jax.experimental.compilation_cache.compilation_cache", "flax", "flax.nnx",
           "flax.nnx.initializers", "optax", "optax.losses", "numpy", "graphmod",
           "graphmod.bricks", "managers", "os", "sys", "pickle", "subprocess", "builtins")
_KIND = {"$callable": "function", "$class": "class", "$enum": "class", "$brick": "class",
         "$call": "factory", "$partial": "partial"}
_FORMS: dict[str, Callable[[str], dict[str, Any]]] = {
    "$callable": lambda path: {"$callable": path},
    "$class": lambda path: {"$class": path},
    "$enum": lambda path: {"$enum": {"class": path, "name": "HIGHEST"}},
    "$brick": lambda path: {"$brick": {"class": path, "arguments": {}}},
    "$call": lambda path: _call(path),
    "$partial": lambda path: _partial({"$callable": path}),
}


def _get(path: str) -> Any:
    """What ``path`` names, by attribute or by import; None if nothing."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except Exception:  # a deprecated or lazy name that fails: try a submodule
            try:
                obj = importlib.import_module(".".join(parts[:index]))
            except Exception:
                return None
    return obj


def _refused(path: str, obj: Any) -> bool:
    """Whether ``path`` (reaching ``obj``) is of a kind rebuild must never admit."""
    parts = path.split(".")
    words = {word for part in [parts[-1], str(getattr(obj, "__name__", ""))]
             for word in part.lower().split("_")}
    return (any(part.startswith("_") for part in parts) or bool(set(parts) & _NEVER_PART)
            or bool(words & _NEVER_WORD)
            or bool(_NEVER_MODULE.search(str(getattr(obj, "__module__", "")))))


@functools.cache
def _pool() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every attribute of the spaces, private ones included; those of refused kinds)."""
    importlib.import_module("jax.experimental.compilation_cache.compilation_cache")
    spaces = [*_SPACES, *sorted(m for m in sys.modules if m.startswith("jax.experimental.")
                                and "._" not in m)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = sorted({f"{space}.{name}" for space in spaces for name in dir(_get(space))})
        refused = [name for name in names if _refused(name, _get(name))]
    return tuple(names), tuple(refused)


def test_every_default_name_is_a_constructor_or_a_pure_function() -> None:
    names, rules = gm.provenance.default_names(), Rules()
    assert len(names) > 400
    for path in names:
        reached = _get(path)  # what the list holds is what the name reaches
        kind = "class" if isinstance(reached, type) else "function"
        assert rules.resolve(path, kind, "list") is reached, path
        assert not _refused(path, reached), path


def test_no_attribute_of_the_spaces_is_admitted_unless_listed() -> None:
    names, refused = _pool()
    assert len(names) > 3000 and len(refused) > 300
    rules, admitted = Rules(), set()
    for path in names:
        for kind in ("class", "function", "partial", "factory"):
            try:
                obj = rules.resolve(path, kind, "pool")
            except RebuildError:
                continue
            admitted.add(path)
            assert path in gm.provenance.default_names(), (path, kind)
            assert not _refused(path, obj), (path, kind)
    assert {"jax.nn.relu", "flax.nnx.Linear", "optax.adam", "managers.Dropout"} <= admitted
    assert not admitted & set(refused)


@settings(max_examples=300, deadline=None)
@given(path=st.deferred(lambda: st.sampled_from(_pool()[0]) | st.sampled_from(_pool()[1])),
       form=st.sampled_from(sorted(_FORMS)),
       packages=st.sampled_from([(), ("numpy",), ("os",), ("subprocess",)]))
def test_no_record_form_of_a_generated_name_gets_a_refused_kind_through(
        path: str, form: str, packages: tuple[str, ...]) -> None:
    rules = Rules.widened(packages, ())
    value = _FORMS[form](path)
    try:
        RecordDecoder(rules, None, dry=True)(value, "x")
        RecordDecoder(rules, None, dry=False)(value, "x")
    except RebuildError:
        return
    obj = rules.resolve(path, _KIND[form], "x")
    assert not _refused(path, obj), (path, form)
    if path not in gm.provenance.default_names():  # a class of an allowed package's own
        assert _KIND[form] == "class" and isinstance(obj, type), (path, form)
        assert obj.__module__.split(".")[0] in packages, (path, form)
