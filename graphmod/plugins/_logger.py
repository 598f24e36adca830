"""``Logger``: one row per due event (times on every timeline, metrics) to CSV or JSON lines.

Each run writes its own file: when the log file already holds another run's rows, a new run
writes to the next free name (``log-2.csv``, ``log-3.csv``, ...) and says so; a checkpointed
run that resumes appends to its own file, first cut back to the rows it had when saved
(``state_dict`` holds the file's name and row count), so a resumed run logs every step once.
A due event never waits on the device: its metrics start copying to the host and the row is
written once they are there (at a later due event, or when the run ends or saves a
checkpoint). With ``tensorboard=True`` TensorBoard scalars are written too, one run per log
file (``log.tensorboard/`` beside ``log.csv``); with ``wandb=True`` every row goes to a
Weights & Biases run as well, whose config holds the run's provenance.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO, TypeAlias

from graphmod._core._warn import warn
from graphmod._train._events import TIMELINES, Event, On, Template
from graphmod._train._host_metrics import copying, on_host, scalar_metrics
from graphmod._train._plugin import Plugin
from graphmod._train._schedule import each
from graphmod.plugins._common import event_metrics, metric_names, template_or
from graphmod.plugins._wandb import LogRow, WandbRun
from graphmod.typing import JSON, ArrayLike, LoopLike

if TYPE_CHECKING:  # tensorboardX is optional: imported at the first TensorBoard row
    from tensorboardX import SummaryWriter

_Row: TypeAlias = dict[str, float | str]  # a row of the log: see LogRow

_FORMATS = {".csv": "csv", ".jsonl": "jsonl"}


class Logger(Plugin):
    """Appends one row per due event: its type, its time on every timeline, its metrics.

    Metrics (an event's own when it was fired with some, such as a ``validated`` event's,
    else the latest step's) are written as Python floats; a one-dimensional metric of at
    most 64 values (``ActivationStats`` of a scan over layers or an ensemble: one per layer
    or member) as one column per index, ``name[0]``, ``name[1]``, ...; other non-scalar
    metrics and those the event lacks are left out (an empty CSV cell). A CSV file has a
    header; when a later row brings a new metric, the file is rewritten once with the wider
    header (earlier rows get empty cells). JSON lines hold one object per row. A row waits until
    its metrics have reached the host (the training is never held up for a log line), is
    flushed as written, and every row is on disk when the run ends or saves its state.

    Args:
        directory_or_path: a ``.csv`` or ``.jsonl`` file, or a directory to hold
            ``log.csv`` / ``log.jsonl`` (created when missing).
        format: ``"csv"`` or ``"jsonl"`` (default: from the file's suffix, else CSV).
        metrics: names of the metrics to log (default: every scalar metric).
        every: the events to log (default: every 100 steps).
        tensorboard: also write TensorBoard scalars, in ``<log file>.tensorboard/`` beside
            the log (needs ``tensorboardX``).
        wandb: also log to Weights & Biases (needs ``wandb``): True, or the keyword
            arguments of ``wandb.init`` (``{"project": "digits", "mode": "offline"}``;
            ``dir`` defaults to the log's directory). The run's provenance is its config
            (``config["provenance"]``, the final record at the end); a run resumed from a
            checkpoint continues its W&B run.
        log_checkpoints: with ``wandb``, give the checkpoints a ``Checkpoint`` of the loop
            kept of this run to W&B at the end, as versions of a ``model`` artifact
            (aliased ``step-N``).
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, tempfile, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Logger
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> log = Logger(tempfile.mkdtemp(), every=gm.On("epoch_end"), tensorboard=False)
        >>> state = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2,
        ...                 plugins=[log]).run(state)
        >>> print(open(log.path).read().splitlines()[0])
        event,step,epoch,examples,seconds,train_seconds,loss
        >>> log.rows
        2
    """

    def __init__(self, directory_or_path: str | os.PathLike, *, format: str | None = None,
                 metrics: Iterable[str] | None = None, every: Template | str | None = None,
                 tensorboard: bool = False,
                 wandb: bool | Mapping[str, Any] = False,  # wandb.init's arguments
                 log_checkpoints: bool = False, name: str = "logger") -> None:
        super().__init__(name=name,
                         every=template_or(every, On("step", step=each(100)), "Logger"))
        if format is not None and format not in ("csv", "jsonl"):
            raise ValueError(f"Logger(format={format!r}): must be 'csv' or 'jsonl'")
        try:
            location = os.fspath(directory_or_path)
        except TypeError:
            raise TypeError(f"Logger(directory_or_path): expected a path, got "
                            f"{directory_or_path!r}") from None
        suffix = os.path.splitext(location)[1].lower()
        if suffix in _FORMATS:
            if format is not None and format != _FORMATS[suffix]:
                raise ValueError(f"Logger({location!r}, format={format!r}): the file's suffix "
                                 f"says {_FORMATS[suffix]!r}; pass a matching path or format")
            self.format = _FORMATS[suffix]
            self.path = os.path.abspath(location)
        else:
            self.format = format or "csv"
            self.path = os.path.join(os.path.abspath(location), f"log.{self.format}")
        if isinstance(metrics, str):
            metrics = (metrics,)
        self.metrics = metric_names(metrics or (), "Logger(metrics=...)")
        if tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ImportError("Logger(tensorboard=True) needs tensorboardX: "
                              "pip install tensorboardX (or pass tensorboard=False)")
        self.tensorboard = bool(tensorboard)
        if not isinstance(wandb, bool | Mapping):
            raise TypeError(f"Logger(wandb={wandb!r}): pass True, or a dict of wandb.init "
                            "arguments such as {'project': 'digits'}")
        if log_checkpoints and not wandb:
            raise ValueError("Logger(log_checkpoints=True) gives checkpoints to Weights & "
                             "Biases: pass wandb=True (or wandb={...}) as well")
        self.wandb = (WandbRun({} if wandb is True else wandb, log_checkpoints) if wandb
                      else None)
        self.rows = 0  # rows in the file, earlier runs included
        self._keep: int | None = None  # rows to keep when resuming from a checkpoint
        self._opened = False  # whether this logger wrote its file already (then it appends)
        self._file: TextIO | None = None
        self._columns: list[str] = []
        self._writer: SummaryWriter | None = None
        self._pending: list[tuple[_Row, dict[str, ArrayLike]]] = []  # rows in transit

    # -- plugin protocol ------------------------------------------------------------------------
    def __call__(self, event: Event) -> None:
        self._pending.append(self._start(event))
        while self._pending and on_host(self._pending[0][1]):
            self.write(_finish(*self._pending.pop(0)))

    def setup(self, loop: LoopLike) -> None:
        if self.wandb is not None:
            self.wandb.start(os.path.dirname(self.path), loop)

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        try:
            self.close()
        finally:
            if self.wandb is not None:
                self.wandb.close(loop)

    def state_dict(self) -> dict[str, JSON]:
        self.flush()  # the row count a resumed run cuts back to includes every due event
        state: dict[str, JSON] = {"rows": self.rows, "file": os.path.basename(self.path)}
        if self.wandb is not None and self.wandb.id is not None:
            state["wandb_id"] = self.wandb.id
        return state

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        rows = state["rows"]
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise ValueError(f"Logger: the checkpoint's row count is {rows!r}, not a count; "
                             "was it written by a Logger?")
        self._keep = rows
        if self.wandb is not None and "wandb_id" in state:
            self.wandb.id = str(state["wandb_id"])  # the resumed run continues it
        if "file" in state:  # the run's own file, in this logger's directory
            file = str(state["file"])
            if os.path.basename(file) != file or not file.endswith(f".{self.format}"):
                raise ValueError(f"Logger: the checkpoint names log file {file!r}, not a "
                                 f".{self.format} file name; was it written by this Logger?")
            self.path = os.path.join(os.path.dirname(self.path), file)
        self.close()  # reopened (and cut back) at the next row

    # -- rows -----------------------------------------------------------------------------------
    def _start(self, event: Event) -> tuple[_Row, dict[str, ArrayLike]]:
        """The row's times, and its scalar metrics on their way to the host."""
        return ({"event": event.type, **event.time.to_dict()},
                copying(event_metrics(event), self.metrics, per_index=True))

    def flush(self) -> None:
        """Writes the rows whose metrics are still on their way (waits for the device)."""
        while self._pending:
            self.write(_finish(*self._pending.pop(0)))

    def write(self, row: LogRow) -> None:
        """Appends ``row`` to the log (and TensorBoard) and flushes it."""
        if self._file is None:
            self._open()
        assert self._file is not None
        if self.format == "jsonl":
            self._file.write(json.dumps(row) + "\n")
        else:
            new = [k for k in row if k not in self._columns]
            if new and self.rows:
                self._widen(new)
            elif new:
                self._columns += new
                self._file.write(_csv_line(self._columns))
            self._file.write(_csv_line([row.get(k, "") for k in self._columns]))
        self._file.flush()
        self.rows += 1
        if self.tensorboard:
            self._tensorboard(row)
        if self.wandb is not None:
            self.wandb.log(row)

    def close(self) -> None:
        """Writes every pending row and closes the log (the next row reopens it)."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- files ----------------------------------------------------------------------------------
    def _open(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if not self._opened and self._keep is None:  # a new run: never into another's log
            self.path = _free_path(self.path)
        self._opened = True
        lines = _read_lines(self.path)
        header = 1 if self.format == "csv" and lines else 0
        if self._keep is not None and len(lines) - header > self._keep:
            lines = lines[:header + self._keep]
            _write_lines(self.path, lines)
        self._keep = None
        self._columns = next(csv.reader(lines[:1])) if header else []
        self.rows = len(lines) - header
        self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115

    def _widen(self, new: list[str]) -> None:
        """Rewrites the CSV file with ``new`` columns added to its header."""
        assert self._file is not None
        self._file.close()
        lines = _read_lines(self.path)
        self._columns += new
        body = [line.rstrip("\r\n") + "," * len(new) + "\n" for line in lines[1:]]
        _write_lines(self.path, [_csv_line(self._columns), *body])
        self._file = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115

    def _tensorboard(self, row: LogRow) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=os.path.splitext(self.path)[0] + ".tensorboard")
        for key, value in row.items():
            if key != "event" and key not in TIMELINES:
                self._writer.add_scalar(key, value, global_step=int(row["step"]))
        self._writer.flush()


def _free_path(path: str) -> str:
    """``path``, or when it holds rows already, the first free ``<stem>-N<suffix>`` (with a
    warning naming both)."""
    if not _read_lines(path):
        return path
    stem, suffix = os.path.splitext(path)
    number = 2
    while _read_lines(f"{stem}-{number}{suffix}"):
        number += 1
    free = f"{stem}-{number}{suffix}"
    warn(f"Logger: {path} holds another run's rows; this run logs to {free}")
    return free


def _finish(head: _Row, metrics: dict[str, ArrayLike]) -> _Row:
    return {**head, **scalar_metrics(metrics, per_index=True)}


def _csv_line(values: list[float | str] | list[str]) -> str:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(values)
    return text.getvalue()


def _read_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return [line if line.endswith("\n") else line + "\n" for line in f]


def _write_lines(path: str, lines: list[str]) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8", newline="") as f:
        f.writelines(lines)
    os.replace(temporary, path)
