"""graphmod resume runs only a script the user recognises; what it and inspect print from a
record is escaped for the terminal.

The catalogue's world (``_world``): ``root/work`` is the directory ``graphmod resume`` runs
from and holds the user's ``train.py``, the run directory ``runs/x``, copies of Python
installations' files (``timeit.py`` runs its ``-s`` argument) and a script elsewhere; each
case writes a checkpoint recording a crafted command in ``runs/x`` and resumes it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import pytest

from graphmod._cli import _parser, inspect_run, main, terminal_safe
from graphmod._records._record import Provenance
from graphmod._train._checkpoint import Checkpointer
from graphmod._train._command import ResumeRefusedError, resume_command, script_sha256
from tests.safety.catalogue import Case, check_refused

ROOT = pathlib.Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
RAW = ("\x1b", "\x07", "\x9b", "\x00", "\x7f", "\r")  # what a terminal would act on
HEX = "[0-9a-f]{64}"
LOOP_RESUME = r"graphmod\.Loop\.resume\("  # the fix where no script can be run
LOOP = {"epochs": None, "steps": None, "steps_per_call": 1}  # a loop's limits, none reached


def _world(root: pathlib.Path) -> pathlib.Path:
    """The files of the catalogue's world under ``root``; returns the working directory."""
    work = root / "work"
    files = {
        "work/train.py": "print('the user script')\n",
        "work/other.py": "print('another script')\n",
        "outside/train.py": "print('a script outside the working directory')\n",
        "work/opt/python3.8/lib/python3.8/timeit.py": pathlib.Path(timeit.__file__).read_text(),
        "work/vendor/site-packages/tool.py": "",
        "work/stdlib/os.py": "", "work/stdlib/site.py": "", "work/stdlib/timeit.py": "",
        "work/venv/pyvenv.cfg": "home = /usr/bin\n", "work/venv/bin/pip.py": "",
        "work/runs/x/evil.py": "print('shipped with the checkpoints')\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (work / "link.py").symlink_to(root / "outside" / "train.py")
    (work / "runs" / "x" / "train.py").symlink_to(work / "train.py")
    return work


def _checkpoint(directory: pathlib.Path, command: Any, **meta: Any) -> pathlib.Path:
    """A real checkpoint in ``directory`` whose meta records ``command`` (and ``meta``)."""
    writer = Checkpointer(directory, keep=None)
    writer.save(5, {"w": jnp.ones(3)}, {"command": command, "time": {"step": 5}, "position": 0,
                                        "loop": LOOP, **meta})
    writer.wait()
    writer.close()
    return directory


def _record(script: pathlib.Path, *args: str, cwd: pathlib.Path | None = None,
            sha256: Any = "file") -> dict[str, Any]:
    """A script record as ``recorded_command`` makes one; ``sha256="file"``: the file's hash
    (a crafted record can hold it as well as an honest one), None: no hash."""
    record = {"kind": "script", "script": str(script), "args": list(args),
              "argv": [str(script), *args], "cwd": str(cwd or script.parent)}
    if sha256 is not None:
        record["script_sha256"] = script_sha256(script) if sha256 == "file" else sha256
    return record


@dataclasses.dataclass(frozen=True)
class _Resume:
    """``graphmod resume work/runs/x [FLAGS]`` run in ``root/work``, whose checkpoint
    records ``record(root)``; ``os.execve`` is replaced by the test, so nothing runs."""

    record: Callable[[pathlib.Path], Any]
    flags: Callable[[pathlib.Path], Sequence[str]] = lambda root: ()

    def __call__(self, root: pathlib.Path) -> int:
        args = _parser().parse_args(["resume", str(root / "work" / "runs" / "x"),
                                     *self.flags(root)])
        return args.handler(args)


def _case(id: str, pattern: str, record: Callable[[pathlib.Path], Any],
          flags: Callable[[pathlib.Path], Sequence[str]] = lambda root: ()) -> Case:
    return Case(id, _Resume(record, flags), ResumeRefusedError, pattern)


TIMEIT_38 = "work/opt/python3.8/lib/python3.8/timeit.py"
CODE = "import pathlib; pathlib.Path('pwned').touch()"

CASES: list[Case] = [
    _case("another installation's timeit.py with -s",
          rf"timeit\.py', which belongs to a Python installation \(\S*/lib/python3\.8\)"
          rf".*{LOOP_RESUME}",
          lambda root: _record(root / TIMEIT_38, "-s", CODE, cwd=root / "work")),
    _case("this interpreter's timeit.py with -s",
          rf"timeit\.py', which belongs to a Python installation.*{LOOP_RESUME}",
          lambda root: _record(pathlib.Path(timeit.__file__), "-s", CODE, cwd=root / "work")),
    _case("a file under a site-packages folder",
          rf"tool\.py', which belongs to a Python installation \(\S*/site-packages\)"
          rf".*{LOOP_RESUME}",
          lambda root: _record(root / "work/vendor/site-packages/tool.py")),
    _case("a file of a folder holding a standard library",
          rf"stdlib/timeit\.py', which belongs to a Python installation \(\S*/stdlib\)"
          rf".*{LOOP_RESUME}",
          lambda root: _record(root / "work/stdlib/timeit.py")),
    _case("a script of a virtual environment",
          rf"pip\.py', which belongs to a Python installation \(\S*/venv/bin\).*{LOOP_RESUME}",
          lambda root: _record(root / "work/venv/bin/pip.py")),
    _case("a script outside the working directory",
          rf"outside/train\.py'.*outside the directory graphmod resume runs from \(\S*/work\)"
          rf".*recorded sha256: {HEX}, the file's sha256: {HEX}.*from the directory that "
          r"holds your script.*--script \S*/outside/train\.py",
          lambda root: _record(root / "outside/train.py", cwd=root / "work")),
    _case("a crafted cwd holding the script",
          r"outside/train\.py'.*outside the directory graphmod resume runs from.*--script",
          lambda root: _record(root / "outside/train.py", cwd=root / "outside")),
    _case("a symlinked script leading outside",
          r"link\.py', which resolves to \S*/outside/train\.py, outside the directory "
          r"graphmod resume runs from.*--script",
          lambda root: _record(root / "work/link.py")),
    _case("a script in the run directory",
          rf"runs/x/evil\.py', which lies inside the run directory.*{LOOP_RESUME}",
          lambda root: _record(root / "work/runs/x/evil.py", cwd=root / "work")),
    _case("a link in the run directory to the user's script",
          rf"runs/x/train\.py', which lies inside the run directory.*{LOOP_RESUME}",
          lambda root: _record(root / "work/runs/x/train.py", cwd=root / "work")),
    _case("a changed script (hash differs)",
          rf"work/train\.py', whose content changed since the run started; recorded sha256: "
          rf"0{{64}}, the file's sha256: {HEX}.*--script \S*/work/train\.py",
          lambda root: _record(root / "work/train.py", sha256="0" * 64)),
    _case("a record without a hash",
          rf"work/train\.py', but no hash of it.*recorded sha256: none, the file's sha256: "
          rf"{HEX}.*--script \S*/work/train\.py",
          lambda root: _record(root / "work/train.py", sha256=None)),
    _case("a hash that is no string",
          r"work/train\.py', but no hash of it.*--script",
          lambda root: _record(root / "work/train.py", sha256=["0" * 64])),
    _case("an old-format record (no hash)",
          r"work/train\.py', but no hash of it.*--script",
          lambda root: {"argv": ["train.py", "--lr", "1"], "cwd": str(root / "work")}),
    _case("--script naming another file",
          rf"--script names '\S*/other\.py' \(\S*/other\.py, sha256: {HEX}\), which is not the "
          r"script \S*/runs/x recorded \('\S*/work/train\.py', sha256: [0-9a-f]{64}\).*name the "
          r"recorded script",
          lambda root: _record(root / "work/train.py"),
          lambda root: ["--script", str(root / "work/other.py")]),
    _case("--script naming an installation file",
          rf"--script names '\S*timeit\.py', which belongs to a Python installation"
          rf".*{LOOP_RESUME}",
          lambda root: _record(root / TIMEIT_38, "-s", CODE),
          lambda root: ["--script", str(root / TIMEIT_38)]),
    _case("--script naming this interpreter's file",
          r"--script names '\S*timeit\.py', which belongs to a Python installation",
          lambda root: _record(root / "work/train.py"),
          lambda root: ["--script", timeit.__file__]),
    _case("--script naming a file in the run directory",
          r"--script names '\S*runs/x/evil\.py', which lies inside the run directory",
          lambda root: _record(root / "work/runs/x/evil.py"),
          lambda root: ["--script", str(root / "work/runs/x/evil.py")]),
    _case("--script naming no file",
          r"--script names '\S*/gone\.py', which is not an existing file",
          lambda root: _record(root / "work/train.py"),
          lambda root: ["--script", str(root / "work/gone.py")]),
]


@pytest.fixture
def no_exec(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Records os.execve calls instead of replacing the test process."""
    calls: list[tuple] = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    return calls


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_resume_refuses(case: Case, tmp_path: pathlib.Path, no_exec: list[tuple],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    work = _world(tmp_path)
    _checkpoint(work / "runs" / "x", case.call.record(tmp_path))
    monkeypatch.chdir(work)
    check_refused(case, tmp_path)
    assert no_exec == [] and pathlib.Path.cwd() == work


def _graphmod(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphmod._cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", [TIMEIT_38, "outside/train.py"])
def test_the_crafted_code_does_not_run(script: str, tmp_path: pathlib.Path) -> None:
    work = _world(tmp_path)
    (tmp_path / "outside/train.py").write_text(CODE + "\n")
    run = _checkpoint(work / "runs/x", _record(tmp_path / script, "-n", "1", "-s", CODE,
                                               cwd=work))
    done = _graphmod("resume", str(run), cwd=work)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert not (work / "pwned").exists()


# A run that records its command as a loop's checkpoint does, and says when it is resumed.
RUN = """
import json, os, pathlib, sys
import jax.numpy as jnp
from graphmod._train._checkpoint import Checkpointer
from graphmod._train._command import recorded_command
if os.environ.get("GRAPHMOD_RESUME"):
    pathlib.Path("resumed.json").write_text(json.dumps([__file__, *sys.argv[1:]]))
else:
    writer = Checkpointer(sys.argv[1], keep=None)
    loop = {"epochs": None, "steps": None, "steps_per_call": 1}
    writer.save(1, {"w": jnp.ones(1)}, {"command": recorded_command(), "time": {"step": 1},
                                        "position": 0, "loop": loop})
    writer.wait()
    writer.close()
"""


def test_a_run_resumes_from_where_it_started_and_a_moved_or_changed_one_by_name(
        tmp_path: pathlib.Path, no_exec: list[tuple], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(RUN)
    started = _graphmod("run", "train.py", "runs/x", "--lr", "1", cwd=work)
    assert started.returncode == 0, started.stderr
    done = _graphmod("resume", "runs/x", cwd=work)  # the round trip, from where it started
    assert done.returncode == 0, done.stderr
    script, digest = os.path.realpath(work / "train.py"), script_sha256(work / "train.py")
    assert f"graphmod resume: script {script} (sha256 {digest})" in done.stderr
    assert (work / "resumed.json").read_text() == f'["{script}", "runs/x", "--lr", "1"]'
    run = str(work / "runs/x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the script is outside this directory: named, it runs
    assert main(["resume", run]) == 2 and no_exec == []
    assert "outside the directory graphmod resume runs from" in capsys.readouterr().err
    assert main(["resume", run, "--script", str(work / "train.py")]) == 0
    assert no_exec.pop()[1] == [sys.executable, "--", script, "runs/x", "--lr", "1"]
    monkeypatch.chdir(work)
    with open(work / "train.py", "a") as file:  # changed since the run started
        file.write("# edited\n")
    assert main(["resume", run]) == 2 and no_exec == []
    assert "whose content changed since the run started" in capsys.readouterr().err
    assert main(["resume", run, "--script", "train.py"]) == 0
    assert no_exec.pop()[1][2] == script
    capsys.readouterr()
    (work / "train.py").write_text(RUN)
    (work / "train.py").rename(work / "moved.py")  # the same script, moved
    assert main(["resume", run, "--script", "moved.py"]) == 0
    assert no_exec.pop()[1][2] == os.path.realpath(work / "moved.py")
    assert f"script {os.path.realpath(work / 'moved.py')} (sha256 {digest})" in \
        capsys.readouterr().err


CRAFTED = "\x1b]0;owned\x07\x1b[2J\x9b31m\x7f\r"  # set a title, clear, colour, DEL, CR


def test_terminal_safe_shows_every_control_and_keeps_the_rest() -> None:
    assert terminal_safe(CRAFTED + "\0") == r"\x1b]0;owned\x07\x1b[2J\x9b31m\x7f\x0d\x00"
    assert terminal_safe("loss é ✓ \\x1b\n") == "loss é ✓ \\x1b\\x0a"


def test_inspect_prints_no_control_character_of_a_record(tmp_path: pathlib.Path) -> None:
    provenance = Provenance("training", {"managers": {"drop": {"class": f"Drop{CRAFTED}",
                                                               "arguments": {}}}})
    run = _checkpoint(
        tmp_path / "run", {"kind": "script", "script": f"/w/t{CRAFTED}.py",
                           "args": [f"--x{CRAFTED}"], "argv": [CRAFTED], "cwd": f"/w{CRAFTED}"},
        time={"step": 5, "epoch": 1}, plugins={f"Evil{CRAFTED}": {"n": CRAFTED}},
        metrics={f"loss{CRAFTED}": 0.5, "note": CRAFTED}, provenance=provenance.to_dict(),
        data_changes=[{"step": 3, "fields": [f"x{CRAFTED}"]}])
    (run / "metrics.jsonl").write_text(f'{{"loss{CRAFTED}": 1}}\n')
    report = inspect_run(run)
    for line in report.splitlines():
        assert not any(raw in line for raw in RAW), repr(line)
    for shown in (r"loss\x1b]0;owned\x07", r"Drop\x1b]0;owned", r"/w/t\x1b]0;owned\x07",
                  r"--x\x1b]0;owned", r"x\x1b]0;owned"):
        assert shown in report, shown
    printed = _graphmod("inspect", str(run), cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.rstrip("\n") == report
    assert not any(raw in printed.stdout.replace("\n", "") for raw in RAW)


def test_resume_prints_no_control_character_of_a_record(
        tmp_path: pathlib.Path, no_exec: list[tuple], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    run = _checkpoint(tmp_path / "run", _record(script, f"--x{CRAFTED}"))
    assert main(["resume", str(run)]) == 0 and len(no_exec) == 1
    err = capsys.readouterr().err
    assert r"--x\x1b]0;owned\x07" in err
    assert not any(raw in err.replace("\n", "") for raw in RAW)
    module = _checkpoint(tmp_path / "module", {"kind": "module", "module": f"m{CRAFTED}",
                                               "argv": [CRAFTED], "cwd": str(tmp_path)})
    assert main(["resume", str(module)]) == 2
    err = capsys.readouterr().err
    assert r"python -m m\x1b]0;owned" in err
    assert not any(raw in err.replace("\n", "") for raw in RAW)


def test_a_resumed_multi_process_run_passes_its_arguments_unchanged(
        tmp_path: pathlib.Path, no_exec: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    args = ["--", "--processes", "64", "-c", "import os"]
    run = _checkpoint(tmp_path / "run", {**_record(script, *args), "processes": 2})
    assert main(["resume", str(run)]) == 0
    argv = no_exec.pop()[1]
    assert argv[argv.index("--"):] == ["--", os.path.realpath(script), *args]
    parsed = _parser().parse_args(argv[argv.index("run"):])
    assert (parsed.processes, parsed.script, parsed.args) == (2, os.path.realpath(script),
                                                              args)


def test_resume_from_a_deleted_directory_is_refused(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "gone").mkdir()
    monkeypatch.chdir(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    with pytest.raises(ResumeRefusedError, match="runs from was deleted; change to the "):
        resume_command(_record(script), tmp_path / "run")
