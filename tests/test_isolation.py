"""Traces never leak across programs or modes (inner jit, scan bodies, nnx.remat)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from tests.conftest import has_random


class Inner(gm.Brick):
    """A brick whose application runs through an inner jax.jit, a lax.scan and nnx.remat."""

    def __init__(self, n: int, *, how: str, rngs: nnx.Rngs) -> None:
        self.how = how
        self.lin = gm.bricks.Linear(n, n, rngs=rngs)

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        if self.how == "jit":
            return jax.jit(lambda x: self.lin(x))(input_)
        if self.how == "scan":
            def body(carry: jax.Array, _: None) -> tuple[jax.Array, None]:
                return self.lin(carry), None
            return jax.lax.scan(body, input_, None, length=2)[0]
        return nnx.remat(lambda lin, x: lin(x))(self.lin, input_)


def _program(how: str) -> tuple[gm.Program, jax.Array]:
    model = Inner(4, how=how, rngs=nnx.Rngs(0))
    # Dropout rewrites inside the inner transform; batch norm (whose training update
    # must leave through the outer trace) normalizes the application around it.
    with managers.Dropout(0.5, bricks=[model.lin], roles=[roles.INPUT]), \
            managers.BatchNorm(bricks=[model], roles=[roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), model)
    return program, jnp.arange(24, dtype=jnp.float32).reshape(6, 4) / 10


@pytest.mark.parametrize("how", ["jit", "scan", "remat"])
@pytest.mark.parametrize("first", ["train", "infer"])
def test_inference_never_reuses_a_training_trace(how: str, first: str) -> None:
    program, x = _program(how)
    variables = program.init(x)
    # Population statistics far from the batch ones, so using them is visible.
    stats = variables["managers"]["batch_norm"]["/"]["apply"]
    stats["output.mean"] = stats["output.mean"] + 3.0
    key = jax.random.key(0)
    train = jax.make_jaxpr(lambda v: program.train(v, x, rng=key)[0])
    infer = jax.make_jaxpr(lambda v: program.infer(v, x))
    jaxprs = {first: (train if first == "train" else infer)(variables)}
    second = "infer" if first == "train" else "train"
    jaxprs[second] = (train if second == "train" else infer)(variables)
    assert has_random(jaxprs["train"])
    assert not has_random(jaxprs["infer"])
    # Inference uses the shifted population mean: the output mean moves by about -3/std.
    out = program.infer(variables, x)
    out_train, _ = program.train(variables, x, rng=key)
    assert float(jnp.abs(out.mean() - out_train.mean())) > 1.0


def test_a_program_whose_inner_traces_read_no_frame_shares_one_token() -> None:
    from graphmod._core._tracing import _context

    seen = []

    def fn(model: gm.Brick, x: jax.Array) -> jax.Array:
        seen.append(_context.trace_token())
        return jax.jit(jnp.tanh)(model(x))  # an inner trace of arrays only: shareable

    lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    program = gm.compile(fn, lin)
    x = jnp.ones((1, 2))
    variables = program.init(x)
    program.train(variables, x, rng=jax.random.key(0))
    program.infer(variables, x)
    # One token for every program trace, never None (what traces outside programs use).
    assert seen == [_context.trace_token_shared()] * 3
    assert _context.trace_token() is None


def test_an_inner_trace_reading_the_frame_isolates_every_later_trace() -> None:
    from graphmod._core._tracing import _context

    seen = []

    def fn(model: gm.Brick, x: jax.Array) -> jax.Array:
        seen.append(_context.trace_token())
        return _jitted(model, x)  # the brick's application call is inside jax.jit

    lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    with managers.Dropout(0.5, bricks=[lin], roles=[roles.INPUT]):
        program = gm.compile(fn, lin)
    x = jnp.ones((4, 2))
    variables = program.init(x)
    program.train(variables, x, rng=jax.random.key(0))
    program.infer(variables, x)
    # The first trace stopped at the inner call and was traced again isolated; from then
    # on every outer trace has its own token.
    shared, *fresh = seen
    assert shared == _context.trace_token_shared()
    assert len(fresh) >= 3 and len(set(fresh)) == len(fresh) and shared not in fresh
    assert _context.trace_token() is None


def test_a_function_jitted_before_compile_is_traced_again_in_a_program() -> None:
    lin = gm.bricks.Linear(16, 16, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 16))
    eager = _jitted(lin, x)  # cached outside any program: no manager, no frame
    with managers.Dropout(0.5, bricks=[lin], roles=[roles.INPUT]):
        program = gm.compile(lambda m, x: _jitted(m, x), lin)
    variables = program.init(x)
    out, _ = program.train(variables, x, rng=jax.random.key(0))
    assert not np.allclose(out, eager)  # the dropout ran: the eager trace was not replayed
    np.testing.assert_allclose(program.infer(variables, x), eager, rtol=1e-6)


_REMAT = nnx.remat(lambda lin, x: lin(x))


@jax.jit
def _jitted(lin: gm.bricks.Linear, x: jax.Array) -> jax.Array:
    return lin(x)


class Twice(gm.Brick):
    """Calls one brick twice through one module-level jitted or remat'ed function."""

    def __init__(self, how: str, *, rngs: nnx.Rngs) -> None:
        self.how = how
        self.lin = gm.bricks.Linear(16, 16, rngs=rngs)

    @gm.application(inputs=["input_"], outputs=["first", "second"])
    def apply(self, input_: jax.Array) -> tuple[jax.Array, jax.Array]:
        through = _REMAT if self.how == "remat" else _jitted
        return through(self.lin, input_), through(self.lin, input_)


@pytest.mark.parametrize("how", ["jit", "remat"])
def test_two_calls_through_one_cached_transform_are_two_calls(how: str) -> None:
    model = Twice(how, rngs=nnx.Rngs(0))
    with managers.Dropout(0.5, bricks=[model.lin], roles=[roles.INPUT]):
        program = gm.compile(lambda m, x: m(x), model)
    x = jnp.ones((4, 16))
    variables = program.init(x)
    (first, second), _ = program.train(variables, x, rng=jax.random.key(0))
    assert not np.allclose(first, second)  # call ids 0 and 1: independent masks
    calls = {r.tag.call_id for r in program.graph(x) if r.tag.path == "/lin.apply.input_"}
    assert calls == {0, 1}
    np.testing.assert_allclose(program.infer(variables, x)[0], model.lin(x), rtol=1e-6)


def test_programs_over_one_model_do_not_share_inner_traces() -> None:
    model = Inner(3, how="jit", rngs=nnx.Rngs(1))
    with managers.GaussianNoise(1.0, bricks=[model.lin], roles=[roles.OUTPUT]):
        noisy = gm.compile(lambda m, x: m(x), model)
    plain = gm.compile(lambda m, x: m(x), model)
    x = jnp.ones((2, 3))
    v_noisy, v_plain = noisy.init(x), plain.init(x)
    key = jax.random.key(3)
    a, _ = noisy.train(v_noisy, x, rng=key)
    b, _ = plain.train(v_plain, x, rng=key)
    assert not np.allclose(a, b)
    np.testing.assert_allclose(b, model(x), rtol=1e-6)


@pytest.mark.parametrize("how", ["jit", "scan", "remat"])
def test_state_update_under_a_raw_transform_names_the_application(how: str) -> None:
    model = Inner(4, how=how, rngs=nnx.Rngs(0))
    with managers.BatchNorm(bricks=[model.lin], roles=[roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), model)
    x = jnp.ones((3, 4))
    variables = program.init(x)  # init never updates state: fine
    np.testing.assert_allclose(program.infer(variables, x).shape, (3, 4))
    with pytest.raises(RuntimeError, match=r"application 'apply' of /lin.*graphmod.scan"):
        program.train(variables, x, rng=jax.random.key(0))
