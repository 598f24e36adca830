"""LoRA: the base model at B = 0, W + (alpha / rank) A @ B by hand (Linear layers and a
convolution's kernel), a deterministic A, merge against a program without the manager,
annealing alpha without retracing, constructor checks. (Training only A and B through
optimize(trainable=): tests/managers/test_library.py.)"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod import roles
from tests.managers.helpers import Counted, array, normal

X = normal(1, 6, 3)
IMAGES = normal(2, 2, 5, 5, 3)
TOL = {"rtol": 1e-4, "atol": 1e-5}


def mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([3, 5, 2], activation=jnp.tanh, rngs=nnx.Rngs(0))


def with_random_b(variables: dict, name: str = "lora", seed: int = 20) -> dict:
    """``variables`` with every adapter's B drawn at random (as after fine-tuning)."""
    def fill(path: Any, leaf: jax.Array) -> jax.Array:
        is_b = path[0].key == "managers" and path[1].key == name and path[-1].key == "b"
        return normal(seed + len(path), *leaf.shape) if is_b else leaf
    return jax.tree_util.tree_map_with_path(fill, variables)


def test_b_zero_is_the_base_model_and_owned_shapes_follow_the_weights() -> None:
    model = mlp()
    program = gm.compile(lambda m, x: m(x), model, managers=[managers.LoRA(
        3, roles=[roles.WEIGHT])])
    variables = program.init(X)
    np.testing.assert_allclose(program.infer(variables, X), model(X), **TOL)
    owned = variables["managers"]["lora"]
    shapes = {path: {k: v.shape for k, v in owned[path]["W"].items()}
              for path in ("/linear_layers/0", "/linear_layers/1")}
    assert shapes == {"/linear_layers/0": {"a": (3, 3), "b": (3, 5)},
                      "/linear_layers/1": {"a": (5, 3), "b": (3, 2)}}
    assert not np.any(array(owned["/linear_layers/0"]["W"]["b"]))


def test_the_update_is_alpha_over_rank_a_at_b_reshaped_to_a_conv_kernel() -> None:
    brick = gm.bricks.Conv(3, 4, (3, 3), padding="VALID", rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), brick, managers=[managers.LoRA(
        2, alpha=6.0, roles=[roles.WEIGHT])])
    variables = with_random_b(program.init(IMAGES))
    adapter = variables["managers"]["lora"]["/"]["W"]
    assert adapter["a"].shape == (27, 2) and adapter["b"].shape == (2, 4)
    w = array(brick.W[...]) + 3.0 * (array(adapter["a"]) @ array(adapter["b"])).reshape(
        3, 3, 3, 4)
    expected = jax.lax.conv_general_dilated(IMAGES, jnp.asarray(w), (1, 1), "VALID",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(program.infer(variables, IMAGES),
                               array(expected) + array(brick.b[...]), **TOL)


def test_a_is_the_same_at_every_init_and_differs_by_seed_and_by_weight() -> None:
    def adapters(seed: int) -> dict:
        program = gm.compile(lambda m, x: m(x), mlp(), managers=[managers.LoRA(
            2, seed=seed, roles=[roles.WEIGHT])])
        return program.init(X)["managers"]["lora"]
    first, again, other = adapters(0), adapters(0), adapters(1)
    a = array(first["/linear_layers/0"]["W"]["a"])
    np.testing.assert_array_equal(a, again["/linear_layers/0"]["W"]["a"])
    assert not np.allclose(a, other["/linear_layers/0"]["W"]["a"])
    assert not np.allclose(a[:2], array(first["/linear_layers/1"]["W"]["a"])[:2, :2])
    np.testing.assert_allclose(a.std(), 1 / np.sqrt(3), rtol=0.6)  # normal / sqrt(fan_in)


def test_merge_folds_the_adapters_in_and_a_program_without_lora_agrees() -> None:
    model = mlp()
    lora = managers.LoRA(2, alpha=gm.dynamic(4.0), roles=[roles.WEIGHT])
    dropout = managers.Dropout(0.5, roles=[roles.INPUT], strict=False)
    program = gm.compile(lambda m, x: m(x), model, managers=[lora, dropout])
    variables = lora.hparam("alpha").set(with_random_b(program.init(X)), 8.0)
    merged = lora.merge(variables)
    assert sorted(merged["managers"]) == ["dropout"]
    plain = gm.compile(lambda m, x: m(x), model, managers=[dropout])
    np.testing.assert_allclose(plain.infer(merged, X), program.infer(variables, X), **TOL)
    adapter = variables["managers"]["lora"]["/linear_layers/1"]["W"]
    np.testing.assert_allclose(
        merged["model"]["linear_layers"][1]["W"], array(model.linear_layers[1].W[...])
        + 4.0 * array(adapter["a"]) @ array(adapter["b"]), rtol=1e-5, atol=1e-6)
    # merge copies: the variables given keep their weights and adapters
    np.testing.assert_array_equal(variables["model"]["linear_layers"][1]["W"],
                                  model.linear_layers[1].W[...])
    assert "lora" in variables["managers"]
    # the model called eagerly has no adapters: update_model with them warns, merged it does not
    with pytest.warns(UserWarning, match=r"variables of \['lora'\] would be left out\. Fold "
                      r"them in first: program\.update_model\(lora\.merge\(variables\)\)"):
        program.update_model(variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program.update_model(merged)
    np.testing.assert_allclose(model(X), program.infer(variables, X), **TOL)


def test_merge_folds_each_layers_adapters_in_a_scan_over_layers() -> None:
    model = ScanMLP(3, n_layers=4, rngs=nnx.Rngs(0))  # adapters stacked (4, 3, 2), (4, 2, 3)
    lora = managers.LoRA(2, alpha=3.0, roles=[roles.WEIGHT])
    program = gm.compile(lambda m, x: m(x), model, managers=[lora])
    variables = with_random_b(program.init(X))
    merged = lora.merge(variables)
    adapter = variables["managers"]["lora"]["/layers/linear"]["kernel"]
    kernel = variables["model"]["layers"]["linear"]["kernel"]
    np.testing.assert_allclose(merged["model"]["layers"]["linear"]["kernel"], array(kernel)
                               + 1.5 * array(adapter["a"]) @ array(adapter["b"]), rtol=1e-5,
                               atol=1e-6)
    plain = gm.compile(lambda m, x: m(x), model)
    np.testing.assert_allclose(plain.infer(merged, X), program.infer(variables, X), **TOL)


def test_merge_of_variables_without_the_adapters_names_the_fix() -> None:
    model = mlp()
    variables = gm.compile(lambda m, x: m(x), model).init(X)
    lora = managers.LoRA(2, roles=[roles.WEIGHT])
    with pytest.raises(gm.errors.VariablesMismatch, match=r"LoRA 'lora'.merge.*compiled with"):
        lora.merge(variables)


def test_annealing_alpha_scales_the_update_without_retracing() -> None:
    model = mlp()
    lora = managers.LoRA(2, alpha=gm.dynamic(2.0), roles=[roles.WEIGHT])
    fn = Counted(lambda m, x: m(x))
    program = gm.compile(fn, model, managers=[lora])
    variables = with_random_b(program.init(X))
    program.infer(variables, X)
    count = fn.count
    off = program.infer(lora.hparam("alpha").set(variables, 0.0), X)
    on = program.infer(lora.hparam("alpha").set(variables, 2.0), X)
    assert fn.count == count
    np.testing.assert_allclose(off, model(X), **TOL)
    assert not np.allclose(array(on), array(off), atol=1e-3)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: managers.LoRA(0), r"LoRA\(rank=0\): must be a positive int"),
    (lambda: managers.LoRA(2.0), r"LoRA\(rank=2.0\)"),
    (lambda: managers.LoRA(2, alpha=float("nan")), r"LoRA\(alpha=nan\): must be a finite"),
    (lambda: managers.LoRA(2, alpha=gm.dynamic(float("inf"))), r"alpha="),
    (lambda: managers.LoRA(2, seed="0"), r"LoRA\(seed='0'\): expected an int"),
])
def test_bad_arguments_name_the_argument(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()
