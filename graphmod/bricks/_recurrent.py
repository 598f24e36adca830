"""Recurrent bricks: ``SimpleRecurrent`` and ``LSTM``, one step an application, scanned.

Each brick has a per-step application (``step``) and an ``apply`` application that runs
``step`` over the time axis with :func:`graphmod.scan`. Because the step is an application
called inside the scan body, managers rewrite it at every time step: a dropout mask on the
step's input differs per step (``per_step=False`` shares one), batch-norm statistics of the
step's output update once per step in call order and leave the scan in its carry, and
monitored values come back stacked along a leading time axis.

Layout: ``apply`` takes batch-major inputs ``[batch, time, features]`` and returns every
hidden state ``[batch, time, hidden]``; the scan itself runs time-major.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from graphmod import roles
from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod._core._loops._scan import scan
from graphmod._core._tracing._call import ApplicationCall
from graphmod._core._tracing._variables import Bias, Weight
from graphmod.bricks._checks import check_sizes
from graphmod.typing import ArrayLike


def _check_inputs(owner: str, inputs: ArrayLike, in_features: int) -> tuple[int, int]:
    """``(batch, time)`` of batch-major ``inputs``; raises naming the shape otherwise."""
    shape = jnp.shape(inputs)
    if len(shape) != 3 or shape[-1] != in_features:
        raise ValueError(
            f"{owner}.apply: inputs of shape {shape} must be [batch, time, in_features="
            f"{in_features}] (batch-major; add a batch axis with inputs[None])"
        )
    return shape[0], shape[1]


def _initial(owner: str, argument: str, value: ArrayLike | None, batch: int, hidden: int,
             dtype: DTypeLike, call: ApplicationCall) -> jax.Array:
    """The given initial state (checked, cast to ``dtype``) or zeros, tagged
    ``INITIAL_STATE``."""
    if value is None:
        value = jnp.zeros((batch, hidden), dtype)
    elif jnp.shape(value) != (batch, hidden):
        raise ValueError(f"{owner}.apply: {argument} of shape {jnp.shape(value)} must be "
                         f"[batch, hidden] = {(batch, hidden)}")
    value = jnp.asarray(value, dtype)
    return call.add_auxiliary_variable(value, roles=[roles.INITIAL_STATE], name=argument)


def _carry_dtype(inputs: jax.Array, *weights: nnx.Variable) -> np.dtype:
    """The dtype of the scan carry: the inputs' and stored weights' (read without a tag)."""
    return jnp.result_type(inputs, *(w.get_raw_value() for w in weights))


class SimpleRecurrent(Brick):
    """The simple (Elman) recurrent network: ``h_t = activation(x_t @ W + h_{t-1} @ U + b)``.

    ``step(input_, state)`` computes one step (an application: managers rewrite it at every
    time step); ``apply(inputs, initial_state=None)`` scans it over axis 1 of batch-major
    ``inputs`` ``[batch, time, in_features]`` from ``initial_state`` (zeros by default;
    tagged ``INITIAL_STATE``) and returns every state ``[batch, time, hidden_features]``.
    It computes what ``flax.nnx.SimpleCell`` does, with ``W``, ``U`` and ``b`` for its
    ``dense_i.kernel``, ``dense_h.kernel`` and ``dense_i.bias``.

    Args:
        in_features: size of each step's input.
        hidden_features: size of the state.
        activation: the nonlinearity (default ``tanh``).
        kernel_init, recurrent_kernel_init, bias_init: initializers of ``W`` (Lecun
            normal), ``U`` (orthogonal) and ``b`` (zeros).
        rngs: NNX random streams (``params`` is used).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> rnn = gm.bricks.SimpleRecurrent(3, 5, rngs=nnx.Rngs(0))
        >>> rnn(jnp.ones((2, 7, 3))).shape, rnn.U.shape
        ((2, 7, 5), (5, 5))
        >>> rnn.step(jnp.ones((2, 3)), jnp.zeros((2, 5))).shape
        (2, 5)
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        activation: Callable[[jax.Array], jax.Array] = jnp.tanh,
        kernel_init: Callable = nnx.initializers.lecun_normal(),
        recurrent_kernel_init: Callable = nnx.initializers.orthogonal(),
        bias_init: Callable = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("SimpleRecurrent", in_features=in_features,
                     hidden_features=hidden_features)
        if not callable(activation):
            raise TypeError(f"SimpleRecurrent(activation={activation!r}): must be callable")
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.activation = activation
        self.W = Weight(kernel_init(rngs.params(), (in_features, hidden_features)))
        self.U = Weight(recurrent_kernel_init(rngs.params(), (hidden_features, hidden_features)))
        self.b = Bias(bias_init(rngs.params(), (hidden_features,)))

    @application(inputs=["input_", "state"], outputs=["new_state"])
    def step(self, input_: jax.Array, state: jax.Array) -> jax.Array:
        return self.activation(input_ @ self.W[...] + state @ self.U[...] + self.b[...])

    @application(inputs=["inputs"], outputs=["states"])
    def apply(self, inputs: jax.Array, initial_state: jax.Array | None = None, *,
              application_call: ApplicationCall) -> jax.Array:
        batch, _ = _check_inputs("SimpleRecurrent", inputs, self.in_features)
        dtype = _carry_dtype(inputs, self.W, self.U, self.b)
        state = _initial("SimpleRecurrent", "initial_state", initial_state, batch,
                         self.hidden_features, dtype, application_call)

        def body(state: jax.Array, input_: jax.Array) -> tuple[jax.Array, jax.Array]:
            # The cast keeps the carry's dtype if a manager changed the step's precision.
            new_state = self.step(input_, state).astype(dtype)
            return new_state, new_state

        _, states = scan(body, state, jnp.swapaxes(inputs, 0, 1))
        return jnp.swapaxes(states, 0, 1)


class LSTM(Brick):
    """Long short-term memory (Hochreiter & Schmidhuber), with the gates of
    ``flax.nnx.LSTMCell``.

    One step: ``z = x_t @ W + h_{t-1} @ U + b`` split into input, forget, cell and output
    parts ``i, f, g, o`` (in that order along the last axis); ``c_t = sigmoid(f) * c_{t-1} +
    sigmoid(i) * tanh(g)``, ``h_t = sigmoid(o) * tanh(c_t)``. ``W`` is ``(in, 4 * hidden)``,
    ``U`` is ``(hidden, 4 * hidden)``, ``b`` is ``(4 * hidden,)``.

    ``step(input_, state, cell)`` returns ``(new_state, new_cell)``; ``apply(inputs,
    initial_state=None, initial_cell=None)`` scans it over axis 1 of ``[batch, time,
    in_features]`` and returns every hidden state ``[batch, time, hidden_features]``.

    Args:
        in_features: size of each step's input.
        hidden_features: size of the hidden state and of the cell.
        kernel_init, recurrent_kernel_init, bias_init: initializers of ``W``, ``U``, ``b``.
        rngs: NNX random streams (``params`` is used).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> lstm = gm.bricks.LSTM(3, 4, rngs=nnx.Rngs(0))
        >>> lstm(jnp.ones((2, 6, 3))).shape, lstm.W.shape, lstm.U.shape
        ((2, 6, 4), (3, 16), (4, 16))
        >>> state, cell = lstm.step(jnp.ones((2, 3)), jnp.zeros((2, 4)), jnp.zeros((2, 4)))
        >>> state.shape, cell.shape
        ((2, 4), (2, 4))
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        kernel_init: Callable = nnx.initializers.lecun_normal(),
        recurrent_kernel_init: Callable = nnx.initializers.orthogonal(),
        bias_init: Callable = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("LSTM", in_features=in_features, hidden_features=hidden_features)
        self.in_features = in_features
        self.hidden_features = hidden_features
        gates = 4 * hidden_features
        # One initializer call per gate, so U's blocks are each orthogonal (as Flax).
        self.W = Weight(jnp.concatenate(
            [kernel_init(rngs.params(), (in_features, hidden_features)) for _ in range(4)],
            axis=1))
        self.U = Weight(jnp.concatenate(
            [recurrent_kernel_init(rngs.params(), (hidden_features, hidden_features))
             for _ in range(4)], axis=1))
        self.b = Bias(bias_init(rngs.params(), (gates,)))

    @application(inputs=["input_", "state", "cell"], outputs=["new_state", "new_cell"])
    def step(self, input_: jax.Array, state: jax.Array, cell: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
        z = input_ @ self.W[...] + state @ self.U[...] + self.b[...]
        i, f, g, o = jnp.split(z, 4, axis=-1)
        new_cell = jax.nn.sigmoid(f) * cell + jax.nn.sigmoid(i) * jnp.tanh(g)
        new_state = jax.nn.sigmoid(o) * jnp.tanh(new_cell)
        return new_state, new_cell

    @application(inputs=["inputs"], outputs=["states"])
    def apply(self, inputs: jax.Array, initial_state: jax.Array | None = None,
              initial_cell: jax.Array | None = None, *,
              application_call: ApplicationCall) -> jax.Array:
        batch, _ = _check_inputs("LSTM", inputs, self.in_features)
        dtype = _carry_dtype(inputs, self.W, self.U, self.b)
        state = _initial("LSTM", "initial_state", initial_state, batch,
                         self.hidden_features, dtype, application_call)
        cell = _initial("LSTM", "initial_cell", initial_cell, batch,
                        self.hidden_features, dtype, application_call)

        def body(carry: tuple[jax.Array, jax.Array], input_: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
            new_state, new_cell = self.step(input_, *carry)
            new_state, new_cell = new_state.astype(dtype), new_cell.astype(dtype)
            return (new_state, new_cell), new_state

        _, states = scan(body, (state, cell), jnp.swapaxes(inputs, 0, 1))
        return jnp.swapaxes(states, 0, 1)
