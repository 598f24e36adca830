"""The compiler core: model code → application call → manager chain → frame → jaxpr → jit.

Roles and variables tag what a model holds; filters select tagged variables; managers
rewrite what they select in application calls, run by the chain inside a frame that maps
each variable to its traced value; the program traces a function with its managers into
jitted ``train`` and ``infer`` over plain dicts. The core imports nothing of the training
loop, plugins, checkpoints, evaluation, provenance records or orbax (``tests/test_layers.py``);
it exposes what those layers read as public records (``program.record``). Public names are
re-exported by ``graphmod``.
"""
