"""Data sources for the loop and evaluation.

Examples:
    >>> import numpy as np
    >>> from graphmod.data import ArraySource
    >>> ArraySource(np.array([[1, 2], [3, 4]]), batch_size=1).size
    2
"""

from graphmod.data._array_source import ArraySource

__all__ = ["ArraySource"]
