"""Bad input gets a clear error naming the culprit, raised before anything changes."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._tracing._context import active_managers


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([4, 5, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


X, Y = jnp.ones((8, 4)), jnp.zeros(8, jnp.int32)


def test_a_filter_that_matches_nothing_names_the_manager() -> None:
    mlp = _mlp()
    with managers.Dropout(0.5, bricks=[gm.bricks.Linear], roles=[roles.COST]):
        program = gm.compile(_cost, mlp)
    with pytest.raises(ValueError, match=r"manager 'dropout' \(Dropout\) matched nothing.*"
                                         r"roles=\(COST,\).*strict=False"):
        program.init(X, Y)
    lenient = gm.compile(_cost, mlp, managers=[
        managers.Dropout(0.5, roles=[roles.COST], strict=False)])
    lenient.init(X, Y)


def test_two_exclusive_managers_on_one_variable_name_both() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp, managers=[
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT]),
        managers.BatchNorm(bricks=[gm.bricks.Linear], roles=[roles.OUTPUT], manager_name="bn2"),
    ])
    with pytest.raises(ValueError, match=r"'bn2' and 'batch_norm'.*output.*/linear_layers/0"):
        program.init(X, Y)


def test_a_role_that_is_not_a_role() -> None:
    with pytest.raises(TypeError, match=r"'weight' is not a role.*WEIGHT"):
        managers.Dropout(0.5, roles=["weight"])
    with pytest.raises(TypeError, match=r"VariableFilter\(roles=...\): 3 is not a role"):
        gm.VariableFilter(roles=[3])


def test_duplicate_manager_names_raise_at_compile() -> None:
    with pytest.raises(ValueError, match=r"two managers are named 'dropout'.*name=\.\.\."):
        gm.compile(_cost, _mlp(), managers=[managers.Dropout(0.1), managers.Dropout(0.2)])


def test_a_brick_outside_the_model_named_by_a_filter() -> None:
    stranger = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"manager 'dropout'.*Linear.*not part of the compiled"):
        gm.compile(_cost, _mlp(), managers=[managers.Dropout(0.1, bricks=[stranger])])


def test_not_a_manager() -> None:
    with pytest.raises(TypeError, match=r"managers\[1\]: 'dropout' is not a graphmod.Manager"):
        gm.compile(_cost, _mlp(), managers=[managers.Dropout(0.1), "dropout"])


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_wrong_shapes_or_dtypes_name_the_argument_and_the_expected_shape(mode: str) -> None:
    program = gm.compile(_cost, _mlp())
    variables = program.init(X, Y)
    run = (lambda *a: program.train(variables, *a, rng=jax.random.key(0))) if mode == "train" \
        else (lambda *a: program.infer(variables, *a))
    with pytest.raises(ValueError, match=r"argument 'x': expected shape \(batch, 4\) and dtype "
                                         r"float32.*got shape \(8, 5\)"):
        run(jnp.ones((8, 5)), Y)
    with pytest.raises(ValueError, match=r"argument 'y': expected shape \(batch\) and dtype "
                                         r"int32.*dtype float32"):
        run(X, jnp.zeros(8))
    run(jnp.ones((3, 4)), jnp.zeros(3, jnp.int32))  # another batch size is fine


def test_variables_that_do_not_match_the_program_name_missing_and_extra_paths() -> None:
    program = gm.compile(_cost, _mlp())
    variables = program.init(X, Y)
    layers = variables["model"]["linear_layers"]
    broken = {"model": {"linear_layers": {0: layers[0], 1: {"W": layers[1]["W"],
                                                            "bias": layers[1]["b"]}}},
              "managers": variables["managers"]}
    with pytest.raises(ValueError, match=r"missing linear_layers/1/b; unexpected "
                                         r"linear_layers/1/bias"):
        program.train(broken, X, Y, rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"variables must be the dict made by program.init"):
        program.infer(variables["model"], X, Y)


def test_non_scalar_cost_given_to_optimize() -> None:
    program = gm.compile(lambda m, x: m(x), _mlp())
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(X), jax.random.key(0))
    with pytest.raises(ValueError, match=r"must be a float scalar.*shape \(8, 3\).*mean"):
        step(state, X)


def test_train_without_a_key() -> None:
    program = gm.compile(_cost, _mlp())
    with pytest.raises(TypeError, match=r"rng is required"):
        program.train(program.init(X, Y), X, Y, rng=None)
    with pytest.raises(TypeError, match=r"rng is required, e\.g\. rng=jax\.random\.key\(0\); "
                       r"the function's argument 3 is a key: pass it as rng=key instead"):
        program.train(program.init(X, Y), X, Y, jax.random.key(0))


def test_compile_rejects_a_non_module_model_and_bad_monitors() -> None:
    with pytest.raises(TypeError, match=r"model must be a flax.nnx.Module"):
        gm.compile(_cost, {"W": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"monitor\['a'\]: expected a VariableFilter"):
        gm.compile(_cost, _mlp(), monitor={"a": roles.OUTPUT})


def test_bad_filter_fields() -> None:
    with pytest.raises(ValueError, match=r"name_regex='\('\) is not a valid regular expression"):
        gm.VariableFilter(name_regex="(")
    with pytest.raises(TypeError, match=r"bricks=...\): 3 is neither a Brick instance"):
        gm.VariableFilter(bricks=[3])
    with pytest.raises(TypeError, match=r"filter= or the filter fields \(roles\)"):
        managers.Dropout(0.5, roles=[roles.INPUT], filter=gm.VariableFilter())


def test_frozen_manager_and_stored_arrays_unchanged_after_a_failed_call() -> None:
    mlp = _mlp()
    dropout = managers.Dropout(0.5, roles=[roles.INPUT])
    program = gm.compile(_cost, mlp, managers=[dropout])
    with pytest.raises(AttributeError, match=r"'dropout' is frozen"):
        dropout.rate = 0.1
    variables = program.init(X, Y)
    snapshot = jax.tree.map(np.asarray, variables)
    with pytest.raises(ValueError):
        program.train(variables, jnp.ones((8, 5)), Y, rng=jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, variables, snapshot)


def test_a_wrong_feature_size_in_a_sequence_names_the_argument() -> None:
    rnn = gm.bricks.SimpleRecurrent(3, 5, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), rnn)
    variables = program.init(jnp.ones((2, 7, 3)))
    with pytest.raises(ValueError, match=r"argument 'x': expected shape \(batch, \*, 3\)"):
        program.infer(variables, jnp.ones((2, 7, 4)))


def test_variables_with_string_list_keys_get_a_restore_hint() -> None:
    program = gm.compile(_cost, _mlp())
    variables = program.init(X, Y)
    layers = variables["model"]["linear_layers"]
    as_restored = {"model": {"linear_layers": {"0": layers[0], "1": layers[1]}},
                   "managers": variables["managers"]}
    with pytest.raises(ValueError, match=r"differ only in key types.*restore with one"):
        program.update_model(as_restored)


def test_an_int_where_a_key_is_wanted_names_rng_and_the_fix() -> None:
    program = gm.compile(_cost, _mlp())
    fix = r"rng must be one JAX random key, e.g. rng=jax\.random\.key\(0\).*got 0 \(int\)"
    with pytest.raises(TypeError, match=r"program\.init\(\.\.\., rng=key\): " + fix):
        program.init(X, Y, rng=0)
    assert program._example is None and not program._shared.examples  # nothing recorded
    variables = program.init(X, Y)
    snapshot = jax.tree.map(np.asarray, variables)
    with pytest.raises(TypeError, match=r"program\.train\(variables, \*args, rng=key\): " + fix):
        program.train(variables, X, Y, rng=0)
    step = gm.optimize(program, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"step\.init\(variables, rng\): " + fix):
        step.init(variables, 0)
    with pytest.raises(TypeError, match=r"rng must be one JAX random key.*got an array of "
                                        r"shape \(2,\) and dtype key<fry>"):
        program.train(variables, X, Y, rng=jax.random.split(jax.random.key(0)))
    jax.tree.map(np.testing.assert_array_equal, variables, snapshot)
    data = jax.random.key_data(jax.random.key(0))  # raw key data is a key too
    program.train(variables, X, Y, rng=data)
    assert int(step.init(variables, data).step) == 0


def _runs(program: gm.Program, variables: dict) -> dict:
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    return {"train": lambda *a: program.train(variables, *a, rng=jax.random.key(0)),
            "infer": lambda *a: program.infer(variables, *a),
            "step": lambda *a: step(state, *a)}


@pytest.mark.parametrize("run", ["train", "infer", "step"])
def test_arguments_disagreeing_on_the_batch_size_name_both(run: str) -> None:
    program = gm.compile(_cost, _mlp())
    call = _runs(program, program.init(X[:1], Y[:1]))[run]
    with pytest.raises(ValueError, match=r"disagree on their leading \(batch\) dimension: "
                                         r"argument 'x' has 8 rows, argument 'y' has 5 rows "
                                         r"\(init's example gave them all 1\)"):
        call(X, Y[:5])
    call(X[:3], Y[:3])  # another batch size, the same for both, is fine


def test_an_argument_that_is_not_batched_may_keep_its_own_leading_size() -> None:
    program = gm.compile(lambda m, x, scale: (m(x * scale) ** 2).mean(), _mlp())
    variables = program.init(X[:2], jnp.ones(4))
    for rows in (1, 8):
        program.train(variables, X[:rows], jnp.ones(4), rng=jax.random.key(0))


def test_an_array_source_with_rows_that_disagree_names_each_array() -> None:
    with pytest.raises(ValueError, match=r"arrays\[0\] has 8 rows; arrays\[1\] has 5 rows\. "
                                         r"Pass as many rows in each"):
        gm.data.ArraySource((np.ones((8, 4)), np.ones((5, 2))), batch_size=2)
    with pytest.raises(ValueError, match=r"arrays\['x'\] has 8 rows; arrays\['y'\] is a scalar"):
        gm.data.ArraySource({"x": np.ones((8, 4)), "y": np.float32(1)}, batch_size=2)


def test_token_inputs_may_change_their_length_but_not_their_rank_or_dtype() -> None:
    embed = gm.bricks.Embedding(10, 4, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, tokens: m(tokens).sum(), embed)
    variables = program.init(jnp.zeros((2, 16), jnp.int32))
    for length in (7, 16, 40):  # a token sequence has no feature axis
        assert program.infer(variables, jnp.ones((3, length), jnp.int32)).shape == ()
    with pytest.raises(ValueError, match=r"argument 'tokens': expected shape \(batch, \*\) and "
                                         r"dtype int32.*got shape \(3,\)"):
        program.infer(variables, jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match=r"argument 'tokens'.*dtype int32.*float32"):
        program.infer(variables, jnp.ones((3, 16), jnp.float32))


def test_a_typed_key_is_accepted_as_an_argument() -> None:
    lin = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x, key: (m(x) + jax.random.normal(key, (3,))).sum(), lin)
    variables = program.init(jnp.ones((1, 2)), jax.random.key(1))
    first = program.infer(variables, jnp.ones((4, 2)), jax.random.key(2))
    again = program.infer(variables, jnp.ones((4, 2)), jax.random.key(2))
    other = program.infer(variables, jnp.ones((4, 2)), jax.random.key(3))
    assert first == again and first != other


def test_a_manager_entered_twice_names_it_and_the_fix() -> None:
    dropout = managers.Dropout(0.5)
    with dropout, pytest.raises(gm.errors.ManagerReentered,
                                match=r"'dropout' is already active.*name="):
        with dropout:
            pass
        assert active_managers() == (dropout,)  # the failed entry left the stack as it was
    assert active_managers() == ()


def test_a_manager_that_skips_super_init_is_told_to_call_it() -> None:
    class NoSuper(gm.Manager):
        def __init__(self, rate: float) -> None:
            self.rate = rate

        def rewrite_output(self, call: Any, name: str, value: Any) -> Any:
            return value * self.rate

    lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(AttributeError, match=r"NoSuper has no .*super\(\).__init__\(\*\*kwargs\)"):
        gm.compile(lambda m, x: m(x), lin, managers=[NoSuper(0.5)]).init(jnp.ones((1, 2)))
    assert not hasattr(NoSuper(0.5), "strict")  # hasattr still answers


def test_a_dynamic_hyperparameter_used_as_a_number_points_to_hp() -> None:
    class Scale(gm.Manager):
        hparams = ("factor",)

        def __init__(self, factor: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.factor = factor

        def rewrite_output(self, call: Any, name: str, value: Any) -> Any:
            return value * self.factor  # should be self.hp("factor")

    lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), lin,
                         managers=[Scale(gm.dynamic(2.0), roles=[roles.OUTPUT])])
    with pytest.raises(TypeError, match=r"Dynamic\(value=2.0\).*self.hp\("):
        program.init(jnp.ones((1, 2)))
    with pytest.raises(TypeError, match=r"self.hp\("):
        jnp.asarray(gm.dynamic(0.5))


class _Tokens(nnx.Module):
    def __init__(self) -> None:
        self.embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.head(self.embed(ids)).mean(1)


@pytest.mark.parametrize("argument, given", [
    (jnp.zeros((3, 5)), r"inputs=float32\[3, 5\]"),  # float token ids: Flax's own error
    (_Tokens(), r"inputs=<_Tokens>"),  # the model passed where the ids belong
])
def test_an_error_inside_a_layer_names_the_innermost_application_and_its_inputs(
        argument: Any, given: str) -> None:
    program = gm.compile(lambda m, ids: m(ids).sum(), _Tokens())
    with pytest.raises((ValueError, AttributeError)) as raised:
        program.init(argument)
    notes = [note for note in raised.value.__notes__ if note.startswith("graphmod: raised")]
    assert len(notes) == 1  # the Embed's, not also the model's around it
    assert re.fullmatch(rf"graphmod: raised in the application 'apply' of /embed \(Embed\), "
                        rf"called with {given}", notes[0]), notes


def test_an_abstract_model_from_eval_shape_is_refused_at_compile_naming_the_variable() -> None:
    # Flax's surgery guide: partial init by nnx.eval_shape, then nnx.update with weights;
    # forgetting the update left init to fail inside numpy.
    model = nnx.eval_shape(lambda: _Tokens())
    model.embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))  # one layer given real values
    with pytest.raises(TypeError, match=r"variable /head\.bias is abstract \(float32\[2\], as "
                       r"nnx\.eval_shape makes them\), not an array: give it values first"):
        gm.compile(lambda m, ids: m(ids).sum(), model)
