"""rebuild: the same bricks, managers and optimizer, the same fingerprint; safe by default."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._records._fingerprint import canonical_text
from graphmod.provenance import RebuildError
from tests.provenance.provenance_workload import cost, flat, train

ROOT = pathlib.Path(__file__).parents[2]
WORKLOAD = pathlib.Path(__file__).with_name("provenance_workload.py")


def _program(**dropout: Any) -> tuple[gm.Program, gm.bricks.MLP]:
    mlp = gm.bricks.MLP([3, 5, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(cost, mlp, managers=[
        managers.Dropout(dropout.pop("rate", 0.5), bricks=mlp.linear_layers[1:],
                         roles=[roles.INPUT], **dropout),
        managers.WeightNoise(gm.dynamic(0.01), roles=[roles.WEIGHT], priority=2)])
    program.init(jnp.ones((2, 3)), jnp.ones((2, 2)))
    return program, mlp


def _crafted(program: gm.Program, edit: Any) -> gm.Provenance:
    record = program.provenance.to_dict()
    edit(record)
    return gm.Provenance.from_json(json.dumps(record))


def test_rebuild_gives_the_same_model_managers_and_fingerprint() -> None:
    program, mlp = _program(rate=0.3, broadcast_dims=(0,))
    again = gm.rebuild(gm.Provenance.from_json(program.provenance.to_json()))
    assert type(again.model) is gm.bricks.MLP and again.model is not mlp
    for path, leaf in flat(nnx.state(mlp)).items():
        np.testing.assert_array_equal(flat(nnx.state(again.model))[path], leaf)
    dropout, noise = again.managers
    assert (dropout.name, dropout.rate, dropout.broadcast_dims) == ("dropout", 0.3, (0,))
    assert dropout.filter.bricks == tuple(again.model.linear_layers[1:])
    assert noise.priority == 2 and isinstance(noise.std, gm.Dynamic)
    twin = again.compile(cost)
    twin.init(*again.example_arguments()[0])
    assert twin.provenance.fingerprint == program.provenance.fingerprint
    assert twin.provenance.inputs_hash == program.provenance.inputs_hash


def test_rebuild_makes_the_recorded_optimizer_and_seeds() -> None:
    loop, _ = train(epochs=1)
    record = gm.provenance.capture(loop)
    again = gm.rebuild(record)
    assert again.optimizer.config["name"] == "adam"
    assert again.optimizer.config["arguments"] == {"learning_rate": 1e-2}
    assert jax.random.key_data(again.seeds["train"]).tolist() == [0, 7]
    assert set(again.seeds) == {"init", "train"}


def test_rebuild_from_an_evaluation_uses_its_model() -> None:
    program, _ = _program()
    predict = program.derive(lambda m, x: m(x))
    x = np.ones((4, 3), np.float32)
    evaluation = gm.evaluate(predict, program.init(x, np.ones((4, 2), np.float32)),
                             {"x": x, "y": np.zeros((4, 2), np.float32)},
                             metrics=["mse"], model_provenance=program.provenance)
    assert type(gm.rebuild(evaluation.provenance).model) is gm.bricks.MLP


def test_a_record_naming_another_package_is_refused_before_any_import(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "evilmod.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('pwned')\n"
        "import jax\n"
        "def run(x):\n    return jax.nn.relu(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    program, _ = _program()

    def activation(record: dict) -> None:
        record["inputs"]["bricks"]["/"]["arguments"]["activation"] = {"$callable": "evilmod.run"}

    crafted = _crafted(program, activation)
    str(crafted), gm.provenance.diff(crafted, program.provenance)  # reading is harmless
    with pytest.raises(RebuildError, match=r"'evilmod\.run', which is not on rebuild's allow "
                                           r"list.*nothing was imported.*"
                                           r"allow=\['evilmod\.run'\]"):
        gm.rebuild(crafted)
    with pytest.raises(RebuildError, match=r"'evilmod\.run', which is not a class: "
                                           r"allow=\['evilmod'\] admits only the classes"):
        gm.rebuild(crafted, allow=["evilmod"])  # a package admits its classes, no function
    assert not marker.exists() and "evilmod" not in sys.modules
    rebuilt = gm.rebuild(crafted, allow=["evilmod.run"])  # the caller vouches for it
    assert marker.exists() and rebuilt.model.activation.__module__ == "evilmod"
    assert rebuilt.allowed == ("evilmod.run",) and "allowed: evilmod.run" in repr(rebuilt)
    monkeypatch.delitem(sys.modules, "evilmod")


@pytest.mark.parametrize("path, message", [
    ("os.system", r"'os\.system', which is not on rebuild's allow list.*nothing was imported"),
    ("graphmod._cli.os.system", r"part '_cli' is private.*nothing was imported"),
    ("graphmod.__builtins__", r"part '__builtins__' is private"),
    ("jax.nn.relu; import os", r"not a dotted import path"),
])
def test_crafted_paths_are_refused(path: str, message: str) -> None:
    program, _ = _program()

    def manager_class(record: dict) -> None:
        record["inputs"]["managers"]["dropout"]["class"] = path

    with pytest.raises(RebuildError, match=message):
        gm.rebuild(_crafted(program, manager_class))


def test_classes_must_be_bricks_and_managers() -> None:
    program, _ = _program()

    def brick_class(record: dict) -> None:
        record["inputs"]["bricks"]["/"]["class"] = "flax.nnx.Linear"  # listed, not a brick

    with pytest.raises(RebuildError, match=r"'flax\.nnx\.Linear', which is not a graphmod "
                                           r"Brick"):
        gm.rebuild(_crafted(program, brick_class), verify=False)


def test_opaque_values_cannot_be_rebuilt_and_the_error_says_where() -> None:
    mlp = gm.bricks.MLP([3, 2], activation=lambda x: x, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x).sum(), mlp)
    with pytest.raises(RebuildError, match=r"bricks\['/'\]\.arguments\.activation was "
                                           r"recorded as opaque.*module level"):
        gm.rebuild(program.provenance)


class FlaxMLP(nnx.Module):
    """A plain Flax model: graphmod records its modules and parameters, not how it is made."""

    def __init__(self, hidden: int, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(3, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(nnx.relu(self.linear1(x)))


def test_a_flax_model_is_passed_to_rebuild_and_the_rest_is_rebuilt_for_it() -> None:
    model = FlaxMLP(4, nnx.Rngs(0))
    fn = lambda m, x: (m(x) ** 2).mean()
    drop = managers.Dropout(0.3, bricks=[model.linear2], roles=[roles.INPUT])
    program = gm.compile(fn, model, managers=[drop, managers.WeightNoise(0.1)])
    program.init(jnp.ones((5, 3)))
    record = gm.Provenance.from_json(program.provenance.to_json())
    with pytest.raises(RebuildError, match=r"bricks\['/'\] \(tests\.provenance\.test_rebuild\."
                       r"FlaxMLP\) cannot be rebuilt: its construction was not recorded.*; "
                       r"construct the model yourself and pass it, rebuild\(record, "
                       r"model=model\)"):
        gm.rebuild(record)
    mine = FlaxMLP(4, nnx.Rngs(0))
    again = gm.rebuild(record, model=mine)
    assert again.model is mine
    dropout, noise = again.managers
    assert dropout.filter.bricks == (mine.linear2,) and noise.std == 0.1
    twin = again.compile(fn)
    twin.init(*again.example_arguments()[0])
    assert twin.provenance.fingerprint == program.provenance.fingerprint
    with pytest.raises(RebuildError, match=r"/linear1\.kernel: shape recorded \[3, 4\], "
                                           r"rebuilt \[3, 5\]"):
        gm.rebuild(record, model=FlaxMLP(5, nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"rebuild\(model=\.\.\.\): expected the flax\.nnx"
                                        r"\.Module the record describes, got dict"):
        gm.rebuild(record, model={"linear1": None})


def test_a_model_changed_after_construction_is_caught() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    mlp.linear_layers[1] = gm.bricks.Linear(4, 6, rngs=nnx.Rngs(1))
    program = gm.compile(lambda m, x: m(x).sum(), mlp)
    with pytest.raises(RebuildError, match=r"/linear_layers/1\.W: shape recorded \[4, 6\], "
                                           r"rebuilt \[4, 2\]"):
        gm.rebuild(program.provenance)


def test_initializers_and_custom_roles_round_trip() -> None:
    gate = roles.add_role("PROVENANCE_GATE", roles.INPUT)
    lin = gm.bricks.Linear(3, 4, kernel_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(2))
    program = gm.compile(lambda m, x: m(x).sum(), lin, managers=[
        managers.Dropout(0.5, roles=[gate], strict=False)])
    config = program.provenance["bricks"]["/"]["arguments"]["kernel_init"]["$call"]
    assert config["function"] == "jax.nn.initializers.normal"
    assert config["kwargs"]["stddev"] == 0.5
    again = gm.rebuild(program.provenance)
    np.testing.assert_array_equal(again.model.W[...], lin.W[...])
    assert again.managers[0].filter.roles == (gate,)


@pytest.mark.slow
def test_rebuild_in_a_fresh_process_trains_to_the_same_variables_bitwise(
        tmp_path: pathlib.Path) -> None:
    loop, state = train(epochs=2)
    record = gm.provenance.capture(loop)
    (tmp_path / "record.json").write_text(record.to_json())
    np.savez(tmp_path / "here.npz", **flat(state.variables))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKLOAD.parent)])}
    done = subprocess.run(
        [sys.executable, str(WORKLOAD), "rebuild", str(tmp_path / "record.json"),
         str(tmp_path / "there.npz"), str(tmp_path / "fingerprint.txt")],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fingerprint.txt").read_text() == record.fingerprint
    here, there = np.load(tmp_path / "here.npz"), np.load(tmp_path / "there.npz")
    assert sorted(here.files) == sorted(there.files) and len(here.files) > 4
    for name in here.files:
        np.testing.assert_array_equal(here[name], there[name], err_msg=name)
    assert int(record.derived["steps"]) == 12


def test_the_fingerprint_is_independent_of_objects_and_trace_tokens() -> None:
    a, _ = _program()
    b, _ = _program()
    assert a.provenance.fingerprint == b.provenance.fingerprint
    text = canonical_text(a._training_jaxpr())
    assert " at 0x" not in text
    assert not re.search(r"[0-9a-f]{32}", text)  # no uuid trace token leaks into the text
    c, _ = _program(rate=0.25)
    assert c.provenance.fingerprint != a.provenance.fingerprint


def test_a_program_over_a_mapped_axis_has_a_fingerprint_that_rebuilds() -> None:
    def compiled(axis_name: str | None) -> gm.Program:
        mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
        program = gm.compile(cost, mlp, axis_name=axis_name, managers=[
            managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[roles.INPUT])])
        program.init(jnp.ones((2, 3)), jnp.ones((2, 2)))
        return program

    mapped, plain = compiled("devices"), compiled(None)
    record = mapped.provenance
    assert "fingerprint_error" not in record.derived and record.fingerprint is not None
    assert "axis_index" in canonical_text(mapped._training_jaxpr())  # the device index folds
    assert record.fingerprint != plain.provenance.fingerprint
    again = gm.rebuild(gm.Provenance.from_json(record.to_json()))
    twin = again.compile(cost)
    twin.init(*again.example_arguments()[0])
    assert twin.provenance.fingerprint == record.fingerprint



def test_monitor_filters_and_class_filters_are_rebuilt() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    program = gm.compile(
        lambda m, x: m(x).sum(), mlp,
        managers=[managers.BatchNorm(filter=gm.VariableFilter(bricks=[gm.bricks.Linear],
                                                              roles=[roles.OUTPUT]))],
        monitor={"first": gm.VariableFilter(bricks=[mlp.linear_layers[0]],
                                            roles=[roles.OUTPUT])})
    x = np.ones((2, 3), np.float32)
    program.init(x)
    again = gm.rebuild(program.provenance)
    assert again.monitor["first"].bricks == (again.model.linear_layers[0],)
    assert again.managers[0].filter.bricks == (gm.bricks.Linear,)
    twin = again.compile(lambda m, x: m(x).sum())
    twin.init(x)
    assert twin.provenance.fingerprint == program.provenance.fingerprint


def test_the_training_record_lists_what_trained_and_rebuild_selects_it_again() -> None:
    program, mlp = _program()
    lora = managers.LoRA(2, bricks=[mlp.linear_layers[1]], roles=[roles.WEIGHT])
    program = gm.compile(cost, mlp, managers=[*program.managers, lora])
    program.init(jnp.ones((2, 3)), jnp.ones((2, 2)))
    step = gm.optimize(program, gm.provenance.optimizer("sgd", learning_rate=0.1),
                       trainable=[lora, gm.VariableFilter(path="/linear_layers/0.b")])
    record = step.provenance["trainable"]
    assert (list(record["model"]), list(record["managers"])) == (["/linear_layers/0.b"],
                                                                 ["lora"])
    again = gm.rebuild(gm.Provenance.from_json(step.provenance.to_json()))
    twin = again.compile(cost)
    twin.init(*again.example_arguments()[0])
    rebuilt_step = gm.optimize(twin, again.optimizer, trainable=again.trainable)
    assert rebuilt_step.provenance["trainable"] == record
    assert gm.rebuild(program.provenance).trainable is None  # a program record: no training


@pytest.mark.parametrize(("entry", "message"), [
    ({"model": "/linear_layers/0.b", "managers": []}, r"trainable.model is not a list"),
    ({"model": [], "managers": ["elsewhere"]}, r"trainable.managers names \['elsewhere'\]"),
])
def test_a_damaged_trainable_entry_is_refused_by_field(entry: dict, message: str) -> None:
    program, _ = _program()
    record = gm.optimize(program, gm.provenance.optimizer("sgd", learning_rate=0.1),
                         trainable=gm.VariableFilter(path="/linear_layers/0.b")).provenance
    damaged = record.to_dict()
    damaged["inputs"]["trainable"] = entry
    with pytest.raises(RebuildError, match=message):
        gm.rebuild(gm.Provenance.from_json(json.dumps(damaged)))
