"""``managers.Quantized`` and ``managers.quantize``: stored int8/int4 weights from trained
variables (the character LM), across a scan over layers and an ensemble, saved and loaded
in a fresh process, converted from FakeQuant, against Qwix's PTQ, and the errors."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from managers import _quantize as quantize_module
from managers._merge import _node
from managers._quantize import dequantize_matrix, quantize_matrix, stored_bytes

ROOT = Path(__file__).resolve().parents[2]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.lin(x))


class Stack(nnx.Module):
    """Three blocks made by ``nnx.vmap`` and run by ``nnx.scan``: stacked weights."""

    def __init__(self) -> None:
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key: jax.Array) -> Block:
            return Block(nnx.Rngs(key))

        self.blocks = make(jax.random.split(jax.random.key(0), 3))
        self.head = nnx.Linear(64, 4, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(body(x, self.blocks))


class MLP(nnx.Module):
    def __init__(self) -> None:
        self.a = nnx.Linear(128, 256, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(256, 10, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(jax.nn.relu(self.a(x)))


def _x(shape: tuple[int, ...] = (8, 64)) -> jax.Array:
    return jax.random.normal(jax.random.key(2), shape)


@pytest.fixture(scope="module")
def char_lm() -> tuple:
    """A small character LM (features 64 as the example's, one block, context 32: a
    test-sized config of examples/char_lm.py), trained 150 Adam steps; its program,
    variables, held-out windows and the example module."""
    spec = importlib.util.spec_from_file_location("graphmod_quantize_char_lm",
                                                  ROOT / "examples" / "char_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        ids = module.corpus("a", "m", 40_000)
        data = module.windows(ids[:36_000], 1024, 32, 0)
        held_out = module.windows(ids[36_000:], 128, 32, 1)
        model = module.CharLM(len(module.VOCABULARY) + 1, 32, 64, 4, 1, rngs=nnx.Rngs(0))
        program = gm.compile(module.cost, model)
        args = argparse.Namespace(steps=150, lr=3e-3, seed=0)
        state = module.train(program, program.init(data[:2]), data, args)
        yield program, state.variables, held_out, module
    finally:
        sys.modules.pop(spec.name, None)


def _quantized_ratio(stored: dict, name: str, floats: dict) -> float:
    """Bytes of the quantized weights as stored (``q`` and ``scale``) over their float32
    bytes in ``floats``."""
    owned = {path: {w: entry for w, entry in weights.items() if "q" in entry}
             for path, weights in stored["managers"][name].items() if path != "hparams"}
    originals = sum(_node(floats["model"], path)[weight].size * 4
                    for path, weights in owned.items() for weight in weights)
    return stored_bytes({"model": {}, "managers": owned}) / originals


@pytest.mark.slow
def test_int8_ptq_of_the_char_lm_keeps_its_loss_within_one_percent(char_lm: tuple) -> None:
    program, variables, held_out, module = char_lm
    base = module.validation_loss(program, variables, held_out)
    served, stored = managers.quantize(program, variables, managers.Quantized("int8"))
    loss = module.validation_loss(served, stored, held_out)
    assert abs(loss - base) / base < 0.01
    assert _quantized_ratio(stored, "quantized", variables) <= 0.27
    assert stored_bytes(stored) < 0.5 * stored_bytes(variables)  # embedding, head, blocks


@pytest.mark.slow
def test_int4_per_group_ptq_of_the_char_lm_keeps_its_loss_within_five_percent(
        char_lm: tuple) -> None:
    program, variables, held_out, module = char_lm
    base = module.validation_loss(program, variables, held_out)
    int4 = managers.Quantized("int4", group=(128, 64, 32), bricks=[gm.bricks.Linear])
    served, stored = managers.quantize(program, variables, int4)
    groups = {path: entry["scale"].shape for path, weights in
              stored["managers"]["quantized"].items() if path != "hparams"
              for entry in weights.values()}
    assert groups["/blocks/0/mlp/branch/linear_layers/1"] == (2, 64)  # fan-in 256: two of 128
    assert groups["/head"] == (1, 99)  # fan-in 64: one
    loss = module.validation_loss(served, stored, held_out)
    assert abs(loss - base) / base < 0.05
    assert _quantized_ratio(stored, "quantized", variables) <= 0.16


def test_stacked_layers_get_their_own_scales() -> None:
    program = gm.compile(lambda m, x: m(x), Stack())
    variables = program.init(_x())
    _, stored = managers.quantize(program, variables, managers.Quantized())
    entry = stored["managers"]["quantized"]["/blocks/lin"]["kernel"]
    kernels = variables["model"]["blocks"]["lin"]["kernel"]
    assert entry["q"].shape == (3, 64, 64) and entry["scale"].shape == (3, 1, 64)
    for layer in range(3):  # each layer quantized on its own
        q, scale = quantize_matrix(kernels[layer], "int8", 64)
        np.testing.assert_array_equal(entry["q"][layer], q)
        np.testing.assert_array_equal(entry["scale"][layer], scale)
    assert stored["model"]["blocks"]["lin"]["kernel"].shape == (3, 64, 64, 0)


def test_an_ensemble_quantizes_each_member() -> None:
    class Ensemble(nnx.Module):
        def __init__(self) -> None:
            @nnx.vmap(in_axes=0, out_axes=0)
            def make(key: jax.Array) -> nnx.Linear:
                return nnx.Linear(64, 8, rngs=nnx.Rngs(key))

            self.members = make(jax.random.split(jax.random.key(1), 2))

        def __call__(self, x: jax.Array) -> jax.Array:
            return nnx.vmap(lambda member, x: member(x), in_axes=(0, None))(self.members, x)

    program = gm.compile(lambda m, x: m(x), Ensemble())
    x = _x()
    variables = program.init(x)
    served, stored = managers.quantize(program, variables, managers.Quantized())
    assert stored["managers"]["quantized"]["/members"]["kernel"]["scale"].shape == (2, 1, 8)
    np.testing.assert_allclose(served.infer(stored, x), program.infer(variables, x),
                               atol=0.02)


def test_dequantize_inverts_quantize_to_half_a_step() -> None:
    w = jax.random.normal(jax.random.key(0), (64, 16))
    for dtype, group in (("int8", 64), ("int4", 32), ("float8_e4m3fn", 64)):
        q, scale = quantize_matrix(w, dtype, group)
        error = jnp.abs(dequantize_matrix(q, scale, dtype, group) - w)
        steps = jnp.repeat(scale, group, axis=0)
        bound = 0.5 * steps if dtype.startswith("int") else 0.07 * jnp.abs(w) + steps
        assert bool((error <= bound + 1e-6).all()), dtype


@pytest.mark.slow
def test_saved_quantized_variables_load_and_infer_in_a_fresh_process(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, jax, numpy as np, graphmod as gm, managers
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_quantize import Stack, _x
        program = gm.compile(lambda m, x: m(x), Stack())
        variables = program.init(_x())
        if sys.argv[1] == "save":  # 'trained': the initial weights plus one
            trained = jax.tree.map(lambda w: w + 1e-2, variables)
            served, stored = managers.quantize(program, trained, managers.Quantized("int4"))
            served.save(sys.argv[2], stored)
        else:
            served, _ = managers.quantize(program, variables, managers.Quantized("int4"))
            stored = served.load(sys.argv[2])
        np.save(sys.argv[3], np.asarray(served.infer(stored, _x())))
        """)
    saved = tmp_path / "served"
    for mode in ("save", "load"):
        subprocess.run([sys.executable, "-c", script, mode, str(saved),
                        str(tmp_path / f"{mode}.npy")], check=True, cwd=ROOT, timeout=120)
    np.testing.assert_array_equal(np.load(tmp_path / "save.npy"),
                                  np.load(tmp_path / "load.npy"))
    files = [f for f in saved.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 0.5 * (3 * 64 * 64 * 4)


def test_a_fake_quant_trained_model_converts_to_stored_int8_with_its_outputs() -> None:
    fake = managers.FakeQuant(8, bricks=[nnx.Linear])  # weights, inputs and outputs
    program = gm.compile(lambda m, x: jnp.mean((m(x) - 1.0) ** 2), MLP(), managers=[fake])
    x = _x((32, 128))
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(program.init(x), jax.random.key(0))
    for _ in range(5):
        state, _ = step(state, x)
    predict = program.derive(lambda m, x: m(x))
    predict.init(x)  # its examples shape the serving program
    served, stored = managers.quantize(predict, state.variables)
    assert stored["managers"]["quantized"]["/a"]["kernel"]["q"].dtype == jnp.int8
    assert "fake_quant" not in stored["managers"]
    np.testing.assert_allclose(served.infer(stored, x), predict.infer(state.variables, x),
                               rtol=1e-5, atol=1e-5)


def test_the_same_scheme_gives_qwix_ptq_outputs() -> None:
    qwix = pytest.importorskip("qwix", reason="qwix is not installed: pip install qwix")
    model, x = MLP(), _x((16, 128))
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(x)
    for dtype, tile in (("int8", None), ("int4", 128)):
        rule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.dtype(dtype),
                                     tile_size=tile)
        theirs = qwix.quantize_model(model, qwix.PtqProvider([rule]), x)(x)
        served, stored = managers.quantize(program, variables,
                                           managers.Quantized(dtype, group=tile))
        np.testing.assert_allclose(served.infer(stored, x), theirs, rtol=1e-5, atol=1e-5)


# -- bad input ---------------------------------------------------------------------------
def test_a_group_that_does_not_divide_the_fan_in_names_the_weight_and_the_fix() -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    variables = program.init(_x((2, 128)))
    with pytest.raises(ValueError, match=r"group=96 does not divide the fan-in 128 of "
                                         r"weight /a\.kernel.*Choose a group"):
        managers.quantize(program, variables, managers.Quantized("int4", group=96))


def test_a_dtype_the_backend_lacks_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"dtype='int3'.*choose one of"):
        managers.Quantized("int3")

    def unsupported(dtype: object) -> None:  # as a backend without float8 answers
        raise RuntimeError(f"UNIMPLEMENTED: {dtype} is not supported")

    monkeypatch.setattr(quantize_module, "_round_trip", unsupported)
    with pytest.raises(TypeError, match=r"dtype='float8_e5m2'\): the cpu backend cannot "
                                        r"store or convert float8_e5m2.*Use dtype='int8'"):
        managers.Quantized("float8_e5m2")


def test_quantizing_quantized_variables_names_the_variable_and_the_fix() -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    variables = program.init(_x((2, 128)))
    served, stored = managers.quantize(program, variables, managers.Quantized())
    with pytest.raises(ValueError, match=r"quantized already \(model\.a\.kernel is stored by "
                                         r"manager 'quantized'\).*float variables"):
        managers.quantize(served, stored, managers.Quantized())


def test_two_quantizations_of_one_weight_are_refused_naming_both() -> None:
    first, second = managers.Quantized(), managers.Quantized(manager_name="again")
    program = gm.compile(lambda m, x: m(x), MLP(), managers=[first, second])
    with pytest.raises(gm.errors.ManagerConflict, match=r"quantized.*again"):
        program.init(_x((2, 128)))


def test_calibrated_activations_without_data_ask_for_it() -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    variables = program.init(_x((2, 128)))
    with pytest.raises(ValueError, match=r"pass data=\[batch, \.\.\.\]"):
        managers.quantize(program, variables, managers.Quantized(
            activations="absmax", bricks=[nnx.Linear]))


def test_brick_instances_in_the_filter_select_the_same_weights_of_the_copy() -> None:
    model = MLP()
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(_x((2, 128)))
    _, stored = managers.quantize(program, variables, managers.Quantized(bricks=[model.b]))
    assert sorted(stored["managers"]["quantized"]) == ["/b", "hparams"]
    assert stored["model"]["a"]["kernel"].shape == (128, 256)  # left float


def test_the_served_program_agrees_under_vmap_and_differentiates_in_its_inputs() -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    x = _x((4, 128))
    served, stored = managers.quantize(program, program.init(x), managers.Quantized("int4",
                                                                                    group=64))
    batched = served.infer(stored, x)
    one_by_one = jax.vmap(lambda row: served.infer(stored, row[None])[0])(x)
    np.testing.assert_allclose(one_by_one, batched, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda x: served.infer(stored, x).sum())(x)
    assert bool(jnp.isfinite(grads).all()) and float(jnp.abs(grads).sum()) > 0


def test_an_einsum_kernel_is_quantized_per_unit_of_its_own_layout() -> None:
    query = nnx.Einsum("BTD,NDH->BTNH", (2, 64, 8), rngs=nnx.Rngs(0))  # Gemma's, D inside
    program = gm.compile(lambda m, x: m(x), query)
    x = _x((2, 3, 64))
    variables = program.init(x)
    served, stored = managers.quantize(program, variables, managers.Quantized())
    entry = stored["managers"]["quantized"]["/"]["kernel"]
    assert entry["q"].shape == (64, 16) and entry["scale"].shape == (1, 16)  # D by N*H
    np.testing.assert_allclose(served.infer(stored, x), program.infer(variables, x),
                               atol=0.05)


def test_the_served_program_keeps_the_programs_mesh_and_rules() -> None:
    program = gm.compile(lambda m, x: m(x), Stack(), mesh=jax.make_mesh((1,), ("data",)),
                         **gm.sharding.fsdp())
    x = _x()
    variables = program.init(x)
    served, stored = managers.quantize(program, variables, managers.Quantized())
    assert served.placement is not None and served.placement.mesh.axis_names == ("data",)
    np.testing.assert_allclose(served.infer(stored, x), program.infer(variables, x),
                               atol=0.05)
