"""Control of a running loop: the Control plugin's commands against a live run in a
subprocess (``controlled_run.py``), its transport's refusals, ``graphmod control``, and
``loop.start`` in a thread.

The live run is one subprocess, in one test (a module-scoped fixture would start one per
xdist worker): ``_drive`` takes it through every command once, in an order that keeps each
check meaningful (the state-changing sets before the checkpoint the resume starts from,
``stop`` last) and records what it saw; each ``_check`` function asserts one part. Every
wait is bounded: a run that does not get somewhere within ``WAIT_S`` fails, naming where.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest

import graphmod as gm
from graphmod._cli import main
from graphmod._train._checkpoint import CheckpointReader
from graphmod._train._control import (
    COMMANDS,
    ENDPOINT_NAME,
    MAX_REQUEST_BYTES,
    SOCKET_NAME,
    ControlServer,
    _connect,
    send_command,
)
from graphmod.errors import GraphmodWarning
from graphmod.plugins import Checkpoint, Control
from tests.loop import controlled_run
from tests.loop.conftest import Problem

SCRIPT = pathlib.Path(__file__).with_name("controlled_run.py")
ROOT = pathlib.Path(__file__).parents[2]
WAIT_S = 120.0  # a bound against a hang, never a timing


def _until(what: str, ready: Callable[[], Any], process: subprocess.Popen | None = None) -> Any:
    """``ready()``'s first true value, polled; fails naming ``what`` after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not (value := ready()):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended ({process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {WAIT_S:g} s")
        time.sleep(0.02)
    return value


def _raw(directory: pathlib.Path, payload: bytes, *, end: bool = True) -> dict | None:
    """Sends ``payload`` as it is (``end``: then closes the sending side) and returns the
    answer, or None where the run closed the connection without one."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with _connect({"unix": SOCKET_NAME}, str(directory), fd, 5.0) as sock:
            try:
                sock.sendall(payload)
                if end:
                    sock.shutdown(socket.SHUT_WR)
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            except (BrokenPipeError, ConnectionResetError):
                return None
    finally:
        os.close(fd)
    return json.loads(data) if data else None


def _token(directory: pathlib.Path) -> str:
    return json.loads((directory / ENDPOINT_NAME).read_text())["token"]


def _junk(rng: random.Random, token: str) -> bytes:
    """One request that must be refused: random bytes, random JSON, or a request with a
    wrong token, unknown fields or commands, or wrong arguments (never a valid one)."""
    def value(depth: int = 0) -> Any:
        kinds = ["int", "float", "str", "none", "bool"] + (["list", "dict"] if depth < 3 else [])
        kind = rng.choice(kinds)
        if kind == "int":
            return rng.randint(-10**12, 10**12)
        if kind == "float":
            return rng.uniform(-1e9, 1e9)
        if kind == "str":
            return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 12)))
        if kind in ("none", "bool"):
            return None if kind == "none" else rng.random() < 0.5
        if kind == "list":
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {str(value(3)): value(depth + 1) for _ in range(rng.randint(0, 4))}

    kind = rng.randrange(4)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if kind == 1:
        return json.dumps(value()).encode() + b"\n"
    if kind == 2:
        return b"x" * rng.randint(MAX_REQUEST_BYTES + 1, 3 * MAX_REQUEST_BYTES) + b"\n"
    request: dict[str, Any] = {}
    good_token = rng.random() < 0.5
    if good_token:
        request["token"] = token
    elif rng.random() < 0.7:
        request["token"] = rng.choice(["", "0" * 64, token[::-1], token.upper(), value()])
    command = rng.choice([*COMMANDS, "run", "exec", "__init__", value()]) \
        if rng.random() < 0.9 else None
    if command is not None:
        request["command"] = command
    request["args"] = rng.choice([value(), {"name": value(), "value": value()},
                                  {"name": "lr", "value": "0.1"}, {"save": "no"}])
    if good_token:  # a valid command's arguments: one it does not take, always
        request["args"] = {**(request["args"] if isinstance(request["args"], dict) else {}),
                           "zz-not-an-argument": value()}
    if rng.random() < 0.3:
        request[rng.choice(["wait", "code", "path", "pickle"])] = value()
    return json.dumps(request).encode() + b"\n"


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` used so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _drive(base: pathlib.Path) -> dict[str, Any]:
    """Drives a live run (a subprocess, in ``base``) through every command; returns what it
    saw."""
    directory, out = base / "run", base / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with open(base / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([sys.executable, str(SCRIPT), str(directory), str(out)],
                                   env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    seen: dict[str, Any] = {"directory": directory, "pid": process.pid}

    def ask(command: str, args: dict | None = None) -> dict:
        return send_command(str(directory), command, args, wait=WAIT_S / 2)

    def step_after(step: int) -> int:
        return _until(f"a step after {step}",
                      lambda: (s := ask("status")["step"]) > step and s, process)

    def report(name: str) -> dict:
        at = ask("event", {"name": name})["step"]
        found = _until(f"report {name}", lambda: (out / f"{name}.json").exists(), process)
        assert found
        record = json.loads((out / f"{name}.json").read_text())
        assert record["step"] >= at
        return record

    try:
        _until("the first step's trace", lambda: (out / "tracing").exists(), process)
        seen["status while tracing"] = ask("status")
        seen["traced by then"] = (out / "traced").exists()
        step_after(3)
        seen["before"] = report("report_before")
        # set lr=0 freezes the parameters from the next step on; then it is set back.
        seen["lr 0"] = ask("set", {"name": "lr", "value": 0.0})
        seen["frozen a"] = report("report_frozen_a")
        step_after(seen["frozen a"]["step"] + 3)
        seen["frozen b"] = report("report_frozen_b")
        seen["lr back"] = ask("set", {"name": "learning_rate", "value": 0.01})
        seen["rate"] = ask("set", {"name": "dropout/rate", "value": 0.3})
        seen["after sets"] = report("report_after_sets")
        # Refused requests: the answers, then the state they must not have changed.
        token, bad = _token(directory), {}
        line = lambda **r: json.dumps(r).encode() + b"\n"
        bad["no token"] = _raw(directory, line(command="pause"))
        bad["wrong token"] = _raw(directory, line(token="0" * 64, command="pause"))
        bad["malformed"] = _raw(directory, b'{"token": "' + token.encode() + b'", "comm\n')
        bad["oversized"] = _raw(directory, line(token=token, command="pause",
                                                args={"name": "x" * MAX_REQUEST_BYTES}))
        bad["unknown command"] = _raw(directory, line(token=token, command="jump"))
        bad["wrong type"] = _raw(directory, line(token=token, command="set",
                                                 args={"name": "lr", "value": "0.5"}))
        bad["out of range"] = ask("set", {"name": "dropout/rate", "value": 2.0})
        bad["unknown name"] = ask("set", {"name": "dropout/nope", "value": 0.5})
        bad["extra field"] = _raw(directory, line(token=token, command="pause", code="1"))
        seen["refused"] = bad
        seen["after refusals"] = report("report_after_refusals")
        # 1,000 junk requests; the run must go on training, its checkpoints intact.
        rng = random.Random(0)
        at = ask("status")["step"]
        seen["junk answers"] = [_raw(directory, _junk(rng, token)) for _ in range(1000)]
        seen["steps after junk"] = (at, step_after(at))
        seen["after junk"] = report("report_after_junk")
        # pause: the step holds still, the process burns no CPU; then resume.
        seen["pause"] = ask("pause")
        held = ask("status")
        cpu = _cpu_seconds(process.pid)
        time.sleep(1.0)  # what is measured is the CPU used meanwhile, not this time
        seen["paused cpu"] = _cpu_seconds(process.pid) - cpu
        seen["held"] = (held, ask("status"))
        seen["resume"] = ask("resume")
        step_after(seen["pause"]["step"])
        seen["cli"] = _cli(directory, "status"), _cli(directory, "set", "nope=1")
        # save, a few steps on, stop: two checkpoints, the second reachable from the first.
        seen["save"] = ask("save")
        step_after(seen["save"]["step"] + 3)
        seen["stop"] = ask("stop")
        seen["exit"] = process.wait(WAIT_S)
        seen["files after"] = sorted(p.name for p in directory.iterdir())
        seen["cli after"] = _cli(directory, "status")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return seen


def _cli(directory: pathlib.Path, *argv: str) -> tuple[int, str, str]:
    """``graphmod control DIRECTORY ARGV...``'s status, standard output and error."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["control", str(directory), *argv])
    return status, out.getvalue(), err.getvalue()


def _status_answers_while_the_first_step_compiles(live: dict) -> None:
    status = live["status while tracing"]
    assert status["ok"] and status["step"] == 0 and status["running"]
    assert status["planned_steps"] == 10**7 and "lr" in status["settable"]
    assert not live["traced by then"]  # the trace was still asleep when status answered


def _set_takes_effect_at_the_next_step_without_a_retrace(live: dict) -> None:
    before, a, b, after = (live[k] for k in ("before", "frozen a", "frozen b", "after sets"))
    assert live["lr 0"]["ok"] and live["lr 0"]["previous"] == pytest.approx(0.01)
    assert a["lr"] == 0.0 and b["step"] > a["step"] and a["params"] == b["params"]
    assert after["lr"] == pytest.approx(0.01) and after["rate"] == pytest.approx(0.3)
    assert after["params"] != b["params"]  # training again
    assert before["traces"] == after["traces"] and before["compiled"] == after["compiled"] == 1


def _refused_requests_change_nothing(live: dict) -> None:
    for name, answer in live["refused"].items():
        assert answer is None or answer["ok"] is False, name
        if name != "oversized":
            assert answer is not None, name
    refused = live["refused"]
    assert "token" in refused["no token"]["error"] and "token" in refused["wrong token"]["error"]
    assert "JSON" in refused["malformed"]["error"]
    assert "unknown command 'jump'" in refused["unknown command"]["error"]
    assert "finite number" in refused["wrong type"]["error"]
    assert "valid range" in refused["out of range"]["error"]
    assert "not a hyperparameter" in refused["unknown name"]["error"]
    after, before = live["after refusals"], live["after sets"]
    assert (after["lr"], after["rate"]) == (before["lr"], before["rate"])


def _a_thousand_junk_requests_leave_the_run_training_and_its_checkpoints_intact(
        live: dict) -> None:
    answers = live["junk answers"]
    assert len(answers) == 1000 and not [a for a in answers if a is not None and a["ok"]]
    assert sum(a is not None for a in answers) > 500  # most were answered with a refusal
    at, later = live["steps after junk"]
    assert later > at
    after = live["after junk"]
    assert (after["lr"], after["rate"]) == (live["after sets"]["lr"], live["after sets"]["rate"])
    reader = CheckpointReader(live["directory"])
    try:
        assert reader.steps() and all(reader.verify(s) is None for s in reader.steps())
    finally:
        reader.close()


def _pause_holds_the_step_and_burns_no_cpu(live: dict) -> None:
    assert live["pause"]["paused"] and live["resume"]["ok"]
    first, second = live["held"]
    assert first["paused"] and first["step"] == second["step"] == live["pause"]["step"]
    assert live["paused cpu"] < 0.2  # CPU seconds used over a second's pause


def _the_command_line_controls_a_live_run(live: dict) -> None:
    (status, out, err), (refused, _, why) = live["cli"]
    assert status == 0 and out.startswith("step ") and "running" in out and not err
    assert refused == 1 and "not a hyperparameter of this run" in why


def _save_adds_a_checkpoint_and_stop_one_that_resumes_bitwise(live: dict) -> None:
    saved, stopped = live["save"]["step"], live["stop"]["step"]
    assert live["stop"]["stopping"] and live["exit"] == 0 and stopped > saved
    step, data, template, _ = controlled_run.build()
    reader = CheckpointReader(live["directory"])
    try:
        assert {saved, stopped} <= set(reader.steps())
        assert reader.verify(saved) is None and reader.verify(stopped) is None
        state, meta = reader.restore(template, stopped)
    finally:
        reader.close()
    commands = [(c["command"], c["step"]) for c in meta["plugins"]["control"]["commands"]]
    assert [c for c, _ in commands] == ["event", "set", "event", "event", "set", "set",
                                        "event", "event", "event", "pause", "resume", "save",
                                        "stop"]
    assert commands[-2:] == [("save", saved), ("stop", stopped)]
    with pytest.warns(GraphmodWarning, match=r"\['function'\] differ"):  # __main__'s there
        resumed = gm.Loop.resume(live["directory"], step, data, state=template,
                                 checkpoint=saved, steps=stopped)
    assert int(resumed.step) == stopped
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _a_stopped_run_leaves_no_control_files_and_the_command_says_so(live: dict) -> None:
    assert ENDPOINT_NAME not in live["files after"] and SOCKET_NAME not in live["files after"]
    status, out, err = live["cli after"]
    assert status == 1 and out == "" and len(err.splitlines()) == 1
    assert "no run is controlled from it" in err


def test_a_live_run_does_what_each_command_says_and_refuses_the_rest(
        tmp_path: pathlib.Path) -> None:
    """One live run for every check (a subprocess costs seconds): each check below asserts
    one part of what the run did."""
    live = _drive(tmp_path)
    _status_answers_while_the_first_step_compiles(live)
    _set_takes_effect_at_the_next_step_without_a_retrace(live)
    _refused_requests_change_nothing(live)
    _a_thousand_junk_requests_leave_the_run_training_and_its_checkpoints_intact(live)
    _pause_holds_the_step_and_burns_no_cpu(live)
    _the_command_line_controls_a_live_run(live)
    _save_adds_a_checkpoint_and_stop_one_that_resumes_bitwise(live)
    _a_stopped_run_leaves_no_control_files_and_the_command_says_so(live)


def _dead_run(directory: pathlib.Path) -> None:
    """The record and socket a run that died leaves: nothing listens on the socket."""
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(directory / SOCKET_NAME))
    record = directory / ENDPOINT_NAME
    record.write_text(json.dumps({"graphmod": "control", "token": "0" * 64, "pid": os.getpid(),
                                  "host": socket.gethostname(),
                                  "address": {"unix": SOCKET_NAME}}))
    record.chmod(0o600)


def test_the_command_without_a_run_is_one_line_and_exit_1(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["control", str(tmp_path / "none"), "status"]) == 1
    assert "not a run directory" in capsys.readouterr().err
    _dead_run(tmp_path)
    assert main(["control", str(tmp_path), "pause"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "is gone" in err
    replacement = ControlServer(str(tmp_path), None, lambda request: {"here": True})
    replacement.open()  # a dead run's files are replaced
    try:
        assert send_command(str(tmp_path), "status") == {"ok": True, "here": True}
    finally:
        replacement.close()
    assert not (tmp_path / ENDPOINT_NAME).exists() and not (tmp_path / SOCKET_NAME).exists()


@pytest.mark.parametrize("kind", ["text", "symlink", "other mode", "socket alone"])
def test_files_graphmod_did_not_write_are_left_alone(tmp_path: pathlib.Path, kind: str) -> None:
    record = tmp_path / ENDPOINT_NAME
    if kind == "text":
        record.write_text("not graphmod's")
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text("{}")
        record.symlink_to(tmp_path / "elsewhere")
    elif kind == "other mode":
        record.write_text(json.dumps({"graphmod": "control", "token": "0" * 64, "pid": 1,
                                      "host": socket.gethostname(),
                                      "address": {"unix": SOCKET_NAME}}))
        record.chmod(0o644)
    else:
        with socket.socket(socket.AF_UNIX) as stray:
            stray.bind(str(tmp_path / SOCKET_NAME))
    before = {p.name: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in tmp_path.iterdir()}
    loop = gm.Loop(lambda state, x: (state, {}), [(np.ones(2),)], plugins=[Control(tmp_path)])
    with pytest.raises(gm.PluginError, match="left as it is"):
        loop.run(0)
    assert {p.name: (p.lstat().st_ino, p.lstat().st_mtime_ns)
            for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("address", ["0.0.0.0:0", "192.168.1.10:8765", "[::]:0",
                                     "example.com:80", "127.0.0.1", "127.0.0.1:99999"])
def test_a_non_loopback_or_malformed_address_is_refused_before_binding(address: str) -> None:
    with pytest.raises(ValueError, match="Control\\(address="):
        Control(address=address)


def test_the_server_limits_its_rate_and_refuses_a_request_without_a_newline(
        tmp_path: pathlib.Path) -> None:
    server = ControlServer(str(tmp_path), None, lambda request: {}, requests_per_second=1)
    server.open()
    try:
        assert send_command(str(tmp_path), "status")["ok"]
        limited = send_command(str(tmp_path), "status")
        assert not limited["ok"] and "too many requests" in limited["error"]
    finally:
        server.close()
    server = ControlServer(str(tmp_path), None, lambda request: {})
    server.open()
    try:
        answer = _raw(tmp_path, b'{"command": "status"}')
        assert answer is not None and "newline" in answer["error"]
    finally:
        server.close()


@pytest.fixture(scope="module")
def dynamic_problem() -> Problem:
    problem = Problem(dropout=gm.dynamic(0.1))
    problem.step = gm.optimize(problem.program,
                               optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    return problem


def test_loop_start_runs_in_a_thread_with_status_pause_set_stop_and_result(
        dynamic_problem: Problem, tmp_path: pathlib.Path) -> None:
    loop = gm.Loop(dynamic_problem.step, dynamic_problem.source(), steps=10**7, plugins=[
        Checkpoint(tmp_path, every=gm.On("end")), Control(address="127.0.0.1:0")])
    run = loop.start(dynamic_problem.state())
    try:
        assert run.running and run.status()["running"]
        paused = run.pause()
        assert paused["paused"] and run.status()["step"] == paused["step"]
        over_tcp = send_command(str(tmp_path), "status")  # the record names the TCP port
        assert over_tcp["ok"] and over_tcp["paused"] and over_tcp["step"] == paused["step"]
        assert run.set("dropout/rate", 0.5)["previous"] == pytest.approx(0.1)
        with pytest.raises(ValueError, match="valid range"):
            run.set("dropout/rate", 1.5)
        with pytest.raises(ValueError, match="finite number"):
            run.set("lr", "fast")
        assert run.resume()["paused"] is False
        stopped = run.stop()
    finally:
        with contextlib.suppress(ValueError):  # ended already
            run.stop(save=False)
    state = run.result()
    assert not run.running and int(state.step) == stopped["step"] >= paused["step"]
    assert float(dynamic_problem.dropout.hparam("rate").get(state.variables)) == 0.5
    reader = CheckpointReader(tmp_path)
    assert stopped["saved"] == [str(tmp_path)] and reader.steps() == [stopped["step"]]
    reader.close()
    assert [r.plugin for r in loop.trace if r.event == "command"] == ["control"] * 4
    with pytest.raises(ValueError, match="not running"):
        run.pause()


def test_loop_start_refuses_saving_without_a_checkpoint_and_reraises_the_runs_error(
        dynamic_problem: Problem) -> None:
    problem = dynamic_problem
    loop = gm.Loop(problem.step, problem.source(), steps=10**7)
    run = loop.start(problem.state())
    try:
        with pytest.raises(ValueError, match="no Checkpoint plugin"):
            run.save()
        with pytest.raises(ValueError, match="stop without saving"):
            run.stop()
        assert run.event("evaluate")["step"] >= 1
    finally:
        with contextlib.suppress(ValueError):
            run.stop(save=False)
    assert int(run.result().step) >= 1

    def fail(event: gm.Event) -> None:
        raise RuntimeError("boom")

    failing = gm.Loop(problem.step, problem.source(), steps=10**7)
    failing.on(gm.On("step", step=3), fail)
    run = failing.start(problem.state())
    with pytest.raises(gm.PluginError, match="boom"):
        run.result(timeout=WAIT_S)
