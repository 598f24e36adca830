"""graphmod.export: the inference function as StableHLO with a symbolic batch axis, loaded
and run bitwise where graphmod cannot be imported, with its provenance."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod.data import ArraySource, Standardize, Transforms

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flatbuffers") is None,
                                reason="jax.export's serialisation needs flatbuffers: "
                                       "pip install 'graphmod[export]'")

SIZES = (1, 5, 33)

# Loads with the saved load.py, graphmod (and managers) refused by the import system, and
# runs the function on each input file: python -c BLOCKED EXPORT_DIR IN.npz OUT.npz ...
BLOCKED = """
import importlib.abc, json, runpy, sys
import numpy as np
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("graphmod", "managers"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Refuse())
sys.modules["graphmod"] = None
directory, files = sys.argv[1], sys.argv[2:]
infer, provenance = runpy.run_path(directory + "/load.py")["load"](directory)
for inputs, outputs in zip(files[::2], files[1::2]):
    np.save(outputs, np.asarray(infer(np.load(inputs))))
assert not [m for m, v in sys.modules.items() if m.startswith(("graphmod", "managers"))
            and v is not None]
print(json.dumps(provenance["derived"]["fingerprint"]))
"""


@pytest.fixture(scope="module")
def trained() -> tuple[gm.Program, dict]:
    """An MLP with dropout and batch norm (so inference differs from training), trained a
    few steps so the batch-norm statistics are not their initial values."""
    mlp = gm.bricks.MLP([4, 16, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    with managers.Dropout(0.3, bricks=mlp.linear_layers, roles=[gm.roles.INPUT]), \
            managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[gm.roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), mlp)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    variables = program.init(x[:1])
    for i in range(3):
        _, variables = program.train(variables, x, rng=jax.random.key(i))
    return program, variables


def _inputs(size: int) -> np.ndarray:
    return np.random.default_rng(size).normal(size=(size, 4)).astype(np.float32)


def test_a_process_that_cannot_import_graphmod_runs_it_bitwise_on_three_batch_sizes(
        trained, tmp_path) -> None:
    program, variables = trained
    gm.export(program, variables, _inputs(1)).save(tmp_path / "export")
    files = []
    for size in SIZES:
        np.save(tmp_path / f"in{size}.npy", _inputs(size))
        files += [str(tmp_path / f"in{size}.npy"), str(tmp_path / f"out{size}.npy")]
    done = subprocess.run([sys.executable, "-I", "-c", BLOCKED, str(tmp_path / "export"),
                           *files], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == program.provenance.fingerprint  # it travelled along
    outputs = [np.load(tmp_path / f"out{size}.npy") for size in SIZES]
    for size, got in zip(SIZES, outputs, strict=True):
        want = np.asarray(program.infer(variables, _inputs(size)))
        assert got.shape == (size, 3) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)  # bitwise: exact float equality
    trained_out = program.train(variables, _inputs(5), rng=jax.random.key(9))[0]
    assert not np.array_equal(outputs[1], trained_out)  # inference mode, not training


def test_the_provenance_travels_with_the_export(trained, tmp_path) -> None:
    program, variables = trained
    gm.export(program, variables, _inputs(1)).save(tmp_path)
    with open(tmp_path / "provenance.json") as f:
        record = gm.Provenance.from_json(f.read())
    assert record == program.provenance and record.fingerprint == program.provenance.fingerprint
    with open(tmp_path / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["arguments"] == [{"shape": ["batch", 4], "dtype": "float32"}]
    assert manifest["outputs"] == [{"shape": ["batch", 3], "dtype": "float32"}]
    assert "['model']['linear_layers'][0]['W']" in [v["name"] for v in manifest["variables"]]
    assert sorted(os.listdir(tmp_path)) == ["function.jaxexport", "load.py", "manifest.json",
                                            "provenance.json", "variables.npz"]
    assert gm.ExportedProgram.load(tmp_path).provenance == program.provenance


def test_the_loader_as_a_script_prints_the_signature_and_runs_input_files(
        trained, tmp_path, capsys) -> None:
    program, variables = trained
    gm.export(program, variables, _inputs(1)).save(tmp_path / "export")
    loader = runpy.run_path(str(tmp_path / "export" / "load.py"))
    loader["_main"]([str(tmp_path / "export")])
    assert json.loads(capsys.readouterr().out)["arguments"][0]["shape"] == ["batch", 4]
    np.savez(tmp_path / "in.npz", arg0=_inputs(5))
    loader["_main"]([str(tmp_path / "export"), str(tmp_path / "in.npz"),
                     str(tmp_path / "out.npz")])
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_array_equal(out["out0"], program.infer(variables, _inputs(5)))
    with pytest.raises(SystemExit, match="usage"):
        loader["_main"]([])


def test_a_derived_program_exports_and_loads_back_in_process(trained, tmp_path) -> None:
    program, variables = trained
    predict = program.derive(lambda m, x: {"label": jnp.argmax(m(x), -1), "score": m(x)})
    gm.export(predict, variables, _inputs(1)).save(tmp_path)
    loaded = gm.ExportedProgram.load(tmp_path)
    for size in SIZES:
        got, want = loaded(_inputs(size)), predict.infer(variables, _inputs(size))
        assert sorted(got) == ["label", "score"]
        np.testing.assert_array_equal(got["label"], want["label"])
        np.testing.assert_array_equal(got["score"], want["score"])
    assert "batch" in repr(loaded) and "platforms=('cpu',)" in repr(loaded)


def test_key_and_bfloat16_variables_travel_as_their_bits(tmp_path) -> None:
    model = nnx.Sequential(nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                           nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(_inputs(1))
    gm.export(program, variables, _inputs(1)).save(tmp_path)
    loaded = gm.ExportedProgram.load(tmp_path)
    np.testing.assert_array_equal(loaded(_inputs(5)), program.infer(variables, _inputs(5)))
    with open(tmp_path / "manifest.json") as f:
        dtypes = {v["dtype"] for v in json.load(f)["variables"]}
    assert "bfloat16" in dtypes and "uint32" in dtypes  # the kernel; the key's data


def test_batch_none_keeps_the_examples_shapes(trained) -> None:
    program, variables = trained
    exported = gm.export(program, variables, _inputs(5), batch=None)
    np.testing.assert_array_equal(exported(_inputs(5)), program.infer(variables, _inputs(5)))
    with pytest.raises(ValueError, match="shape"):
        exported(_inputs(6))


def test_bad_input_is_refused_naming_it(trained, tmp_path) -> None:
    program, variables = trained
    with pytest.raises(TypeError, match=r"graphmod\.compile"):
        gm.export(lambda v, x: x, variables, _inputs(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch='two words'"):
        gm.export(program, variables, _inputs(1), batch="two words")
    with pytest.raises(TypeError, match="example argument 0"):
        gm.export(program, variables, object())
    exported = gm.export(program, variables, _inputs(1))
    exported.save(tmp_path)
    with pytest.raises(FileExistsError, match="holds an export already"):
        exported.save(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no manifest\.json"):
        gm.ExportedProgram.load(tmp_path / "missing")


def test_the_fitted_input_transformations_are_inside_the_export(tmp_path) -> None:
    x = (np.random.default_rng(0).normal(size=(64, 4)) * 5 + 3).astype(np.float32)
    fitted = Transforms({"x": Standardize()}).fit(ArraySource({"x": x}, 8))
    mlp = gm.bricks.MLP([4, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), mlp, transforms=fitted)
    variables = program.init(x[:1])
    gm.export(program, variables, x[:1]).save(tmp_path)
    loaded = gm.ExportedProgram.load(tmp_path)
    raw = mlp(jnp.asarray(x[:7]))  # the model on untransformed inputs
    np.testing.assert_array_equal(loaded(x[:7]), program.infer(variables, x[:7]))
    assert not np.allclose(loaded(x[:7]), raw)
    assert loaded.provenance["transforms"] == program.provenance["transforms"]
