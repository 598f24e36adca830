"""Built-in loop plugins.

Examples:
    >>> from graphmod import plugins
    >>> plugins.Checkpoint("runs/example").every
    On('epoch_end')
"""

from graphmod.plugins._checkpoint import Checkpoint

__all__ = ["Checkpoint"]
