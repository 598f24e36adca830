"""Owned variables keyed per parameter and initialised from it; one draw per tied weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._tracing._frame import crc32

KEY = jax.random.key(3)
TOL = dict(rtol=1e-5, atol=1e-5)


class LoRA(gm.Manager):
    """W + A @ B with B starting at zero: the identity at init."""

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        rows, cols = value.shape
        a = call.variable("a", lambda: jnp.full((rows, 2), 0.5), role=roles.PARAMETER)
        b = call.variable("b", lambda: jnp.zeros((2, cols)), role=roles.PARAMETER)
        return value + a.value @ b.value


class WeightNorm(gm.Manager):
    """W * g / ||W|| per output unit, g starting at ||W|| (from the parameter)."""

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        norm = lambda w: jnp.linalg.norm(w, axis=0)
        g = call.variable("g", norm, role=roles.PARAMETER)
        return value * g.value / norm(value)


class TwoKernels(nnx.Module):
    """Two raw weights read in one application (its own ``__call__``)."""

    def __init__(self) -> None:
        keys = jax.random.split(jax.random.key(0))
        self.w1 = nnx.Param(jax.random.normal(keys[0], (8, 8)))
        self.w2 = nnx.Param(jax.random.normal(keys[1], (8, 8)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w1[...] @ self.w2[...]


class TwoLinears(nnx.Module):
    def __init__(self) -> None:
        self.linear1 = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.linear2 = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(nnx.relu(self.linear1(x)))


X = jax.random.normal(jax.random.key(1), (4, 8))


def test_two_parameters_of_one_application_get_two_lora_pairs() -> None:
    program = gm.compile(lambda m, x: m(x), TwoKernels(), managers=[LoRA(roles=[roles.PARAMETER])])
    owned = program.init(X)["managers"]["lo_r_a"]
    assert sorted(owned["/"]) == ["w1", "w2"]
    assert sorted(owned["/"]["w1"]) == ["a", "b"]


def test_two_linears_get_two_pairs_and_the_program_learns_them_apart() -> None:
    model = TwoLinears()
    lora = LoRA(roles=[roles.WEIGHT], manager_name="lora")
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[lora])
    variables = program.init(X)
    owned = variables["managers"]["lora"]
    assert sorted(k for k in owned if k != "hparams") == ["/linear1", "/linear2"]
    assert owned["/linear1"]["kernel"]["b"].shape == (2, 8)
    out, _ = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(out, (model(X) ** 2).mean(), **TOL)  # B = 0: the identity
    grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0])(variables)["managers"]["lora"]
    first, second = grads["/linear1"]["kernel"]["b"], grads["/linear2"]["kernel"]["b"]
    assert np.abs(np.asarray(first)).max() > 0 and np.abs(np.asarray(second)).max() > 0
    assert not np.allclose(first, second)


def test_weight_norm_g_starts_at_the_parameters_norm_and_is_trained() -> None:
    model = TwoLinears()
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model,
                         managers=[WeightNorm(roles=[roles.WEIGHT], manager_name="wn")])
    variables = program.init(X)
    g = variables["managers"]["wn"]["/linear1"]["kernel"]["g"]
    np.testing.assert_allclose(g, jnp.linalg.norm(model.linear1.kernel[...], axis=0), **TOL)
    out, after = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(out, (model(X) ** 2).mean(), **TOL)  # W * ||W|| / ||W|| = W
    np.testing.assert_array_equal(after["managers"]["wn"]["/linear1"]["kernel"]["g"], g)
    grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0])(variables)
    assert np.abs(np.asarray(grads["managers"]["wn"]["/linear2"]["kernel"]["g"])).max() > 0
    # init from the parameter happens once: later programs read g from the variables
    changed = jax.tree.map(lambda v: v, variables)
    changed["managers"]["wn"]["/linear1"]["kernel"]["g"] = 2 * g
    doubled, _ = program.train(changed, X, rng=KEY)
    assert not np.allclose(doubled, out)


class Tied(nnx.Module):
    def __init__(self) -> None:
        self.embed = nnx.Embed(10, 6, rngs=nnx.Rngs(0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.embed.attend(self.embed(ids))


IDS = jnp.array([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("per_call", [False, True])
def test_a_tied_embedding_gets_one_noise_draw_per_step_or_one_per_call(per_call: bool) -> None:
    model = Tied()
    noise = managers.WeightNoise(0.1, roles=[roles.WEIGHT], per_call=per_call)
    program = gm.compile(lambda m, ids: m(ids), model, managers=[noise])
    out, _ = program.train(program.init(IDS), IDS, rng=KEY)
    table = model.embed.embedding[...]
    parameter_key = jax.random.fold_in(
        KEY, crc32("weight_noise|/embed.embedding||WEIGHT|embedding#0"))
    noisy = table + 0.1 * jax.random.normal(parameter_key, table.shape)
    one_draw = noisy[IDS] @ noisy.T
    assert np.allclose(out, one_draw, **TOL) != per_call
    if per_call:  # apply and attend each draw from their own call's key
        keys = [jax.random.fold_in(KEY, crc32(f"weight_noise|/embed|{app}|WEIGHT|embedding#0"))
                for app in ("apply", "attend")]
        first, second = (table + 0.1 * jax.random.normal(k, table.shape) for k in keys)
        np.testing.assert_allclose(out, first[IDS] @ second.T, **TOL)


def test_one_owned_variable_for_a_tied_parameter_read_by_two_applications() -> None:
    program = gm.compile(lambda m, ids: m(ids), Tied(),
                         managers=[WeightNorm(roles=[roles.WEIGHT], manager_name="wn")])
    owned = program.init(IDS)["managers"]["wn"]
    assert list(owned["/embed"]) == ["embedding"]
    assert [r.application for r in program.rewrites["init"]] == [
        "apply", "attend"]


class OnOutputs(gm.Manager):
    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        call.variable("s", jnp.zeros(()), per_parameter=True)
        return value


class PerCall(gm.Manager):
    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        call.variable("s", jnp.zeros(()), per_call=True)
        return value


@pytest.mark.parametrize(("manager", "message"), [
    (OnOutputs(roles=[roles.OUTPUT]), "is for rewrite_parameter hooks"),
    (PerCall(roles=[roles.WEIGHT]), "cannot also be per_call"),
])
def test_per_parameter_variables_outside_parameter_hooks_are_refused(
        manager: gm.Manager, message: str) -> None:
    program = gm.compile(lambda m, x: m(x), TwoLinears(), managers=[manager])
    with pytest.raises(ValueError, match=message):
        program.init(X)


def test_application_variables_in_parameter_hooks_stay_available() -> None:
    class Counted(gm.Manager):
        def rewrite_parameter(self, call, name, value):
            call.variable("seen", lambda: jnp.zeros(()), per_parameter=False)
            return value

    program = gm.compile(lambda m, x: m(x), TwoLinears(),
                         managers=[Counted(roles=[roles.WEIGHT])])
    owned = program.init(X)["managers"]["counted"]
    assert list(owned["/linear1"]) == ["apply"] and list(owned["/linear1"]["apply"]) == ["seen"]


class ScannedLayers(nnx.Module):
    def __init__(self) -> None:
        @nnx.vmap(axis_size=2)
        def create(key: jax.Array) -> nnx.Linear:
            return nnx.Linear(4, 4, rngs=nnx.Rngs(key))

        self.layers = create(jax.random.split(jax.random.key(0)))

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def body(x: jax.Array, layer: nnx.Linear) -> tuple[jax.Array, None]:
            return layer(x), None

        return body(x, self.layers)[0]


def test_a_variable_from_a_parameter_inside_an_nnx_scan_body_is_one_per_layer() -> None:
    model = ScannedLayers()
    program = gm.compile(lambda m, x: m(x), model,
                         managers=[WeightNorm(roles=[roles.WEIGHT], manager_name="wn")])
    x = jax.random.normal(KEY, (2, 4))
    variables = program.init(x)
    g = variables["managers"]["wn"]["/layers"]["kernel"]["g"]
    np.testing.assert_allclose(g, jnp.linalg.norm(model.layers.kernel[...], axis=1), **TOL)
    out, _ = program.train(variables, x, rng=KEY)  # W * g / ||W|| = W at init
    np.testing.assert_allclose(out, model(x), **TOL)
    grown = {**variables, "managers": {"wn": {"/layers": {"kernel": {"g": g * 2}},
                                              "hparams": {}}}}
    # Each layer reads its own g: doubling both doubles each layer's output (its bias is
    # zero), 4x in all.
    np.testing.assert_allclose(program.train(grown, x, rng=KEY)[0], 4 * model(x), **TOL)


class JittedCall(nnx.Module):
    """A layer called inside ``nnx.jit``: the inner trace sees the whole module."""

    def __init__(self) -> None:
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.jit(lambda m, x: m(x))(self.lin, x)


def test_a_variable_from_a_parameter_in_a_transform_that_shares_the_module_is_refused(
        ) -> None:
    program = gm.compile(lambda m, x: m(x), JittedCall(),
                         managers=[WeightNorm(roles=[roles.WEIGHT], manager_name="wn")])
    with pytest.raises(RuntimeError, match=r"(?s)creating 'g' from parameter /lin.kernel"
                       r".*nnx.scan.*graphmod.scan"):
        program.init(jnp.ones((2, 4)))
