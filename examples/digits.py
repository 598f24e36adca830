"""Train a regularized MLP on scikit-learn's digits, evaluate it, checkpoint it, use it eagerly.

The end-to-end path of graphmod in one script:

1. an MLP brick (``graphmod.bricks.MLP([64, 256, 256, 10])``) written once, with no
   regularization in its code, taking raw pixel intensities: the feature scaling
   (``graphmod.data.MinMax``, each pixel's training range onto 0..1) is fitted on the
   training split only and compiled into the program (``compile(..., transforms=)``), so
   training, validation and the saved model all scale alike;
2. managers that rewrite it while ``graphmod.compile`` traces the cost: ``Dropout`` on the
   inputs of every linear layer and ``BatchNorm`` on the outputs of every linear layer but
   the last;
3. ``graphmod.optimize(program, optax.adam(...))`` (cosine-decayed learning rate): a
   jitted, buffer-donating train step, run by ``graphmod.Loop`` over shuffled minibatches
   (``graphmod.data.ArraySource``) with plugins: ``Checkpoint`` (the run, every epoch, in
   ``--out``), ``Validation`` (test accuracy every 10 epochs), ``ProgressBar`` and ``Print``;
4. a derived inference program (``program.derive(lambda m, x: m(x))``) for predictions:
   dropout off, batch norm on its running statistics;
5. the trained variables saved with their provenance and fitted scaling (``program.save``)
   and checked by loading them back (``graphmod.provenance.transforms(DIR)`` gives a
   fresh process the scaling to compile with);
6. ``program.update_model``: the trained arrays written back into the NNX objects for eager
   use. Outside a compiled program managers do nothing, so the eager MLP has no batch
   normalization; folding batch norm's inference-mode affine map into the linear layers
   gives an eager model whose predictions agree with the inference program.

Run it::

    python examples/digits.py                      # defaults: reaches >= 97% test accuracy
    python examples/digits.py --epochs 5 --out /tmp/digits
    graphmod inspect runs/digits                   # checkpoints, counters, provenance
    graphmod resume runs/digits                    # continue a run that was stopped

Sharp edges
    The last incomplete minibatch of an epoch is dropped, so every step has the same shape
    and the step compiles once. ``--out`` is a directory this script owns: a new run
    deletes the loop checkpoints an earlier run left there (``Checkpoint(overwrite=True)``)
    and replaces ``variables/`` and ``metrics.json``; ``graphmod resume`` continues the run
    saved there instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import graphmod
import managers
from graphmod import On, each, roles
from graphmod.data import ArraySource, FittedTransforms, MinMax, Transforms
from graphmod.plugins import Checkpoint, Print, ProgressBar, Validation

DIMS = (64, 256, 256, 10)


def load_data(seed: int, test_size: float = 0.25) -> tuple[np.ndarray, ...]:
    """Digits (8x8 pixels, 10 classes), raw intensities 0..16, split stratified by class.

    Returns:
        ``(x_train, x_test, y_train, y_test)``: float32 features and int32 labels.
    """
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, stratify=y, random_state=seed)
    return x_train, x_test, y_train, y_test


def cost(model: graphmod.bricks.MLP, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    """Mean softmax cross-entropy of the model's logits, and the batch accuracy."""
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = (jnp.argmax(logits, axis=-1) == y).mean()
    return loss, {"accuracy": accuracy}


def fit_scaling(x_train: np.ndarray, y_train: np.ndarray) -> FittedTransforms:
    """Each pixel's training range onto 0..1 (``MinMax``), fitted on the training split."""
    return Transforms({0: MinMax()}).fit(ArraySource((x_train, y_train), batch_size=1))


def build(seed: int, dropout: float, transforms: FittedTransforms | None = None
          ) -> tuple[graphmod.bricks.MLP, graphmod.Program]:
    """The MLP and its cost program, compiled with dropout and batch-norm managers and the
    fitted feature scaling (``transforms``, applied to ``x`` before the model runs)."""
    mlp = graphmod.bricks.MLP(list(DIMS), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    with managers.Dropout(dropout, bricks=mlp.linear_layers, roles=[roles.INPUT]), \
         managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = graphmod.compile(cost, mlp, transforms=transforms)
    return mlp, program


def accuracy(predict: graphmod.Program, variables: dict, x: Any, y: np.ndarray) -> float:
    """Fraction of ``x`` whose arg-max prediction of the inference program is ``y``."""
    logits = predict.infer(variables, x)
    return float(np.mean(np.asarray(jnp.argmax(logits, axis=-1)) == y))


def save_variables(directory: Path, program: graphmod.Program, variables: dict) -> Path:
    """Saves ``variables`` with the program's provenance to ``directory / "variables"`` and
    checks that they load back unchanged.

    The new save is written beside an earlier one and swapped in only once complete and
    verified, so an interrupted save never loses the earlier one.
    """
    directory = directory.resolve()
    final, staging = directory / "variables", directory / f".variables-{uuid.uuid4().hex[:8]}"
    program.save(staging, variables)
    loaded = program.load(staging)
    if not all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(variables), jax.tree.leaves(loaded), strict=True)):
        raise RuntimeError(f"the variables saved at {staging} do not load back as saved")
    retired = directory / f".variables-old-{uuid.uuid4().hex[:8]}"
    if final.exists():
        os.replace(final, retired)
    os.replace(staging, final)
    shutil.rmtree(retired, ignore_errors=True)
    return final


def fold_batch_norm(variables: dict, epsilon: float = 1e-5) -> dict:
    """Variables whose linear layers include batch norm's inference-mode affine map.

    ``BatchNorm`` in inference computes ``(z - mean) / sqrt(var + eps) * scale + bias`` of
    ``z = x @ W + b``: the same as a linear layer with ``W * s`` and ``(b - mean) * s + bias``,
    ``s = scale / sqrt(var + eps)``. The returned variables run the trained network with no
    manager, e.g. eagerly after ``program.update_model``.
    """
    model = jax.tree.map(lambda a: a, variables["model"])
    for path, apps in variables["managers"].get("batch_norm", {}).items():
        if path == "hparams":
            continue
        bn = apps["apply"]
        layer = model["linear_layers"][int(path.rsplit("/", 1)[-1])]
        s = bn["output.scale"] * jax.lax.rsqrt(bn["output.var"] + epsilon)
        layer["W"] = layer["W"] * s
        layer["b"] = (layer["b"] - bn["output.mean"]) * s + bn["output.bias"]
    return {"model": model, "managers": {}}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=40, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="Adam's initial learning rate (cosine decay to 0)")
    parser.add_argument("--dropout", type=float, default=0.2,
                        help="drop rate on the inputs of every linear layer")
    parser.add_argument("--seed", type=int, default=0, help="split, init, shuffle, dropout")
    parser.add_argument("--out", type=Path, default=Path("runs/digits"),
                        help="the run directory: loop checkpoints, variables/, metrics.json")
    parser.add_argument("--quiet", action="store_true", help="print only the final metrics")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, program: graphmod.Program, data: tuple[np.ndarray, ...]
          ) -> tuple[Any, graphmod.Loop]:
    """Runs the loop (or continues the run saved in ``--out`` under ``graphmod resume``)."""
    x_train, x_test, y_train, y_test = data
    steps_per_epoch = len(x_train) // args.batch_size
    schedule = optax.cosine_decay_schedule(args.lr, max(1, args.epochs * steps_per_epoch))
    step = graphmod.optimize(program, optax.adam(schedule), config={
        "name": "adam", "learning_rate": args.lr, "schedule": "cosine decay to 0"})
    variables = program.init(x_train[:args.batch_size], y_train[:args.batch_size])
    state = step.init(variables, jax.random.key(args.seed))
    predict = program.derive(lambda m, x: m(x))
    every_10 = On("epoch_end", epoch=each(10)) | On("end")
    plugins: list[Any] = [
        Checkpoint(args.out, every=On("epoch_end"), keep=2, overwrite=True),
        Validation(predict, ArraySource((x_test, y_test), 256), metrics=["accuracy"],
                   every=every_10, prefix="test/"),
    ]
    if not args.quiet:
        plugins += [ProgressBar(metrics=("loss", "accuracy")),
                    Print("test/accuracy", every=On("validated"))]
    source = ArraySource((x_train, y_train), args.batch_size, shuffle=True, seed=args.seed)
    loop = graphmod.Loop(step, source, epochs=args.epochs, plugins=plugins)
    return loop.run(state), loop


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains, evaluates, saves and checks the model; returns the metrics.

    Returns:
        ``test_accuracy``, ``train_accuracy``, ``final_loss``, ``epochs``, ``steps``,
        ``train_seconds`` (the loop's own timeline: wall time less plugins and evaluation),
        ``eager_agreement`` (fraction of test predictions on which the eager,
        batch-norm-folded model agrees with the inference program), ``eager_max_abs_diff``
        (of the logits), ``checkpoint`` (the saved variables) and ``variables`` (the trained
        variables, as numpy arrays).
    """
    args = parse_args(argv)
    data = x_train, x_test, y_train, y_test = load_data(args.seed)
    scaling = fit_scaling(x_train, y_train)  # on the training split only
    mlp, program = build(args.seed, args.dropout, scaling)
    state, loop = train(args, program, data)
    predict = program.derive(lambda m, x: m(x))
    trained = jax.tree.map(np.array, state.variables)  # host copies
    results: dict[str, Any] = {
        "test_accuracy": accuracy(predict, state.variables, x_test, y_test),
        "train_accuracy": accuracy(predict, state.variables, x_train, y_train),
        "final_loss": float(loop.metrics["loss"]),
        "epochs": args.epochs,
        "steps": int(state.step),
        "train_seconds": round(loop.time.train_seconds, 3),
    }
    checkpoint = save_variables(args.out, program, state.variables)

    # Eager use: the model's NNX variables get the trained arrays. Managers and transforms
    # do nothing outside a compiled program, so fold batch norm into the linear layers
    # first and scale the inputs on the host (the same arithmetic, in NumPy).
    program.update_model(state.variables)
    if not np.array_equal(np.asarray(mlp.linear_layers[0].W[...]),
                          trained["model"]["linear_layers"][0]["W"]):
        raise RuntimeError("program.update_model did not write the trained arrays")
    batch_norm = next(m for m in program.managers if isinstance(m, managers.BatchNorm))
    program.update_model(fold_batch_norm(state.variables, batch_norm.epsilon))
    eager = np.asarray(mlp(jnp.asarray(scaling.apply_host((x_test,))[0])))
    compiled = np.asarray(predict.infer(state.variables, x_test))
    results["eager_agreement"] = float(np.mean(eager.argmax(-1) == compiled.argmax(-1)))
    results["eager_max_abs_diff"] = float(np.max(np.abs(eager - compiled)))
    if not np.allclose(eager, compiled, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"eager predictions disagree with the inference program: {results}")

    results["checkpoint"] = str(checkpoint)
    (checkpoint.parent / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    print(result_table(results, checkpoint.parent / "metrics.json"))
    return {**results, "variables": trained}


def result_table(results: dict[str, Any], written: Path) -> str:
    """The results as a short two-column table (all of them are in ``written``)."""
    rows = [("test accuracy", f"{results['test_accuracy']:.2%}"),
            ("train accuracy", f"{results['train_accuracy']:.2%}"),
            ("final loss", f"{results['final_loss']:.4f}"),
            ("epochs, steps", f"{results['epochs']}, {results['steps']}"),
            ("train seconds", f"{results['train_seconds']:.1f}"),
            ("eager model agrees", f"{results['eager_agreement']:.2%} "
                                   f"(max |diff| {results['eager_max_abs_diff']:.1e})"),
            ("saved", results["checkpoint"]), ("metrics", str(written))]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


if __name__ == "__main__":
    main()
