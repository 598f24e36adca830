"""rebuild's allow list names constructors and pure functions explicitly: a record naming a
registration, configuration, I/O, process, cache or monitoring function is refused, naming
the field, the name and how to allow a name of one's own, with nothing touched on disk; an
``allow=`` that is not an exact name is refused naming the entry and the fix."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod.provenance import RebuildError
from tests.safety.catalogue import Case, check_refused

ROOT = pathlib.Path(__file__).parents[2]
WHERE = "bricks['/'].arguments.layers[1]"  # the activation between the two layers
OWN = r"of your own is allowed by its exact name: allow=\['{}'\]"


def _record() -> dict[str, Any]:
    """A program record of Linear, relu, Linear, as a dict."""
    rngs = nnx.Rngs(0)
    model = gm.bricks.Sequence(gm.bricks.Linear(3, 4, rngs=rngs), jax.nn.relu,
                               gm.bricks.Linear(4, 2, rngs=rngs))
    program = gm.compile(lambda m, x: m(x).sum(), model)
    program.init(np.ones((2, 3), np.float32))
    return program.provenance.to_dict()


RECORD = _record()


def _with(activation: dict[str, Any]) -> gm.Provenance:
    """The record with ``activation`` in place of relu."""
    record = json.loads(json.dumps(RECORD))
    record["inputs"]["bricks"]["/"]["arguments"]["layers"][1] = activation
    return gm.Provenance.from_dict(record)


def _callable(path: str) -> dict[str, Any]:
    return {"$callable": path}


def _partial(path: str, *args: Any) -> dict[str, Any]:
    return {"$partial": {"function": {"$callable": path}, "args": list(args), "kwargs": {}}}


def _run(activation: Callable[[pathlib.Path], dict[str, Any]], allow: list[str] | None = None,
         *, run: bool = True) -> Callable[[pathlib.Path], Any]:
    """A case's call: rebuild the record, then run the model as its user would (so a file
    the record reaches under ``root`` would be written, read or removed); with
    ``run=False`` only rebuild (what would run reconfigures this very process)."""
    def call(root: pathlib.Path) -> Any:
        again = gm.rebuild(_with(activation(root)), allow=allow or [])
        return again.model(np.ones((2, 3), np.float32)) if run else again
    return call


def _unlisted(name: str, *, where: str = WHERE) -> str:
    """The refusal of ``name``, not on the default list, at ``where``."""
    return (rf"^rebuild: {re.escape(where)} names '{re.escape(name)}', which is not on "
            r"rebuild's allow list.*nothing was imported.*" + OWN.format(re.escape(name)))


def _not_a_class(name: str, package: str) -> str:
    """The refusal of the function ``name`` of a ``package`` the caller named."""
    return (rf"^rebuild: {re.escape(WHERE)}\.function names '{re.escape(name)}', which is "
            rf"not a class: allow=\['{package}'\] admits only the classes defined in "
            rf"{package}; nothing was imported.*" + OWN.format(re.escape(name)))


def _allow(entry: str, fix: str) -> Case:
    """An ``allow=`` entry that is not an exact public name of a class or function."""
    return Case(f"allow {entry}", lambda root: gm.rebuild(_with(_callable("jax.nn.relu")),
                                                          allow=[entry]), ValueError,
                rf"^rebuild\(allow=\[{re.escape(repr(entry))}\]\): .*{fix}")


CACHE = "jax.experimental.compilation_cache.compilation_cache.set_cache_dir"
LISTENER = "jax.monitoring.register_event_listener"
CASES: list[Case] = [
    # registration, configuration, cache and monitoring under the default list
    Case("register_event_listener", _run(lambda root: _callable(LISTENER), run=False),
         RebuildError, _unlisted(LISTENER)),
    Case("clear_caches", _run(lambda root: _callable("jax.clear_caches"), run=False),
         RebuildError, _unlisted("jax.clear_caches")),
    Case("set_cache_dir", _run(lambda root: _partial(CACHE, str(root / "cache"))),
         RebuildError, _unlisted(CACHE, where=f"{WHERE}.function")),
    Case("config update", _run(lambda root: _partial("jax.config.update", "jax_enable_x64"),
                               run=False),
         RebuildError, _unlisted("jax.config.update", where=f"{WHERE}.function")),
    Case("profiler start_trace", _run(lambda root: _partial("jax.profiler.start_trace",
                                                            str(root / "trace"))),
         RebuildError, _unlisted("jax.profiler.start_trace", where=f"{WHERE}.function")),
    Case("jax.numpy.load", _run(lambda root: _partial("jax.numpy.load", str(root / "x.npy"))),
         RebuildError, _unlisted("jax.numpy.load", where=f"{WHERE}.function")),
    # file readers and writers of a package the caller named: its functions stay refused
    Case("numpy.savetxt with allow=['numpy']", _run(
        lambda root: _partial("numpy.savetxt", str(root / "written.txt")), ["numpy"]),
        RebuildError, _not_a_class("numpy.savetxt", "numpy")),
    Case("numpy.loadtxt with allow=['numpy']", _run(
        lambda root: _partial("numpy.loadtxt", str(root / "data.txt")), ["numpy"]),
        RebuildError, _not_a_class("numpy.loadtxt", "numpy")),
    Case("numpy.genfromtxt with allow=['numpy']", _run(
        lambda root: _partial("numpy.genfromtxt", str(root / "data.txt")), ["numpy"]),
        RebuildError, _not_a_class("numpy.genfromtxt", "numpy")),
    # the process and the interpreter
    Case("os.remove with allow=['os']", _run(
        lambda root: _partial("os.remove", str(root / "victim.txt")), ["os"]), RebuildError,
        _not_a_class("os.remove", "os")),
    Case("os.system called", _run(lambda root: {"$call": {
        "function": "os.system", "kwargs": {"command": f"touch {root / 'pwned'}"}}}, ["os"]),
        RebuildError, rf"^rebuild: {re.escape(WHERE)} calls 'os\.system', which is not a "
        r"factory.*nothing was imported.*allow_factories=\['os\.system'\]"),
    Case("subprocess.run", _run(lambda root: _partial("subprocess.run", ["touch",
                                                                         str(root / "pwned")])),
         RebuildError, _unlisted("subprocess.run", where=f"{WHERE}.function")),
    Case("builtins.open with allow=['builtins']", _run(
        lambda root: _partial("builtins.open", str(root / "opened.txt"), "w"), ["builtins"]),
        RebuildError, _not_a_class("builtins.open", "builtins")),
    Case("builtins.eval", _run(lambda root: _callable("builtins.eval")), RebuildError,
         _unlisted("builtins.eval")),
    Case("builtins.exec", _run(lambda root: _partial(
        "builtins.exec", f"open({str(root / 'pwned')!r}, 'w')")), RebuildError,
        _unlisted("builtins.exec", where=f"{WHERE}.function")),
    Case("a name with a private part", _run(lambda root: _partial(
        "jax._src.config.update", "jax_enable_x64"), run=False),
         RebuildError, rf"^rebuild: {re.escape(WHERE)}\.function names "
         r"'jax\._src\.config\.update', whose part '_src' is private.*"
         + OWN.format(r"mypackage\.layers\.Scaled")),
    # allow= entries that are not exact names
    _allow("numpy.*", r"expected exact dotted names of your classes or functions, e\.g\. "
                      r"'mypackage\.layers\.Scaled', or a top-level package name"),
    _allow("jax", r"allowed through graphmod's explicit list.*never as a whole package; "
                  r"name what else you need exactly"),
    _allow("tests.safety", r"it is a module, not a class or a function; name each exactly"),
    _allow("graphmod.bricks._linear.Linear", r"its part '_linear' is private; name a public "
                                             r"class or function"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_record_naming_what_is_not_listed_is_refused(case: Case,
                                                       tmp_path: pathlib.Path) -> None:
    (tmp_path / "victim.txt").write_text("kept\n")
    (tmp_path / "data.txt").write_text("1 2\n3 4\n")
    check_refused(case, tmp_path)


def test_after_a_refused_listener_a_later_jit_still_works(tmp_path: pathlib.Path) -> None:
    """The issue's record: an event listener as an activation broke every later jax.jit."""
    (tmp_path / "record.json").write_text(_with(_callable(LISTENER)).to_json())
    script = (
        "import sys, jax, numpy as np, graphmod as gm\n"
        "record = gm.provenance.read(sys.argv[1])\n"
        "try:\n"
        "    again = gm.rebuild(record)\n"
        "except gm.provenance.RebuildError:\n"
        "    print('refused')\n"
        "else:  # what its user does next\n"
        "    try:\n"
        "        again.compile(lambda m, x: m(x).sum()).init(np.ones((2, 3), np.float32))\n"
        "    except Exception as error:\n"
        "        print('init failed:', type(error).__name__)\n"
        "print('jit:', int(jax.jit(lambda x: x + 1)(1)))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "record.json")],
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (0, "refused\njit: 2\n"), done.stderr[-2000:]
