"""Built-in bricks. Signatures mirror Flax NNX layers.

Examples:
    >>> import graphmod as gm
    >>> sorted(gm.bricks.__all__)[:3]
    ['Conv', 'Embedding', 'LSTM']
"""

from graphmod.bricks._attention import MultiHeadAttention, causal_mask
from graphmod.bricks._conv import Conv
from graphmod.bricks._cost import SoftmaxCrossEntropy, SquaredError
from graphmod.bricks._embedding import Embedding
from graphmod.bricks._linear import MLP, Linear
from graphmod.bricks._norm import LayerNorm
from graphmod.bricks._recurrent import LSTM, SimpleRecurrent
from graphmod.bricks._residual import Residual, TransformerBlock
from graphmod.bricks._sequence import Sequence

__all__ = [
    "LSTM",
    "MLP",
    "Conv",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "Residual",
    "Sequence",
    "SimpleRecurrent",
    "SoftmaxCrossEntropy",
    "SquaredError",
    "TransformerBlock",
    "causal_mask",
]
