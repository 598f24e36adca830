"""Ready sharding rules for ``graphmod.compile(..., mesh=mesh, **preset)``.

Each preset returns ``{"rules": [(VariableFilter, PartitionSpec), ...], "batch_axis": ...}``
to spread into :func:`graphmod.compile`. The rules place the model's variables (the first
matching rule wins, unmatched variables are replicated); a manager's variables for a
parameter and the optimizer's moments follow the parameter; batches are split along
``batch_axis``. The program is the one-device program run by JAX's SPMD partitioner: the
same losses, gradients and random masks, to float rounding. The presets' specs describe one
layer (:func:`per_layer`): on Flax's scan over layers, whose weights are stacked with the
layers first, they split the dimensions of each layer, so each step of the scan gathers one
layer, never the whole stack. A preset's rule may select no variable of a model (a preset
serves a family of models); a rule of your own that selects none is refused at ``compile``.

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

import glob
from collections.abc import Mapping
from typing import TypedDict

from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

from graphmod import roles
from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._selection._per_layer import PerLayer
from graphmod._core._selection._rules import PresetRule, misfit

__all__ = ["annotated", "data_parallel", "fsdp", "misfit", "per_layer", "tensor_parallel"]


class Preset(TypedDict):
    """A preset's arguments of :func:`graphmod.compile`: ``compile(..., mesh=mesh,
    **preset)``."""

    rules: list[PresetRule]
    batch_axis: str | None


def per_layer(spec: PartitionSpec) -> PerLayer:
    """``spec`` as one layer's placement, for a rule: a variable stacked over layers (Flax's
    scan over layers: ``nnx.vmap``-made layers applied by ``nnx.scan``) or an ensemble's
    members keeps those leading axes whole and is split as ``spec`` says after them, as
    Flax's ``nnx.vmap`` inserts ``None`` for the stacking axis into a variable's sharding
    annotation; any other variable is split as ``spec`` says. A plain ``PartitionSpec``
    places the stored variable as it is (``P('data')`` on a stacked weight splits its
    layers: each step of the scan would gather the whole stack). The stacking is what
    ``init``'s trace sees, so a rule's placement is known from ``init`` on.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> from examples.flax_nnx.scan_over_layers import ScanMLP
        >>> rules = [(gm.VariableFilter(roles=[gm.roles.WEIGHT]), gm.sharding.per_layer(P("data")))]
        >>> program = gm.compile(lambda m, x: m(x).sum(), ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0)),
        ...                      mesh=jax.make_mesh((1,), ("data",)), rules=rules)
        >>> program.init(jnp.ones((2, 4)))["model"]["layers"]["linear"]["kernel"].sharding.spec
        P(None, 'data')
    """
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"sharding.per_layer(spec): expected a PartitionSpec, got {spec!r}")
    return PerLayer(spec)


def data_parallel(axis: str = "data") -> Preset:
    """Every variable replicated, batches split along ``axis``.

    Examples:
        >>> import graphmod as gm
        >>> gm.sharding.data_parallel()
        {'rules': [], 'batch_axis': 'data'}
    """
    return {"rules": [], "batch_axis": axis}


def fsdp(axis: str = "data") -> Preset:
    """Fully sharded data parallel: every weight split along its first dimension over
    ``axis`` (so are the optimizer's moments), biases and norms replicated, batches split
    along ``axis``. A weight stacked over Flax's scanned layers (or an ensemble's members)
    is split along its first dimension after the stacking axes (:func:`per_layer`), so the
    scan gathers one layer at a time. A weight whose dimension ``axis`` does not divide is
    refused at ``init``, naming it and the rule that splits a later dimension instead.

    Examples:
        >>> import graphmod as gm
        >>> gm.sharding.fsdp()["rules"][0][1]
        per_layer(P('data',))
    """
    return {"rules": [PresetRule((VariableFilter(roles=[roles.WEIGHT]),
                                  per_layer(PartitionSpec(axis))))], "batch_axis": axis}


def tensor_parallel(axis: str = "model", batch_axis: str | None = "data") -> Preset:
    """Megatron-style tensor parallelism for graphmod's bricks and Flax's attention, over
    the mesh axis ``axis``.

    ``MultiHeadAttention`` (graphmod's brick, and ``flax.nnx.MultiHeadAttention``, whose
    projections are ``nnx.LinearGeneral`` kernels of shape (features, heads, head size)
    and (heads, head size, features)): the query, key and value projections split by head,
    the output projection by input head. ``MLP`` (and the MLP of a ``TransformerBlock``):
    layers 0, 2, ... split by output feature, layers 1, 3, ... by input feature, so each
    pair needs one reduction. Everything else is replicated (a Flax model's MLP layers
    have no names to pair them by: split them with ``annotated`` or rules of your own);
    batches are split along ``batch_axis`` (None: replicated). The specs are per layer
    (:func:`per_layer`): attention stacked over scanned layers is split the same way.

    Examples:
        >>> import graphmod as gm
        >>> [(f.path, spec) for f, spec in gm.sharding.tensor_parallel()["rules"]][:2]
        [('*/query.W', per_layer(P(None, 'model'))), ('*/query.b', per_layer(P('model',)))]
    """
    def split(*entries: str | None) -> PerLayer:
        return per_layer(PartitionSpec(*entries))

    columns, rows = split(None, axis), split(axis, None)
    rules: list[tuple[VariableFilter, PerLayer]] = []
    for projection in ("query", "key", "value"):
        rules += [(VariableFilter(path=f"*/{projection}.W"), columns),
                  (VariableFilter(path=f"*/{projection}.b"), split(axis))]
    flax = [nnx.LinearGeneral]
    for projection in ("query", "key", "value"):
        rules += [(VariableFilter(bricks=flax, path=f"*/{projection}.kernel"),
                   split(None, axis, None)),
                  (VariableFilter(bricks=flax, path=f"*/{projection}.bias"), split(axis, None))]
    rules += [(VariableFilter(bricks=flax, path="*/out.kernel"), split(axis, None, None)),
              (VariableFilter(path="*/out.W"), rows),
              (VariableFilter(path="*/linear_layers/*[02468].W"), columns),
              (VariableFilter(path="*/linear_layers/*[02468].b"), split(axis)),
              (VariableFilter(path="*/linear_layers/*[13579].W"), rows)]
    return {"rules": [PresetRule(rule) for rule in rules], "batch_axis": batch_axis}


def annotated(model: object, axis_rules: Mapping[str, str | None] | None = None,
              batch_axis: str | None = "data") -> Preset:
    """Rules from a Flax model's own sharding annotations (``nnx.with_partitioning``, the
    ``out_sharding`` metadata of its variables), as Flax's SPMD guide and its lm1b example
    annotate them: each annotated variable is placed by its names, each name mapped through
    ``axis_rules`` (logical name to mesh axis or None, a dict or Flax's pairs), else the
    variable's own ``sharding_rules`` metadata, else the ``nnx.logical_axis_rules`` in force
    when this is called, as Flax maps them; a name none maps is a mesh axis.

    Build the model without a mesh under ``nnx.use_eager_sharding(False)``; graphmod places
    its variables when ``init`` runs.

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        >>> with nnx.use_eager_sharding(False):
        ...     layer = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
        >>> gm.sharding.annotated(layer, {"embed": None, "mlp": "model"})["rules"]
        [(VariableFilter(path='/.kernel'), P(None, 'model'))]
    """
    if not isinstance(model, nnx.Pytree):
        raise TypeError(f"sharding.annotated(model): expected a Flax NNX model, got "
                        f"{type(model).__name__}")
    context = dict(core_spmd.get_logical_axis_rules() or ())  # nnx.logical_axis_rules(...)
    layout, rules = Layout(model), list[PresetRule]()
    for info, annotation in layout.metadata("out_sharding"):
        own = layout.objects[info.identity].get_metadata("sharding_rules", None) or ()
        names = {**context, **dict(own), **dict(axis_rules or {})}  # the argument wins
        spec = PartitionSpec(*(names.get(name, name) if name is not None else None
                               for name in annotation))
        if any(entry is not None for entry in spec):
            rules.append(PresetRule((VariableFilter(path=glob.escape(info.path)), spec)))
    return {"rules": rules, "batch_axis": batch_axis}
