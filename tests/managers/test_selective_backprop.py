"""SelectiveBackprop: the step learns from the examples of highest loss, ranked by an extra
forward pass in inference mode, before any augmentation; on a schedule without retrace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([4, 8, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def _data(n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), (np.arange(n) % 3).astype(np.int32)


def _losses(model: gm.bricks.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


def _cost(model: gm.bricks.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return _losses(model, x, y).mean()


def test_keep_one_is_the_plain_step_bitwise() -> None:
    x, y = _data()
    states = []
    for chosen in ([], [managers.SelectiveBackprop(1.0)]):
        program = gm.compile(_cost, _mlp(), managers=chosen)
        step = gm.optimize(program, optax.adam(0.01))
        state = step.init(program.init(x, y), jax.random.key(0))
        for _ in range(3):
            state, metrics = step(state, x, y)
        adam = state.opt_state[0]  # the model's moments (the managers' entries differ)
        states.append((state.variables["model"], adam.mu["model"], adam.nu["model"],
                       metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, states[0], states[1])
    assert int(metrics["selective_backprop.kept"]) == 16


def test_half_the_batch_gives_the_gradient_of_its_highest_losses() -> None:
    x, y = _data()
    model = _mlp()
    graph, state = nnx.split(model)
    program = gm.compile(_cost, model, managers=[managers.SelectiveBackprop(0.5)])
    variables = program.init(x, y)
    params, rest = program.split(variables, gm.roles.PARAMETER)
    grads = jax.grad(lambda p: program.train(program.merge(p, rest), x, y,
                                             rng=jax.random.key(0))[0])(params)
    # By hand: the plain model's per-example losses, the top half, its mean's gradient.
    top = np.sort(np.argsort(-np.asarray(_losses(model, x, y)), kind="stable")[:8])
    expected = jax.grad(lambda m: _cost(nnx.merge(graph, m), x[top], y[top]))(state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 grads["model"], nnx.to_pure_dict(expected))
    rows = [(r.manager, r.name, r.shape_in, r.shape_out) for r in program.rewrites.train]
    assert rows == [("selective_backprop", "x", (16, 4), (8, 4)),
                    ("selective_backprop", "y", (16,), (8,))]
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(variables, jax.random.key(0)), x, y)
    assert int(metrics["selective_backprop.kept"]) == 8
    np.testing.assert_allclose(metrics["selective_backprop.batch_loss"],
                               program.infer(variables, x, y), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], np.asarray(_losses(model, x, y))[top].mean(),
                               rtol=1e-6)


class Classifier(gm.Brick):
    """The MLP and its cost in one application taking the examples and their targets."""

    def __init__(self) -> None:
        self.mlp = _mlp()
        self.cost = gm.bricks.SoftmaxCrossEntropy()

    @gm.application(inputs=["x"], targets=["y"], outputs=["cost"])
    def apply(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return self.cost(self.mlp(x), y)


def test_listed_after_mixup_it_still_selects_before_the_mix() -> None:
    x, y = _data()
    mixup = managers.Mixup(0.4, num_classes=3, bricks=[Classifier])
    program = gm.compile(lambda m, x, y: m(x, y), Classifier(),
                         managers=[mixup, managers.SelectiveBackprop(0.5)])
    assert [m.name for m in program.managers] == ["selective_backprop", "mixup"]
    assert "moved selective_backprop before mixup (SelectiveBackprop.runs_before " \
        "'augmentation')" in repr(program)
    variables = program.init(x, y)
    _, _ = program.train(variables, x, y, rng=jax.random.key(0))
    rows = [(r.manager, r.name, r.shape_out) for r in program.rewrites.train]
    # The mix is of the kept examples: 8 of them, their targets one-hot.
    assert rows == [("selective_backprop", "x", (8, 4)), ("selective_backprop", "y", (8,)),
                    ("mixup", "x", (8, 4)), ("mixup", "y", (8, 3))]
    assert "moved: selective_backprop before mixup" in str(program.rewrites.train)


def test_a_schedule_switches_without_retrace_and_resumes_the_same_draws() -> None:
    x, y = _data()
    traces = []
    sb = managers.SelectiveBackprop(0.5, start=1, interrupt=3, sample=True)
    program = gm.compile(lambda m, x, y: traces.append(1) or _cost(m, x, y), _mlp(),
                         managers=[sb])
    step = gm.optimize(program, optax.adam(0.01))
    state = step.init(program.init(x, y), jax.random.key(0))
    kept, states = [], []
    for _ in range(4):
        states.append(jax.tree.map(jnp.copy, state))
        state, metrics = step(state, x, y)
        kept.append(int(metrics["selective_backprop.kept"]))
    assert kept == [16, 8, 16, 8]  # off before start=1, every 3rd step a plain one
    counted = len(traces)
    again = states[3]
    again, metrics = step(again, x, y)  # as a resumed run would: the same draw
    assert len(traces) == counted
    jax.tree.map(np.testing.assert_array_equal, again.variables, state.variables)
    assert int(state.variables["managers"]["selective_backprop"]["/"]["program"]["step"]) == 4


@pytest.mark.parametrize(("make", "error"), [
    (lambda: managers.SelectiveBackprop(0.0), r"keep=0.0.*in \(0, 1\]"),
    (lambda: managers.SelectiveBackprop(0.5, start=0.5), r"fraction of the run: pass steps="),
    (lambda: managers.SelectiveBackprop(0.5, roles=[gm.roles.INPUT]), r"no filter fields"),
    (lambda: managers.SelectiveBackprop(0.5, start=4, end=2), r"end must come after start"),
])
def test_bad_arguments_are_refused_naming_them(make, error) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        make()


def test_a_batch_too_small_to_keep_one_example_names_the_fix() -> None:
    x, y = _data(2)
    program = gm.compile(_cost, _mlp(), managers=[managers.SelectiveBackprop(0.25)])
    with pytest.raises(ValueError, match=r"keeps int\(0.25 \* 2\) = 0 examples.*raise keep"):
        program.train(program.init(x, y), x, y, rng=jax.random.key(0))
