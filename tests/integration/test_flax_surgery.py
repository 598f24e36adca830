"""Parameter surgery on a compiled Flax model: a program holds the modules and variables it
was compiled over, so replacing, adding or removing one afterwards is refused by name (before,
``init`` read the replaced arrays, ``update_model`` wrote into modules no longer in the model
and a new trace took the new module's arrays as constants: silently wrong gradients), while
changing values in place (``nnx.update``, ``variable[...] = ...``) is what programs read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from tests.integration.test_flax_intermediates import Sowing


class Classifier(nnx.Module):
    """A pretrained backbone and a head, as in Flax's parameter-surgery example."""

    def __init__(self, seed: int = 0) -> None:
        self.backbone = nnx.Linear(6, 5, rngs=nnx.Rngs(seed))
        self.head = nnx.Linear(5, 3, rngs=nnx.Rngs(seed + 1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.backbone(x)))


def cost(model: Classifier, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x) ** 2)


X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)


def arrays(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]


def surgeries() -> dict:
    def replace_module(model: Classifier) -> None:
        model.backbone = nnx.Linear(6, 5, rngs=nnx.Rngs(9))

    def replace_variable(model: Classifier) -> None:
        model.head.kernel = nnx.Param(jnp.ones((5, 3)))

    def add_module(model: Classifier) -> None:
        model.extra = nnx.Linear(3, 3, rngs=nnx.Rngs(3))

    def remove_module(model: Classifier) -> None:
        del model.head

    return {"replace_module": (replace_module, "/backbone is another Linear"),
            "replace_variable": (replace_variable, "/head.kernel is another Param"),
            "add_module": (add_module, "/extra is new"),
            "remove_module": (remove_module, "/head is gone")}


@pytest.mark.parametrize("surgery", sorted(surgeries()))
def test_a_module_or_variable_changed_after_compile_is_refused_by_path(surgery: str) -> None:
    change, named = surgeries()[surgery]
    model = Classifier()
    program = gm.compile(cost, model, managers=[managers.Dropout(0.1)])
    variables = program.init(X)
    change(model)
    before = arrays(model)
    with pytest.raises(gm.errors.ModelChanged, match=named) as raised:
        program.init(X)
    assert "compile again" in str(raised.value)
    with pytest.raises(gm.errors.ModelChanged, match=named):
        program.train(variables, X, rng=jax.random.key(0))  # a new trace
    with pytest.raises(gm.errors.ModelChanged, match=named):
        program.graph(X)
    with pytest.raises(gm.errors.ModelChanged, match=named):
        program.update_model(variables)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    with pytest.raises(gm.errors.ModelChanged, match=named):
        step(state, X)
    after = arrays(model)
    assert len(after) == len(before)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_replaced_module_is_named_once_not_with_each_of_its_variables() -> None:
    model = Classifier()
    program = gm.compile(cost, model)
    model.backbone = nnx.Linear(6, 5, rngs=nnx.Rngs(9))
    with pytest.raises(gm.errors.ModelChanged) as raised:
        program.init(X)
    assert "/backbone is another Linear" in str(raised.value)
    assert "/backbone.kernel" not in str(raised.value)


def test_values_changed_in_place_are_what_init_reads_and_update_model_writes() -> None:
    model, pretrained = Classifier(), Classifier(seed=5)
    program = gm.compile(cost, model)
    first = program.infer(program.init(X), X)
    nnx.update(model.backbone, nnx.state(pretrained.backbone))  # in place: same variables
    model.head.bias[...] = jnp.full((3,), 0.5)
    variables = program.init(X)
    np.testing.assert_array_equal(variables["model"]["backbone"]["kernel"],
                                  pretrained.backbone.kernel[...])
    np.testing.assert_allclose(program.infer(variables, X), cost(model, X), rtol=1e-6)
    assert abs(float(program.infer(variables, X)) - float(first)) > 1e-3
    variables["model"]["head"]["bias"] = jnp.full((3,), -0.5)
    program.update_model(variables)
    np.testing.assert_array_equal(model.head.bias[...], np.full((3,), -0.5))
    np.testing.assert_allclose(cost(model, X), program.infer(variables, X), rtol=1e-6)


def test_an_array_changed_in_shape_or_dtype_in_place_is_refused_by_init() -> None:
    model = Classifier()
    program = gm.compile(cost, model)
    model.backbone.kernel[...] = jnp.ones((6, 5))  # same shape: fine
    program.init(X)
    model.backbone.kernel.set_value(jnp.ones((7, 5)))
    with pytest.raises(gm.errors.ModelChanged,
                       match=r"/backbone.kernel has shape \(7, 5\).*expected \(6, 5\)"):
        program.init(X)
    model.backbone.kernel.set_value(jnp.ones((6, 5), jnp.bfloat16))
    with pytest.raises(gm.errors.ModelChanged, match=r"/backbone.kernel .*bfloat16"):
        program.init(X)


def test_compiling_again_after_surgery_trains_the_new_module() -> None:
    model = Classifier()
    gm.compile(cost, model).init(X)
    model.backbone = Classifier(seed=5).backbone  # the pretrained backbone, then compile again
    program = gm.compile(cost, model)
    variables = program.init(X)
    np.testing.assert_allclose(program.infer(variables, X), cost(model, X), rtol=1e-6)
    step = gm.optimize(program, optax.sgd(0.5))
    state = step.init(variables, jax.random.key(0))
    state, first = step(state, X)
    for _ in range(4):
        state, last = step(state, X)
    assert float(last["loss"]) < float(first["loss"])
    grads = jax.grad(lambda v: program.infer(v, X))(variables)
    assert float(jnp.abs(grads["model"]["backbone"]["kernel"]).sum()) > 0


def test_values_sown_by_an_eager_call_are_named_with_flaxs_fix() -> None:
    model = Sowing()
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), model)
    variables = program.init(X)
    model(X)  # an eager look at the model leaves /.hidden on it
    with pytest.raises(gm.errors.ModelChanged,
                       match=r"/\.hidden is new\. /\.hidden: values a call of the model sowed "
                       r"outside the program; take them off with nnx.pop\(model, "
                       r"nnx.Intermediate\)"):
        program.train(variables, X, rng=jax.random.key(0))
    nnx.pop(model, nnx.Intermediate)
    out, _ = program.train(variables, X, rng=jax.random.key(0))
    np.testing.assert_allclose(out, jnp.mean(model(X) ** 2), rtol=1e-6)
