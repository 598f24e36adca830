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
from managers._loss_scale import DynamicLossScale
from managers._measurements import ActivationStats
from managers._noise import GaussianNoise, WeightNoise
from managers._precision import MixedPrecision, Precision
from managers._qlora import QLoRA
from managers._quantization import FakeQuant
from managers._quantize import Quantized, quantize
from managers._regularizers import L2, WeightDecay
from managers._reparametrizations import MaxNorm, SpectralNorm, WeightNorm, WeightStandardization
from managers._selective_backprop import SelectiveBackprop
from managers._sharding import Sharding
from managers._stochastic_depth import StochasticDepth
from managers._systems import Remat, StopGradient
from managers._targets import LabelSmoothing, Mixup

__all__ = [
    "EMA",
    "L2",
    "ActivationStats",
    "BatchNorm",
    "Dropout",
    "DynamicLossScale",
    "FakeQuant",
    "GaussianNoise",
    "LabelSmoothing",
    "LayerFreezing",
    "LoRA",
    "MaxNorm",
    "MixedPrecision",
    "Mixup",
    "Precision",
    "QLoRA",
    "Quantized",
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
    "quantize",
]
