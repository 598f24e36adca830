"""A module that reads a child's parameter only for its shape rewrites nothing.

Flax's Gemma (``examples/gemma/modules.py``) reads its heads from its projections' kernels
in ``Attention``'s own call (``self.q_einsum.kernel.shape[0]``). Such a read is of the
stored array's shape, not of a value a manager should see: before, it ran every manager
selecting the kernel in the parent's call too, so the rewrite trace listed the parent and
``SpectralNorm`` ran its power iteration once more per step, silently changing its vector
and the model's outputs.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles

X = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)


class Heads(nnx.Module):
    """Gemma's query projection (``BTD,NDH->BTNH``) and a read-out, heads given."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (2, 8, 4), rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.read_out(x, 2, 4)

    def read_out(self, x: jax.Array, heads: int, head_dim: int) -> jax.Array:
        return self.out(self.q_einsum(x).reshape(*x.shape[:-1], heads * head_dim))


class PeekingHeads(Heads):
    """The same, its heads read from the kernel's shape, ndim and size in its own call."""

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.q_einsum.kernel
        assert kernel.ndim == 3 and kernel.size == 64  # (2, 8, 4)
        heads, _, head_dim = kernel.shape
        return self.read_out(x, heads, head_dim)


def run(cls: type[Heads]) -> tuple[gm.Program, jax.Array, dict, int]:
    """The program over ``cls`` under SpectralNorm and WeightNoise, its training output,
    the variables it writes and its training jaxpr's length."""
    model = cls(nnx.Rngs(0))
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[
        managers.SpectralNorm(roles=[roles.WEIGHT]),
        managers.WeightNoise(0.01, roles=[roles.WEIGHT])])
    variables = program.init(X)
    out, written = program.train(variables, X, rng=jax.random.key(1))
    jaxpr = jax.make_jaxpr(lambda v: program.train(v, X, rng=jax.random.key(1)))(variables)
    return program, out, written, len(jaxpr.eqns)


def test_reading_a_childs_kernel_shape_runs_no_manager_and_changes_nothing() -> None:
    plain, out, written, equations = run(Heads)
    peeking, peeked_out, peeked_written, peeked_equations = run(PeekingHeads)
    rewritten = sorted({(r.manager, r.path) for r in peeking.rewrites["train"]})
    assert rewritten == sorted({(r.manager, r.path) for r in plain.rewrites["train"]}) == [
        ("spectral_norm", "/out"), ("spectral_norm", "/q_einsum"),
        ("weight_noise", "/out"), ("weight_noise", "/q_einsum")]
    # One power iteration per step, as without the read: the same vectors and outputs.
    np.testing.assert_array_equal(peeked_out, out)
    jax.tree.map(np.testing.assert_array_equal, peeked_written, written)
    assert peeked_equations == equations  # no rewrite traced and left for XLA to drop
    assert PeekingHeads(nnx.Rngs(0)).q_einsum.kernel.shape == (2, 8, 4)  # outside: Flax's
