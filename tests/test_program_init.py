"""``init`` is a pure abstract evaluation: no XLA compile of the program, nothing kept by a
``graph``, roles from the layout, one codec for the managers' layout, no program kept alive."""

from __future__ import annotations

import ctypes
import gc
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._model import _owned_layout
from graphmod._core._program._abstract_init import evaluate_needed

X = jnp.ones((4, 6))
# An XLA compile, or one the persistent compilation cache (tests/conftest.py) answered.
_COMPILES = ("/jax/core/compile/backend_compile_duration",
             "/jax/compilation_cache/cache_retrieval_time_sec")


def _program(layers: int = 3, with_managers: bool = True) -> gm.Program:
    mlp = gm.bricks.MLP([6] * (layers + 1), activation=jax.nn.relu, rngs=nnx.Rngs(0))
    chosen = [managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]),
              managers.Dropout(0.1, bricks=mlp.linear_layers, roles=[roles.INPUT])]
    return gm.compile(lambda m, x: m(x).sum(), mlp, managers=chosen if with_managers else [])


def _compiles(run: Any) -> int:
    events: list[str] = []
    listen = lambda event, seconds, **_: events.append(event) if event in _COMPILES else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(run())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


def test_init_compiles_no_program() -> None:
    _program().init(X)  # warms the few primitives init evaluates (zeros, ones, copies)
    program = _program()
    assert _compiles(lambda: program.init(X)) == 0
    assert _compiles(lambda: program.train(program.init(X), X, rng=jax.random.key(0))) > 0


def test_init_values_are_those_of_the_compiled_trace() -> None:
    program = _program()
    variables = program.init(X)
    bn = variables["managers"]["batch_norm"]["/linear_layers/0"]["apply"]
    np.testing.assert_array_equal(bn["output.mean"], np.zeros(6))
    np.testing.assert_array_equal(bn["output.var"], np.ones(6))
    mlp = program.model
    np.testing.assert_array_equal(variables["model"]["linear_layers"][0]["W"],
                                  mlp.linear_layers[0].W[...])
    assert variables["model"]["linear_layers"][0]["W"] is not mlp.linear_layers[0].W[...]
    assert variables["managers"]["dropout"] == {"hparams": {}}


def test_evaluate_needed_skips_what_the_outputs_do_not_need() -> None:
    calls: list[int] = []

    def fn(x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda: calls.append(1))  # an effect: kept
        unused = jnp.linalg.inv(x)  # noqa: F841 (traced, never evaluated)
        return 2 * x[0]

    out = evaluate_needed(jax.jit(fn), jnp.eye(2))
    np.testing.assert_array_equal(out, [2.0, 0.0])
    assert calls == [1]


def test_graph_before_init_initialises_nothing() -> None:
    program = _program()
    program.graph(X)
    record = program.record
    assert (record.inits, record.examples, record.variables) == (0, None, None)
    with pytest.raises(RuntimeError, match=r"has not been initialised"):
        program.roles(_program().init(X))
    program.init(jnp.ones((2, 6)))
    program.graph(jnp.ones((3, 5, 6)))
    assert program.record.examples["x"].shape == (2, 6)


def test_roles_and_split_need_no_init_where_the_layout_suffices() -> None:
    program = _program(with_managers=False)
    variables = _program(with_managers=False).init(X)
    assert program.record.inits == 0
    weights, rest = program.split(variables, roles.WEIGHT)
    assert set(weights["model"]["linear_layers"][0]) == {"W"}
    assert program.merge(weights, rest) == variables
    derived = _program().derive(lambda m, x: m(x))
    with_owned = derived.origin.init(X)
    assert derived.roles(with_owned)["managers"]["batch_norm"]["/linear_layers/0"]["apply"][
        "output.mean"].is_a(roles.PERSISTENT)


def test_the_managers_layout_round_trips_through_its_codec() -> None:
    owned = {("bn", "/a", "apply", None, "mean"): 0, ("noise", "/a", "apply", 0, "eps"): 1,
             ("noise", "/a", "apply", 1, "eps"): 2}
    hparams = {("bn", "momentum"): 0.9}
    tree = _owned_layout.encode(owned, hparams)
    assert tree["noise"]["/a"]["apply"] == {0: {"eps": 1}, 1: {"eps": 2}}
    assert _owned_layout.decode(tree) == (owned, hparams)
    update = {("noise", "/a", "apply", 1, "eps"): 5}
    assert _owned_layout.decode(_owned_layout.replaced(tree, update))[0] == {**owned, **update}
    with pytest.raises(ValueError, match=r"mixes per_call and shared variables"):
        _owned_layout.encode({**owned, ("noise", "/a", "apply", None, "eps"): 3}, {})


def _rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: count leaks
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def _build() -> weakref.ref:
    program = _program(layers=3)
    variables = program.init(X)
    jax.block_until_ready(program.train(variables, X, rng=jax.random.key(0)))
    return weakref.ref(program)


def test_building_programs_again_keeps_neither_them_nor_much_memory() -> None:
    for _ in range(3):
        _build()
    gc.collect()
    before = _rss_mb()
    built = [_build() for _ in range(10)]
    gc.collect()
    assert not any(ref() for ref in built)
    grown = _rss_mb() - before
    # A leak, not a speed: generous (about 0.2 MB a build is measured). Inner traces that
    # read no frame share JAX's caches across programs, as hand-written JAX does.
    assert grown < 10, f"{grown:.1f} MB"
