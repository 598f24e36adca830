"""Train a regularized MLP on scikit-learn's digits, evaluate it, checkpoint it, use it eagerly.

The end-to-end path of graphmod in one script:

1. an MLP brick (``graphmod.bricks.MLP([64, 256, 256, 10])``) written once, with no
   regularization in its code;
2. managers that rewrite it while ``graphmod.compile`` traces the cost: ``Dropout`` on the
   inputs of every linear layer and ``BatchNorm`` on the outputs of every linear layer but
   the last;
3. ``graphmod.optimize(program, optax.adam(...))`` (cosine-decayed learning rate): a
   jitted, buffer-donating train step, run over shuffled minibatches for a fixed number of
   epochs in a plain Python loop;
4. a derived inference program (``program.derive(lambda m, x: m(x))``) for predictions:
   dropout off, batch norm on its running statistics;
5. an orbax checkpoint of the trained variables (a plain nested dict of arrays), replaced
   safely when one is already there, and checked by restoring it;
6. ``program.update_model``: the trained arrays written back into the NNX objects for eager
   use. Outside a compiled program managers do nothing, so the eager MLP has no batch
   normalization; folding batch norm's inference-mode affine map into the linear layers
   gives an eager model whose predictions agree with the inference program.

Run it::

    python examples/digits.py                      # defaults: reaches >= 97% test accuracy
    python examples/digits.py --epochs 5 --out /tmp/digits

Sharp edges
    The last incomplete minibatch of an epoch is dropped, so every step has the same shape
    and the step compiles once. ``--out`` is a directory this script owns: it writes
    ``variables/`` (the checkpoint) and ``metrics.json`` there, replacing earlier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import graphmod
import managers
from graphmod import roles

DIMS = (64, 256, 256, 10)


def load_data(seed: int, test_size: float = 0.25) -> tuple[np.ndarray, ...]:
    """Digits (8x8 pixels, 10 classes) scaled to [0, 1], split stratified by class.

    Returns:
        ``(x_train, x_test, y_train, y_test)``: float32 features and int32 labels.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
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


def build(seed: int, dropout: float) -> tuple[graphmod.bricks.MLP, graphmod.Program]:
    """The MLP and its cost program, compiled with dropout and batch-norm managers."""
    mlp = graphmod.bricks.MLP(list(DIMS), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    with managers.Dropout(dropout, bricks=mlp.linear_layers, roles=[roles.INPUT]), \
         managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = graphmod.compile(cost, mlp)
    return mlp, program


def batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of one epoch of shuffled full minibatches (the remainder is dropped)."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def accuracy(predict: graphmod.Program, variables: dict, x: Any, y: np.ndarray) -> float:
    """Fraction of ``x`` whose arg-max prediction of the inference program is ``y``."""
    logits = predict.infer(variables, x)
    return float(np.mean(np.asarray(jnp.argmax(logits, axis=-1)) == y))


def save_variables(directory: Path, variables: dict) -> Path:
    """Saves ``variables`` to ``directory / "variables"`` with orbax, replacing a previous save.

    The new checkpoint is written beside the old one and swapped in only once complete, so an
    interrupted save never loses the previous checkpoint.
    """
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / "variables"
    staging = directory / f".variables.partial-{uuid.uuid4().hex[:8]}"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(staging, variables)
    checkpointer.wait_until_finished()
    checkpointer.close()
    retired = directory / f".variables.old-{uuid.uuid4().hex[:8]}"
    if final.exists():
        os.replace(final, retired)
    os.replace(staging, final)
    shutil.rmtree(retired, ignore_errors=True)
    return final


def load_variables(path: str | os.PathLike, like: dict) -> dict:
    """Restores a checkpoint written by :func:`save_variables` into the structure of ``like``.

    ``like`` (e.g. ``program.init(...)``) gives the nesting, shapes and dtypes; the model's
    integer keys (``linear_layers/0``) come back as integers.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(path).resolve(), abstract)


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
                        help="directory for the checkpoint and metrics.json")
    parser.add_argument("--quiet", action="store_true", help="print only the final metrics")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains, evaluates, checkpoints and checks the model; returns the metrics.

    Returns:
        ``test_accuracy``, ``train_accuracy``, ``final_loss``, ``steps``, ``train_seconds``
        (the loop, compile included), ``first_step_seconds`` (trace, compile and one step),
        ``eager_agreement`` (fraction of test predictions on which the eager, batch-norm-folded
        model agrees with the inference program), ``eager_max_abs_diff`` (of the logits),
        ``checkpoint`` (its path) and ``variables`` (the trained variables, as numpy arrays).
    """
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else print
    x_train, x_test, y_train, y_test = load_data(args.seed)
    mlp, program = build(args.seed, args.dropout)
    steps_per_epoch = len(x_train) // args.batch_size
    schedule = optax.cosine_decay_schedule(args.lr, max(1, args.epochs * steps_per_epoch))
    step = graphmod.optimize(program, optax.adam(schedule))
    variables = program.init(x_train[:args.batch_size], y_train[:args.batch_size])
    state = step.init(variables, jax.random.key(args.seed))
    predict = program.derive(lambda m, x: m(x))

    shuffle = np.random.default_rng(args.seed)
    xs, ys = jnp.asarray(x_train), jnp.asarray(y_train)
    start = time.perf_counter()
    first_step_seconds: float | None = None
    metrics: dict[str, jax.Array] = {}
    for epoch in range(1, args.epochs + 1):
        for index in batches(len(x_train), args.batch_size, shuffle):
            state, metrics = step(state, xs[index], ys[index])
            if first_step_seconds is None:  # trace, compile and run the first step
                jax.block_until_ready(metrics)
                first_step_seconds = time.perf_counter() - start
        if epoch % 10 == 0 or epoch == args.epochs:  # the only host syncs of the loop
            say(f"epoch {epoch:3d}  loss {float(metrics['loss']):.4f}  "
                f"test accuracy {accuracy(predict, state.variables, x_test, y_test):.4f}")
    jax.block_until_ready(state)
    train_seconds = time.perf_counter() - start

    trained = jax.tree.map(np.array, state.variables)  # host copies
    results: dict[str, Any] = {
        "test_accuracy": accuracy(predict, state.variables, x_test, y_test),
        "train_accuracy": accuracy(predict, state.variables, x_train, y_train),
        "final_loss": float(metrics["loss"]) if metrics else float("nan"),
        "epochs": args.epochs,
        "steps": int(state.step),
        "train_seconds": round(train_seconds, 3),
        "first_step_seconds": round(first_step_seconds or 0.0, 3),
    }

    checkpoint = save_variables(args.out, state.variables)
    restored = load_variables(checkpoint, like=state.variables)
    if not all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(trained), jax.tree.leaves(restored), strict=True)):
        raise RuntimeError(f"the checkpoint at {checkpoint} does not restore what was saved")

    # Eager use: the model's NNX variables get the trained arrays. Managers do nothing
    # outside a compiled program, so fold batch norm into the linear layers first.
    program.update_model(state.variables)
    if not np.array_equal(np.asarray(mlp.linear_layers[0].W[...]),
                          trained["model"]["linear_layers"][0]["W"]):
        raise RuntimeError("program.update_model did not write the trained arrays")
    batch_norm = next(m for m in program.managers if isinstance(m, managers.BatchNorm))
    program.update_model(fold_batch_norm(state.variables, batch_norm.epsilon))
    eager = np.asarray(mlp(jnp.asarray(x_test)))
    compiled = np.asarray(predict.infer(state.variables, x_test))
    results["eager_agreement"] = float(np.mean(eager.argmax(-1) == compiled.argmax(-1)))
    results["eager_max_abs_diff"] = float(np.max(np.abs(eager - compiled)))
    if not np.allclose(eager, compiled, rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"eager predictions disagree with the inference program: {results}")

    results["checkpoint"] = str(checkpoint)
    (checkpoint.parent / "metrics.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))
    return {**results, "variables": trained}


if __name__ == "__main__":
    main()
