"""The core's program: one model function, traced with managers into jitted train and infer
functions. ``graphmod.compile`` builds its parts and the public ``graphmod.Program`` adds
provenance and storage: why the program is two classes is told in the docstring of
``graphmod._train._program``, their one home.

How it works
    ``compile`` splits the model once: every variable gets an identity and a path (see
    ``graphmod._core._model._layout``), the managers active in ``with`` blocks are captured
    and frozen.
    ``init`` copies the model's arrays into a plain nested dict and runs an abstract
    training-mode trace to create manager-owned variables from the shapes it sees
    (evaluating only what they need, uncompiled). ``train``
    and ``infer`` are ``jax.jit`` functions over plain dicts: inside the trace a frame maps
    each variable's identity to the traced value, so the model code — reached through
    ``model``, a closure or a global — reads the program's variables, rewritten by the
    managers of the innermost application call.

Variables layout
    ``{"model": <pure dict of the model's NNX state>, "managers": {name: {"hparams": {...},
    <path>: {<application>: {<var>: array}}}}}`` (``per_call`` variables nest one more level
    by call id; encoded and decoded by ``graphmod._core._model._owned_layout``).

Sharp edges
    Inputs and variables are validated when a new signature is traced, not on every call:
    arguments against init's examples (rank, feature size, dtype, and one batch size for
    those that shared one; a derived function's only where its argument of that name has
    the example's structure); the model's variables against the layout, the managers'
    against init's (paths, shapes, dtypes: float64 fits float32 with x64 off, bf16 not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.extend.core import ClosedJaxpr

from graphmod import roles as _roles
from graphmod._core._bricks._construction import key_record
from graphmod._core._clock import utc_now
from graphmod._core._loops._loop_resolution import resolving
from graphmod._core._managers._manager import Manager
from graphmod._core._model import _owned_layout as owned_layout
from graphmod._core._model._layout import Layout
from graphmod._core._program._abstract_init import fresh_variables
from graphmod._core._program._arguments import (
    argument_names,
    as_key,
    bind_arguments,
    check_arguments,
    check_binds,
    check_traceable,
)
from graphmod._core._program._graph import ComputationGraph
from graphmod._core._program._input_transforms import apply_transforms, check_transformed
from graphmod._core._program._program_chain import program_function
from graphmod._core._program._program_checks import check_strict, check_variables, warn_held_off
from graphmod._core._program._program_record import ProgramRecord, Shared, abstract
from graphmod._core._program._program_variables import VariablesByRole
from graphmod._core._program._rng_arguments import with_random_streams
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._sharding import Placement, batch_on_mesh, init_mesh, on_mesh, put
from graphmod._core._tracing import _context
from graphmod._core._tracing._frame import Frame, OwnedKey
from graphmod._core._tracing._rewrites import Rewrites, RewriteTrace
from graphmod.typing import AxisName, InputTransforms, KeyLike, PyTree, Variables

__all__ = ["ProgramCore", "ProgramRecord"]

_TRAIN = "program.train(variables, *args, rng=key)"


class ProgramCore(VariablesByRole):
    """The compiler core's program: ``init``, ``train``, ``infer``, ``derive``, ``graph``.

    Knows nothing of provenance or storage: what those need it exposes as :attr:`record`.
    ``graphmod.compile`` makes the public :class:`graphmod.Program`, which adds them.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._core._program._program_core import ProgramCore
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> isinstance(program, ProgramCore), program.infer(program.init(jnp.ones((1, 2))),
        ...                                                 jnp.ones((4, 2))).shape
        (True, (4, 3))
    """

    def __init__(self, fn: Callable[..., object], shared: Shared,
                 managers: tuple[Manager, ...], monitor: dict[str, VariableFilter],
                 axis_name: AxisName | None, strict: bool) -> None:
        self.fn = fn
        self._shared = shared
        self._managers = managers
        self._function = program_function(fn, managers)  # fn inside wrap_program layers
        self._monitor = monitor
        self._axis_name = axis_name
        self._strict = strict
        self._argument_names = argument_names(fn)
        self.rewrites = Rewrites()
        # Loop bodies' keys get their iteration (_loop_keys); traced on its mesh (on_mesh).
        self._train_traced = on_mesh(resolving(self._train_traced), shared.placement)  # type: ignore[method-assign]
        self._train = jax.jit(self._train_traced)
        # Owned variables stacked over loops are read one slice per iteration.
        self._infer_traced = on_mesh(resolving(self._infer_traced), shared.placement)  # type: ignore[method-assign]
        # ``program.infer`` is this jitted function itself (``mutable`` static): no Python
        # frame before JAX's C++ dispatch, which costs 5% of a tiny model's call.
        self._infer = jax.jit(functools.partial(_infer_with, self._infer_traced),
                              static_argnames="mutable")
        # Provenance: recorded when cheap, assembled only when asked for.
        self._created = utc_now()
        self._example: tuple[tuple[PyTree, ...], dict[str, PyTree]] | None = None
        self._abstract_variables: Variables | None = None
        self._init_rng: dict | None = None
        self._inits = 0  # how many times init ran: records made before are stale
        self._origin: ProgramCore | None = None  # the program this one was derived from
        self._derived: dict[Callable[..., object], ProgramCore] = {}  # by derive, by function
        self._key_folds: tuple[int, ...] = ()  # the draws its traces made (Frame.key_folds)

    # -- public properties ------------------------------------------------------------------
    @property
    def model(self) -> nnx.Pytree:
        """The root brick this program was compiled over."""
        return self._shared.layout.model

    @property
    def managers(self) -> tuple[Manager, ...]:
        """The managers captured at compile, outermost first."""
        return self._managers

    @property
    def layout(self) -> Layout:
        """Paths, identities and roles of the model's variables."""
        return self._shared.layout

    @property
    def placement(self) -> Placement | None:
        """Where this program's arrays live on a mesh (``compile(mesh=...)``; None: one)."""
        return self._shared.placement

    @property
    def transforms(self) -> InputTransforms | None:
        """The transformations fitted on the training data that this program applies to
        its arguments (``compile(..., transforms=)``; None without).

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
            ...            ).transforms is None
            True
        """
        return self._shared.transforms

    @property
    def record(self) -> ProgramRecord:
        """What this program knows of how it came to be, for provenance records.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x).sum(),
            ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> program.record.examples is None
            True
            >>> _ = program.init(jnp.ones((1, 2)))
            >>> program.record.examples["x"].shape, program.record.positional
            ((1, 2), ['x'])
        """
        examples = positional = None
        if self._example is not None:
            args, kwargs = self._example
            examples = self._bind(args, kwargs, lambda x: x)
            positional = list(examples)[:len(args)]
        return ProgramRecord(self.fn, self._shared.layout, self._managers, self._monitor,
                             self._axis_name, self._created, examples, positional,
                             self._abstract_variables, self._init_rng, self._inits,
                             self._training_jaxpr, self._shared.placement,
                             self._shared.transforms)

    @property
    def origin(self) -> ProgramCore | None:
        """The program :meth:`derive` made this one from (None for a compiled program).

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x).sum(),
            ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> program.derive(lambda m, x: m(x)).origin is program, program.origin
            (True, None)
        """
        return self._origin

    def _training_jaxpr(self) -> ClosedJaxpr | None:
        """The training-mode jaxpr for init's example shapes (None before init)."""
        if self._example is None or self._abstract_variables is None:
            return None
        args, kwargs = self._example
        # A mapped axis is bound (size 1) so that its lax.axis_index can be traced here.
        names = self._axis_name if isinstance(self._axis_name, tuple) else (
            () if self._axis_name is None else (self._axis_name,))
        trace = jax.make_jaxpr(self._train_traced, axis_env=[(name, 1) for name in names])
        return trace(self._abstract_variables, jax.random.key(0), args, kwargs)

    # -- the three functions --------------------------------------------------------------
    def init(self, *example_args: PyTree, rng: KeyLike | None = None,
             **example_kwargs: PyTree) -> Variables:
        """Variables for this program: copies of the model's arrays and managers' variables.

        Runs an abstract training-mode trace on the example arguments, whose feature shapes
        and dtypes later calls are checked against, and evaluates only what the managers'
        variables need of it (see ``graphmod._core._program._abstract_init``): no XLA compile.
        """
        key = jax.random.key(0) if rng is None else as_key(rng, "program.init(..., rng=key)")
        variables, owned_roles = self._fresh_variables(
            example_args, example_kwargs, key, probe=False)
        placement = self._shared.placement
        if placement is not None:  # checked against the rules before anything is kept
            variables = put(variables, placement.variables(variables, self._shared.layout))
        # Kept only once the variables exist: a failed init changes nothing.
        self._shared.examples.update(self._bind(example_args, example_kwargs, jax.typeof))
        self._shared.owned_roles = owned_roles
        self._remember_example(example_args, example_kwargs, variables, key)
        return variables

    def _fresh_variables(self, args: tuple[PyTree, ...], kwargs: dict[str, PyTree],
                         key: jax.Array, *, probe: bool
                         ) -> tuple[Variables, dict[OwnedKey, _roles.Role]]:
        """Init's variables for these arguments and the owned variables' roles; changes
        nothing of the program. ``probe``: only their shapes, traced for ``graph``."""
        check_traceable(self._bind(args, kwargs, lambda x: x),
                        "program.graph" if probe else "program.init")
        def trace(values: dict[str, jax.Array], hparams: dict[tuple[str, str], jax.Array],
                  key: jax.Array, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                  ) -> Frame:
            return self._trace("init", values, {}, hparams, key, args, kwargs, record=probe)

        with init_mesh(self._shared.placement):  # model code may name the mesh's axes
            return fresh_variables(self._shared.layout, self._managers, trace, args, kwargs,
                                   key, probe=probe)

    def _remember_example(self, args: tuple[PyTree, ...], kwargs: dict[str, PyTree],
                          variables: Variables, key: jax.Array) -> None:
        """Keeps the shapes of init's examples and variables, and its seed, for provenance."""
        self._example = (jax.tree.map(abstract, args), jax.tree.map(abstract, kwargs))
        self._abstract_variables = jax.tree.map(abstract, variables)
        seed = key_record(key)
        if seed is not None or self._init_rng is None:  # traced (eval_shape): keep the last
            self._init_rng = seed
        self._inits += 1

    def train(self, variables: Variables, *args: PyTree, rng: KeyLike | None = None,
              **kwargs: PyTree) -> Any:
        """Runs ``fn`` in training mode: ``(out, variables)`` (``+ monitored`` with monitor=)."""
        if not hasattr(rng, "dtype"):  # e.g. rng=0: refused before jit sees it
            as_key(rng, _TRAIN, args)
        try:
            return self._train(variables, rng, args, kwargs)
        except TypeError:  # jit's, for an argument it cannot trace: ours names the fix
            check_traceable(self._bind(args, kwargs, lambda x: x), "program.train")
            raise

    @property
    def infer(self) -> Callable[..., Any]:
        """``infer(variables, *args, mutable=False, **kwargs)``: runs ``fn`` in inference
        mode: ``out`` (``(out, monitored)`` with monitor=).

        With ``mutable=True`` (as in Linen's ``apply``) the model's writes are kept and
        returned: ``(out, variables)`` (``+ monitored``), e.g. a decode cache and its index.
        Parameters and manager-owned variables are never changed in inference.

        This is a jitted function (``program.infer.lower(...)`` works) whose ``mutable`` is
        a static argument: ``mutable=False`` written out compiles once more than leaving it
        out, and a value that is neither True nor False is refused as it is traced.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Count(nnx.Module):
            ...     def __init__(self):
            ...         self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
            ...     def __call__(self, x):
            ...         self.calls[...] += 1
            ...         return 2 * x
            >>> program = gm.compile(lambda m, x: m(x), Count())
            >>> variables = program.init(jnp.ones(2))
            >>> out, variables = program.infer(variables, jnp.ones(2), mutable=True)
            >>> int(variables["model"]["calls"]), out.tolist()
            (1, [2.0, 2.0])
        """
        return self._infer

    def _train_traced(self, variables: Variables, rng: KeyLike, args: tuple[PyTree, ...],
                      kwargs: dict[str, PyTree], with_costs: bool = False) -> Any:
        """``train``'s traced function; ``with_costs``: always ``(out, variables,
        monitored, costs, measured)``, costs by owner then key (what ``optimize``
        differentiates), measurements by key (``call.report``)."""
        values, owned, hparams = self._unpack(variables)
        frame = self._trace("train", values, owned, hparams, as_key(rng, _TRAIN), args, kwargs,
                            costs=with_costs)
        new = {
            "model": self._shared.layout.pure(frame.values),
            "managers": owned_layout.replaced(variables["managers"], {
                key: value for key, value in frame.owned_out().items()
                if key in frame.owned_updated}),
        }
        if self._shared.placement is not None:
            new = self._shared.placement.constrain(new, self._shared.layout)
        if with_costs:
            return frame.out, new, frame.monitored, frame.costs, frame.measured
        return (frame.out, new, frame.monitored) if self._monitor else (frame.out, new)

    def _infer_traced(self, variables: Variables, args: tuple[PyTree, ...],
                      kwargs: dict[str, PyTree], mutable: bool = False) -> Any:
        values, owned, hparams = self._unpack(variables)
        frame = self._trace("infer", values, owned, hparams, None, args, kwargs)
        out = (frame.out,)
        if mutable:
            out += ({"model": self._shared.layout.pure(frame.values),
                     "managers": variables["managers"]},)
        if self._monitor:
            out += (frame.monitored,)
        return out if len(out) > 1 else frame.out

    def _trace(self, mode: str, values: dict[str, jax.Array], owned: dict[OwnedKey, jax.Array],
               hparams: dict[tuple[str, str], jax.Array], key: jax.Array | None,
               args: tuple[PyTree, ...], kwargs: dict[str, PyTree], record: bool = False,
               costs: bool = False) -> Frame:
        # graph()'s traces (record=True) neither check against nor change the program.
        if mode != "init" and not record:  # nnx.Rngs arguments left out, made from the key
            args, kwargs = with_random_streams(self.fn, self._shared.examples, args, kwargs,
                                               key, f"program.{mode}", self._axis_name)
        where = "the train step" if costs else "program.graph" if record else f"program.{mode}"
        check_binds(self.fn, args, kwargs, where)
        placement, transforms = self._shared.placement, self._shared.transforms
        # The training data's metadata first: its error names the field and the data.
        check_transformed(transforms, self._argument_names, args, kwargs, where)
        if mode != "init" and not record:
            example = self._example  # else a derived fn's: its names may mean else
            check_arguments(self._bind(*example, lambda x: x) if example is not None else
                            self._shared.examples, self._bind(args, kwargs, lambda x: x),
                            own=example is not None)
        args, kwargs = batch_on_mesh((args, kwargs), placement, split=mode != "init" and not record)
        args, kwargs = apply_transforms(transforms, self._argument_names, args, kwargs)

        def fresh() -> Frame:
            return Frame(layout=self._shared.layout, mode=mode, values=values, owned=owned,
                         hparams=hparams, managers=self._managers, key=key,
                         axis_name=self._axis_name, mesh=placement and placement.mesh,
                         monitor=self._monitor, record=record, costs=costs,
                         folds=self._key_folds)

        frame = _context.traced(self._shared, fresh, self._function, self.model, *args,
                                **kwargs)
        self._key_folds = tuple(dict.fromkeys((*self._key_folds, *frame.key_folds)))
        if not record:
            self.rewrites.store(RewriteTrace.traced(mode, frame.rewrites, frame.unchanged,
                                                    frame.managers))
            warn_held_off(frame)
        if self._strict:
            check_strict(frame)
        return frame

    # -- variables --------------------------------------------------------------------------
    def _unpack(self, variables: Variables) -> tuple[dict[str, jax.Array],
                                                     dict[OwnedKey, jax.Array],
                                                     dict[tuple[str, str], jax.Array]]:
        """Model values by identity, owned variables by key, hyperparameters by name, of
        variables checked to fit (against init's, this program's or else its origin's)."""
        origin = self._origin
        reference = self._abstract_variables or (origin and origin._abstract_variables)
        check_variables(variables, self._shared.layout, reference)
        return self._split(variables)

    def _split(self, variables: Variables) -> tuple[dict[str, jax.Array],
                                                    dict[OwnedKey, jax.Array],
                                                    dict[tuple[str, str], jax.Array]]:
        # Entries of managers this program does not use are read but never asked for.
        owned, hparams = owned_layout.decode(variables["managers"])
        return self._shared.layout.model_values(variables["model"]), owned, hparams

    # -- more programs and views ----------------------------------------------------------------
    def derive(self, fn: Callable[..., object]) -> ProgramCore:
        """A program for another function over the same model, managers and variables.

        The same ``fn`` gives the same derived program, so its compiled functions are reused
        (``evaluate(..., predict=fn)`` called every epoch traces once).

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> variables = program.init(jnp.ones((1, 2)), jnp.ones((1, 1)))
            >>> predict = program.derive(lambda m, x: m(x))
            >>> predict.infer(variables, jnp.ones((5, 2))).shape
            (5, 1)
        """
        if not callable(fn):
            raise TypeError(f"program.derive(fn): fn must be callable, e.g. lambda model, x: "
                            f"model(x); got {fn!r}")
        origin = self._origin or self
        derived = origin._derived.get(fn)
        if derived is None:
            derived = type(self)(fn, self._shared, self._managers, self._monitor,
                                 self._axis_name, strict=False)
            derived._origin = origin
            origin._derived[fn] = derived
        return derived

    def graph(self, *args: PyTree, mode: str = "train", **kwargs: PyTree) -> ComputationGraph:
        """The :class:`ComputationGraph` of ``fn`` on these arguments in ``mode``.

        Traced abstractly on fresh variables of the arguments' shapes: it changes nothing of
        the program (not the examples later calls are checked against, not the provenance,
        not ``program.rewrites``), so it may be called before or after ``init``, on any
        shapes the model accepts.
        """
        if mode not in ("train", "infer"):
            raise ValueError(f"graph(mode={mode!r}): mode must be 'train' or 'infer'")
        variables, _ = self._fresh_variables(args, kwargs, jax.random.key(0), probe=True)
        found: dict[str, Frame] = {}

        def trace(variables: Variables, key: jax.Array) -> object:
            values, owned, hparams = self._split(variables)  # fresh: nothing to check
            frame = self._trace(mode, values, owned, hparams,
                                key if mode == "train" else None, args, kwargs, record=True)
            found["frame"] = frame
            return frame.out

        jaxpr = jax.make_jaxpr(on_mesh(trace, self._shared.placement))(variables, jax.random.key(0))
        return ComputationGraph(tuple(found["frame"].records or ()), jaxpr, mode, self.layout)

    def _bind(self, args: tuple[PyTree, ...], kwargs: dict[str, PyTree],
              leaf: Callable[[object], object]) -> dict[str, PyTree]:
        return bind_arguments(self._argument_names, args, kwargs, leaf)


def _infer_with(traced: Callable[..., object], variables: Variables, *args: PyTree,
                mutable: bool = False, **kwargs: PyTree) -> Any:
    """``traced(variables, args, kwargs, mutable=mutable)``: the arguments spread."""
    if mutable is not True and mutable is not False:
        raise TypeError(f"program.infer(..., mutable={mutable!r}): expected True or False")
    return traced(variables, args, kwargs, mutable=mutable)
