"""The compiler core: model code → application call → manager chain → frame → jaxpr → jit.

Roles and variables tag what a model holds; filters select tagged variables; managers
rewrite what they select in application calls, run by the chain inside a frame that maps
each variable to its traced value; the program traces a function with its managers into
jitted ``train`` and ``infer`` over plain dicts. The core imports nothing of the training
loop, plugins, checkpoints, evaluation, provenance records or orbax (``tests/test_layers.py``);
it exposes what those layers read as public records (``program.record``). Public names are
re-exported by ``graphmod``.

A folder per concept, each saying in its own docstring what it owns:

* ``_bricks``: ``Brick``, ``@application`` and what it declares, unmodified Flax modules as
  applications, constructor records, Flax's array leaves;
* ``_tracing``: one trace: the context stacks, the frame, the chain around each call, the
  call's view for hooks, the parameter read and its rewrite, the rewrite trace;
* ``_loops``: ``graphmod.scan``/``remat`` and the keys and owned variables of loop bodies;
* ``_model``: the model's layout, manager-owned variables and their layout, roles as a tree;
* ``_program``: init, train and infer, derive, graph, the program-wide chain, the checks
  ``compile`` runs (``graphmod.compile`` is the training layer's, beside the public
  ``Program``), the record, input transformations;
* ``_selection``: the filter language, selectors, placement rules, unmatched-filter hints;
* ``_managers``: the ``Manager`` base and the order of a chain;
* ``_display``: tables in terminals and notebooks;
* ``_codec``: recorded values as tagged JSON;
* beside them, what every folder uses: ``_sharding`` (placement on a mesh), ``_warn``,
  ``_number_checks``, ``_naming``, ``_clock``, ``_public_path``.
"""
