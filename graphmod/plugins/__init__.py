"""Built-in loop plugins: progress, printing, logging, timing, plots, annealing, early
stopping, validation, NaN guarding and checkpoints.

Examples:
    >>> from graphmod import plugins
    >>> plugins.Checkpoint("runs/example").every
    On('epoch_end') | On('end')
"""

from graphmod.plugins._anneal import Anneal
from graphmod.plugins._checkpoint import Checkpoint
from graphmod.plugins._early_stopping import EarlyStopping
from graphmod.plugins._live_plot import LivePlot
from graphmod.plugins._logger import Logger
from graphmod.plugins._nan_guard import NaNGuard
from graphmod.plugins._print import Print
from graphmod.plugins._progress import ProgressBar
from graphmod.plugins._timing import Tally, Timing
from graphmod.plugins._validation import Validation

__all__ = [
    "Anneal",
    "Checkpoint",
    "EarlyStopping",
    "LivePlot",
    "Logger",
    "NaNGuard",
    "Print",
    "ProgressBar",
    "Tally",
    "Timing",
    "Validation",
]
