"""Checkpoints of a run: the train state's arrays (orbax), verified, and a JSON record.

Modules: ``_format`` (what a checkpoint holds and what verifies it; no I/O), ``_reader``
(listing, reading and verifying through orbax), ``_writer`` (asynchronous saves and
pruning), ``_lock`` (the writer's lock of a run directory), ``_parts`` (the file one process
writes in a run of several), ``_errors`` (``CheckpointError``, plain reasons, orbax's log
kept out of the terminal).

**Layout.** A checkpoint directory holds one sub-directory per saved step, ``<step>/``,
written by orbax: ``state`` (the train state's leaves as a flat list of host arrays, PRNG
keys as their key data; empty arrays live in the record only) and ``meta`` (JSON: the
format, the id of the run that wrote it, the step, each leaf's path, shape, dtype and
checksum, loop counters and timelines, data position, plugin states, and the provenance
record when there is one), and graphmod's marker ``graphmod-checkpoint.json`` (the run id and
the step). Orbax writes into ``<step>.orbax-checkpoint-tmp-<run id>``, graphmod adds the
marker and renames it to ``<step>`` when complete, so a save cut off half-way leaves the
earlier checkpoints intact; such a leftover is an incomplete write, never read.

**Recognition.** A checkpoint is a folder named ``str(step)`` (no leading zeros) holding the
marker of that step, neither of them a link (nor anything inside it: a link fails
verification). Checkpoints written before markers (graphmod until 2026-12) are recognised by
their own meta record instead, which names the step and the run (graphmod 0.1's: its
counters' step), and are never rewritten. Anything else named like a checkpoint or a leftover (a
numbered folder of the user's, ``00095``, a link, a file) is *foreign*: listed
(``CheckpointReader.foreign``, ``graphmod inspect``), never read, moved or deleted; a run
refuses to start among such entries (``graphmod.plugins.Checkpoint``).

**One writer.** The ``Checkpoint`` plugin locks the run directory from its setup to its
teardown (``_lock``: ``fcntl.flock`` on ``graphmod.lock``, which names the holder's process
and host; the OS lets go when the process ends, however it ends); a second writer is
refused at its setup. Reading takes no lock.

**Several processes.** In a run of several processes (:mod:`graphmod.distributed`) no
process gathers the state: each writes the chunks its devices hold (of each array split
over processes, the shards whose first copy is on its devices; process 0 also what every
process holds whole) as one file, ``<step>.graphmod-part-<run id>-<process>.npz``
(``_parts``), and waits at a barrier of JAX's coordination service. Process 0 then reads
the parts' chunk lists, writes ``meta`` (format 3: each array's chunks with the process
that wrote each and its checksum) into ``<step>.graphmod-part-<run id>-whole``, moves the
parts in as ``part-<process>.npz`` and renames the whole to ``<step>``: a checkpoint
appears complete or not at all, and a part left by a cut-off run is a leftover. Reading
puts the chunks together, checking that they tile each array exactly and each one's
checksum (``_chunks``), so a checkpoint of any number of processes restores in any other.
Restored in several processes, each reads only the chunks overlapping what its devices
hold of the template state, and the processes agree on whether a checkpoint verifies
before any of them uses it (one that fails in any process is skipped by all).

**Verification.** Every array's checksum (CRC-32; what it guarantees, accidental
corruption and not tampering, in ``_format``) is computed on the host copy a save makes
anyway, off the training thread, and checked on restore along with its shape and dtype; so
are the meta record's step and run id (against the folder and the marker) and a loop's
counters (types and ranges).

**Ownership.** Each writer has a run id (random, made when a run starts writing; a resumed
run continues its id) and prunes only the checkpoints of its own run, by their markers
(``keep``), oldest write first, once a newer write is complete. It never replaces a step
another run wrote; a step directory that fails verification (one a resumed run skipped) is
renamed to ``<step>.unverified`` when its step is written again, never deleted.
``overwrite=True`` deletes another run's checkpoints only where they verify (the others are
set aside so), and nothing else.

**Errors.** A checkpoint that cannot be read or verified raises :class:`CheckpointError`
naming its path and the reason; orbax's own log messages and tracebacks go to the
``graphmod.checkpoint`` logger at debug level, not to the terminal.
"""

from graphmod._train._checkpoint._errors import CheckpointError
from graphmod._train._checkpoint._reader import CheckpointReader
from graphmod._train._checkpoint._writer import Checkpointer

__all__ = ["CheckpointError", "CheckpointReader", "Checkpointer"]
