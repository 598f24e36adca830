"""How programs, variables and train states show in a terminal and in a notebook."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import plugins, roles
from graphmod.data import ArraySource


def regularized_program() -> tuple[gm.Program, gm.bricks.MLP]:
    mlp = gm.bricks.MLP([3, 64, 64, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(
        lambda m, x: jnp.mean(m(x) ** 2), mlp,
        managers=[managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT]),
                  managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT])])
    return program, mlp


def assert_fits(text: str) -> None:
    assert all(len(line) <= 100 for line in text.splitlines()), text


class LongNames(nnx.Module):
    """Paths as long as Flax's translation tutorial's."""

    def __init__(self) -> None:
        self.positional_embedding_of_the_decoder = nnx.Sequential(
            nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.positional_embedding_of_the_decoder(x)


def test_graphs_and_rewrite_traces_of_long_paths_fit_100_columns() -> None:
    program = gm.compile(lambda m, x: m(x).sum(), LongNames(),
                         managers=[managers.Dropout(0.1, bricks=[nnx.Linear])])
    x = jnp.ones((2, 3))
    program.init(x)
    text = str(program.graph(x))
    assert "…" in text and "/layers/1" in text  # paths cut from the left: their ends stay
    assert_fits(text)
    assert_fits(str(program.rewrites))


def test_a_program_shows_its_model_managers_in_order_and_traces() -> None:
    program, _ = regularized_program()
    before = repr(program)
    assert "nothing yet" in before and "at 0x" not in before  # bricks by path, not id
    assert before.index("0. dropout: Dropout") < before.index("1. batch_norm: BatchNorm")
    assert "/linear_layers/0" in before
    program.init(jnp.ones((4, 3)))
    after = repr(program)
    assert "traced: init (example x: (4, 3) float32)" in after
    assert_fits(after)
    many = gm.compile(lambda m, encoder_inputs, decoder_inputs, target_output: m(encoder_inputs),
                      nnx.Linear(3, 1, rngs=nnx.Rngs(0)))  # Flax's translation tutorial's
    many.init(*[jnp.ones((8, 3))] * 3)
    last = repr(many).splitlines()[-1]  # cut at its end: the traced modes stay
    assert last.startswith("  traced: init (example encoder_inputs: (8, 3) float32, ")
    assert_fits(last)
    page = program._repr_html_()
    assert page.count("<table>") == 2
    for expected in ("WEIGHT", "BIAS", "(64, 64)", "batch_norm", "Dropout", "/linear_layers/2"):
        assert expected in page
    graph = repr(program.graph(jnp.ones((4, 3))))  # at a prompt: the table, not an address
    assert graph.startswith("train graph: ") and "/linear_layers/2  apply" in graph


def test_variables_show_roles_shapes_and_sizes_never_values() -> None:
    program, _ = regularized_program()
    variables = program.init(jnp.full((4, 3), 0.123456))
    table = program.variables_table(variables)
    rows = {row["path"]: row for row in table.rows}
    assert rows["model/linear_layers/1/W"] == {
        "path": "model/linear_layers/1/W", "role": "WEIGHT", "shape": (64, 64),
        "dtype": "float32", "size": 4096, "bytes": 16384, "devices": 1,
        "placement": "one device", "per device": 16384}
    assert not table.placement and "placement" not in repr(table)  # one device: no column
    assert {row["role"] for row in table.rows} == {"WEIGHT", "BIAS", "PARAMETER", "STATE"}
    assert table.size == sum(leaf.size for leaf in jax.tree.leaves(variables))
    text, page = repr(table), table._repr_html_()
    assert_fits(text)
    assert "0.12" not in text + page and "managers/batch_norm" in page
    assert text.splitlines()[-1] == table.totals


def test_a_train_state_shows_sizes_in_a_line_and_tables_in_a_notebook() -> None:
    program, _ = regularized_program()
    variables = program.init(jnp.ones((4, 3)))
    step = gm.optimize(program, optax.adam(1e-3))
    state, _ = step(step.init(variables, jax.random.key(0)), jnp.ones((4, 3)))
    line = repr(state)
    assert line.startswith("TrainState(step=1, variables: 14 arrays")  # no skipped count
    assert_fits(line)
    skipping = gm.optimize(program, optax.adam(1e-3), skip_nonfinite=True)
    assert repr(skipping.init(variables, jax.random.key(0))).startswith(
        "TrainState(step=0, skipped=0, variables: 14 arrays")
    page = state._repr_html_()
    assert '<td style="text-align:left">(64, 64)</td>' in page  # text left, not Jupyter's
    assert '<td style="text-align:right">4096</td>' in page  # numbers right
    assert '<td style="text-align:left">WEIGHT</td>' in page  # roles: the program's
    # Adam's moments folded: a row each, inside a closed <details>, not 2 x 10 rows
    opt = page[page.index("<details>"):]
    assert opt.startswith("<details><summary>opt_state: 21 arrays") and "open" not in opt
    assert opt.count("as the variables") == 2 and opt.count("<tr>") == 1 + 3
    shown = []
    jax.jit(lambda s: shown.append(repr(s)) or s.step)(state)  # inside a trace: no read
    assert shown[0].startswith("TrainState(step=traced, variables")


def test_a_filter_names_brick_instances_briefly() -> None:
    lin = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
    text = repr(gm.VariableFilter(bricks=[lin], roles=[roles.WEIGHT]))
    assert text.startswith("VariableFilter(roles=(WEIGHT,), bricks=(<Linear at 0x")
    assert "Weight" not in text  # not the module's own (long) repr


def test_a_loop_shows_its_length_data_plugins_step_and_program() -> None:
    program, mlp = regularized_program()
    program.init(jnp.ones((4, 3)))
    lora = managers.LoRA(2)
    step = gm.optimize(gm.compile(lambda m, x: jnp.mean(m(x) ** 2), mlp, managers=[lora]),
                       gm.provenance.optimizer("adam", 1e-3), trainable=[lora],
                       skip_nonfinite=True)
    assert repr(step).splitlines()[:2] == [
        "TrainStep: trains the parameters of lora, skip_nonfinite",
        "  optimizer: adam(learning_rate=0.001)"]
    assert "not recorded (optax." in repr(gm.optimize(program, optax.sgd(0.1)))
    source = ArraySource({"x": np.ones((10, 3), np.float32)}, 4, shuffle=True, seed=5)
    assert repr(source) == ("ArraySource(arrays, 10 rows, batch 4, shuffled (seed 5), shapes [3] "
                            "float32; 2 batches an epoch)")
    loop = gm.Loop(step, source, epochs=3, steps_per_call=2,
                   plugins=[plugins.ProgressBar(), plugins.Checkpoint("unused", every=gm.On(
                       "epoch_end"))])
    text = repr(loop)
    assert text.splitlines()[:3] == [
        "Loop: 3 epochs, at step 0, steps_per_call=2", f"  data: {source!r}",
        "  plugins: progress_bar at On('step') | On('epoch_end') | On('terminate'), "
        "checkpoint at On('epoch_end')"]
    assert text.splitlines()[3] == "  TrainStep: trains the parameters of lora, skip_nonfinite"
    assert "\n    Program " in text and "\n      0. lora: LoRA, VariableFilter(roles=(WEIGHT,))" \
        in text and "at 0x" not in text


def test_variables_group_under_their_module_and_long_paths_keep_both_ends() -> None:
    program, _ = regularized_program()
    variables = program.init(jnp.ones((4, 3)))
    table = program.variables_table(variables)
    lines = repr(table).splitlines()
    assert lines[0].split() == ["path", "role", "shape", "dtype", "size", "bytes"]
    at = lines.index("model/linear_layers/1/")  # the module once, its arrays under it
    assert lines[at + 1].split()[:3] == ["W", "WEIGHT", "(64,"]
    assert lines[at + 2].split()[:2] == ["b", "BIAS"]
    assert sum("output.scale" in line for line in lines) == 2
    page = table._repr_html_()
    assert page.count('<th colspan="6" style="text-align:left">') == 5  # 5 modules
    assert '<th colspan="6" style="text-align:left">managers/batch_norm/linear_layers/0/apply/' \
        in page
    one = gm.VariablesTable({"model": {"W": jnp.ones((2, 3)), "b": jnp.ones(3)}})
    assert "model/W" in repr(one)  # one module: no grouping
    text = gm.VariablesTable({"the_positional_embedding_of_the_decoder_" * 3: {
        "layers": {"0": {"kernel_of_the_query_projection": jnp.ones(2)}}}})
    assert_fits(repr(text))
    first = repr(text).splitlines()[2]
    assert first.startswith("the_positional") and "…" in first  # both ends: cut inside
    assert first.split()[0].endswith("layers/0/kernel_of_the_query_projection")


def test_rewrites_show_one_table_when_modes_agree_and_the_dtype_column_is_a_field() -> None:
    program, _ = regularized_program()
    x = jnp.ones((4, 3))
    variables = program.init(x)
    program.train(variables, x, rng=jax.random.key(0))
    text = str(program.rewrites)
    assert text.startswith("init and train: 5 rewrites\n") and text.count("rewrites") == 1
    assert program.rewrites._repr_html_().count("<table>") == 1
    program.infer(variables, x)
    assert str(program.rewrites).count("\n\n") == 1  # init and train, then infer
    rewrite = program.rewrites.train[0]
    assert (rewrite.shape, rewrite.dtype) == ("(4, 3)", "float32")
    assert rewrite.row(0)[-2:] == (rewrite.shape, rewrite.dtype)
    cast = gm.compile(lambda m, x: m(x).sum(), gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0)),
                      managers=[managers.Precision("bfloat16")])
    cast.init(x)
    dtypes = {r.name: r.dtype for r in cast.rewrites["init"]}
    assert dtypes["W"] == "float32->bfloat16"  # the column and the field say the same
    assert "float32->bfloat16" in str(cast.rewrites)
