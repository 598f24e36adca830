"""Built-in loop plugins: progress, printing, logging (CSV, JSON lines, TensorBoard, Weights &
Biases), profiling, timing, plots, annealing, early stopping, validation, NaN guarding,
checkpoints and population-based training.

Examples:
    >>> from graphmod import plugins
    >>> plugins.Checkpoint("runs/example").every
    On('epoch_end') | On('end')
"""

from graphmod.plugins._anneal import Anneal
from graphmod.plugins._checkpoint import Checkpoint
from graphmod.plugins._control import Control
from graphmod.plugins._early_stopping import EarlyStopping
from graphmod.plugins._freeze import FreezeLayers
from graphmod.plugins._live_plot import LivePlot
from graphmod.plugins._logger import Logger
from graphmod.plugins._nan_guard import NaNGuard
from graphmod.plugins._pbt import PBT, PopulationValidation
from graphmod.plugins._print import Print
from graphmod.plugins._profile import Profile
from graphmod.plugins._progress import ProgressBar
from graphmod.plugins._timing import Tally, Timing
from graphmod.plugins._validation import Validation

__all__ = [
    "PBT",
    "Anneal",
    "Checkpoint",
    "Control",
    "EarlyStopping",
    "FreezeLayers",
    "LivePlot",
    "Logger",
    "NaNGuard",
    "PopulationValidation",
    "Print",
    "Profile",
    "ProgressBar",
    "Tally",
    "Timing",
    "Validation",
]
