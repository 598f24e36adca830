"""``compile``: one model function, traced with managers into jitted train and infer functions.

How it works
    ``compile`` splits the model once: every variable gets an identity and a path (see
    ``graphmod._layout``), the managers active in ``with`` blocks are captured and frozen.
    ``init`` copies the model's arrays into a plain nested dict and runs an abstract
    training-mode trace to create manager-owned variables from the shapes it sees. ``train``
    and ``infer`` are ``jax.jit`` functions over plain dicts: inside the trace a frame maps
    each variable's identity to the traced value, so the model code — reached through
    ``model``, a closure or a global — reads the program's variables, rewritten by the
    managers of the innermost application call.

Variables layout
    ``{"model": <pure dict of the model's NNX state>, "managers": {name: {"hparams": {...},
    <path>: {<application>: {<var>: array}}}}}`` (``per_call`` variables nest one more level
    by call id).

Sharp edges
    Inputs and variables are validated when a new signature is traced, not on every call:
    arguments against init's examples (rank, feature size, dtype, and one batch size for
    the arguments that shared one there); the model's variables against the layout, the
    managers' against init's (paths, shapes, canonical dtypes: float64 fits float32 when
    x64 is off, bfloat16 does not).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from graphmod import _context
from graphmod import roles as _roles
from graphmod._application import interceptor
from graphmod._clock import utc_now
from graphmod._filter import VariableFilter
from graphmod._frame import Frame, OwnedKey
from graphmod._graph import ComputationGraph
from graphmod._layout import Layout
from graphmod._loop_keys import resolving
from graphmod._manager import Manager
from graphmod._rewrites import Rewrites, RewriteTrace
from graphmod._validation import (
    as_key,
    check_arguments,
    flat_keys,
    flat_leaves,
    spec,
    spec_differences,
    tree_difference,
)
from graphmod.provenance._capture import key_record

_TRAIN = "program.train(variables, *args, rng=key)"


class _Shared:
    """What programs derived from one another share: layout, owned variables, examples."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.owned_roles: dict[OwnedKey, _roles.Role] | None = None
        self.examples: dict[str, Any] = {}


def compile(
    fn: Callable[..., Any],
    model: Any,
    *,
    managers: Iterable[Manager] | None = None,
    monitor: VariableFilter | Mapping[str, VariableFilter] | None = None,
    axis_name: Any = None,
    applications: Mapping[type, Sequence[str]] | None = None,
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
    if not callable(fn):
        raise TypeError(f"compile(fn, model): fn must be callable, got {fn!r}")
    layout = Layout(model, interceptor(applications))
    chosen = _context.active_managers() if managers is None else tuple(managers)
    monitors = _monitors(monitor)
    for label, monitor_filter in monitors.items():
        layout.resolve(monitor_filter.brick_instances(), f"monitor[{label!r}]")
    return Program(fn, _Shared(layout), _check_managers(chosen, layout), monitors, axis_name,
                   strict=True)


def _check_managers(managers: tuple[Any, ...], layout: Layout) -> tuple[Manager, ...]:
    names: dict[str, Manager] = {}
    for index, manager in enumerate(managers):
        if not isinstance(manager, Manager):
            raise TypeError(f"managers[{index}]: {manager!r} is not a graphmod.Manager")
        if manager.name in names:
            raise ValueError(
                f"two managers are named {manager.name!r} ({names[manager.name]!r} and "
                f"{manager!r}): pass manager_name=... to one of them"
            )
        names[manager.name] = manager
        layout.resolve(manager.filter.brick_instances(), f"manager {manager.name!r}")
    for manager in managers:
        manager.freeze()
    return tuple(managers)


def _monitors(monitor: Any) -> dict[str, VariableFilter]:
    if monitor is None:
        return {}
    if isinstance(monitor, VariableFilter):
        return {"": monitor}
    if isinstance(monitor, Mapping):
        for label, f in monitor.items():
            if not isinstance(f, VariableFilter):
                raise TypeError(f"monitor[{label!r}]: expected a VariableFilter, got {f!r}")
        return dict(monitor)
    raise TypeError(f"monitor=: expected a VariableFilter or a dict of them, got {monitor!r}")


class Program:
    """A compiled model function: pure, jitted ``train`` and ``infer`` over plain dicts.

    Made by :func:`compile`. ``train(variables, *args, rng=key)`` returns
    ``(out, variables)`` (and monitored values with ``monitor=``); ``infer(variables,
    *args)`` returns ``out`` (and monitored values).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> out, variables = program.train(variables, jnp.ones((4, 2)), rng=jax.random.key(0))
        >>> out.shape, sorted(variables["model"])
        ((4, 3), ['W', 'b'])
    """

    def __init__(self, fn: Callable[..., Any], shared: _Shared, managers: tuple[Manager, ...],
                 monitor: dict[str, VariableFilter], axis_name: Any, strict: bool) -> None:
        self.fn = fn
        self._shared = shared
        self._managers = managers
        self._monitor = monitor
        self._axis_name = axis_name
        self._strict = strict
        self._argument_names = _argument_names(fn)
        self.rewrites = Rewrites()
        # Keys drawn in loop bodies get their iteration index (also in optimize's steps).
        self._train_traced = resolving(self._train_traced)  # type: ignore[method-assign]
        self._train = jax.jit(self._train_traced)
        # Owned variables stacked over loops are read one slice per iteration.
        self._infer_traced = resolving(self._infer_traced)  # type: ignore[method-assign]
        self._infer = jax.jit(self._infer_traced, static_argnames="mutable")
        # Provenance: recorded when cheap, assembled only when asked for.
        self._created = utc_now()
        self._example: tuple[tuple, dict] | None = None
        self._abstract_variables: dict | None = None
        self._init_rng: dict | None = None
        self._provenance: Any = None
        self._origin: Program | None = None  # the program this one was derived from
        self._derived: dict[Callable[..., Any], Program] = {}  # by derive, by function

    # -- public properties ------------------------------------------------------------------
    @property
    def model(self) -> Any:
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
    def provenance(self) -> Any:
        """How this program came to be: a :class:`graphmod.Provenance` record.

        Holds the bricks (class, configuration, RNG key data, parameter shapes and dtypes),
        the managers (class, configuration, filter, order, priority), the function, init's
        example shapes and seed, library versions and platform; derived: the graph
        fingerprint and the training-mode rewrite trace (both need ``init`` to have run:
        before it they are empty). Assembled when first asked for, then kept.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x).sum(),
            ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> _ = program.init(jnp.ones((1, 2)))
            >>> program.provenance["parameters"]["/.W"]["shape"]
            (2, 3)
        """
        if self._provenance is None:
            from graphmod.provenance._collect import program_provenance

            self._provenance = program_provenance(self)
        return self._provenance

    def _training_jaxpr(self) -> Any:
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
    def init(self, *example_args: Any, rng: Any = None, **example_kwargs: Any) -> dict:
        """Variables for this program: copies of the model's arrays and managers' variables.

        Runs an abstract training-mode trace on the example arguments, whose feature shapes
        and dtypes later calls are checked against.
        """
        key = jax.random.key(0) if rng is None else as_key(rng, "program.init(..., rng=key)")
        self._shared.examples.update(self._bind(example_args, example_kwargs, jax.typeof))
        variables, self._shared.owned_roles = self._fresh_variables(
            example_args, example_kwargs, key, probe=False)
        self._remember_example(example_args, example_kwargs, variables, key)
        return variables

    def _fresh_variables(self, args: tuple, kwargs: dict, key: Any, *, probe: bool
                         ) -> tuple[dict, dict[OwnedKey, _roles.Role]]:
        """Init's variables for these arguments and the owned variables' roles; changes
        nothing of the program. ``probe``: only their shapes, traced for ``graph``."""
        layout = self._shared.layout
        copy = _abstract if probe else (lambda value: jnp.array(value, copy=True))
        model = layout.pure({identity: copy(variable.get_raw_value())
                             for identity, variable in layout.objects.items()})
        hparams = {(m.name, h): jnp.float32(v) for m in self._managers
                   for h, v in m.dynamic_hparams().items()}
        found: dict[str, Any] = {}

        def trace(model: dict, args: tuple, kwargs: dict, key: Any) -> dict:
            frame = self._trace("init", layout.model_values(model), {}, hparams, key,
                                args, kwargs, record=probe)
            found["roles"] = frame.owned_roles
            found["managers"] = [m.name for m in frame.seen_managers.values()]
            return _owned_tree(frame.owned_out(), frame.hparams)

        # Owned variables first met in loop bodies are stacked over the loops' lengths.
        resolved = resolving(trace)
        run = functools.partial(jax.eval_shape, resolved) if probe else jax.jit(resolved)
        managers = run(model, args, kwargs, key)
        for name in found["managers"]:
            managers.setdefault(name, {"hparams": {}})
        return {"model": model, "managers": managers}, found["roles"]

    def _remember_example(self, args: tuple, kwargs: dict, variables: dict, key: Any) -> None:
        """Keeps the shapes of init's examples and variables, and its seed, for provenance."""
        self._example = (jax.tree.map(_abstract, args), jax.tree.map(_abstract, kwargs))
        self._abstract_variables = jax.tree.map(_abstract, variables)
        seed = key_record(key)
        if seed is not None or self._init_rng is None:  # traced (eval_shape): keep the last
            self._init_rng = seed
        self._provenance = None

    def train(self, variables: dict, *args: Any, rng: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` in training mode: ``(out, variables)`` (``+ monitored`` with monitor=)."""
        if not hasattr(rng, "dtype"):  # e.g. rng=0: refused before jit sees it
            as_key(rng, _TRAIN)
        return self._train(variables, rng, args, kwargs)

    def infer(self, variables: dict, *args: Any, mutable: bool = False, **kwargs: Any) -> Any:
        """Runs ``fn`` in inference mode: ``out`` (``(out, monitored)`` with monitor=).

        With ``mutable=True`` (as in Linen's ``apply``) the model's writes are kept and
        returned: ``(out, variables)`` (``+ monitored``), e.g. a decode cache and its index.
        Parameters and manager-owned variables are never changed in inference.

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
        if not isinstance(mutable, bool):
            raise TypeError(f"program.infer(..., mutable={mutable!r}): expected True or False")
        return self._infer(variables, args, kwargs, mutable=mutable)

    def _train_traced(self, variables: dict, rng: Any, args: tuple, kwargs: dict) -> Any:
        values, owned, hparams = self._unpack(variables)
        frame = self._trace("train", values, owned, hparams, as_key(rng, _TRAIN), args, kwargs)
        new = {
            "model": self._shared.layout.pure(frame.values),
            "managers": _replace_owned(variables["managers"], frame.owned_out(),
                                       frame.owned_updated),
        }
        return (frame.out, new, frame.monitored) if self._monitor else (frame.out, new)

    def _infer_traced(self, variables: dict, args: tuple, kwargs: dict,
                      mutable: bool = False) -> Any:
        values, owned, hparams = self._unpack(variables)
        frame = self._trace("infer", values, owned, hparams, None, args, kwargs)
        out = (frame.out,)
        if mutable:
            out += ({"model": self._shared.layout.pure(frame.values),
                     "managers": variables["managers"]},)
        if self._monitor:
            out += (frame.monitored,)
        return out if len(out) > 1 else frame.out

    def _trace(self, mode: str, values: dict, owned: dict, hparams: dict, key: Any,
               args: tuple, kwargs: dict, record: bool = False) -> Frame:
        # graph()'s traces (record=True) neither check against nor change the program.
        if mode != "init" and not record:
            check_arguments(self._shared.examples, self._bind(args, kwargs, lambda x: x))
        frame = Frame(layout=self._shared.layout, mode=mode, values=values, owned=owned,
                      hparams=hparams, managers=self._managers, key=key,
                      axis_name=self._axis_name, monitor=self._monitor, record=record)
        with _context.tracing(frame):
            frame.out = self.fn(self.model, *args, **kwargs)
        if not record:
            self.rewrites.store(RewriteTrace(mode, tuple(frame.rewrites)))
        if self._strict:
            _check_strict(frame)
        return frame

    # -- variables --------------------------------------------------------------------------
    def _unpack(self, variables: Any) -> tuple[dict, dict, dict]:
        if not isinstance(variables, Mapping) or set(variables) != {"model", "managers"}:
            raise ValueError(
                "variables must be the dict made by program.init: {'model': ..., "
                f"'managers': ...}}; got {_describe_keys(variables)}"
            )
        layout = self._shared.layout
        actual = flat_keys(variables["model"])
        missing, extra = tree_difference(set(layout.by_key), actual)
        if missing or extra:
            hint = ""
            if {_int_keys(k) for k in actual} == set(layout.by_key):
                hint = (". The paths differ only in key types ('0' for 0), as orbax returns "
                        "them when restoring without a target: restore with one, e.g. the "
                        "variables program.init returns")
            raise ValueError(
                "variables['model'] does not match the model this program was compiled over: "
                + "; ".join(part for part in (
                    missing and f"missing {', '.join(missing)}",
                    extra and f"unexpected {', '.join(extra)}") if part) + hint
            )
        self._check_specs(variables)
        return self._split(variables)

    def _split(self, variables: dict) -> tuple[dict, dict, dict]:
        """Model values by identity, owned variables by key, hyperparameters by name."""
        owned: dict[OwnedKey, Any] = {}
        hparams: dict[tuple[str, str], Any] = {}
        # Entries of managers this program does not use are read but never asked for.
        for name, entry in variables["managers"].items():
            owned.update(_flat_owned(name, entry))
            hparams.update({(name, h): v for h, v in entry.get("hparams", {}).items()})
        return self._shared.layout.model_values(variables["model"]), owned, hparams

    def _check_specs(self, variables: Mapping) -> None:
        """Shapes and dtypes: the model's against the layout, the managers' against init's
        (this program's, else its origin's; unchecked before any init)."""
        layout = self._shared.layout
        differences = spec_differences(
            flat_leaves(variables["model"]),
            {key: (info.shape, info.dtype) for key, info in layout.by_key.items()},
            lambda key: layout.by_key[key].path)
        reference = self._abstract_variables or (self._origin and self._origin._abstract_variables)
        if reference is not None:
            differences += spec_differences(
                flat_leaves(variables["managers"]),
                {key: spec(leaf) for key, leaf in flat_leaves(reference["managers"]).items()},
                lambda key: "managers" + "".join(f"[{part!r}]" for part in key))
        if differences:
            raise ValueError(
                "variables do not fit this program's layout:\n  " + "\n  ".join(differences)
                + "\nThese variables were made by another program or model: use the variables "
                "this program's init returns (program.init(...)), or the program they were "
                "made for")

    def update_model(self, variables: dict) -> None:
        """Writes ``variables["model"]`` (copies) into the model's NNX variables.

        Checks every path, shape and dtype first; nothing is written if one does not fit.
        """
        values, _, _ = self._unpack(variables)
        layout = self._shared.layout
        for identity, value in values.items():
            layout.objects[identity].set_raw_value(jnp.array(value, copy=True))

    def save(self, directory: Any, variables: dict, *, step: int = 0) -> None:
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
        from graphmod._checkpoint import Checkpointer

        self._unpack(variables)  # checked before anything is written
        writer = Checkpointer(directory, keep=None, asynchronous=False)
        try:
            writer.save(step, variables, {"kind": "program",
                                          "provenance": self.provenance.to_dict()})
            writer.wait()
        finally:
            writer.close()

    def load(self, directory: Any, *, step: int | None = None) -> dict:
        """The variables :meth:`save` wrote to ``directory`` (checked against this program's
        layout; ``init`` must have run, to know the shapes)."""
        from graphmod._checkpoint import Checkpointer

        if self._abstract_variables is None:
            raise RuntimeError("program.load: call program.init(*example_args) first, so the "
                               "program knows its variables' shapes")
        reader = Checkpointer(directory, keep=None)
        try:
            variables, _ = reader.restore(self._abstract_variables, step)
        finally:
            reader.close()
        return variables

    def roles(self, variables: dict) -> dict:
        """The tree of roles of ``variables`` (same nesting, a Role per leaf)."""
        layout = self._shared.layout
        owned_roles = self._owned_roles()

        def model_roles(node: Any, key: tuple) -> Any:
            if isinstance(node, Mapping):
                return {k: model_roles(v, (*key, k)) for k, v in node.items()}
            return layout.by_key[key].role

        def manager_roles(name: str, entry: Mapping) -> dict:
            out: dict[str, Any] = {}
            for path, apps in entry.items():
                if path == "hparams":
                    out[path] = {h: _roles.HYPERPARAMETER for h in apps}
                    continue
                out[path] = {app: _map_owned(name, path, app, d, owned_roles)
                             for app, d in apps.items()}
            return out

        return {
            "model": model_roles(variables["model"], ()),
            "managers": {n: manager_roles(n, e) for n, e in variables["managers"].items()},
        }

    def split(self, variables: dict, *roles: _roles.Role) -> tuple[dict, dict]:
        """``(selected, rest)``: leaves whose role is one of ``roles`` (or a sub-role), and
        the others, each in the original nesting (empty branches dropped)."""
        wanted = _roles.as_roles(roles, argument="program.split(variables, *roles)")
        tree = self.roles(variables)

        def part(node: Any, role_node: Any, keep: bool) -> Any:
            if isinstance(node, Mapping):
                parts = {k: part(v, role_node[k], keep) for k, v in node.items()}
                return {k: v for k, v in parts.items() if v is not _EMPTY}
            hit = any(role_node.is_a(r) for r in wanted)
            return node if hit == keep else _EMPTY

        return part(variables, tree, True), part(variables, tree, False)

    @staticmethod
    def merge(selected: dict, rest: dict) -> dict:
        """The inverse of :meth:`split`: one nested dict from two disjoint ones."""
        out = dict(rest)
        for key, value in selected.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = Program.merge(value, out[key])
            else:
                out[key] = value
        return out

    def _owned_roles(self) -> dict[OwnedKey, _roles.Role]:
        if self._shared.owned_roles is None:
            raise RuntimeError(
                "this program has not been initialised: call program.init(*example_args) "
                "(or init a program it was derived from) first"
            )
        return self._shared.owned_roles

    # -- more programs and views ----------------------------------------------------------------
    def derive(self, fn: Callable[..., Any]) -> Program:
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
            derived = Program(fn, self._shared, self._managers, self._monitor,
                              self._axis_name, strict=False)
            derived._origin = origin
            origin._derived[fn] = derived
        return derived

    def graph(self, *args: Any, mode: str = "train", **kwargs: Any) -> ComputationGraph:
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

        def trace(variables: dict, key: Any) -> Any:
            values, owned, hparams = self._split(variables)  # fresh: nothing to check
            frame = self._trace(mode, values, owned, hparams,
                                key if mode == "train" else None, args, kwargs, record=True)
            found["frame"] = frame
            return frame.out

        jaxpr = jax.make_jaxpr(trace)(variables, jax.random.key(0))
        records = found["frame"].records or []
        return ComputationGraph(tuple(records), jaxpr, mode, self._shared.layout)

    def _bind(self, args: tuple, kwargs: dict, leaf: Callable[[Any], Any]) -> dict[str, Any]:
        names = self._argument_names
        bound: dict[str, Any] = {}
        for index, value in enumerate(args):
            name = names[index] if index < len(names) else f"args[{index}]"
            bound[name] = jax.tree.map(leaf, value)
        for name, value in kwargs.items():
            bound[name] = jax.tree.map(leaf, value)
        return bound


class _Empty:
    pass


_EMPTY = _Empty()


def _argument_names(fn: Callable[..., Any]) -> list[str]:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[1:]


def _abstract(value: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(value)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _int_keys(key: tuple) -> tuple:
    return tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in key)


def _check_strict(frame: Frame) -> None:
    for manager in frame.seen_managers.values():
        if manager.strict and frame.matches[id(manager)] == 0:
            raise ValueError(
                f"manager {manager.name!r} ({type(manager).__name__}) matched nothing in the "
                f"{frame.mode} trace: its filter {manager.filter!r} selects no variable of "
                "any application call. Fix the filter, or pass strict=False."
            )


def _describe_keys(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return type(value).__name__


def _owned_tree(owned: dict[OwnedKey, Any], hparams: dict[tuple[str, str], Any]) -> dict:
    out: dict[str, dict] = {}
    for (manager, name), value in hparams.items():
        out.setdefault(manager, {"hparams": {}})["hparams"][name] = value
    for (manager, path, application, call_id, name), value in owned.items():
        apps = out.setdefault(manager, {"hparams": {}}).setdefault(path, {})
        node = apps.setdefault(application, {})
        if call_id is not None:
            node = node.setdefault(call_id, {})
        if isinstance(node, dict) and any(
                isinstance(k, int) != (call_id is not None) for k in node if node is not apps):
            raise ValueError(f"manager {manager!r} mixes per_call and shared variables in "
                             f"application {application!r} of {path}: use one or the other")
        node[name] = value
    return out


def _flat_owned(manager: str, entry: Mapping) -> dict[OwnedKey, Any]:
    flat: dict[OwnedKey, Any] = {}
    for path, apps in entry.items():
        if path == "hparams":
            continue
        for application, node in apps.items():
            for key, value in node.items():
                if isinstance(key, int):
                    for name, leaf in value.items():
                        flat[(manager, path, application, key, name)] = leaf
                else:
                    flat[(manager, path, application, None, key)] = value
    return flat


def _map_owned(manager: str, path: str, application: str, node: Mapping,
               roles: dict[OwnedKey, _roles.Role]) -> dict:
    def role(call_id: int | None, name: str) -> _roles.Role:
        key = (manager, path, application, call_id, name)
        if key not in roles:
            raise KeyError(f"variables hold {manager}/{path}/{application}/{name}, which this "
                           "program's init did not create")
        return roles[key]

    return {
        k: ({n: role(k, n) for n in v} if isinstance(k, int) else role(None, k))
        for k, v in node.items()
    }


def _replace_owned(managers: Mapping, owned: dict[OwnedKey, Any], updated: set) -> dict:
    """``variables["managers"]`` with updated owned leaves replaced (structure kept)."""
    out = {name: dict(entry) for name, entry in managers.items()}
    for key in updated:
        manager, path, application, call_id, name = key
        entry = out[manager]
        entry[path] = dict(entry[path])
        node = entry[path][application] = dict(entry[path][application])
        if call_id is not None:
            node[call_id] = dict(node[call_id])
            node = node[call_id]
        node[name] = owned[key]
    return out
