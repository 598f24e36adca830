"""``PerLayer``: the placement of a variable stacked over layers, by a ``PartitionSpec`` of
one layer's own dimensions (what :func:`graphmod.sharding.per_layer` makes, the second half
of a rule). A value of its own, importing nothing of graphmod, so that
:data:`graphmod.typing.ShardingRule` can name it."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

__all__ = ["PerLayer"]


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """A ``PartitionSpec`` of one layer's own dimensions (``graphmod.sharding.per_layer``):
    a variable stacked over layers (Flax's scan over layers) or an ensemble's members gets
    its stacking axes whole in front, as Flax's ``nnx.vmap`` inserts ``None`` into a
    variable's sharding annotation; an unstacked variable gets ``spec`` as it is.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> PerLayer(P("data")).placing(2)
        P(None, None, 'data')
    """

    spec: PartitionSpec

    def placing(self, stacked: int) -> PartitionSpec:
        """The spec of a variable with ``stacked`` leading axes of layers or members."""
        return PartitionSpec(*[None] * stacked, *self.spec)

    def __repr__(self) -> str:
        return f"per_layer({self.spec})"
