"""Built-in bricks. Signatures mirror Flax NNX layers.

Examples:
    >>> import graphmod as gm
    >>> sorted(gm.bricks.__all__)[:3]
    ['Conv', 'Embedding', 'LSTM']
"""

from graphmod.bricks._linear import MLP, Linear

__all__ = ["MLP", "Linear"]
