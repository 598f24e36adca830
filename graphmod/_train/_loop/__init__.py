"""The training loop: ``Loop`` runs a train step over data; plugins do everything around it.

Modules: ``_loop`` (the ``Loop`` class: settings, counters, the run's epochs and steps),
``_dispatch`` (plugins and the delivery of events to them), ``_steps`` (batches read ahead,
fused-step planning, step calls), ``_models`` (several named models on schedules, reading
each other's variables), ``_resume`` (continuing from a checkpoint).

Order of events
    ``begin``, then per epoch ``epoch_begin``, ``step`` events, ``epoch_end``; finally
    ``end`` (``interrupt`` instead when the run stops on an error or KeyboardInterrupt).
    Plugins receive an event in registration order, ``*_end`` and ``end`` in reverse
    (LIFO), higher ``priority`` first. Events a plugin fires are queued and dispatched
    after the current one; a ``terminate`` event stops the run after the current step.

Speed
    The hot loop never waits on the device: metrics stay on the device until a plugin that
    is due reads them, batches are put on an accelerator one step ahead (on the CPU, where
    the device is the host, jit takes the NumPy batch directly: faster than a put), and with
    ``steps_per_call=k`` up to k steps run in one ``lax.scan`` dispatch whenever no planned
    template is due inside them. Templates whose fields are schedules on the ``step``,
    ``epoch`` or ``examples`` timelines are planned exactly; catch-all plugins and schedules
    on wall-clock timelines see one ``step`` event per dispatch, covering its range.

Ctrl-C, SIGTERM
    In the main thread, Ctrl-C or SIGTERM (or a signal opted in with
    ``GRAPHMOD_STOP_SIGNALS``) only asks the run to stop: the loop finishes the step or
    event in progress, plugins get the ``interrupt`` event with the state of that finished
    step (a ``Checkpoint`` saves it, recording the stop, and says so), and ``run`` raises
    ``KeyboardInterrupt`` (a script then exits with status 130; 143 after SIGTERM). A second
    signal aborts at once, saving nothing more. See ``graphmod._train._interrupt``.
"""

from graphmod._train._loop._dispatch import Dispatch, DispatchTrace, PluginError
from graphmod._train._loop._loop import Loop

__all__ = ["Dispatch", "DispatchTrace", "Loop", "PluginError"]
