"""The training layer: programs with provenance and storage, optimization, the loop.

``graphmod.compile``'s :class:`~graphmod.Program` (the core's program with its provenance
record and ``save``/``load``), ``optimize``'s train step, events and schedules, the plugin
protocol, the ``Loop``, checkpoints (orbax, opened on first use) and ``evaluate``. Imports
the core and the record assemblers, never the reverse.
"""
