"""A loss that draws its own noise from an ``nnx.Rngs`` argument, as Flax's diffusion
tutorial writes it, under ``program.train``, a train step and the loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm

X = np.random.RandomState(0).randn(16, 4).astype(np.float32)


def flow_loss(model: Any, x1: jax.Array, rngs: nnx.Rngs) -> jax.Array:
    """Flax's digits_diffusion_model loss, shortened: noise and times from ``rngs``."""
    t = jax.nn.sigmoid(rngs.normal((x1.shape[0],)))
    x0 = rngs.normal(x1.shape)
    xt = (1 - t[:, None]) * x0 + t[:, None] * x1
    return jnp.mean((model(xt) - (x1 - x0)) ** 2)


def program() -> gm.Program:
    compiled = gm.compile(flow_loss, nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    compiled.init(X[:4], nnx.Rngs(0))
    return compiled


def losses(seed: int, steps: int = 3, learning_rate: float = 0.0) -> list[float]:
    compiled = program()
    step = gm.optimize(compiled, optax.sgd(learning_rate))
    state = step.init(compiled.init(X[:4], nnx.Rngs(0)), jax.random.key(seed))
    out = []
    for _ in range(steps):
        state, metrics = step(state, X[:4])  # no rngs: made from the step's key
        out.append(float(metrics["loss"]))
    return out


def test_an_rngs_argument_left_out_draws_fresh_numbers_each_step_from_the_key() -> None:
    first = losses(seed=0)
    assert len(set(first)) == 3           # the same parameters, other noise every step
    assert losses(seed=0) == first         # set by step.init's key
    assert losses(seed=1) != first
    compiled = program()
    variables = compiled.init(X[:4], nnx.Rngs(0))
    key = jax.random.key(0)
    assert float(compiled.train(variables, X[:4], rng=key)[0]) == float(
        compiled.train(variables, X[:4], rng=key)[0])


def test_an_rngs_argument_given_to_a_step_is_drawn_from() -> None:
    compiled = program()
    variables = compiled.init(X[:4], nnx.Rngs(0))
    expected = float(compiled.train(variables, X[:4], nnx.Rngs(7), rng=jax.random.key(0))[0])
    step = gm.optimize(compiled, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    # drawn inside the step's differentiated function (Flax refused: TraceContextError)
    state, metrics = step(state, X[:4], nnx.Rngs(7))
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-6)
    state, metrics = step(state, X[:4], rngs=nnx.Rngs(7))
    assert int(state.step) == 2


def test_the_loop_runs_a_loss_with_an_rngs_argument_on_batches_of_data_alone() -> None:
    compiled = program()
    start = compiled.init(X[:4], nnx.Rngs(0))

    def run() -> dict:
        step = gm.optimize(compiled, optax.adam(3e-2))
        state = step.init(start, jax.random.key(0))
        source = gm.data.ArraySource((X,), batch_size=4, shuffle=True, seed=0)
        return jax.device_get(gm.Loop(step, source, epochs=10).run(state).variables)

    trained = run()
    np.testing.assert_array_equal(trained["model"]["kernel"], run()["model"]["kernel"])
    fixed = lambda variables: float(compiled.infer(variables, X, nnx.Rngs(5)))
    assert fixed(trained) < 0.9 * fixed(start)  # 3.08 against 4.02


def test_infer_needs_the_rngs_argument_it_has_no_key_for() -> None:
    compiled = program()
    variables = compiled.init(X[:4], nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"program\.infer: argument 'rngs' \(an nnx\.Rngs in "
                       r"init's example\) is made from the key only in training; pass one "
                       r"here, e.g\. nnx\.Rngs\(0\), or None if the function draws nothing then"):
        compiled.infer(variables, X[:4])
    assert compiled.infer(variables, X[:4], nnx.Rngs(3)).shape == ()


class ViewGuideModel(nnx.Module):
    """Flax's ``docs_nnx/guides/view.md`` model: Dropout drawing from a ``rngs=`` argument."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin1 = nnx.Linear(4, 8, rngs=rngs)
        self.do = nnx.Dropout(0.5)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.lin2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.lin2(nnx.relu(self.do(self.bn(self.lin1(x)), rngs=rngs)))


def test_the_view_guides_model_trains_from_a_view_and_infers_with_rngs_none() -> None:
    model = ViewGuideModel(nnx.Rngs(0))
    compiled = gm.compile(lambda m, x, rngs: (m(x, rngs=rngs) ** 2).mean(),
                          nnx.view(model, deterministic=False))
    variables = compiled.init(X[:4], nnx.Rngs(1))
    assert "example x: (4, 4) float32" in repr(compiled)  # the nnx.Rngs is not an array
    _, trained = compiled.train(variables, X[:4], None, rng=jax.random.key(0))
    assert not np.allclose(trained["model"]["bn"]["mean"], 0)  # batch statistics moved
    # rngs=None, as Flax's evaluation passes it: running averages, no dropout.
    inferred = compiled.infer(trained, X[:4], None)
    compiled.update_model(trained)
    eager = (nnx.view(model, deterministic=True, use_running_average=True)(X[:4]) ** 2).mean()
    np.testing.assert_allclose(inferred, eager, rtol=1e-6)


def test_an_argument_of_another_structure_is_described_not_dumped() -> None:
    compiled = gm.compile(lambda m, batch: m(batch["x"]).mean(),
                          nnx.Linear(4, 1, rngs=nnx.Rngs(0)))
    variables = compiled.init({"x": X[:4]})
    with pytest.raises(ValueError, match=r"argument 'batch': expected a dict \{'x': \*\} as "
                       r"in init's example, got an array of shape \(4, 4\) and dtype float32; "
                       r"pass the same structure"):
        compiled.infer(variables, X[:4])
    with pytest.raises(ValueError, match=r"expected an nnx\.Rngs as in init's example, got "
                       r"a tuple \(\*,\)"):
        rng_program = program()
        rng_program.infer(rng_program.init(X[:4], nnx.Rngs(0)), X[:4], (X[:4],))


def test_a_cost_returned_with_logits_is_refused_with_the_fix() -> None:
    def loss_and_logits(model: Any, x: jax.Array, y: jax.Array) -> tuple:
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    compiled = gm.compile(loss_and_logits, nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    y = np.zeros(4, np.int32)
    step = gm.optimize(compiled, optax.sgd(0.1))
    state = step.init(compiled.init(X[:4], y), jax.random.key(0))
    with pytest.raises(TypeError, match=r"loss_and_logits returned a tuple of 2; .* return "
                       r"\(loss, \{'logits': logits\}\)"):
        step(state, X[:4], y)


def test_a_raw_key_where_init_had_a_typed_one_is_named_with_the_fix() -> None:
    def noisy(model: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        return jnp.mean(model(x + jax.random.normal(key, x.shape)) ** 2)

    compiled = gm.compile(noisy, nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    variables = compiled.init(X[:4], jax.random.key(0))
    with pytest.raises(ValueError, match=r"argument 'key': expected shape \(\) and dtype "
                       r"key<fry>.*a raw uint32 key \(jax\.random\.PRNGKey\): pass "
                       r"jax\.random\.key\(seed\)"):
        compiled.infer(variables, X[:4], jax.random.PRNGKey(0))


def test_with_an_axis_name_every_device_draws_its_own_noise() -> None:
    def draw(axis_name: Any) -> jax.Array:
        compiled = gm.compile(flow_loss, nnx.Linear(4, 4, rngs=nnx.Rngs(0)),
                              axis_name=axis_name)
        variables = compiled.init(X[:4], nnx.Rngs(0))
        return jax.vmap(lambda x: compiled.train(variables, x, rng=jax.random.key(0))[0],
                        axis_name="devices")(jnp.stack([X[:4], X[:4]]))

    per_device, shared = draw("devices"), draw(None)
    assert per_device[0] != per_device[1]  # the same data, each device its own noise
    assert shared[0] == shared[1]
