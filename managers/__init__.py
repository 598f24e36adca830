"""Built-in managers: one module per family.

Examples:
    >>> import managers
    >>> managers.Dropout(0.5).name, managers.BatchNorm().name
    ('dropout', 'batch_norm')
"""

from managers._batch_norm import BatchNorm
from managers._dropout import Dropout
from managers._noise import GaussianNoise, WeightNoise

__all__ = ["BatchNorm", "Dropout", "GaussianNoise", "WeightNoise"]
