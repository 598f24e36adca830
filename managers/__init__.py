"""Built-in managers: one module per family.

Examples:
    >>> import graphmod as gm, managers
    >>> managers.Dropout(0.5, roles=[gm.roles.OUTPUT]).name, managers.BatchNorm().name
    ('dropout', 'batch_norm')
"""

from managers._averaging import EMA
from managers._batch_norm import BatchNorm
from managers._dropout import Dropout
from managers._layer_freezing import LayerFreezing
from managers._lora import LoRA
from managers._measurements import ActivationStats
from managers._noise import GaussianNoise, WeightNoise
from managers._quantization import FakeQuant
from managers._regularizers import L2, WeightDecay
from managers._reparametrizations import MaxNorm, SpectralNorm, WeightNorm, WeightStandardization
from managers._selective_backprop import SelectiveBackprop
from managers._sharding import Sharding
from managers._stochastic_depth import StochasticDepth
from managers._systems import Precision, Remat, StopGradient
from managers._targets import LabelSmoothing, Mixup

__all__ = [
    "EMA",
    "L2",
    "ActivationStats",
    "BatchNorm",
    "Dropout",
    "FakeQuant",
    "GaussianNoise",
    "LabelSmoothing",
    "LayerFreezing",
    "LoRA",
    "MaxNorm",
    "Mixup",
    "Precision",
    "Remat",
    "SelectiveBackprop",
    "Sharding",
    "SpectralNorm",
    "StochasticDepth",
    "StopGradient",
    "WeightDecay",
    "WeightNoise",
    "WeightNorm",
    "WeightStandardization",
]
