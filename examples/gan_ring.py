"""A GAN on a ring of 8 Gaussians: two models, each with its own program and optimizer, in
one ``graphmod.Loop``, each cost reading the other model's current variables.

The 2-D benchmark of Metz et al. (2017, "Unrolled Generative Adversarial Networks"): the
data are a mixture of 8 Gaussians of standard deviation 0.02 on a circle of radius 2. A GAN
that collapses onto a few modes (the benchmark's point) covers fewer than 8.

1. Two bricks, written once: a generator ``graphmod.bricks.MLP([noise, h, h, 2])`` and a
   discriminator ``graphmod.bricks.MLP([2, h, h, 1])`` (its input scaled by 1/4, as in
   Metz et al., so that the ring lies within [-1, 1]).
2. Each has an inference program (``draw``: noise to samples; ``judge``: samples to logits)
   and a cost program, compiled over its own brick, with its own ``graphmod.optimize`` step
   (Adam, beta1 = 0.5). The costs are the non-saturating GAN losses of Goodfellow et al.
   (2014): the discriminator's reads the generator's variables (``gen``) to make fakes with
   ``draw.infer(gen, z)``, the generator's reads the discriminator's (``disc``) to judge its
   samples with ``judge.infer(disc, ...)``. A read is an input of the step, never
   differentiated nor updated there: each step moves its own model only.
3. ``graphmod.Loop({"disc": d_step, "gen": g_step}, data, reads={"disc": ["gen"], "gen":
   ["disc"]}, schedules=...)``: in every iteration the discriminator steps first, then the
   generator (when its schedule holds), reading the discriminator's variables just updated.
4. At the end 10,000 generated samples are measured: a mode counts as covered when at least
   1% of them lie within 3 std of it, and the share of samples within 3 std of some mode is the
   share of "high-quality" samples.

Choices
    The noise comes with the batch: the data source yields real samples and noise vectors
    together (``{"x": real, "z": noise}``), shuffled together each epoch. Both steps of an
    iteration then see the same noise, the run is reproducible from ``--seed`` alone and
    the data's description (sizes, content hash) records the noise too. A step's own key
    would need an application drawing from ``call.rng()``, which is for training mode only,
    while the discriminator's cost runs the generator in inference mode (``draw.infer``).
    The pool holds 65,536 rows (``--pool``): 256 batches of 256, so a noise vector
    recurs every 256 iterations, with other partners.

    Schedule: both models step at every iteration (``--gen-every 1``), at equal learning
    rates (1e-3), and both MLPs are 64 wide. Over five seeds that covered 8 of 8 modes each
    time; stepping the generator every second iteration (``--gen-every 2``, so the
    discriminator trains twice as often) covered 6, 6, 2, 6 and 8 modes, and 6, 6, 2, 4
    and 8 with twice the iterations (as many generator steps): with its discriminator
    ahead, the generator dropped modes. The numbers and commands are in
    ``docs/examples.md``.

Run it::

    python examples/gan_ring.py                             # the measured run (< 1 min)
    python examples/gan_ring.py --seed 2 --gen-every 2      # the generator every 2nd step
    python examples/gan_ring.py --iterations 200 --hidden 32 --batch-size 64   # seconds

Sharp edges
    A GAN is sensitive to its seed and learning rates: other settings may cover fewer
    modes. ``--out`` is a directory this script owns: ``results.json`` is replaced.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import graphmod
from graphmod.data import ArraySource
from graphmod.plugins import ProgressBar
from graphmod.provenance import optimizer
from graphmod.typing import Variables

MODES = 8
RADIUS = 2.0
STD = 0.02
INPUT_SCALE = 0.25  # the discriminator sees the ring within [-1, 1]


def centers() -> np.ndarray:
    """The 8 modes: points on a circle of radius 2, the first at angle 0."""
    angles = 2 * np.pi * np.arange(MODES) / MODES
    return RADIUS * np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def ring(count: int, seed: int) -> np.ndarray:
    """``count`` samples of the mixture (modes drawn uniformly), float32 of shape (count, 2)."""
    rng = np.random.default_rng([seed, 0])
    modes = rng.integers(MODES, size=count)
    return (centers()[modes] + STD * rng.normal(size=(count, 2))).astype(np.float32)


def noise(count: int, dim: int, seed: int) -> np.ndarray:
    """Standard normal noise vectors, float32 of shape (count, dim)."""
    return np.random.default_rng([seed, 1]).normal(size=(count, dim)).astype(np.float32)


def measure(samples: np.ndarray) -> dict[str, Any]:
    """Mode coverage and quality of ``samples`` (Metz et al., 2017).

    Returns:
        ``modes_covered`` (modes with at least 1% of the samples within 3 std),
        ``high_quality`` (share of samples within 3 std of some mode), ``per_mode`` (the
        share of samples within 3 std of each mode) and ``mean_distance`` (from a sample to
        its nearest mode, averaged).

    Examples:
        >>> import numpy as np
        >>> result = measure(ring(1000, seed=0))
        >>> result["modes_covered"], result["high_quality"] > 0.98
        (8, True)
        >>> measure(np.zeros((10, 2), np.float32))["modes_covered"]
        0
    """
    distances = np.linalg.norm(samples[:, None, :] - centers()[None], axis=-1)
    near = distances < 3 * STD
    per_mode = near.mean(axis=0)
    return {"modes_covered": int((per_mode >= 0.01).sum()),
            "high_quality": float(near.any(axis=1).mean()),
            "per_mode": [round(float(share), 4) for share in per_mode],
            "mean_distance": float(distances.min(axis=1).mean())}


@dataclass
class Gan:
    """The two models' programs and steps, and the data.

    ``draw`` (noise → samples) and ``judge`` (samples → logits) are the inference programs,
    ``g_step`` and ``d_step`` the train steps of the generator's and the discriminator's
    costs, ``states`` the first train states by model name.
    """

    draw: graphmod.Program
    judge: graphmod.Program
    d_step: graphmod.TrainStep
    g_step: graphmod.TrainStep
    source: ArraySource
    states: dict[str, graphmod.TrainState]
    noise_dim: int


def discriminator_loss(real: jax.Array, fake: jax.Array) -> jax.Array:
    """``-log D(x) - log(1 - D(G(z)))`` of the logits, averaged."""
    return (jax.nn.softplus(-real) + jax.nn.softplus(fake)).mean()


def generator_loss(fake: jax.Array) -> jax.Array:
    """The non-saturating generator loss ``-log D(G(z))`` of the logits, averaged."""
    return jax.nn.softplus(-fake).mean()


def build(args: argparse.Namespace) -> Gan:
    """Bricks, programs, steps, data and first states for ``args`` (see :func:`parse_args`)."""
    h = args.hidden
    gen = graphmod.bricks.MLP([args.noise_dim, h, h, 2], activation=jax.nn.relu,
                              rngs=nnx.Rngs(args.seed))
    disc = graphmod.bricks.MLP([2, h, h, 1], activation=jax.nn.relu,
                               rngs=nnx.Rngs(args.seed + 1))
    draw = graphmod.compile(lambda m, z: m(z), gen)
    judge = graphmod.compile(lambda m, x: m(x * INPUT_SCALE)[:, 0], disc)

    def d_cost(m: graphmod.bricks.MLP, x: jax.Array, z: jax.Array, gen: Variables
               ) -> tuple[jax.Array, dict]:
        fake = draw.infer(gen, z)  # the generator's current variables, read
        real_logits, fake_logits = m(x * INPUT_SCALE)[:, 0], m(fake * INPUT_SCALE)[:, 0]
        return discriminator_loss(real_logits, fake_logits), {
            "real": jax.nn.sigmoid(real_logits).mean(), "fake": jax.nn.sigmoid(fake_logits).mean()}

    def g_cost(m: graphmod.bricks.MLP, x: jax.Array, z: jax.Array, disc: Variables) -> jax.Array:
        del x  # the generator's step takes the batch whole; it needs only the noise
        return generator_loss(judge.infer(disc, m(z)))

    x, z = ring(args.pool, args.seed), noise(args.pool, args.noise_dim, args.seed)
    source = ArraySource({"x": x, "z": z}, args.batch_size, shuffle=True, seed=args.seed,
                         name="ring of 8 Gaussians + noise")
    d_program, g_program = graphmod.compile(d_cost, disc), graphmod.compile(g_cost, gen)
    # beta1 = 0.5, as GANs usually take; recorded in each step's provenance.
    d_step = graphmod.optimize(d_program, optimizer("adam", args.d_lr, b1=0.5))
    g_step = graphmod.optimize(g_program, optimizer("adam", args.g_lr, b1=0.5))
    example = {"x": x[:args.batch_size], "z": z[:args.batch_size]}
    d_vars = d_program.init(**example, gen=draw.init(z[:1]))
    g_vars = g_program.init(**example, disc=judge.init(x[:1]))
    states = {"disc": d_step.init(d_vars, jax.random.key(args.seed)),
              "gen": g_step.init(g_vars, jax.random.key(args.seed + 1))}
    return Gan(draw, judge, d_step, g_step, source, states, args.noise_dim)


def make_loop(gan: Gan, args: argparse.Namespace, plugins: Sequence[Any] = ()) -> graphmod.Loop:
    """The loop of the two models: the discriminator at every iteration, then the generator
    every ``args.gen_every``; each reads the other's current variables."""
    schedules = {} if args.gen_every == 1 else {"gen": graphmod.each(args.gen_every)}
    return graphmod.Loop({"disc": gan.d_step, "gen": gan.g_step}, gan.source,
                         steps=args.iterations, schedules=schedules,
                         reads={"disc": ["gen"], "gen": ["disc"]}, plugins=list(plugins))


def samples(gan: Gan, variables: Variables, count: int, seed: int) -> np.ndarray:
    """``count`` generated samples from fresh noise (not the training pool's)."""
    z = np.random.default_rng([seed, 2]).normal(size=(count, gan.noise_dim))
    return np.asarray(gan.draw.infer(variables, z.astype(np.float32)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=10_000,
                        help="loop iterations (the discriminator steps at each)")
    parser.add_argument("--gen-every", type=int, default=1,
                        help="the generator steps every this many iterations")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64, help="width of both MLPs")
    parser.add_argument("--noise-dim", type=int, default=16)
    parser.add_argument("--d-lr", type=float, default=1e-3)
    parser.add_argument("--g-lr", type=float, default=1e-3)
    parser.add_argument("--pool", type=int, default=65_536,
                        help="rows of real samples and noise, reshuffled each epoch")
    parser.add_argument("--samples", type=int, default=10_000, help="generated for the measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/gan_ring"),
                        help="directory for results.json")
    parser.add_argument("--quiet", action="store_true", help="print only the results")
    args = parser.parse_args(argv)
    for name in ("iterations", "gen_every", "batch_size", "hidden", "noise_dim", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.pool < args.batch_size:
        parser.error(f"--pool {args.pool} must hold at least one batch (--batch-size "
                     f"{args.batch_size})")
    return args


def main(argv: Sequence[str] | None = None, plugins: Sequence[Any] = ()) -> dict[str, Any]:
    """Trains the GAN, measures 10,000 samples, writes ``results.json``; returns the results.

    ``plugins`` are added to the loop's (a test's probes of the run).

    Returns:
        ``modes_covered``, ``high_quality``, ``per_mode`` (see :func:`measure`), the same
        before training (``initial``), ``disc_loss`` and ``gen_loss`` (the last steps'),
        ``disc_steps``, ``gen_steps``, ``train_seconds`` and the settings.
    """
    args = parse_args(argv)
    gan = build(args)
    initial = measure(samples(gan, gan.states["gen"].variables, args.samples, args.seed))
    bar = [] if args.quiet else [ProgressBar(metrics=("disc/loss", "gen/loss"))]
    loop = make_loop(gan, args, [*bar, *plugins])
    states = loop.run(gan.states)
    results: dict[str, Any] = {
        **measure(samples(gan, states["gen"].variables, args.samples, args.seed)),
        "initial": {k: v for k, v in initial.items() if k != "per_mode"},
        "disc_loss": float(loop.metrics["disc/loss"]),
        "gen_loss": float(loop.metrics["gen/loss"]),
        "disc_steps": int(states["disc"].step),
        "gen_steps": int(states["gen"].step),
        "train_seconds": round(loop.time.train_seconds, 2),
        "samples": args.samples,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("modes_covered", "high_quality", "disc_loss",
                                              "gen_loss", "train_seconds")}))
    return results


if __name__ == "__main__":
    main()
