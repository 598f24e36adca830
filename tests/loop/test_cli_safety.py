"""graphmod resume runs only a recorded script file; how a run was started is recorded."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import sysconfig
import textwrap
import timeit
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import pytest

import graphmod as gm
from graphmod._cli import main
from graphmod._train._checkpoint import Checkpointer
from graphmod._train._command import command_text, recorded_command, script_sha256

ROOT = pathlib.Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
LOOP = {"epochs": None, "steps": None, "steps_per_call": 1}  # a loop's limits, none reached
PROBE = ("import json, graphmod._train._command as c; "
         "print('RECORD' + json.dumps(c.recorded_command()))")


def _python(*args: str, cwd: pathlib.Path, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def _graphmod(*args: str, cwd: pathlib.Path = ROOT, timeout: float = 120
              ) -> subprocess.CompletedProcess:
    return _python("-m", "graphmod._cli", *args, cwd=cwd, timeout=timeout)


def _record_of(done: subprocess.CompletedProcess) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD")]
    assert done.returncode == 0 and lines, done.stderr
    return json.loads(lines[-1].removeprefix("RECORD"))


def _checkpoint(directory: pathlib.Path, command: Any, *, step: int = 5,
                loop: dict | None = None) -> pathlib.Path:
    """A real checkpoint in ``directory`` whose meta records ``command`` (and a loop time,
    position and limits, no limit unless given)."""
    writer = Checkpointer(directory, keep=None)
    writer.save(step, {"w": jnp.ones(3)}, {"command": command,
                                           "time": {"step": step, "epoch": 2}, "position": 0,
                                           "loop": loop or LOOP})
    writer.wait()
    writer.close()
    return directory


def _script_run(script: pathlib.Path, args: Sequence[str] = (), cwd: pathlib.Path | None = None,
                **more: Any) -> dict[str, Any]:
    """The record of a run of ``script`` started in ``cwd`` (its folder by default), with the
    script's hash as recorded_command records it."""
    return {"kind": "script", "script": str(script), "args": list(args),
            "argv": [str(script), *args], "cwd": str(cwd or script.parent),
            "script_sha256": script_sha256(script), **more}


@pytest.fixture
def probe(tmp_path: pathlib.Path) -> pathlib.Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE + "\n")
    return script


# -- recording ---------------------------------------------------------------------------------
def test_a_script_start_records_the_resolved_script_its_args_and_cwd_not_the_interpreter(
        probe: pathlib.Path) -> None:
    record = _record_of(_python("probe.py", "a", "--b", "-c", cwd=probe.parent))
    assert record["kind"] == "script"
    assert record["script"] == os.path.realpath(probe)
    assert record["args"] == ["a", "--b", "-c"]
    assert record["cwd"] == str(probe.parent)
    assert sys.executable not in json.dumps(record)


def test_graphmod_run_records_the_script_not_the_entry_point(probe: pathlib.Path) -> None:
    record = _record_of(_graphmod("run", "probe.py", "x", "--y", cwd=probe.parent))
    assert record["kind"] == "script"
    assert record["script"] == os.path.realpath(probe)
    assert record["args"] == ["x", "--y"]


@pytest.mark.parametrize(("args", "stdin", "kind"), [
    (["-c", PROBE, "x"], None, "code"),
    (["-m", "probe", "q"], None, "module"),
    (["-", "z"], PROBE, "stdin"),
    (["-i", "probe.py"], "", "interactive"),
    ([], PROBE, "interactive"),  # the REPL reading piped input: sys.argv == ['']
], ids=["python -c", "python -m", "python -", "python -i", "python (shell)"])
def test_other_starts_are_recorded_as_what_they_are(
        probe: pathlib.Path, args: list[str], stdin: str | None, kind: str) -> None:
    record = _record_of(_python(*args, cwd=probe.parent, stdin=stdin))
    assert record["kind"] == kind
    assert "script" not in record
    if kind == "module":
        assert record["module"] == "probe"


def test_a_jupyter_kernel_start_is_recorded_as_jupyter(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("jupyter_client")
    out = tmp_path / "record.json"
    driver = textwrap.dedent(f"""
        from jupyter_client.manager import start_new_kernel
        km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
        try:
            code = ("import json, graphmod._train._command as c; "
                    "open({str(out)!r}, 'w').write(json.dumps(c.recorded_command()))")
            assert kc.execute_interactive(code, timeout=60)["content"]["status"] == "ok"
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    """)
    done = _python("-c", driver, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["kind"] == "jupyter"


def test_a_loop_records_how_its_process_was_started(problem: Any) -> None:
    loop = gm.Loop(problem.step, problem.source(), steps=1)
    assert loop.state_dict()["command"] == recorded_command()


def test_an_ipython_shell_and_a_kernel_command_line_are_recognised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = os.path.join(sysconfig.get_paths()["purelib"], "ipykernel_launcher.py")
    monkeypatch.setattr(sys, "argv", [launcher, "-f", "/run/user/1/kernel-1a2b.json"])
    assert recorded_command()["kind"] == "jupyter"
    monkeypatch.setattr(sys, "argv", ["x.py", "--f=/home/u/kernel-v2-9.json"])
    assert recorded_command()["kind"] == "jupyter"
    monkeypatch.setattr(sys, "argv", ["train.py", "-f", "config.json"])  # a script's own -f
    assert recorded_command()["kind"] != "jupyter"
    import builtins

    class Shell:  # a terminal IPython shell has no kernel
        kernel = None

    monkeypatch.setattr(builtins, "get_ipython", lambda: Shell(), raising=False)
    assert recorded_command()["kind"] == "interactive"
    Shell.kernel = object()
    assert recorded_command()["kind"] == "jupyter"


# -- graphmod resume: what it runs -------------------------------------------------------------
@pytest.fixture
def no_exec(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> list[tuple]:
    """Records os.execve calls instead of replacing the test process."""
    calls: list[tuple] = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    monkeypatch.chdir(tmp_path)  # resume changes directory; restored after the test
    return calls


def test_resume_runs_the_recorded_script_with_its_arguments_as_data(
        tmp_path: pathlib.Path, no_exec: list[tuple], capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    args = ["--lr", "0.1; touch pwned", "$(touch pwned)", "-c", "import os", "--"]
    run = _checkpoint(tmp_path / "run", _script_run(script, args))
    assert main(["resume", str(run)]) == 0
    [(executable, argv, env)] = no_exec
    assert argv == [sys.executable, "--", os.path.realpath(script), *args]
    assert executable == sys.executable
    assert env["GRAPHMOD_RESUME"] == str(run)
    assert os.getcwd() == str(script.parent)
    err = capsys.readouterr().err
    assert f"resuming {run} at step 5 (epoch 2), from its newest checkpoint" in err
    assert f"script {os.path.realpath(script)} (sha256 {script_sha256(script)})" in err
    assert shlex.join(argv) in err


def test_resume_of_a_run_that_had_ended_says_so(
        tmp_path: pathlib.Path, no_exec: list[tuple], capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    command = _script_run(script)
    ended = _checkpoint(tmp_path / "ended", command, loop={**LOOP, "epochs": 2})
    assert main(["resume", str(ended)]) == 0 and len(no_exec) == 1  # the script still runs
    assert ("that checkpoint ends the run it was saved by (epoch 2 of 2): the script stops "
            "at once unless it now asks for more epochs or steps") in capsys.readouterr().err
    going = _checkpoint(tmp_path / "going", command, loop={**LOOP, "epochs": 3})
    assert main(["resume", str(going)]) == 0
    assert "ends the run" not in capsys.readouterr().err


def test_resume_replaces_itself_with_the_script_and_keeps_its_exit_status(
        tmp_path: pathlib.Path) -> None:
    script = tmp_path / "train.py"
    out = tmp_path / "seen.json"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        json.dump({{"argv": sys.argv, "cwd": os.getcwd(),
                   "resume": os.environ.get("GRAPHMOD_RESUME")}}, open({str(out)!r}, "w"))
        sys.exit(7)
    """))
    args = ["a b", "'; touch pwned", "-m", "os"]
    run = _checkpoint(tmp_path / "run", _script_run(script, args))
    done = _graphmod("resume", str(run), cwd=tmp_path)
    assert done.returncode == 7, done.stderr
    seen = json.loads(out.read_text())
    assert seen == {"argv": [os.path.realpath(script), *args], "cwd": str(tmp_path),
                    "resume": str(run)}
    assert not (tmp_path / "pwned").exists()
    assert f"running in {tmp_path}: {sys.executable} -- {script}" in done.stderr


def test_a_process_of_a_multi_process_run_records_the_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHMOD_NUM_PROCESSES", "2")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x "
                                    "--xla_force_host_platform_device_count=4")
    record = recorded_command()
    assert (record["processes"], record["devices_per_process"]) == (2, 4)
    monkeypatch.delenv("GRAPHMOD_NUM_PROCESSES")
    assert "processes" not in recorded_command()


def test_resume_starts_a_multi_process_run_in_as_many_processes(
        tmp_path: pathlib.Path, no_exec: list[tuple], capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    record = _script_run(script, ["--steps", "9"], processes=2, devices_per_process=4)
    run = _checkpoint(tmp_path / "run", record)
    assert main(["resume", str(run)]) == 0
    [(_, argv, env)] = no_exec
    assert argv == [sys.executable, "-P", "-m", "graphmod._cli", "run", "--processes", "2",
                    "--devices-per-process", "4", "--", os.path.realpath(script), "--steps",
                    "9"]
    assert env["GRAPHMOD_RESUME"] == str(run)
    assert command_text(record).endswith("; 2 processes of 4 devices)")


def test_a_resumed_multi_process_run_imports_no_graphmod_planted_in_its_directory(
        tmp_path: pathlib.Path) -> None:
    work = tmp_path / "work"
    (work / "graphmod").mkdir(parents=True)
    for name in ("__init__.py", "_cli.py"):  # what `python -m graphmod._cli` would import
        (work / "graphmod" / name).write_text(f"open({str(tmp_path / 'pwned')!r}, 'w')\n")
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r} + __import__('os').environ["
                      "'GRAPHMOD_PROCESS_ID'], 'w')\n")
    run = _checkpoint(tmp_path / "run", _script_run(script, cwd=work, processes=2))
    done = _graphmod("resume", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran0").exists() and (tmp_path / "ran1").exists()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("counts", [(0, None), (True, None), ("2", None), (10**6, None),
                                    (2, 0), (2, 2.0)])
def test_resume_refuses_process_counts_that_are_not_whole_numbers_in_bounds(
        counts: tuple, tmp_path: pathlib.Path, no_exec: list[tuple],
        capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    processes, devices = counts
    record = _script_run(script, processes=processes, devices_per_process=devices)
    run = _checkpoint(tmp_path / "run", record)
    assert main(["resume", str(run)]) == 2
    assert no_exec == []
    assert f"recorded {processes!r} processes of {devices!r} devices" in capsys.readouterr().err


# -- graphmod resume: what it refuses ----------------------------------------------------------
REFUSED = {  # name: (record, words the message must contain)
    "python -c": ({"kind": "code", "argv": ["-c", "x"], "cwd": "/"}, ["python -c", "'x'"]),
    "python -m": ({"kind": "module", "module": "pkg.train", "argv": ["/p/pkg/train.py"],
                   "cwd": "/"}, ["python -m pkg.train"]),
    "stdin": ({"kind": "stdin", "argv": ["-"], "cwd": "/"}, ["python -"]),
    "jupyter": ({"kind": "jupyter", "argv": ["/k/ipykernel_launcher.py", "-f", "/k.json"],
                 "cwd": "/"}, ["Jupyter", "ipykernel_launcher.py"]),
    "interactive": ({"kind": "interactive", "argv": [""], "cwd": "/"}, ["interactive"]),
    "unknown": ({"kind": "unknown", "argv": ["x"], "cwd": "/"}, ["could not identify"]),
    "a made-up kind": ({"kind": "shell", "argv": ["x"], "cwd": "/"}, ["'shell'"]),
    "old format, -c payload": ({"argv": ["-cimport os;os.system('id')#.py"], "cwd": "/"},
                               ["old-format", "-cimport os"]),
    "old format, plain list": (["missing.py", "--x"], ["old-format", "missing.py"]),
    "old format, not .py": ({"argv": ["/bin/sh", "-c", "id"], "cwd": "/"},
                            ["old-format", "/bin/sh"]),
    "old format, empty": ({"argv": [], "cwd": "/"}, ["old-format", "[]"]),
    "old format, kernel": ({"argv": ["/x/ipykernel_launcher.py", "-f", "/r/kernel-1.json"],
                            "cwd": "/"}, ["Jupyter"]),
    "no record": ("python train.py", ["records no command", "'python train.py'"]),
    "script: an option": ({"kind": "script", "script": "-cimport os#.py", "args": [],
                           "cwd": "/"}, ["'-cimport os#.py'", "not an absolute path"]),
    "script: relative": ({"kind": "script", "script": "train.py", "args": [], "cwd": "/"},
                         ["'train.py'", "not an absolute path"]),
    "script: missing": ({"kind": "script", "script": "/nonexistent/train.py", "args": [],
                         "cwd": "/"}, ["'/nonexistent/train.py'", "not an existing file"]),
    "script: a folder": ({"kind": "script", "script": "/", "args": [], "cwd": "/"},
                         ["not an existing file"]),
    "script: not a string": ({"kind": "script", "script": ["/x.py"], "args": [], "cwd": "/"},
                             ["['/x.py']"]),
    "script: of the installation": ({"kind": "script", "script": timeit.__file__,
                                     "args": ["import os"], "cwd": "/"},
                                    ["timeit.py", "Python installation"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_resume_refuses_what_is_not_a_recorded_script_file(
        name: str, tmp_path: pathlib.Path, no_exec: list[tuple],
        capsys: pytest.CaptureFixture) -> None:
    record, words = REFUSED[name]
    run = _checkpoint(tmp_path / "run", record)
    assert main(["resume", str(run)]) == 2
    assert no_exec == []
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"graphmod resume: {run}")
    assert "graphmod.Loop.resume(" in captured.err
    for word in words:
        assert word in captured.err


@pytest.mark.parametrize("field", ["args: not strings", "args: a NUL byte", "cwd: missing",
                                   "script: inside the run directory"])
def test_resume_refuses_bad_arguments_directories_and_scripts_stored_with_the_run(
        field: str, tmp_path: pathlib.Path, no_exec: list[tuple],
        capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run = tmp_path / "run"
    record = _script_run(script)
    if field == "args: not strings":
        record["args"] = ["--n", 3]
    elif field == "args: a NUL byte":
        record["args"] = ["a\0b"]
    elif field == "cwd: missing":
        record["cwd"] = str(tmp_path / "gone")
    else:
        run.mkdir()
        record["script"] = str(run / "evil.py")
        (run / "evil.py").write_text("")
    _checkpoint(run, record)
    assert main(["resume", str(run)]) == 2
    assert no_exec == []
    err = capsys.readouterr().err
    culprit = {"args: not strings": "['--n', 3]", "args: a NUL byte": "a\\x00b",
               "cwd: missing": "gone", "script: inside the run directory": "evil.py"}[field]
    assert culprit in err and "graphmod.Loop.resume(" in err


@pytest.mark.parametrize("form", ["old", "new"])
def test_the_reported_exploit_runs_nothing(form: str, tmp_path: pathlib.Path) -> None:
    sentinel = tmp_path / "pwned"
    payload = f"-cimport pathlib;pathlib.Path({str(sentinel)!r}).touch()#.py"
    (tmp_path / "cwd").mkdir()
    record = ({"argv": [payload], "cwd": str(tmp_path / "cwd")} if form == "old" else
              {"kind": "script", "script": payload, "args": [], "cwd": str(tmp_path / "cwd")})
    run = _checkpoint(tmp_path / "run", record)
    done = _graphmod("resume", str(run), cwd=tmp_path / "cwd")
    assert done.returncode == 2, done.stderr
    assert not sentinel.exists()
    assert "Traceback" not in done.stderr and "graphmod.Loop.resume(" in done.stderr


@pytest.mark.parametrize("form", ["old", "new"])
def test_a_script_of_the_installation_never_runs_its_arguments(
        form: str, tmp_path: pathlib.Path) -> None:
    sentinel = tmp_path / "pwned"
    args = ["-n", "1", f"import pathlib; pathlib.Path({str(sentinel)!r}).touch()"]
    run = _checkpoint(tmp_path / "run", (
        {"argv": [timeit.__file__, *args], "cwd": str(tmp_path)} if form == "old" else
        {"kind": "script", "script": timeit.__file__, "args": args, "cwd": str(tmp_path)}))
    done = _graphmod("resume", str(run))
    assert done.returncode == 2, done.stderr
    assert not sentinel.exists()


def test_resuming_a_run_started_in_jupyter_is_refused_at_once(tmp_path: pathlib.Path) -> None:
    # The record a kernel made before records were typed: the launcher exists as a .py file,
    # and running it again waits for a Jupyter client forever.
    launcher = os.path.join(sysconfig.get_paths()["purelib"], "ipykernel_launcher.py")
    run = _checkpoint(tmp_path / "run", {"argv": [launcher, "-f", str(tmp_path / "k.json")],
                                         "cwd": str(tmp_path)})
    done = _graphmod("resume", str(run), timeout=60)
    assert done.returncode == 2
    assert "Jupyter" in done.stderr and "graphmod.Loop.resume(" in done.stderr


# -- errors of the command line ----------------------------------------------------------------
def test_a_bad_flag_is_named_on_stderr_with_status_2() -> None:
    done = _graphmod("--badflag")
    assert done.returncode == 2
    assert "--badflag" in done.stderr and done.stdout == ""


def test_a_bare_run_says_a_script_is_needed() -> None:
    done = _graphmod("run")
    assert done.returncode == 2
    assert "a script is needed" in done.stderr
    assert "required" not in done.stderr


@pytest.mark.parametrize("command", [[], ["run"], ["resume"], ["inspect"]])
def test_help_is_plain_text(command: list[str]) -> None:
    done = _graphmod(*command, "--help")
    assert done.returncode == 0
    assert "`" not in done.stdout
    assert len(done.stdout.split()) > 20  # says something about each command


def _run_directory(tmp_path: pathlib.Path, layout: str) -> pathlib.Path:
    run = tmp_path / "run"
    if layout != "missing":
        run.mkdir()
    if layout == "stray numbered directory":
        (run / "7").mkdir()
    return run


def _quiet(stderr: str) -> bool:
    """No traceback and none of orbax's log output reached the terminal."""
    return not any(word in stderr for word in ("Traceback", "Event loop is closed", "WARNING"))


@pytest.mark.parametrize("layout", ["missing", "empty", "stray numbered directory"])
def test_resume_names_a_directory_without_checkpoints_with_status_2(
        layout: str, tmp_path: pathlib.Path) -> None:
    run = _run_directory(tmp_path, layout)
    done = _graphmod("resume", str(run))
    assert done.returncode == 2, done.stdout
    assert str(run) in done.stderr and done.stdout == ""
    assert _quiet(done.stderr), done.stderr
    assert len(done.stderr.splitlines()) <= 2


@pytest.mark.parametrize("layout", ["missing", "empty", "stray numbered directory"])
def test_inspect_names_a_missing_directory_and_lists_what_is_not_a_checkpoint(
        layout: str, tmp_path: pathlib.Path) -> None:
    run = _run_directory(tmp_path, layout)
    done = _graphmod("inspect", str(run))
    assert _quiet(done.stderr), done.stderr
    if layout == "missing":
        assert done.returncode == 2 and done.stdout == ""
        assert f"no run directory at {run}" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert "checkpoints: none" in done.stdout
        assert ("not graphmod's 7" in done.stdout) == (layout != "empty")


def test_an_interrupted_run_exits_130_with_one_line(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(f"import os, time\nos.kill(os.getpid(), {int(signal.SIGINT)})\n"
                      "time.sleep(60)\n")
    done = _graphmod("run", str(script))
    assert done.returncode == 130
    assert done.stderr.strip().splitlines() == ["graphmod run: interrupted"]
