"""The public ``graphmod.compile`` and ``Program``: a model function compiled with its
managers, and the program's provenance and storage.

Why two layers
    The compiler core (``graphmod._core``) knows nothing of provenance records, checkpoints
    or orbax (``tests/test_layers.py``), so the program is split in two classes, one per
    layer. The core's :class:`~graphmod._core._program._program_core.ProgramCore` is handed
    the parts ``compile`` built (the function, the model's layout, the placement on a mesh,
    the checked managers and monitors) and owns what runs: ``init``, the jitted ``train``
    and ``infer``, ``derive``, ``graph``, and the public ``program.record`` of how it came to
    be. :class:`Program` adds what needs the training layer: ``program.provenance``
    (assembled by ``graphmod._records`` from that record), ``save``/``load`` through the
    training layer's checkpointer (which opens orbax on first use), and the tables.

How ``compile`` builds a program
    Here, in order: the arguments checked, the model's layout (every variable an identity
    and a path, unmodified Flax modules' applications found), the modules ``fn`` reads from
    outside the model warned of, the placement on a mesh (its rules checked against the
    layout), the managers (those listed, or those active in ``with`` blocks) and monitors
    checked and frozen; then one :class:`Program` whose constructor (the core's) wraps the
    traced train and infer functions in ``jax.jit``. The checks are the core's functions
    (``graphmod._core._program._program_checks``), their errors naming the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from jax.sharding import Mesh

from graphmod._core._bricks._intercept import interceptor
from graphmod._core._display._show import VariablesTable, program_html, program_lines
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._program._input_transforms import check_transform_fields
from graphmod._core._program._program_checks import (
    check_compile_arguments,
    check_managers,
    chosen_managers,
    monitors,
    warn_outside_modules,
)
from graphmod._core._program._program_core import ProgramCore
from graphmod._core._program._program_record import Shared
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._sharding import Placement, put
from graphmod._records._collect import program_provenance
from graphmod._records._record import Provenance
from graphmod._train._checkpoint import Checkpointer, CheckpointReader
from graphmod.typing import (
    AxisName,
    InputTransforms,
    Model,
    PathLike,
    ShardingRule,
    Variables,
)


def compile(
    fn: Callable[..., object],
    model: Model,
    *,
    managers: Iterable[Manager] | None = None,
    monitor: VariableFilter | Mapping[str, VariableFilter] | None = None,
    axis_name: AxisName | None = None,
    applications: Mapping[type, Sequence[str]] | None = None,
    mesh: Mesh | None = None,
    rules: Sequence[ShardingRule] = (),
    batch_axis: AxisName | None = None,
    transforms: InputTransforms | None = None,
) -> Program:
    """Traces ``fn(model, *args)`` with managers into a :class:`Program`.

    Args:
        fn: ordinary model code; returns a scalar cost, ``(cost, metrics_dict)`` or any
            outputs.
        model: the root brick: any ``flax.nnx.Module``, bricks or unmodified Flax code (every
            call of a Flax module's ``__call__`` is then an application named ``apply``).
        managers: the managers to apply, first outermost; default: those active in ``with``
            blocks around this call.
        monitor: a filter (or a dict of named filters) of tagged variables returned as
            monitored values by ``train``/``infer``.
        axis_name: a mapped axis name (``pmap``/``shard_map``) folded into randomness.
        applications: more methods of unmodified Flax modules that are applications, by
            class (subclasses included): ``{MyModule: ["encode"]}``; ``nnx.Embed.attend``
            always is.
        mesh: a ``jax.sharding.Mesh`` to run on (JAX's SPMD: one program, its arrays split
            over the devices); default: one device.
        rules: ``[(VariableFilter, PartitionSpec), ...]``: each model variable is placed by
            the first rule whose filter selects it (``bricks``, ``roles``, ``name``,
            ``path``), replicated when none does; a manager's variables for a parameter
            follow it; presets in :mod:`graphmod.sharding`.
        batch_axis: the mesh axis (or axes) the arguments of ``train``/``infer`` and the
            train step's batches are split along (their leading dimension).
        transforms: transformations fitted on the training data
            (``graphmod.data.Transforms(spec).fit(train)``), applied to the function's
            arguments (by name, or by position after the model) before it runs in every
            mode, so training, evaluation and inference see the same inputs; each new
            signature is checked against the training data's metadata first. Recorded in
            the provenance (``inputs["transforms"]``).

    Returns:
        The program: ``init``, ``train``, ``infer``, ``derive``, ``graph``, ...

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> with managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[gm.roles.INPUT]):
        ...     program = gm.compile(lambda m, x: m(x).sum(), mlp)
        >>> x = jnp.ones((5, 3))
        >>> variables = program.init(x)
        >>> cost, variables = program.train(variables, x, rng=jax.random.key(0))
        >>> program.infer(variables, x).shape
        ()
    """
    check_compile_arguments(fn, mesh, rules, batch_axis)
    if transforms is not None:  # before anything else is built: names the field
        check_transform_fields(transforms, fn)
    layout = Layout(model, interceptor(applications))
    warn_outside_modules(fn, layout)
    placement = None if mesh is None else Placement(mesh, rules, batch_axis, layout=layout)
    chosen = chosen_managers(managers)
    labelled = monitors(monitor, layout)
    return Program(fn, Shared(layout, placement, transforms), check_managers(chosen, layout),
                   labelled, axis_name, strict=True)


class Program(ProgramCore):
    """A compiled model function: pure, jitted ``train`` and ``infer`` over plain dicts.

    Made by :func:`compile`. ``train(variables, *args, rng=key)`` returns
    ``(out, variables)`` (and monitored values with ``monitor=``); ``infer(variables,
    *args)`` returns ``out`` (and monitored values). ``provenance`` is its record,
    ``save``/``load`` store its variables with that record.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> out, variables = program.train(variables, jnp.ones((4, 2)), rng=jax.random.key(0))
        >>> out.shape, sorted(variables["model"])
        ((4, 3), ['W', 'b'])
    """

    _assembled: tuple[int, Provenance] | None = None  # (inits when made, the record)

    @property
    def provenance(self) -> Provenance:
        """How this program came to be: a :class:`graphmod.Provenance` record.

        Holds the bricks (class, configuration, RNG key data, parameter shapes and dtypes),
        the managers (class, configuration, filter, order, priority), the function, init's
        example shapes and seed, library versions and platform; derived: the graph
        fingerprint and the training-mode rewrite trace (both need ``init`` to have run:
        before it they are empty). Assembled when first asked for, then kept until the
        next ``init``.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x).sum(),
            ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> _ = program.init(jnp.ones((1, 2)))
            >>> program.provenance["parameters"]["/.W"]["shape"]
            (2, 3)
        """
        inits = self.record.inits
        if self._assembled is None or self._assembled[0] != inits:
            self._assembled = (inits, program_provenance(self))
        return self._assembled[1]

    def variables_table(self, variables: Variables) -> VariablesTable:
        """``variables`` as a table of path, role, shape, dtype and size (never values).

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> print(program.variables_table(program.init(jnp.ones((1, 2)))))
            path     role    shape   dtype    size  bytes
            -------  ------  ------  -------  ----  -----
            model/W  WEIGHT  (2, 3)  float32  6     24 B
            model/b  BIAS    (3,)    float32  3     12 B
            2 arrays, 9 values, 36 B
        """
        return VariablesTable(variables, self.roles(variables))

    def sharding(self, variables: Variables) -> VariablesTable:
        """Where ``variables`` live: the :meth:`variables_table` with each array's
        placement (its ``PartitionSpec``, "replicated" or "one device") and bytes per
        device.

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4,
            ...                      rngs=nnx.Rngs(0)), mesh=jax.make_mesh((1,), ("data",)),
            ...                      **gm.sharding.fsdp())
            >>> print(program.sharding(program.init(jnp.ones((1, 2)))))
            path     role    shape   dtype    size  bytes  placement   per device
            -------  ------  ------  -------  ----  -----  ----------  ----------
            model/W  WEIGHT  (2, 4)  float32  8     32 B   P('data',)  32 B
            model/b  BIAS    (4,)    float32  4     16 B   replicated  16 B
            2 arrays, 12 values, 48 B, 48 B per device
        """
        return VariablesTable(variables, self.roles(variables), title="placement",
                              placement=True)

    def __repr__(self) -> str:
        return "\n".join(program_lines(self))

    def _repr_html_(self) -> str:
        return program_html(self)

    def save(self, directory: PathLike, variables: Variables, *, step: int = 0) -> None:
        """Writes ``variables`` and this program's provenance record to ``directory``.

        The directory is an orbax checkpoint like the loop's (``graphmod inspect DIR``
        prints it; ``graphmod.provenance.read(DIR)`` returns the record); :meth:`load`
        reads the variables back.

        Examples:
            >>> import tempfile, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x).sum(),
            ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> variables = program.init(jnp.ones((1, 2)))
            >>> directory = tempfile.mkdtemp()
            >>> program.save(directory, variables)
            >>> loaded = program.load(directory)
            >>> bool((loaded["model"]["W"] == variables["model"]["W"]).all())
            True
            >>> gm.provenance.read(directory) == program.provenance
            True
        """
        self._unpack(variables)  # checked before anything is written
        writer = Checkpointer(directory, keep=None, asynchronous=False)
        try:
            writer.save(step, variables, {"kind": "program",
                                          "provenance": self.provenance.to_dict()})
            writer.wait()
        finally:
            writer.close()

    def load(self, directory: PathLike, *, step: int | None = None) -> Variables:
        """The variables :meth:`save` wrote to ``directory`` (checked against this program's
        layout; ``init`` must have run, to know the shapes), placed as ``init`` places them
        (on the program's mesh, by its rules).

        A model saved with fitted transforms (``compile(..., transforms=)``) is refused by a
        program with other transforms, or none: it would predict on inputs transformed
        otherwise than in training. Compile with the saved ones,
        ``transforms=graphmod.provenance.transforms(directory)``."""
        shapes = self.record.variables
        if shapes is None:
            raise RuntimeError("program.load: call program.init(*example_args) first, so the "
                               "program knows its variables' shapes")
        reader = CheckpointReader(directory)  # reads only: creates and prunes nothing
        try:
            variables, meta = reader.restore(shapes, step)
        finally:
            reader.close()
        _check_transforms(meta, self.transforms, directory)
        placement = self.placement
        return variables if placement is None else put(
            variables, placement.variables(variables, self.layout))


def _check_transforms(meta: Mapping[str, object], transforms: InputTransforms | None,
                      directory: PathLike) -> None:
    """Refuses saved variables whose recorded transforms differ from ``transforms``, naming
    the differing parts (a record without the field, e.g. a run of several models, is not
    compared)."""
    provenance = meta.get("provenance")
    inputs = provenance.get("inputs") if isinstance(provenance, dict) else None
    if not isinstance(inputs, dict) or "transforms" not in inputs:
        return
    saved = inputs["transforms"]
    mine = None if transforms is None else json.loads(json.dumps(transforms.record()))
    if saved == mine:
        return
    if saved is None or mine is None:
        what = ("were trained on raw inputs (no transforms)" if saved is None else
                "were trained with transforms of the fields "
                f"{sorted(saved.get('transforms', {}))}")
        parts = f"this program has {'none' if mine is None else 'some'}"
    else:
        what = "were trained with other transforms"
        parts = ", ".join(
            [f"transforms of {k!r}" for k in sorted({*saved.get("transforms", {}),
                                                    *mine.get("transforms", {})})
             if saved.get("transforms", {}).get(k) != mine.get("transforms", {}).get(k)]
            + [k for k in ("metadata", "source") if saved.get(k) != mine.get(k)]) + " differ"
    raise ValueError(
        f"program.load({os.fspath(directory)!r}): the saved variables {what}; {parts}. "
        "Compile with the saved transforms: compile(fn, model, transforms=graphmod."
        f"provenance.transforms({os.fspath(directory)!r})) (graphmod.data.FittedTransforms."
        "from_record(record['inputs']['transforms']) from a record), so inputs are "
        "transformed as in training")
