"""Population-based training of the digits MLP, against a fixed grid of the same size and budget.

The digits MLP of ``examples/digits.py`` (64-256-256-10, dropout on the inputs of every
linear layer, batch norm on the hidden outputs), built by that script's ``build`` with a
*dynamic* dropout rate (``graphmod.dynamic``) and trained with
``optax.inject_hyperparams(optax.adam)``, so that both the learning rate and the dropout
rate are values in the train state, one per member:

1. ``graphmod.population(step, members=N)``: the N members train as one vmapped step on
   the same batches, each from its own initial weights and with its own key;
2. the *grid*: the members' learning rates and dropout rates fixed on a grid
   (``--members`` of them: learning rates log-spaced, dropout rates 0.1 and 0.4);
3. *PBT*: the same start, the same steps and the same data, with ``plugins.PBT`` every
   ``--every`` epochs: the members are ranked by their validation accuracy
   (``plugins.PopulationValidation`` on a held-out fifth of the training split), the worst
   quarter copy the best quarter's weights and optimizer state and multiply each copied
   hyperparameter by 0.8 or 1.2.

For both it prints the best member's validation accuracy (and, for the record, that
member's accuracy on the test split, which neither run looks at), as JSON.

Run it::

    python examples/pbt_digits.py                    # 8 members, 40 epochs
    python examples/pbt_digits.py --seed 1 --members 16
    python examples/pbt_digits.py --small            # a few seconds: 4 members, 2 epochs
"""

from __future__ import annotations

import argparse
import json
import runpy
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.model_selection import train_test_split

import graphmod
import managers
from graphmod import On, each
from graphmod.data import ArraySource
from graphmod.plugins import PBT, PopulationValidation

# The data, cost and model of the digits example beside this script (examples/ is not a
# package: read from its file, leaving sys.path as it is).
digits = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("digits.py"))))


def grid(members: int) -> tuple[list[float], list[float]]:
    """The members' learning rates and dropout rates: half at dropout 0.1, half at 0.4,
    each half over learning rates log-spaced from 3e-4 to 1e-2."""
    half = members // 2
    lrs = [*np.geomspace(3e-4, 1e-2, half), *np.geomspace(3e-4, 1e-2, members - half)]
    return [float(lr) for lr in lrs], [0.1] * half + [0.4] * (members - half)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8, help="models trained side by side")
    parser.add_argument("--epochs", type=int, default=40, help="passes over the training set")
    parser.add_argument("--every", type=int, default=2,
                        help="epochs between validations (and PBT's exploit/explore rounds)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0,
                        help="split, initial weights, shuffling, dropout and PBT's draws")
    parser.add_argument("--small", action="store_true",
                        help="4 members, 2 epochs, a round every epoch (a smoke run)")
    parser.add_argument("--quiet", action="store_true", help="print only the results")
    args = parser.parse_args(argv)
    if args.small:
        args.members, args.epochs, args.every = 4, 2, 1
    return args


class Setup:
    """The data, program, population step and plugins both runs share."""

    def __init__(self, args: argparse.Namespace) -> None:
        x_train, x_test, y_train, y_test = digits.load_data(args.seed)
        x_train, x_valid, y_train, y_valid = train_test_split(
            x_train, y_train, test_size=0.2, stratify=y_train, random_state=args.seed)
        self.args = args
        self.train = ArraySource((x_train, y_train), args.batch_size, shuffle=True,
                                 seed=args.seed)
        _, self.program = digits.build(args.seed, graphmod.dynamic(0.1))
        self.rate = next(m for m in self.program.managers
                         if isinstance(m, managers.Dropout)).hparam("rate")
        step = graphmod.optimize(self.program,
                                 optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
        self.population = graphmod.population(step, members=args.members)
        shared = self.program.init(x_train[:2], y_train[:2])
        # Each member starts from its own weights: an MLP of the same shape, seeded apart.
        self.variables = [{**shared, "model": nnx.to_pure_dict(nnx.state(graphmod.bricks.MLP(
            list(digits.DIMS), activation=jax.nn.relu, rngs=nnx.Rngs(1000 * args.seed + i))))}
            for i in range(args.members)]
        self.keys = jax.random.split(jax.random.key(args.seed), args.members)
        predict = self.program.derive(lambda m, x: m(x))
        every = On("epoch_end", epoch=each(args.every))
        self.valid = PopulationValidation(predict, ArraySource((x_valid, y_valid), 256),
                                          metrics=["accuracy"], every=every)
        self.test = PopulationValidation(predict, ArraySource((x_test, y_test), 256),
                                         metrics=["accuracy"], prefix="test/")

    def run(self, pbt: bool) -> dict[str, Any]:
        """Trains the population from the grid (with PBT or not); the best member's record."""
        lrs, dropouts = grid(self.args.members)
        state = self.population.init(self.variables, self.keys,
                                     hparams={"learning_rate": lrs, self.rate: dropouts})
        plugins: list[Any] = [self.valid]
        # Every validation but the last: copies made after it would only duplicate members.
        last = self.args.epochs
        explorer = PBT("valid/accuracy", ["learning_rate", self.rate], mode="max",
                       seed=self.args.seed, every=On("validated", epoch=lambda e: e < last))
        if pbt:
            plugins.append(explorer)
        if not self.args.quiet:
            plugins.append(graphmod.plugins.Print("valid/accuracy", every=On("validated")))
        loop = graphmod.Loop(self.population, self.train, epochs=self.args.epochs,
                             plugins=plugins)
        state = loop.run(state)
        valid = self.valid.evaluate(state.variables)["valid/accuracy"]
        test = self.test.evaluate(state.variables)["test/accuracy"]
        best = int(np.argmax(valid))
        return {
            "best_member": best,
            "valid_accuracy": float(valid[best]),
            "test_accuracy": float(test[best]),
            "mean_valid_accuracy": float(np.mean(valid)),
            "learning_rate": float(self.population.get(state, "learning_rate")[best]),
            "dropout_rate": float(self.population.get(state, self.rate)[best]),
            "exploits": len(explorer.decisions),
            "steps": int(state.step[0]),
        }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the grid, then PBT, from the same start; prints and returns both records.

    Returns:
        ``members``, ``epochs``, and for ``grid`` and ``pbt`` each: ``best_member``,
        ``valid_accuracy`` (the best member's), ``test_accuracy`` (that member's on the
        test split), ``mean_valid_accuracy`` (over the members), the best member's final
        ``learning_rate`` and ``dropout_rate``, ``exploits`` (PBT's decisions) and
        ``steps``.
    """
    args = parse_args(argv)
    setup = Setup(args)
    results = {"members": args.members, "epochs": args.epochs, "every": args.every,
               "seed": args.seed, "grid": setup.run(pbt=False), "pbt": setup.run(pbt=True)}
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
