"""Flax's ways to take intermediates out of a model, inside programs: storing one on a
module in its call and popping it in the loss (``self.kl_loss = Loss(...)``,
``nnx.pop(model, Loss)``: Flax's VAE example; the model below is written for this test in
that example's style, an encoder that keeps its own ``nnx.Rngs`` stream for the
reparametrization noise), ``nnx.capture`` of what modules ``sow``, what they ``sow`` popped
with ``nnx.pop`` (Flax's idiom before ``nnx.capture``), and gradients of ``perturb``-ed
intermediates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.errors import TraceContextError

import graphmod as gm
import managers
from graphmod import roles

X = (np.random.default_rng(0).random((8, 6)) > 0.5).astype(np.float32)
KEY = jax.random.key(0)


class Loss(nnx.Variable):
    pass


class Encoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(6, 5, rngs=rngs)
        self.mean = nnx.Linear(5, 2, rngs=rngs)
        self.log_std = nnx.Linear(5, 2, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.hidden(x))
        mean, std = self.mean(h), jnp.exp(self.log_std(h))
        self.kl_loss = Loss(jnp.mean(std**2 + mean**2 - 1.0 - 2 * jnp.log(std)) / 2)
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class AutoEncoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.encoder = Encoder(rngs=rngs)
        self.decoder = nnx.Linear(2, 6, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.decoder(self.encoder(x))


def popping_loss(model: AutoEncoder, x: jax.Array) -> jax.Array:
    logits = model(x)
    kl = sum(jax.tree.leaves(nnx.pop(model, Loss)), 0.0)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x)) + 0.1 * kl


def keeping_loss(model: AutoEncoder, x: jax.Array) -> jax.Array:
    return jnp.mean(optax.sigmoid_binary_cross_entropy(model(x), x))


def new_model() -> AutoEncoder:
    return AutoEncoder(rngs=nnx.Rngs(0, noise=1))


def test_a_popped_intermediate_trains_as_in_flax() -> None:
    model = new_model()
    program = gm.compile(popping_loss, model)
    variables = program.init(X)
    loss, after = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(loss, popping_loss(nnx.clone(model), X), rtol=1e-6)
    noise = after["model"]["encoder"]["rngs"]["noise"]["count"]
    assert int(noise) == int(variables["model"]["encoder"]["rngs"]["noise"]["count"]) + 1
    assert not hasattr(model.encoder, "kl_loss")  # the program changed nothing of the model

    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(variables, KEY)
    losses = []
    for _ in range(40):
        state, metrics = step(state, X)
        losses.append(float(metrics["loss"]))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # the KL term trains through pop
    assert not hasattr(model.encoder, "kl_loss")


def test_managers_rewrite_a_model_that_pops_its_intermediates() -> None:
    model = new_model()
    noise = managers.GaussianNoise(1.0, bricks=[model.decoder], roles=[roles.INPUT])
    program = gm.compile(popping_loss, model, managers=[noise])
    variables = program.init(X)
    loss, _ = program.train(variables, X, rng=KEY)
    assert [r.path for r in program.rewrites.train] == ["/decoder"]
    assert not np.allclose(loss, popping_loss(nnx.clone(model), X))


def test_an_intermediate_left_on_a_module_raises_and_is_taken_off() -> None:
    model = new_model()
    program = gm.compile(keeping_loss, model)
    with pytest.raises(gm.errors.AttributeOutlivesTrace,
                       match=r"Encoder\.kl_loss \(the module at '/encoder'\).*nnx\.pop"):
        program.init(X)
    assert not hasattr(model.encoder, "kl_loss")
    assert issubclass(gm.errors.AttributeOutlivesTrace, TraceContextError)


def test_an_error_in_the_function_leaves_the_module_as_it_was() -> None:
    def failing(model: AutoEncoder, x: jax.Array) -> jax.Array:
        model(x)
        raise ValueError("the user's own error")

    model = new_model()
    before = nnx.state(model, nnx.Param, nnx.RngCount)
    with pytest.raises(ValueError, match="the user's own error"):
        gm.compile(failing, model).init(X)
    assert not hasattr(model.encoder, "kl_loss")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param, nnx.RngCount),
                 before)
    assert np.isfinite(popping_loss(model, X))  # the model still runs eagerly


def test_rebinding_an_attribute_in_a_program_stays_refused() -> None:
    class Scaled(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(6, 2, rngs=nnx.Rngs(0))
            self.last = 0.0

        def __call__(self, x: jax.Array) -> jax.Array:
            self.last = x.mean()  # its new value could not outlive the trace
            return self.linear(x)

    model = Scaled()
    with pytest.raises(TraceContextError, match="Cannot mutate 'Scaled'") as raised:
        gm.compile(lambda m, x: m(x).sum(), model).init(X)
    assert not isinstance(raised.value, gm.errors.AttributeOutlivesTrace)
    assert model.last == 0.0


def test_a_brick_may_store_and_pop_an_intermediate() -> None:
    class Square(gm.Brick):
        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x: jax.Array) -> jax.Array:
            self.norm = Loss(jnp.sum(x**2))
            return x * x

    def loss(model: Square, x: jax.Array) -> jax.Array:
        y = model(x)
        return y.sum() + nnx.pop(model, Loss)["norm"][...]

    brick = Square()
    out, _ = gm.compile(loss, brick).train(gm.compile(loss, brick).init(X), X, rng=KEY)
    np.testing.assert_allclose(out, 2 * np.sum(X**2), rtol=1e-6)
    assert not hasattr(brick, "norm")


class Sowing(nnx.Module):
    def __init__(self) -> None:
        self.linear = nnx.Linear(6, 2, rngs=nnx.Rngs(0))

    def features(self, x: jax.Array) -> jax.Array:
        h = self.linear(x)
        self.sow(nnx.Intermediate, "hidden", h)
        return h

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.features(x)).sum()


def capturing_loss(model: Sowing, x: jax.Array) -> jax.Array:
    out, captured = nnx.capture(model, nnx.Intermediate)(x)
    return out + sum(jnp.sum(v**2) for v in jax.tree.leaves(captured))


def test_nnx_capture_in_a_program_gets_what_modules_sow() -> None:
    model = Sowing()
    monitor = gm.VariableFilter(roles=[roles.AUXILIARY])
    program = gm.compile(capturing_loss, model, monitor=monitor)
    variables = program.init(X)
    expected = capturing_loss(nnx.clone(model), X)
    plain = jnp.tanh(model.linear(X)).sum()  # the model's output (no sow outside capture)
    assert not np.isclose(expected, plain)  # the captured term counts
    out, _, monitored = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(program.infer(variables, X)[0], expected, rtol=1e-6)
    assert list(monitored) == ["/.apply.hidden"]  # still monitorable, as any sow
    assert not hasattr(model, "__captures__")


def test_nnx_capture_of_method_outputs_in_a_program_gets_what_flax_gets() -> None:
    def outputs(model: Sowing, x: jax.Array) -> tuple[jax.Array, dict]:
        out, captured = nnx.capture(model, nnx.Intermediate,
                                    method_outputs=nnx.Intermediate)(x)
        return out, nnx.to_pure_dict(captured)

    model = Sowing()
    out, captured = gm.compile(outputs, model).infer(gm.compile(outputs, model).init(X), X)
    eager_out, eager = outputs(nnx.clone(model), X)
    np.testing.assert_allclose(out, eager_out, rtol=1e-6)
    assert jax.tree.structure(captured) == jax.tree.structure(eager)
    assert {"__call__", "features", "hidden", "linear"} <= set(eager)  # methods and sows
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), captured, eager)


class Containers(nnx.Module):
    """Layers in ``nnx.List`` and ``nnx.Dict`` (as Gemma keeps its blocks), each sowing."""

    def __init__(self) -> None:
        self.blocks = nnx.List([Sowing(), Sowing()])
        self.heads = nnx.Dict(first=nnx.Linear(6, 3, rngs=nnx.Rngs(1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return sum(block(x) for block in self.blocks) + self.heads["first"](x).sum()


def test_nnx_capture_writes_nnx_list_and_dict_containers_in_a_program_as_in_flax() -> None:
    # nnx.capture sets an attribute on every module, containers included: a program lets
    # it, for the trace, as it lets the model's other modules.
    def captured(model: Containers, x: jax.Array) -> tuple[jax.Array, dict]:
        out, sown = nnx.capture(model, nnx.Intermediate)(x)
        return out, nnx.to_pure_dict(sown)

    model = Containers()
    program = gm.compile(captured, model)
    (out, sown), _ = program.train(program.init(X), X, rng=KEY)
    eager_out, eager = captured(nnx.clone(model), X)
    assert set(eager["blocks"]) == {0, 1}  # what each block in the list sowed
    np.testing.assert_allclose(out, eager_out, rtol=1e-6)
    assert jax.tree.structure(sown) == jax.tree.structure(eager)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), sown, eager)
    assert not any(hasattr(m, "__captures__") for _, m in nnx.iter_modules(model))


class SowingTwice(Sowing):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.features(x)).sum() + self.features(2 * x).sum()


def sown_and_popped(model: nnx.Module, x: jax.Array) -> tuple[jax.Array, dict]:
    """Flax's idiom before ``nnx.capture``: sow in the call, pop in the function."""
    out = model(x)
    return out, nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))


@pytest.mark.filterwarnings(r"ignore:Using 'Module.sow\(\)' outside:DeprecationWarning")
def test_values_sown_and_popped_in_the_function_are_what_flax_pops() -> None:
    model = SowingTwice()
    monitor = gm.VariableFilter(roles=[roles.AUXILIARY])
    program = gm.compile(sown_and_popped, model, monitor=monitor)
    variables = program.init(X)
    eager_out, eager = sown_and_popped(nnx.clone(model), X)
    assert len(eager["hidden"]) == 2  # one per call: Flax's tuple
    (out, popped), written, monitored = program.train(variables, X, rng=KEY)
    (inferred_out, inferred), _ = program.infer(variables, X)
    for got in (popped, inferred):  # before: {} (nothing stored on the module)
        assert jax.tree.structure(got) == jax.tree.structure(eager)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, eager)
    np.testing.assert_allclose(out, eager_out, rtol=1e-6)
    np.testing.assert_allclose(inferred_out, eager_out, rtol=1e-6)
    # Monitorable too, each value: before, the second sow's replaced the first's.
    assert list(monitored) == ["/.apply.hidden", "/.apply.hidden#1"]
    for key, value in zip(monitored, eager["hidden"], strict=True):
        np.testing.assert_allclose(monitored[key], value, rtol=1e-6)
    assert jax.tree.structure(written) == jax.tree.structure(variables)
    # Left unpopped, they are monitorable and then dropped: the model stays as it was.
    unpopped = gm.compile(lambda m, x: m(x), model, monitor=monitor)
    out, _, monitored = unpopped.train(unpopped.init(X), X, rng=KEY)
    np.testing.assert_allclose(out, eager_out, rtol=1e-6)
    assert list(monitored) == ["/.apply.hidden", "/.apply.hidden#1"]
    assert not hasattr(model, "hidden")


def test_gradients_of_perturbed_intermediates_in_a_program_equal_flax() -> None:
    class Perturbed(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(6, 2, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.perturb("h", self.linear(x))
            return jnp.sum(3 * h**2)

    def gradient_of_h(model: Perturbed, x: jax.Array) -> dict:
        _, zeros = nnx.capture(lambda m, x: m(x), nnx.Perturbation)(model, x)

        def loss(model: Perturbed, perturbations: nnx.State, x: jax.Array) -> jax.Array:
            return nnx.capture(lambda m, x: m(x), init=perturbations)(model, x)

        return nnx.to_pure_dict(nnx.grad(loss, argnums=1)(model, zeros, x))

    model = Perturbed()
    program = gm.compile(gradient_of_h, model)
    got = program.infer(program.init(X), X)
    expected = gradient_of_h(nnx.clone(model), X)
    np.testing.assert_allclose(got["h"], expected["h"], rtol=1e-6)
    np.testing.assert_allclose(expected["h"], 6 * model.linear(X), rtol=1e-6)  # d(3h²)/dh
    assert not hasattr(model, "__captures__")
