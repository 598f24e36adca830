"""TrainState, variables and the rewrite trace through treescope (Flax's display): folded by
module, roles as annotations, the optimizer's copies of the variables folded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import graphmod as gm
from tests.test_display import regularized_program

treescope = pytest.importorskip("treescope", reason="treescope (Flax's display) not installed")


@pytest.fixture(scope="module")
def trained() -> tuple[gm.Program, dict, gm.TrainState]:
    program, _ = regularized_program()
    x = jnp.ones((4, 3))
    variables = program.init(x)
    step = gm.optimize(program, optax.adam(1e-3))
    state, _ = step(step.init(variables, jax.random.key(0)), x)
    program.infer(variables, x)
    return program, variables, state


def expanded(value: object) -> str:
    """Treescope's text with every node the layout may open opened (not the collapsed)."""
    with treescope.using_expansion_strategy(max_height=None):
        return treescope.render_to_text(value, ignore_exceptions=False)


def test_a_train_state_renders_its_variables_by_module_with_roles(trained) -> None:
    _, _, state = trained
    text = expanded(state)
    lines = text.splitlines()
    assert lines[:2] == ["TrainState(", "  step=<jax.Array(1, dtype=int32)>,"]
    assert not any("skipped" in line for line in lines)  # a step without skip_nonfinite
    assert "  variables={  # 14 arrays, 5.1K values, 19.8 KiB" in lines
    assert "    'model': {  # 6 arrays, 4.5K values" in lines  # a node per module
    weight = next(line for line in lines if "'W': <jax.Array float32(3, 64)" in line)
    assert weight.endswith(">,  # WEIGHT")  # the role, as treescope's annotation
    assert sum(line.endswith("# STATE") for line in lines) == 4  # batch norm's statistics
    page = treescope.render_to_html(state, ignore_exceptions=False, compressed=False)
    assert all(role in page for role in ("WEIGHT", "BIAS", "STATE", "PARAMETER"))


def test_adam_moments_stay_folded_even_when_everything_else_opens(trained) -> None:
    _, _, state = trained
    lines = expanded(state).splitlines()
    at = lines.index("  opt_state=(  # 21 arrays, 9.6K values, 37.5 KiB")
    assert lines[at + 1] == "    ScaleByAdamState(  # 21 arrays, 9.6K values"
    mu = next(line for line in lines[at:] if line.lstrip().startswith("mu={"))
    nu = next(line for line in lines[at:] if line.lstrip().startswith("nu={"))
    # one line each: a collapsed node with the ten copies of the parameters inside
    assert mu.count("<jax.Array") == nu.count("<jax.Array") == 10
    assert not any(line.lstrip().startswith("'W'") for line in lines[at:])


def test_variables_and_rewrites_render_through_treescope(trained) -> None:
    program, variables, _ = trained
    text = expanded(program.variables_table(variables))
    assert text.startswith("{  # variables: 14 arrays")
    assert "  'model': {  # 6 arrays, 4.5K values" in text.splitlines()
    rewrites = expanded(program.rewrites).splitlines()
    assert rewrites[:3] == ["program.rewrites(", "  init and train: 5 rewrites",
                            "    /linear_layers/0:   # 2 rewrites"]
    assert "      dropout apply[0] INPUT input_ (4, 3) float32" in rewrites
    assert any(line.startswith("  infer: 2 rewrites") for line in rewrites)
