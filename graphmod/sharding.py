"""Ready sharding rules for ``graphmod.compile(..., mesh=mesh, **preset)``.

Each preset returns ``{"rules": [(VariableFilter, PartitionSpec), ...], "batch_axis": ...}``
to spread into :func:`graphmod.compile`. The rules place the model's variables (the first
matching rule wins, unmatched variables are replicated); a manager's variables for a
parameter and the optimizer's moments follow the parameter; batches are split along
``batch_axis``. The program is the one-device program run by JAX's SPMD partitioner: the
same losses, gradients and random masks, to float rounding.

Examples:
    >>> import jax, jax.numpy as jnp, graphmod as gm
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> program = gm.compile(lambda m, x: m(x).sum(), gm.bricks.MLP([4, 8, 2],
    ...                      rngs=nnx.Rngs(0)), mesh=mesh, **gm.sharding.fsdp("data"))
    >>> program.init(jnp.ones((2, 4)))["model"]["linear_layers"][0]["W"].sharding.spec
    P('data',)
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec

from graphmod import roles
from graphmod._core._filter import VariableFilter

__all__ = ["data_parallel", "fsdp", "tensor_parallel"]


def data_parallel(axis: str = "data") -> dict[str, Any]:
    """Every variable replicated, batches split along ``axis``.

    Examples:
        >>> import graphmod as gm
        >>> gm.sharding.data_parallel()
        {'rules': [], 'batch_axis': 'data'}
    """
    return {"rules": [], "batch_axis": axis}


def fsdp(axis: str = "data") -> dict[str, Any]:
    """Fully sharded data parallel: every weight split along its first dimension over
    ``axis`` (so are the optimizer's moments), biases and norms replicated, batches split
    along ``axis``. A weight whose first dimension ``axis`` does not divide is refused at
    ``init``, naming it.

    Examples:
        >>> import graphmod as gm
        >>> gm.sharding.fsdp()["rules"][0][1]
        P('data',)
    """
    return {"rules": [(VariableFilter(roles=[roles.WEIGHT]), PartitionSpec(axis))],
            "batch_axis": axis}


def tensor_parallel(axis: str = "model", batch_axis: str | None = "data") -> dict[str, Any]:
    """Megatron-style tensor parallelism for graphmod's bricks, over the mesh axis ``axis``.

    ``MultiHeadAttention``: the query, key and value projections split by output feature
    (heads), the output projection by input feature. ``MLP`` (and the MLP of a
    ``TransformerBlock``): layers 0, 2, ... split by output feature, layers 1, 3, ... by
    input feature, so each pair needs one reduction. Everything else is replicated;
    batches are split along ``batch_axis`` (None: replicated).

    Examples:
        >>> import graphmod as gm
        >>> [(f.path, spec) for f, spec in gm.sharding.tensor_parallel()["rules"]][:2]
        [('*/query.W', P(None, 'model')), ('*/query.b', P('model',))]
    """
    columns, rows = PartitionSpec(None, axis), PartitionSpec(axis, None)
    rules: list[tuple[VariableFilter, PartitionSpec]] = []
    for projection in ("query", "key", "value"):
        rules += [(VariableFilter(path=f"*/{projection}.W"), columns),
                  (VariableFilter(path=f"*/{projection}.b"), PartitionSpec(axis))]
    rules += [(VariableFilter(path="*/out.W"), rows),
              (VariableFilter(path="*/linear_layers/*[02468].W"), columns),
              (VariableFilter(path="*/linear_layers/*[02468].b"), PartitionSpec(axis)),
              (VariableFilter(path="*/linear_layers/*[13579].W"), rows)]
    return {"rules": rules, "batch_axis": batch_axis}
