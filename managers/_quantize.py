"""``Quantized`` and ``quantize``: stored quantized weights (post-training quantization),
calibrated activation quantization, and conversion of ``FakeQuant``-trained variables.

How it works
    :class:`Quantized` owns, per selected weight, the quantized integers ``q`` and their
    float ``scale`` (STATE variables at ``variables["managers"][name][<brick path>]
    [<weight name>]``), and rewrites each read of the weight to ``dequantize(q, scale)``
    in the weight's dtype: the layer's matrix product reads it and XLA fuses the two. A
    weight is read as a matrix ``(fan_in, units)`` (its layer's layout, as ``FakeQuant``
    and ``LoRA`` read it): int8 has one scale per unit (per channel), a ``group`` splits
    the fan-in into blocks with one scale each (int4 is packed two to a byte). The
    numerics are Qwix's symmetric absmax: ``scale = max|w| / (qmax + 0.5)``, ``q =
    clip(round(w / scale), qmin, qmax)``; ``extended=False`` gives ``FakeQuant``'s
    (``scale = max|w| / qmax``, ``|q| <= qmax``).

    :func:`quantize` makes the serving pair from a float program and its trained
    variables: a program over a copy of the model whose quantized weights are zero-size
    placeholders (shape ``(*shape, 0)``, so the copy keeps their shape and dtype for the
    layers and nothing for storage), and variables holding ``q`` and ``scale`` computed
    from the trained weights (per layer in a scan over layers, per member of an
    ensemble). ``program.save`` then writes about a quarter (int8) or an eighth (int4) of
    the float bytes of those weights; a fresh process rebuilds the program the same way
    from an initialised float program and ``load``\\ s them.

    Activations (``activations=``) are quantized per tensor to int8 and back where the
    filter selects inputs or outputs: ``"dynamic"`` from each tensor's own absmax (as
    ``FakeQuant``), or from ranges calibrated over data and stored as owned variables:
    ``"absmax"`` (``max |x|``), ``"percentile"`` (of ``|x|``, NumPy's linear
    interpolation) and ``"minmax"`` (asymmetric, with a zero point as Qwix's).

Sharp edges
    ``quantize`` compiles over copies of the model: managers whose filters name brick
    instances are refused (name classes or ``path=``); the program's mesh, rules and batch
    axis are carried over (``q`` and ``scale`` placed as the program places owned
    variables), its input transforms are not. Calibration runs one training-mode pass over
    all calibration batches concatenated (so a percentile is the one of all of them):
    other stochastic managers of the program are active in it. In training mode the
    manager observes activations (calibration) instead of quantizing them; weights are
    always read dequantized, with no gradient to ``q``. A weight whose last axis has size
    0 reads as a placeholder.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

import graphmod as gm
from graphmod import roles
from graphmod.typing import ArrayLike, Batch, HookContext, Model, Variables
from managers._checks import ManagerOptions, require_floating, roles_by_default
from managers._layout import WeightLayout, weight_layout
from managers._merge import _node
from managers._quantization import FakeQuant

DTYPES = ("int8", "int4", "float8_e4m3fn", "float8_e5m2")
ACTIVATIONS = ("dynamic", "absmax", "percentile", "minmax")
_STATISTICS = {"absmax": ("absmax",), "percentile": ("absmax",), "minmax": ("min", "max")}


class Quantized(gm.Manager):
    """Stored quantized weights, dequantized inside the matrix product that reads them;
    optionally int8 activations. Build the serving program with :func:`quantize` (from a
    float program and its trained variables); compiled by hand, ``init`` quantizes the
    model's initial weights.

    Args:
        dtype: the stored weights' type: ``"int8"`` (per channel), ``"int4"`` (give a
            ``group``: two values to a byte) or a float8 (``"float8_e4m3fn"``,
            ``"float8_e5m2"``, where the backend has it).
        group: fan-in values per scale (None: one scale per output unit); must divide the
            weight's fan-in. A tuple, e.g. ``(128, 64, 32)``: the largest that divides it.
        activations: None (weights only), or the inputs and outputs the filter selects
            quantized per tensor: ``"dynamic"`` (each tensor's absmax, as ``FakeQuant``),
            or from ranges :func:`quantize` calibrates: ``"absmax"``, ``"percentile"`` (of
            ``|x|``) or ``"minmax"`` (asymmetric, with a zero point).
        activation_dtype: ``"int8"`` or ``"int4"``, the activations' integers.
        percentile: the percentile of ``|x|`` kept by ``"percentile"`` calibration.
        extended: Qwix's bound ``qmax + 0.5`` (True) or ``FakeQuant``'s ``qmax`` (False).

    Unless its filter chooses variables it quantizes the weights (and with
    ``activations``, the inputs) of the applications it selects.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(64, 3, rngs=nnx.Rngs(0), use_bias=False)
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[managers.Quantized()])
        >>> x = jnp.ones((1, 64))
        >>> variables = program.init(x)
        >>> stored = variables["managers"]["quantized"]["/"]["W"]
        >>> stored["q"].dtype, stored["scale"].shape
        (dtype('int8'), (1, 3))
        >>> bool(jnp.allclose(program.infer(variables, x), lin(x), atol=0.05))
        True
    """

    kinds = ("parameter_rewrite",)
    exclusive = True  # two quantizations of one weight are refused, naming both

    def __init__(self, dtype: str = "int8", *, group: int | tuple[int, ...] | None = None,
                 activations: str | None = None, activation_dtype: str = "int8",
                 percentile: float = 99.99, extended: bool = True,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        default = (roles.WEIGHT,) + ((roles.INPUT,) if activations is not None else ())
        super().__init__(**roles_by_default(kwargs, default))
        if dtype not in DTYPES:
            raise ValueError(f"Quantized(dtype={dtype!r}): choose one of {list(DTYPES)}")
        _check_backend(dtype)
        candidates = (group,) if isinstance(group, int) else group
        if group is not None and (not isinstance(candidates, tuple) or not candidates or any(
                isinstance(g, bool) or not isinstance(g, int) or g < 1
                or (dtype == "int4" and g % 2) for g in candidates)):
            raise ValueError(f"Quantized(group={group!r}): a positive int (even for int4), "
                             "a tuple of them (the largest that divides each weight's "
                             "fan-in) or None for one scale per output unit")
        if activations is not None and activations not in ACTIVATIONS:
            raise ValueError(f"Quantized(activations={activations!r}): choose None or one of "
                             f"{list(ACTIVATIONS)}")
        if activation_dtype not in ("int8", "int4"):
            raise ValueError(f"Quantized(activation_dtype={activation_dtype!r}): 'int8' or "
                             "'int4'")
        if not 0 < percentile <= 100:
            raise ValueError(f"Quantized(percentile={percentile!r}): must be in (0, 100]")
        self.dtype = dtype
        self.group = group
        self.activations = activations
        self.activation_dtype = activation_dtype
        self.percentile = percentile
        self.extended = extended

    # -- weights ----------------------------------------------------------------------
    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        placeholder = is_placeholder(value)
        shape = jnp.shape(value)[:-1] if placeholder else jnp.shape(value)
        weight = jax.ShapeDtypeStruct(shape, jnp.result_type(value))
        layout = weight_layout(self, call, name, weight)
        group = self._group(call, layout)

        # Zeros of the right shapes for a placeholder.
        def stored(part: int) -> Callable[[jax.Array], jax.Array]:
            def init(w: jax.Array) -> jax.Array:
                if placeholder:
                    return jnp.zeros(*_shapes(self.dtype, layout, group)[part])
                return quantize_matrix(layout.matrix(w), self.dtype, group,
                                       self.extended)[part]
            return init

        q = call.variable("q", stored(0))
        scale = call.variable("scale", stored(1))
        matrix = dequantize_matrix(q.value, scale.value, self.dtype, group)
        return jax.lax.stop_gradient(layout.from_matrix(matrix).astype(weight.dtype))

    def _group(self, call: HookContext, layout: WeightLayout) -> int:
        """The group size for ``layout``: the largest candidate dividing its fan-in (the
        whole fan-in without a group), even for int4; raises naming the weight if none."""
        fan_in = layout.fan_in_size
        candidates = (fan_in,) if self.group is None else (
            (self.group,) if isinstance(self.group, int) else self.group)
        fitting = [g for g in candidates if fan_in % g == 0
                   and (self.dtype != "int4" or g % 2 == 0)]
        if fitting:
            return max(fitting)
        divisors = [g for g in range(2, fan_in + 1, 2) if fan_in % g == 0][-4:]
        raise ValueError(
            f"{type(self).__name__} {self.name!r}: group={self.group} does not divide the fan-in "
            f"{fan_in} of weight {call.parameter} (shape {layout.shape})"
            + (" (int4 needs an even group)" if self.dtype == "int4" else "")
            + f". Choose a group that does (e.g. {divisors or 'int8 with group=None'}), or "
            "leave this weight out with the filter (bricks=, path=)")

    # -- activations ------------------------------------------------------------------
    def _activation(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        if self.activations is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} selected {name!r} of {call.path} (an "
                f"{call.role.name if call.role else 'activation'}) but quantizes weights "
                "only: pass activations='dynamic' (or a calibration: 'absmax', "
                "'percentile', 'minmax'), or narrow the filter to roles=[WEIGHT]")
        require_floating(self, call, name, value)
        if self.activations == "dynamic":
            return fake_quantize(value, {"absmax": jnp.max(jnp.abs(value))},
                                 self.activation_dtype, self.extended)
        ranges = {s: call.variable(f"{name}.{s}", lambda: jnp.zeros((), jnp.float32))
                  for s in _STATISTICS[self.activations]}
        if call.training:  # the calibration pass: observe, leave the values as they are
            for statistic, observed in observe(value, self.activations,
                                               self.percentile).items():
                ranges[statistic].value = observed
            return value
        return fake_quantize(value, {s: v.value for s, v in ranges.items()},
                             self.activation_dtype, self.extended)

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._activation(call, name, value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._activation(call, name, value)


def is_placeholder(value: ArrayLike) -> bool:
    """Whether ``value`` stands for a weight :func:`quantize` stores elsewhere: a zero-size
    array whose last axis is 0, the weight's shape before it.

    Examples:
        >>> import jax.numpy as jnp
        >>> is_placeholder(jnp.zeros((3, 4, 0))), is_placeholder(jnp.zeros((3, 4)))
        (True, False)
    """
    shape = jnp.shape(value)
    return len(shape) >= 2 and shape[-1] == 0


def _bound(dtype: str, extended: bool) -> tuple[float, int, int]:
    """(the absmax's image, qmin, qmax) of an integer ``dtype``."""
    qmax = 2 ** (int(dtype[3:]) - 1) - 1
    return (qmax + 0.5, -qmax - 1, qmax) if extended else (qmax, -qmax, qmax)


def _scale(absmax: jax.Array, bound: float, extended: bool) -> jax.Array:
    """``absmax / bound``, 1 where the range is empty (Qwix's or FakeQuant's test)."""
    empty = absmax < jnp.sqrt(jnp.finfo(absmax.dtype).tiny) if extended else absmax <= 0
    return jnp.where(empty, 1, absmax / bound).astype(absmax.dtype)


def quantize_matrix(matrix: jax.Array, dtype: str, group: int, extended: bool = True
                    ) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)`` of a ``(fan_in, units)`` matrix: one scale per ``group`` rows of a
    unit, ``q`` in ``dtype`` (int4 packed two rows to an int8).

    Examples:
        >>> import jax.numpy as jnp
        >>> q, scale = quantize_matrix(jnp.array([[1.0], [-0.5]]), "int8", 2)
        >>> q.tolist(), bool(jnp.allclose(scale, 1 / 127.5))
        ([[127], [-64]], True)
    """
    fan_in, units = matrix.shape
    blocks = matrix.reshape(fan_in // group, group, units)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    if dtype.startswith("float8"):
        scale = _scale(absmax, float(jnp.finfo(dtype).max), True)
        return (blocks / scale[:, None]).astype(dtype).reshape(fan_in, units), scale
    bound, qmin, qmax = _bound(dtype, extended)
    scale = _scale(absmax, bound, extended)
    q = jnp.clip(jnp.round(blocks / scale[:, None]), qmin, qmax).astype(jnp.int8)
    q = q.reshape(fan_in, units)
    return (_pack(q) if dtype == "int4" else q), scale


def dequantize_matrix(q: jax.Array, scale: jax.Array, dtype: str, group: int) -> jax.Array:
    """The ``(fan_in, units)`` matrix :func:`quantize_matrix` quantized, in float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> w = jnp.linspace(-1, 1, 8).reshape(4, 2)
        >>> q, scale = quantize_matrix(w, "int4", 2)
        >>> q.shape, bool(jnp.abs(dequantize_matrix(q, scale, "int4", 2) - w).max() < 0.1)
        ((2, 2), True)
    """
    values = _unpack(q) if dtype == "int4" else q
    fan_in, units = values.shape
    blocks = values.astype(scale.dtype).reshape(fan_in // group, group, units)
    return (blocks * scale[:, None]).reshape(fan_in, units)


def _shapes(dtype: str, layout: WeightLayout, group: int
            ) -> tuple[tuple[tuple[int, int], DTypeLike], tuple[tuple[int, int], DTypeLike]]:
    """The (shape, dtype) of ``q`` and of ``scale`` for a weight of ``layout``."""
    fan_in, units = layout.fan_in_size, layout.units_size
    stored = jnp.int8 if dtype.startswith("int") else jnp.dtype(dtype)
    rows = fan_in // 2 if dtype == "int4" else fan_in
    return ((rows, units), stored), ((fan_in // group, units), jnp.float32)


def _pack(q: jax.Array) -> jax.Array:
    """int4 values (as int8) packed two rows to a byte: row ``2i`` low, ``2i + 1`` high."""
    low, high = q[0::2], q[1::2]
    return jnp.bitwise_or(jnp.left_shift(high, 4), jnp.bitwise_and(low, 0xF)).astype(jnp.int8)


def _unpack(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`_pack`: arithmetic shifts sign-extend each half."""
    low = jnp.right_shift(jnp.left_shift(packed, 4), 4)
    high = jnp.right_shift(packed, 4)
    return jnp.stack([low, high], axis=1).reshape(2 * packed.shape[0], *packed.shape[1:])


def _check_backend(dtype: str) -> None:
    """Raises naming ``dtype`` and the backend if it cannot convert to and from it."""
    try:
        _round_trip(jnp.int8 if dtype.startswith("int") else jnp.dtype(dtype))
    except Exception as error:  # the backend's own error type varies by platform
        raise TypeError(
            f"Quantized(dtype={dtype!r}): the {jax.default_backend()} backend cannot store "
            f"or convert {dtype} ({type(error).__name__}: {error}). Use dtype='int8' or "
            "'int4', which every backend has") from None


def _round_trip(dtype: DTypeLike) -> None:
    """Converts a float32 array to ``dtype`` and back on the default backend, waited for."""
    jax.block_until_ready(jnp.ones(2, jnp.float32).astype(dtype).astype(jnp.float32))


def observe(value: jax.Array, method: str, percentile: float = 99.99) -> dict[str, jax.Array]:
    """The range statistics of ``value`` that ``method`` calibrates (float32 scalars).

    Examples:
        >>> import jax.numpy as jnp
        >>> observe(jnp.array([-3.0, 1.0, 2.0]), "minmax")
        {'min': Array(-3., dtype=float32), 'max': Array(2., dtype=float32)}
    """
    x = jax.lax.stop_gradient(value).astype(jnp.float32)
    if method == "absmax":
        return {"absmax": jnp.max(jnp.abs(x))}
    if method == "percentile":
        return {"absmax": jnp.percentile(jnp.abs(x), percentile)}
    return {"min": jnp.min(x), "max": jnp.max(x)}


def fake_quantize(value: jax.Array, ranges: dict[str, jax.Array], dtype: str = "int8",
                  extended: bool = True) -> jax.Array:
    """``value`` quantized to ``dtype`` and back with the per-tensor ``ranges`` (``absmax``:
    symmetric; ``min`` and ``max``: asymmetric with a zero point, as Qwix's).

    Examples:
        >>> import jax.numpy as jnp
        >>> fake_quantize(jnp.array([0.0, 0.3, 2.0]), {"absmax": jnp.float32(1.0)}).tolist()
        [0.0, 0.2980392277240753, 0.9960784912109375]
    """
    x = value.astype(jnp.float32)
    if "absmax" in ranges:
        bound, qmin, qmax = _bound(dtype, extended)
        scale = _scale(jnp.asarray(ranges["absmax"], jnp.float32), bound, extended)
        out = jnp.clip(jnp.round(x / scale), qmin, qmax) * scale
    else:
        _, qmin, qmax = _bound(dtype, True)  # the whole integer range, as Qwix's
        low, high = (jnp.asarray(ranges[k], jnp.float32) for k in ("min", "max"))
        scale = _scale(high - low, float(qmax - qmin), True)
        zero = jnp.clip(jnp.round(qmin - low / scale), qmin, qmax)
        out = (jnp.clip(jnp.round(x / scale + zero), qmin, qmax) - zero) * scale
    return value + jax.lax.stop_gradient(out.astype(value.dtype) - value)


def from_fake_quant(fake: FakeQuant) -> Quantized:
    """The :class:`Quantized` manager that stores what ``fake`` simulates: its bits as int8
    or int4, its filter, its numerics, its activations quantized dynamically.

    Examples:
        >>> import managers
        >>> from managers._quantize import from_fake_quant
        >>> from_fake_quant(managers.FakeQuant(8)).dtype
        'int8'
    """
    if fake.bits not in (4, 8):
        raise ValueError(
            f"FakeQuant {fake.name!r} simulates {fake.bits}-bit integers, which have no "
            "stored type here: train with FakeQuant(8) or FakeQuant(4), or quantize with "
            "managers.quantize(program, variables, managers.Quantized('int8'))")
    activations = "dynamic" if any(fake.filter.names_role(r) for r in (
        roles.INPUT, roles.OUTPUT)) else None
    dtype = f"int{fake.bits}"
    return Quantized(dtype, activations=activations, activation_dtype=dtype, extended=False,
                     filter=fake.filter, priority=fake.priority)


def quantize(program: gm.Program, variables: Variables, quantized: Quantized | None = None,
             *, data: Iterable[Batch] | None = None) -> tuple[gm.Program, Variables]:
    """Post-training quantization: a program and variables that serve ``program`` with
    its selected weights stored quantized: a program over a copy of the model whose
    quantized weights are zero-size placeholders (shape ``(*shape, 0)``: no bytes), and
    variables holding their ``q`` and ``scale``, computed from the trained weights per
    layer of a scan and per member of an ensemble.

    Args:
        program: the float program (``init`` has run: its examples shape the new one).
        variables: its trained variables (or ``program.init``'s, to rebuild the serving
            program in a fresh process and then ``load`` saved quantized variables).
        quantized: the scheme and the filter; None converts the program's ``FakeQuant``
            (same bits, scales and rounding: the outputs of the fake-quantized program).
        data: calibration batches (as the program's arguments after the model), needed
            for calibrated activations.

    Returns:
        ``(serving program, its variables)``; the program's other managers are kept.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
        >>> variables = program.init(jnp.ones((1, 64)))
        >>> served, stored = managers.quantize(program, variables, managers.Quantized())
        >>> stored["model"]["kernel"].shape, stored["managers"]["quantized"]["/"]["kernel"][
        ...     "q"].shape
        ((64, 8, 0), (64, 8))
    """
    if program.record.examples is None:
        raise RuntimeError("managers.quantize(program, ...): call program.init(*example_args) "
                           "first: its examples shape the serving program")
    fakes = [m for m in program.managers if isinstance(m, FakeQuant)]
    if quantized is None:
        if len(fakes) != 1:
            raise ValueError(
                "managers.quantize(program, variables): without a Quantized manager it "
                f"converts the program's one FakeQuant, and the program has {len(fakes)}. "
                "Pass quantized=managers.Quantized(...)")
        quantized = from_fake_quant(fakes[0])
    if not isinstance(quantized, Quantized):
        raise TypeError(f"managers.quantize(quantized={quantized!r}): expected a "
                        "managers.Quantized")
    kept = [m for m in program.managers if not isinstance(m, FakeQuant)]
    _check_not_quantized(variables, kept, quantized)
    batches = _calibration_batches(quantized, data)
    for manager in kept:
        if manager.filter.brick_instances():
            raise ValueError(
                f"managers.quantize: manager {manager.name!r} selects brick instances "
                f"({manager.filter!r}); quantize compiles over a copy of the model, where "
                "they are not. Select by class (bricks=[nnx.Linear]) or by path (path=...)")
    examples = program.record.examples
    positional = program.record.positional or []
    args = tuple(examples[n] for n in positional)
    kwargs = {n: v for n, v in examples.items() if n not in positional}

    placement = program.placement  # the same mesh and rules, for the copies
    mesh, rules, batch_axis = (None, (), None) if placement is None else (
        placement.mesh, placement.rules, placement.batch_axis)
    float_model = nnx.clone(program.model)
    floats = gm.compile(program.fn, float_model, managers=[
        _over(quantized, program, float_model), *kept],  # first to read weights
        mesh=mesh, rules=rules, batch_axis=batch_axis)
    floats.update_model({"model": variables["model"], "managers": {}})
    # The examples hold no "rng": init took it as its own (the checker cannot know).
    made = floats.init(*args, **kwargs)  # pyright: ignore[reportArgumentType]
    # The other managers' trained entries; the quantized weights made from the trained ones.
    made = {"model": made["model"], "managers": {
        name: variables["managers"].get(name, entries)
        for name, entries in made["managers"].items()}}
    if batches:
        made = _calibrated(floats, made, quantized, batches)

    model = _with_placeholders(made["model"], made["managers"][quantized.name])
    served_model = nnx.clone(program.model)
    state = nnx.state(served_model)
    nnx.replace_by_pure_dict(state, model)
    nnx.update(served_model, state)
    served = gm.compile(program.fn, served_model, managers=[
        _over(quantized, program, served_model), *kept],
        mesh=mesh, rules=rules, batch_axis=batch_axis)
    # Its layout and shapes, for checks, save and load (the examples hold no "rng").
    served.init(*args, **kwargs)  # pyright: ignore[reportArgumentType]
    return served, {"model": model, "managers": made["managers"]}


def _over(quantized: Quantized, program: gm.Program, copy: Model) -> Quantized:
    """``quantized`` for a copy of ``program``'s model: the brick instances its filter names
    replaced by the copy's at the same paths (itself if it names none)."""
    chosen = quantized.filter
    if not chosen.brick_instances():
        return quantized
    if any(not isinstance(a, str) and hasattr(a, "brick") for a in chosen.applications or ()):
        raise ValueError(
            f"managers.quantize: Quantized {quantized.name!r} names applications of brick "
            "instances; quantize compiles over a copy of the model, where they are not. Name "
            "the bricks (bricks=[...]) and the applications by name (applications=['apply'])")
    paths: dict[int, str] = {}
    for brick in chosen.brick_instances():
        path = program.layout.brick_path(brick)
        if path is None:
            raise ValueError(f"managers.quantize: Quantized {quantized.name!r} names a brick "
                             "that is not part of the program's model; name bricks of the "
                             "model")
        paths[id(brick)] = path
    bricks = tuple(b if isinstance(b, type) else _at(copy, paths[id(b)])
                   for b in chosen.bricks or ())
    return Quantized(quantized.dtype, group=quantized.group, activations=quantized.activations,
                     activation_dtype=quantized.activation_dtype,
                     percentile=quantized.percentile, extended=quantized.extended,
                     filter=dataclasses.replace(chosen, bricks=bricks),
                     priority=quantized.priority, manager_name=quantized.name,
                     strict=quantized.strict)


def _at(model: Model, path: str) -> nnx.Module:
    """The module at brick path ``path`` (``/layers/0``) of ``model``."""
    node: Any = model  # modules and their lists, as deep as the path
    for part in path.split("/"):
        if part:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _check_not_quantized(variables: Variables, kept: list[gm.Manager],
                         quantized: Quantized) -> None:
    """Raises naming the variable if ``variables`` already hold stored weights."""
    done = [m for m in kept if isinstance(m, Quantized)]
    stand_ins = [jax.tree_util.keystr(path, simple=True, separator=".") for path, leaf in
                 jax.tree_util.tree_flatten_with_path(variables["model"])[0]
                 if is_placeholder(leaf)]
    if done or quantized.name in variables.get("managers", {}) or stand_ins:
        named = f"model.{stand_ins[0]}" if stand_ins else "its weights"
        raise ValueError(
            f"managers.quantize: these variables are quantized already ({named} is stored "
            f"by manager {(done[0].name if done else quantized.name)!r}). Quantize the "
            "float program and its float variables instead (a weight is quantized once)")


def _calibration_batches(quantized: Quantized, data: Iterable[Batch] | None) -> list[Batch]:
    """``data`` as a list, checked against what ``quantized`` calibrates."""
    batches = [] if data is None else list(data)
    if quantized.activations in _STATISTICS and not batches:
        raise ValueError(
            f"managers.quantize: Quantized {quantized.name!r} calibrates its activations "
            f"({quantized.activations!r}): pass data=[batch, ...], a few batches of the "
            "program's arguments")
    if batches and quantized.activations not in _STATISTICS:
        raise ValueError(f"managers.quantize(data=...): Quantized {quantized.name!r} "
                         f"calibrates nothing (activations={quantized.activations!r})")
    return batches


def _calibrated(floats: gm.Program, variables: Variables, quantized: Quantized,
                batches: list[Batch]) -> Variables:
    """``variables`` with the activation ranges observed over all ``batches`` at once."""
    joined = jax.tree.map(lambda *parts: np.concatenate(parts), *batches)
    args, kwargs = ((), joined) if isinstance(joined, dict) else (
        (tuple(joined) if isinstance(joined, (tuple, list)) else (joined,)), {})
    _, observed = floats.train(variables, *args, rng=jax.random.key(0), **kwargs)
    owned = dict(variables["managers"])
    owned[quantized.name] = observed["managers"][quantized.name]
    return {"model": variables["model"], "managers": owned}


def _with_placeholders(model: Mapping[str, object],
                       stored: Mapping[str, Mapping[str, Mapping[str, jax.Array]]]
                       ) -> dict[str, Any]:
    """``model`` (a copy of its containers) with each weight ``stored`` holds replaced
    by a placeholder of its shape and dtype."""
    out = jax.tree.map(lambda leaf: leaf, model)
    for path, weights in stored.items():
        if path == "hparams":
            continue
        parent = _node(out, path)
        for name, entries in weights.items():
            if "q" not in entries:  # an application's activation ranges
                continue
            weight = parent[name]
            parent[name] = jnp.zeros((*jnp.shape(weight), 0), jnp.result_type(weight))
    return out


def stored_bytes(variables: Variables) -> int:
    """The bytes of every array in ``variables`` (what ``program.save`` writes, less its
    record).

    Examples:
        >>> import jax.numpy as jnp
        >>> stored_bytes({"model": {"w": jnp.zeros((4, 0))}, "managers": {"q": jnp.zeros(
        ...     8, jnp.int8)}})
        8
    """
    return sum(math.prod(jnp.shape(leaf)) * jnp.result_type(leaf).itemsize
               for leaf in jax.tree.leaves(variables))
