"""Fitted transforms inside programs: bound to the function's arguments, applied in every
mode (init, train, infer, derive, graph, the train step, evaluate), recorded, refused at
compile when a field names no argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource, FittedTransforms, Standardize, Transforms, Vocabulary
from graphmod.plugins import Validation


class Shift:
    """A transform of the core's protocol alone: subtracts a constant from field ``x``,
    counting checks (what the core hands over when a signature is traced)."""

    def __init__(self, field: str | int = "x", by: float = 10.0) -> None:
        self.field, self.by, self.checked = field, by, []

    def fields(self) -> tuple[str | int, ...]:
        return (self.field,)

    def transformed(self) -> tuple[str | int, ...]:
        return (self.field,)

    def check(self, arguments, where):
        self.checked.append((where, {f: (tuple(v.shape), str(v.dtype))
                                     for f, v in arguments.items()}))
        for field, value in arguments.items():
            if value.shape[-1] != 2:
                raise ValueError(f"{where}: field {field!r} has {value.shape[-1]} features")

    def apply(self, arguments):
        return {f: jnp.subtract(v, self.by) for f, v in arguments.items()}

    def record(self):
        return {"by": self.by}


def _linear() -> gm.bricks.Linear:
    return gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))


def _hand(variables: dict, x: np.ndarray, by: float = 10.0) -> np.ndarray:
    model = variables["model"]
    return (x - by) @ np.asarray(model["W"]) + np.asarray(model["b"])


def test_a_protocol_transform_is_applied_in_init_infer_train_derive_and_graph() -> None:
    shift = Shift()
    program = gm.compile(lambda m, x: m(x), _linear(), transforms=shift)
    x = np.full((3, 2), 10.0, np.float32)
    variables = program.init(x)
    np.testing.assert_allclose(program.infer(variables, x), _hand(variables, x), rtol=1e-6)
    out, _ = program.train(variables, x, rng=jax.random.key(0))
    np.testing.assert_allclose(out, _hand(variables, x), rtol=1e-6)
    derived = program.derive(lambda m, x: 2 * m(x))
    np.testing.assert_allclose(derived.infer(variables, x), 2 * _hand(variables, x), rtol=1e-6)
    # the graph's jaxpr holds the subtraction, before the model's matmul
    text = str(program.graph(x).jaxpr)
    assert text.index("sub") < text.index("dot_general")
    # checked once per traced signature, with the abstract values as jit holds them
    assert [where for where, _ in shift.checked] == [
        "program.init", "program.infer", "program.train", "program.infer", "program.graph",
        "program.graph"]
    assert shift.checked[1][1] == {"x": ((3, 2), "float32")}
    program.infer(variables, x + 1)  # the same signature: no new check
    assert len(shift.checked) == 6


def test_fields_bind_by_name_by_position_and_as_keywords() -> None:
    for field in ("x", 0):
        shift = Shift(field)
        program = gm.compile(lambda m, x: m(x), _linear(), transforms=shift)
        x = np.full((3, 2), 10.0, np.float32)
        variables = program.init(x)
        want = _hand(variables, x)
        np.testing.assert_allclose(program.infer(variables, x), want, rtol=1e-6)
        np.testing.assert_allclose(program.infer(variables, x=x), want, rtol=1e-6)


def test_a_derived_program_skips_fields_its_function_lacks() -> None:
    fitted = Transforms({"x": Standardize()}).fit(ArraySource(
        {"x": np.arange(8.0, dtype=np.float32).reshape(4, 2), "y": np.array([0, 1, 0, 1])}, 2))
    program = gm.compile(lambda m, x, y: (m(x) ** 2).mean() + y.mean(), _linear(),
                         transforms=fitted)
    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    variables = program.init(x, np.zeros(4, np.int32))
    predict = program.derive(lambda m, x: m(x))  # takes no labels: not refused
    standardized = (x - x.mean(0)) / x.std(0)
    np.testing.assert_allclose(predict.infer(variables, x), standardized @ np.asarray(
        variables["model"]["W"]) + np.asarray(variables["model"]["b"]), rtol=1e-5)
    # a prediction function compiled directly with these transforms: 'y' is only checked
    gm.compile(lambda m, x: m(x), _linear(), transforms=fitted)


def test_a_transformed_field_naming_no_argument_is_refused_at_compile() -> None:
    with pytest.raises(ValueError, match=r"field 'z' names no argument of .*\(model, x, y\)"):
        gm.compile(lambda m, x, y: m(x), _linear(), transforms=Shift("z"))
    with pytest.raises(ValueError, match=r"field 2 names no argument .*0: x, 1: y"):
        gm.compile(lambda m, x, y: m(x), _linear(), transforms=Shift(2))
    with pytest.raises(TypeError, match=r"fitted on the training data first"):
        gm.compile(lambda m, x: m(x), _linear(), transforms={"x": Standardize()})


def test_a_wrong_shape_is_refused_when_traced_before_anything_computes() -> None:
    shift = Shift()
    program = gm.compile(lambda m, x: m(x), _linear(), transforms=shift)
    variables = program.init(np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"program.infer: field 'x' has 3 features"):
        program.infer(variables, np.ones((4, 3), np.float32))


def test_the_fitted_numbers_are_constants_of_the_jaxpr() -> None:
    x = np.array([[1.0, 10.0], [3.0, 30.0]], np.float32)
    fitted = Transforms({"x": Standardize()}).fit(ArraySource({"x": x}, 2))
    program = gm.compile(lambda m, x: m(x), _linear(), transforms=fitted)
    variables = program.init(x)
    jaxpr = jax.make_jaxpr(program.infer)(variables, x)
    # the variables and x are the only inputs: mean and std are baked in
    assert len(jaxpr.jaxpr.invars) == len(jax.tree.leaves(variables)) + 1
    assert "sub" in str(jaxpr) and ("mul" in str(jaxpr) or "div" in str(jaxpr))


def test_training_steps_evaluate_and_inference_see_the_same_transformed_inputs() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 3.0, (32, 2)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0]], np.float32)
    train = ArraySource({"x": x, "y": y}, 8, name="train")
    fitted = Transforms({"x": Standardize()}).fit(train)
    model = _linear()
    program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), model, transforms=fitted)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
    state = gm.Loop(step, train, epochs=3).run(state)
    predict = program.derive(lambda m, x: m(x))
    raw = predict.infer(state.variables, x)
    standardized = fitted.apply_host({"x": x, "y": y})["x"]
    hand = gm.compile(lambda m, x: m(x), model).infer(state.variables, standardized)
    np.testing.assert_allclose(raw, hand, rtol=1e-5, atol=1e-6)
    evaluation = gm.evaluate(program, state.variables, {"x": x, "y": y}, metrics=["mse"],
                             predict=lambda m, x: m(x), predictions=True)
    np.testing.assert_allclose(evaluation.predictions, raw, rtol=1e-5, atol=1e-6)


def test_the_provenance_records_the_transforms_and_a_refit_is_a_difference() -> None:
    x = np.array([[1.0, 2.0], [3.0, 8.0]], np.float32)
    first = Transforms({"x": Standardize()}).fit(ArraySource({"x": x}, 1))
    other = Transforms({"x": Standardize()}).fit(ArraySource({"x": 2 * x}, 1))

    def program(transforms: FittedTransforms | None) -> gm.Program:
        made = gm.compile(lambda m, x: m(x), _linear(), transforms=transforms)
        made.init(x)
        return made

    a, b, plain = program(first), program(other), program(None)
    assert a.provenance["transforms"]["transforms"]["x"][0]["kind"] == "Standardize"
    assert plain.provenance["transforms"] is None
    assert gm.provenance.transforms(a.provenance) == first
    assert gm.provenance.transforms(plain.provenance) is None
    fields = [d.field for d in gm.provenance.diff(a.provenance, b.provenance).inputs]
    assert fields and all(f.startswith("transforms") for f in fields), fields
    assert gm.provenance.diff(a.provenance, program(first).provenance).inputs == ()
    assert gm.rebuild(a.provenance).transforms == first


def test_a_jnp_transform_under_x64_keeps_the_program_check_canonical() -> None:
    # float64 training data: the program's inputs are float32 without x64 and still fit
    x = np.linspace(0.0, 1.0, 8).reshape(4, 2)
    fitted = Transforms({"x": Standardize()}).fit(ArraySource({"x": x}, 2))
    program = gm.compile(lambda m, x: m(x), _linear(), transforms=fitted)
    variables = program.init(jnp.ones((1, 2)))
    assert program.infer(variables, x).dtype == jnp.float32


def test_evaluate_and_validation_compare_predictions_with_targets_transformed_alike() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 2)).astype(np.float32)
    y = np.array([3, 5, 7], np.int32)[(x[:, 0] > 0).astype(int) + (x[:, 1] > 0)]
    train = ArraySource({"x": x, "y": y}, 8, name="train")
    fitted = Transforms({"y": Vocabulary()}).fit(train)

    def cost(m, x, y):  # y arrives as indices 0..2
        return -jnp.take_along_axis(jax.nn.log_softmax(m(x)), y[:, None], 1).mean()

    program = gm.compile(cost, gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)), transforms=fitted)
    step = gm.optimize(program, optax.adam(0.1))
    state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
    predict = program.derive(lambda m, x: m(x))
    valid = Validation(predict, ArraySource({"x": x, "y": y}, 16), metrics=["accuracy"])
    state = gm.Loop(step, train, epochs=5, plugins=[valid]).run(state)
    by_hand = float(np.mean(np.asarray(predict.infer(state.variables, x)).argmax(-1)
                            == np.searchsorted([3, 5, 7], y)))
    result = gm.evaluate(predict, state.variables, {"x": x, "y": y}, metrics=["accuracy"])
    assert result["accuracy"] == pytest.approx(by_hand) and by_hand > 0.5
    assert valid.history[-1][1]["valid/accuracy"] == pytest.approx(by_hand)
