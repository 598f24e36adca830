"""Unmodified Flax modules as applications, and Flax's own code that follows the program.

Unmodified Flax modules
    Any ``nnx.Module`` of a compiled model that is not a brick is one too: while a program
    traces, every call of its ``__call__`` (read as application ``apply``) and of the methods
    named in ``compile(..., applications={cls: [names]})`` (by default also ``Embed.attend``)
    is an application at the module's path. Its inputs are the arrays among its arguments
    (named as in the method's signature; inside tuples, lists and dicts by their keys,
    ``carry.0``; a ``**kwargs`` entry by its key), its outputs the returned array
    (``output``), the arrays of a returned tuple (``output_0``, ``output_1``, ...) or dict
    (``output.logits``: by key; other results are passed on untagged). This
    works by switching the module instances' class, during a trace only, to a cached
    subclass (same name) whose methods run the chain around the original
    (``graphmod._core._tracing._context`` owns the switch and restores it, also after an exception).

Sharp edges
    Inside a trace ``type(module)`` is that subclass (``isinstance`` checks are
    unaffected). It is made once per class and holds the class's methods as they were then:
    a method replaced on the class afterwards (monkeypatched) is not what programs run. A
    method called on the class (``nnx.Linear.__call__(layer, x)``, ``super().__call__(x)``)
    is not a separate application. Two programs with different
    ``applications=`` tracing one model at the same time share one subclass (the first
    one's). A manager-owned variable of an application whose module a scan slices (``nnx.scan``
    over layers, an ``nnx.vmap`` over an ensemble's members) is one per iteration or member,
    stacked with the loops' lengths as leading axes (see ``graphmod._core._loops._loop_keys``);
    where the transform sees the whole module (``nnx.RNN``'s cell, ``nnx.vmap`` over the
    batch, ``jax.jit``) it is shared by every iteration and cannot be updated there,
    nor created from a parameter's value (use ``graphmod.scan``). A module may gain a new
    attribute while a program traces (Flax's intermediates, ``nnx.pop``-ed in the loss) but
    must lose it before the function returns (:func:`assign_in_program`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import tracers

from graphmod import roles as _roles
from graphmod._core._bricks._array_leaves import ArrayLeaf
from graphmod._core._bricks._spec import MethodSpec, is_array
from graphmod._core._tracing import _context
from graphmod._core._tracing._chain import Chain
from graphmod._core._tracing._container_rebinding import write_rebound
from graphmod.typing import ArrayLike

# Methods besides ``__call__`` that are applications of every program's Flax modules.
_DEFAULT_APPLICATIONS: dict[type, tuple[str, ...]] = {nnx.Embed: ("attend",)}


def method_applications(applications: object) -> dict[type, tuple[str, ...]]:
    """Checks ``compile(..., applications=...)`` and adds the defaults (``Embed.attend``).

    Examples:
        >>> from flax import nnx
        >>> from graphmod._core._bricks._intercept import method_applications
        >>> class Net(nnx.Module):
        ...     def encode(self, x):
        ...         return x
        >>> method_applications({Net: ["encode"]})[Net]
        ('encode',)
    """
    out = dict(_DEFAULT_APPLICATIONS)
    if applications is None:
        return out
    if not isinstance(applications, Mapping):
        raise TypeError(f"compile(applications={applications!r}): expected a dict of module "
                        "classes to method names, e.g. applications={MyModule: ['encode']}")
    for cls, names in applications.items():
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            raise TypeError(f"compile(applications=...): key {cls!r} is not a flax.nnx.Module "
                            "class; write applications={MyModule: ['encode']}")
        if getattr(cls, "__graphmod_brick__", False):
            raise TypeError(f"compile(applications=...): {cls.__name__} is a brick; mark its "
                            "methods with @graphmod.application instead")
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"compile(applications=...): the methods of {cls.__name__} must "
                            f"be a list of names, e.g. ['encode']; got {names!r}")
        for name in names:
            if not inspect.isfunction(inspect.getattr_static(cls, name, None)):
                raise ValueError(f"compile(applications=...): {cls.__name__} has no method "
                                 f"{name!r} (a plain function defined in the class)")
        out[cls] = (*out.get(cls, ()), *names)
    return out


def interceptor(applications: object) -> Callable[[type], type | None]:
    """For ``compile(..., applications=...)`` (checked here, before anything changes): the
    class a plain Flax module class is switched to while a program traces, None for bricks.
    A module without applications (an ``nnx.List`` of layers) is switched too: its
    ``__setattr__`` and ``sow`` follow the program (``nnx.capture`` sets an attribute on
    every module)."""
    checked = method_applications(applications)

    def intercept(cls: type) -> type | None:
        if getattr(cls, "__graphmod_brick__", False) or not issubclass(cls, nnx.Module):
            return None  # bricks declare theirs with @application; an nnx.Pytree has none
        names = ["__call__"] if any("__call__" in vars(c) for c in cls.__mro__[:-1]) else []
        for base, extra in checked.items():
            if issubclass(cls, base):
                names += [name for name in extra if name not in names]
        return intercepting_class(cls, tuple(names))

    return intercept


@functools.cache
def intercepting_class(cls: type, methods: tuple[str, ...]) -> type:
    """A subclass of Flax module class ``cls`` (same name) whose ``methods`` are
    applications; a module's class is switched to it only while a program traces."""
    namespace: dict[str, object] = {"__module__": cls.__module__,
                                    "__qualname__": cls.__qualname__,
                                 "__graphmod_original__": cls, "__slots__": ()}
    for name in methods:
        namespace[name] = _intercepted(getattr(cls, name), name)
    # nnx.capture(..., method_outputs=...) wraps the callables in type(module).__dict__ (not
    # inherited ones) to sow their results: the class's own methods stand here too, so it
    # wraps what it wraps outside programs. graphmod's own hooks are partialmethods, which
    # are not callable, so it leaves them alone (a wrapped sow would sow forever).
    for name, attribute in vars(cls).items():
        if name not in namespace and callable(attribute) and not name.startswith("_"):
            namespace[name] = attribute
    if cls.sow is nnx.Module.sow:
        namespace["sow"] = functools.partialmethod(sow_in_program)
    namespace["__setattr__"] = functools.partialmethod(assign_in_program, cls.__setattr__)
    return type(cls.__name__, (cls,), namespace)


def assign_in_program(module: nnx.Module, assign: Callable[[nnx.Module, str, object], None],
                      name: str, value: object) -> None:
    """``module.name = value`` by ``assign`` (the class's own ``__setattr__``); while a
    program traces, a module of its model may gain a new attribute (Flax refuses it from
    inside a trace), which must be gone when the traced function returns (Flax's examples
    store intermediates so, ``self.kl_loss = Loss(...)``, and ``nnx.pop`` them in the loss;
    see ``graphmod._core._tracing._context.tracing``). Rebinding an array attribute (Flax's
    array leaves, ``self.count += 1``) writes the program's value
    (``graphmod._core._bricks._array_leaves``),
    as rebinding a container of model variables to one with variables at the same places
    does (Flax's ``ToNNX``: ``graphmod._core._tracing._container_rebinding``); rebinding
    another stays Flax's to refuse: the module's new value could not outlive the trace."""
    frame = _context.current_frame()
    held = vars(module).get(name)
    if frame is not None and isinstance(held, ArrayLeaf):  # also a transform's copy of one
        if not isinstance(value, ArrayLike):
            raise TypeError(f"{type(module).__name__}.{name} holds an array, and a program "
                            f"writes it: it was rebound to a {type(value).__name__}; assign "
                            "an array (or a number) to it")
        held.set_value(value)
        return
    path = None if frame is None else frame.layout.brick_path(module)
    if frame is None or path is None:
        assign(module, name, value)
        return
    if name in vars(module):
        owner = f"{path.rstrip('/')}/{name}"
        if not write_rebound(frame, owner, held, value):
            assign(module, name, value)
        return
    state = module._pytree__state
    adopted = state.trace_state
    object.__setattr__(state, "_trace_state", tracers.TraceState())  # valid in this trace
    try:
        assign(module, name, value)
    finally:
        object.__setattr__(state, "_trace_state", adopted)
    _context.note_new_attribute(module, name)


def _intercepted(method: Callable[..., object], name: str) -> Callable[..., Any]:
    spec = MethodSpec("apply" if name == "__call__" else name, (), (),
                       inspect.signature(method), False)
    in_program = _PROGRAM_CODE.get(method, method)

    @functools.wraps(method)
    def wrapper(self: nnx.Module, *args: object, **kwargs: object) -> Any:
        frame = _context.current_frame()
        path = None if frame is None else frame.layout.brick_path(self)
        # no program: another thread calling the model eagerly; or a stranger module
        if frame is None or path is None:
            return method(self, *args, **kwargs)
        return Chain(frame, spec, self, path).run(in_program, args, kwargs)

    return wrapper


def sow_in_program(self: nnx.Module, variable_type: type[nnx.Variable] | str, name: str,
                   value: object, *args: Any, **kwargs: Any) -> bool:
    """``Module.sow`` in a program: each array of ``value`` is an auxiliary variable
    ``name`` (``name_0``, ``name_1``, ... for several) of the innermost application call,
    monitorable, and is stored as Flax stores it: into an ``nnx.capture`` in progress in the
    function, or on the module for the function to ``nnx.pop`` (what it leaves there is
    dropped when the trace ends: the model stays as it was)."""
    frame = _context.current_frame()
    if frame is None or frame.layout.brick_path(self) is None:
        return nnx.Module.sow(self, variable_type, name, value, *args, **kwargs)
    capturing = "__captures__" in vars(self)  # nnx.capture's own store, made in the function
    if frame.calls:
        leaves = [leaf for leaf in jax.tree.leaves(value) if is_array(leaf)]
        for index, leaf in enumerate(leaves):
            frame.calls[-1].call.add_auxiliary_variable(
                leaf, name=name if len(leaves) == 1 else f"{name}_{index}")
    elif not capturing:
        raise RuntimeError(f"{type(self).__name__}.sow({name!r}) outside any application "
                           "call: sow inside a module method, or return the value from fn")
    stored = nnx.Module.sow(self, variable_type, name, value, *args, **kwargs)
    if not capturing:
        _context.note_sown(self, name)
    return stored


def _innermost() -> Chain:
    frame = _context.current_frame()
    assert frame is not None and frame.calls
    return frame.calls[-1]


def _draw_key(chain: Chain, stream: nnx.RngStream | Callable[[], jax.Array] | jax.Array | None
              ) -> jax.Array:
    """The key of a Flax layer's random draw in a program: the step key folded with the
    layer's path and, inside a loop JAX traces once, the iteration; with the layer's own
    stream (stored or passed: an ``RngStream``, a callable or a key) the step key folded
    with the path and the stream's draw instead, made as Flax makes it, so the draws keep
    the structure the user gave the stream (broadcast over a scan's steps by
    ``nnx.with_rngs``, recurrent dropout: one mask for every step) and the step key still
    sets them."""
    if stream is None:
        return chain.call.rng()
    drawn = stream() if callable(stream) else stream
    return jax.random.fold_in(chain.call.rng(per_step=False),
                              jax.random.bits(drawn, (), jnp.uint32))


def _dropout(self: nnx.Dropout, inputs: jax.Array, *, deterministic: bool | None = None,
             rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None) -> jax.Array:
    """``nnx.Dropout.__call__`` in a program: the program's mode, and masks from the
    program's step key (see :func:`_draw_key`); identity in inference or where the user
    set ``deterministic=True`` (at construction or in the call)."""
    chain = _innermost()
    explicit = self.deterministic if deterministic is None else deterministic
    if explicit or not chain.call.training or self.rate == 0.0:
        _held_off(chain, deterministic is None and self.rate > 0.0, "deterministic", explicit)
        return inputs
    keep = 1.0 - self.rate
    if keep == 0.0:  # zeros with zero (finite) gradients, as Flax does
        out = jnp.zeros_like(inputs)
    else:
        shape = list(jnp.shape(inputs))
        for axis in self.broadcast_dims:
            shape[axis] = 1
        # placed as the inputs (as Flax's Dropout): under a user's explicit mesh a mask
        # of another sharding is refused by select
        stream = self.rngs if rngs is None else rngs
        if isinstance(stream, nnx.Rngs):
            stream = stream[self.rng_collection]
        mask = jnp.broadcast_to(jax.random.bernoulli(
            _draw_key(chain, stream), keep, shape, out_sharding=jax.typeof(inputs).sharding),
            jnp.shape(inputs))
        out = jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))
    chain.note_rewrite("nnx.Dropout", chain.tag(_roles.OUTPUT, "output"), inputs, out)
    return out


def _batch_norm(self: nnx.BatchNorm, x: jax.Array, use_running_average: bool | None = None,
                *, mask: jax.Array | None = None) -> jax.Array:
    """``nnx.BatchNorm.__call__`` in a program: batch statistics (running averages updated)
    in training, running averages in inference or where the user set
    ``use_running_average=True`` (at construction or in the call)."""
    explicit = self.use_running_average if use_running_average is None else use_running_average
    chain = _innermost()
    frozen = bool(explicit) or not chain.call.training
    _held_off(chain, use_running_average is None, "use_running_average", explicit)
    return _FLAX_BATCH_NORM(self, x, use_running_average=frozen, mask=mask)


def _attention(self: nnx.MultiHeadAttention, inputs_q: jax.Array,
               inputs_k: jax.Array | None = None, inputs_v: jax.Array | None = None, *,
               deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
               **kwargs: Any) -> jax.Array:
    """``nnx.MultiHeadAttention.__call__`` in a program: its attention-weight dropout
    follows the program's mode and draws from its step key (see :func:`_draw_key`),
    unless the user set ``deterministic=True``."""
    chain = _innermost()
    explicit = self.deterministic if deterministic is None else deterministic
    frozen = bool(explicit) or not chain.call.training or self.dropout_rate == 0.0
    _held_off(chain, deterministic is None and self.dropout_rate > 0.0, "deterministic",
              explicit)
    stream = self.rngs if rngs is None else rngs
    key = None if frozen else _draw_key(
        chain, stream.dropout if isinstance(stream, nnx.Rngs) else stream)
    if key is not None:
        keys = inputs_q if inputs_k is None else inputs_k
        weights = jax.ShapeDtypeStruct(
            (*jnp.shape(inputs_q)[:-2], self.num_heads, jnp.shape(inputs_q)[-2],
             jnp.shape(keys)[-2]), jnp.result_type(inputs_q))
        chain.note_rewrite("nnx.Dropout", chain.tag(_roles.AUXILIARY, "attention_weights"),
                          weights, weights)
    # Flax calls what it is given as rngs= (annotated: an Rngs or an RngStream) for its key.
    return _FLAX_ATTENTION(self, inputs_q, inputs_k, inputs_v, deterministic=frozen,
                           rngs=None if key is None else (lambda: key),  # pyright: ignore[reportArgumentType]
                           **kwargs)


def _held_off(chain: Chain, by_module: bool, flag: str, value: bool | None) -> None:
    """Notes a Flax layer that a flag set on the module (``by_module``, not in the call)
    keeps in eval mode in a training trace: the program warns (``model.eval()`` before
    compiling switches these layers off in training too). Not in init's trace: a model
    loaded only for inference is initialised too."""
    if by_module and value and chain.frame.mode == "train":
        chain.frame.note_held_off(chain.path, f"{type(chain.brick).__name__}.{flag}=True")


_FLAX_BATCH_NORM = nnx.BatchNorm.__call__
_FLAX_ATTENTION = nnx.MultiHeadAttention.__call__
# Flax's own methods whose behaviour follows the program (mode, key) inside one.
_PROGRAM_CODE: dict[Callable[..., object], Callable[..., object]] = {
    nnx.Dropout.__call__: _dropout,
    nnx.BatchNorm.__call__: _batch_norm,
    nnx.MultiHeadAttention.__call__: _attention,
}
