"""Control of a running loop from outside its process: the protocol, the run directory's
files, the server thread and the client (``graphmod control RUN_DIR ...``).

A run with :class:`graphmod.plugins.Control` listens, from its setup to its teardown, on a
Unix domain socket in its run directory (``graphmod-control.sock``) or on a TCP port of the
loopback interface, and writes ``graphmod-control.json`` beside it: the endpoint record,
holding the run's token, its process and host and where it listens. The client finds a run
through that record alone, so the run directory is the run's address.

Threat model: anyone on the machine may connect to the socket or the port and send
anything. A request is one line of JSON of at most :data:`MAX_REQUEST_BYTES` bytes (more is
refused and the connection closed), ``{"token": ..., "command": ..., "args": {...},
"wait": seconds}`` with no other field; the token, ``secrets.token_hex(32)``, is compared
with ``hmac.compare_digest`` before anything else of the request is read, and lives only in
the endpoint record, which the run creates with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode
0600, so only its user reads it. A fixed set of commands (:data:`COMMANDS`) with fixed,
typed arguments is all there is: no code, no attribute path, no pickle, no file path ever
crosses. Requests are rate-limited (a token bucket shared by all connections) and few
connections are served at once; every socket operation has a timeout, on both sides.

Nothing in a run directory that graphmod did not write is touched: a record that is not
graphmod's (a link, another user's file, a file with group or other permissions, anything
but graphmod's JSON), or a socket no record of graphmod's names, stops the run at setup,
left as it is. A record and socket left by a run that died (nothing answers on them) are
replaced; a run still listening there is named in the error.

This module imports only the standard library: ``graphmod control`` answers without JAX.

Examples:
    >>> from graphmod._train._control import parse_address
    >>> parse_address("127.0.0.1:0"), parse_address(None)
    (('127.0.0.1', 0), None)
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple, TypedDict, TypeGuard

if TYPE_CHECKING:  # annotations only: this module imports nothing but the standard library
    from graphmod.typing import JSON

_log = logging.getLogger("graphmod.control")

ENDPOINT_NAME = "graphmod-control.json"
SOCKET_NAME = "graphmod-control.sock"
MAX_REQUEST_BYTES = 4096  # one request line, newline excluded
MAX_WAIT_S = 60.0  # the longest a request may ask to wait for the loop to apply it
READ_TIMEOUT_S = 2.0  # for the request line, once connected
CONNECT_TIMEOUT_S = 2.0
COMMANDS = ("status", "pause", "resume", "stop", "save", "set", "event")
# Each command's arguments: name -> (type, required). No other argument is accepted.
_ARGUMENTS: dict[str, dict[str, tuple[type, bool]]] = {
    "status": {}, "pause": {}, "resume": {}, "save": {},
    "stop": {"save": (bool, False)},
    "set": {"name": (str, True), "value": (float, True)},
    "event": {"name": (str, True)},
}
_FIELDS = {"token", "command", "args", "wait"}
_SETTING = re.compile(r"[A-Za-z_][\w.-]{0,63}(/[A-Za-z_][\w.-]{0,63}){0,2}", re.ASCII)
_EVENT = re.compile(r"[A-Za-z_][\w.-]{0,63}", re.ASCII)
_TOKEN = re.compile(r"[0-9a-f]{64}", re.ASCII)
_SUN_PATH = 100  # a Unix socket's path must fit in sun_path (108 bytes on Linux)


class Refused(ValueError):
    """A request the run refuses (its message says why); the answer is ``{"ok": false,
    "error": message}`` and nothing changed.

    Examples:
        >>> from graphmod._train._control import Refused
        >>> str(Refused("unknown command 'jump'"))
        "unknown command 'jump'"
    """


class NotRunning(Exception):
    """No run answers through a run directory (none listens, it is gone, or it did not
    answer in time): what ``graphmod control`` reports in one line, with exit status 1.

    Examples:
        >>> from graphmod._train._control import NotRunning
        >>> issubclass(NotRunning, Exception)
        True
    """


class Request(NamedTuple):
    """One authenticated, checked request: a command of :data:`COMMANDS`, its arguments,
    and how long the sender waits for the loop to apply it (seconds)."""

    command: str
    args: dict[str, JSON]
    wait: float


class _Address(TypedDict, total=False):
    """Where a run listens: one of the two."""

    unix: str  # the socket's name in the run directory
    tcp: tuple[str, int]  # a loopback IP and port, a JSON list [ip, port] in the record


class _Endpoint(TypedDict):
    """The endpoint record, ``graphmod-control.json``: the run's token and address."""

    graphmod: str  # "control"
    token: str
    pid: int
    host: str
    address: _Address
    since: str


# -- requests ---------------------------------------------------------------------------------
def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _unique_keys(pairs: list[tuple[str, JSON]]) -> dict[str, JSON]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a field appears twice")
    return dict(pairs)


def _json_object(line: bytes) -> dict[str, JSON]:
    """``line`` as a JSON object (strict: UTF-8, no NaN, no repeated field), or Refused."""
    try:
        value = json.loads(line.decode("utf-8"), parse_constant=_refuse_constant,
                           object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise Refused(f"the request is not one line of JSON ({type(error).__name__})") from None
    if not isinstance(value, dict):
        raise Refused("the request must be a JSON object")
    return value


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_token(given: object, token: str) -> bool:
    """Whether ``given`` (from a request) is ``token``, compared in constant time.

    Examples:
        >>> from graphmod._train._control import check_token
        >>> check_token("ab" * 32, "ab" * 32), check_token("ab", "ab" * 32), check_token(3, "x")
        (True, False, False)
    """
    if not isinstance(given, str) or not _TOKEN.fullmatch(given):
        return False
    return hmac.compare_digest(given.encode("ascii"), token.encode("ascii"))


def parse_request(line: bytes, token: str) -> Request:
    """The request in ``line`` (one line of JSON, newline excluded), checked: the token
    first, then the command, its arguments (names and types) and ``wait``; a
    :class:`Refused` says what is wrong.

    Examples:
        >>> import json
        >>> from graphmod._train._control import parse_request
        >>> token = "0" * 64
        >>> line = json.dumps({"token": token, "command": "set",
        ...                    "args": {"name": "lr", "value": 0.01}}).encode()
        >>> parse_request(line, token)
        Request(command='set', args={'name': 'lr', 'value': 0.01}, wait=5.0)
        >>> try:
        ...     parse_request(b'{"token": "nope", "command": "stop"}', token)
        ... except ValueError as refused:
        ...     print(str(refused).split(":")[0])
        no token or a wrong one
    """
    request = _json_object(line)
    if not check_token(request.get("token"), token):
        raise Refused(f"no token or a wrong one: read it from the run's {ENDPOINT_NAME}")
    unknown = sorted(set(request) - _FIELDS)
    if unknown:
        raise Refused(f"unknown request fields {unknown}; a request has {sorted(_FIELDS)}")
    command = request.get("command")
    wait = request.get("wait", 5.0)
    if not _number(wait) or not 0 <= wait <= MAX_WAIT_S:
        raise Refused(f"wait must be a number of seconds in [0, {MAX_WAIT_S:g}]")
    args = check_arguments(command, request.get("args", {}))
    assert isinstance(command, str)  # check_arguments refused any other
    return Request(command, args, float(wait))


def check_arguments(command: object, args: object) -> dict[str, JSON]:
    """``args`` of ``command`` checked: the names it takes, their types (a number is a
    finite int or float, never a bool), a hyperparameter's or event's name.

    Examples:
        >>> from graphmod._train._control import check_arguments
        >>> check_arguments("set", {"name": "dropout/rate", "value": 1})
        {'name': 'dropout/rate', 'value': 1.0}
        >>> check_arguments("set", {"name": "lr", "value": "0.1"})
        Traceback (most recent call last):
        ...
        graphmod._train._control.Refused: set: value must be a finite number, got str
    """
    if not isinstance(command, str) or command not in COMMANDS:
        shown = command if isinstance(command, str) else type(command).__name__
        raise Refused(f"unknown command {shown[:40]!r}; the commands are {', '.join(COMMANDS)}")
    if not isinstance(args, dict):
        raise Refused(f"{command}: args must be a JSON object")
    expected = _ARGUMENTS[command]
    unknown = sorted(set(args) - set(expected))
    missing = sorted(k for k, (_, required) in expected.items() if required and k not in args)
    if unknown or missing:
        wanted = ", ".join(f"{k} ({t.__name__})" for k, (t, _) in expected.items()) or "none"
        raise Refused(f"{command}: wrong arguments (unknown {unknown}, missing {missing}); "
                      f"it takes: {wanted}")
    checked: dict[str, JSON] = {}
    for key, value in args.items():
        kind = expected[key][0]
        if not (_number(value) if kind is float else isinstance(value, kind)):
            wanted = "a finite number" if kind is float else f"a {kind.__name__}"
            raise Refused(f"{command}: {key} must be {wanted}, got {type(value).__name__}")
        checked[key] = float(value) if kind is float else value
    name = checked.get("name")  # set's and event's, a string (checked above)
    if command == "set" and isinstance(name, str) and not _SETTING.fullmatch(name):
        raise Refused(f"set: {name[:80]!r} is not a hyperparameter's name (manager/hparam, "
                      "e.g. dropout/rate, or lr)")
    if command == "event" and isinstance(name, str) and (
            not _EVENT.fullmatch(name) or name in COMMANDS):
        raise Refused(f"event: {name[:80]!r} is not an event name (letters, digits, _ . -; "
                      f"not a command's name)")
    return checked


class RateLimit:
    """A token bucket: ``rate`` requests a second, bursts of up to ``burst``; thread-safe.

    Examples:
        >>> from graphmod._train._control import RateLimit
        >>> bucket = RateLimit(rate=1.0, burst=2)
        >>> [bucket.allow() for _ in range(3)]
        [True, True, False]
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self._tokens, self._last = self.burst, time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


# -- addresses ----------------------------------------------------------------------------
def parse_address(address: str | None) -> tuple[str, int] | None:
    """A TCP address ``"HOST:PORT"`` on the loopback interface as ``(ip, port)``; None (a
    Unix socket in the run directory) for None. HOST is a loopback IP (``127.0.0.1``,
    ``[::1]``) or ``localhost`` when it resolves to loopback addresses only; PORT 0 picks a
    free one. Anything else is refused before any socket is made: the control port would
    be reachable from other machines.

    Examples:
        >>> from graphmod._train._control import parse_address
        >>> parse_address("[::1]:8765")
        ('::1', 8765)
        >>> try:
        ...     parse_address("0.0.0.0:8765")
        ... except ValueError as error:
        ...     print(str(error).split(":")[2].strip())
        0.0.0.0 is not a loopback address
    """
    if address is None:
        return None
    fix = ("use 127.0.0.1:PORT, [::1]:PORT, localhost:PORT, or leave address out for a Unix "
           "socket in the run directory")
    where = f"Control(address={address!r})"
    if not isinstance(address, str):
        raise TypeError(f"{where}: expected a string 'HOST:PORT'; {fix}")
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535 or port != str(int(port)):
        raise ValueError(f"{where}: expected 'HOST:PORT' with a port in 0..65535; {fix}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, int(port),
                                                               type=socket.SOCK_STREAM)}
        except socket.gaierror as error:
            raise ValueError(f"{where}: localhost does not resolve ({error}); {fix}") from None
        outside = sorted(a for a in found if not ipaddress.ip_address(a).is_loopback)
        if outside or not found:
            raise ValueError(f"{where}: localhost resolves to {outside or 'nothing'}, not "
                             f"only to loopback addresses; {fix}")
        host = sorted(found)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{where}: {host!r} is not an IP address or localhost; {fix}") from None
    if not ip.is_loopback:
        raise ValueError(f"{where}: {host} is not a loopback address: a control port must "
                         f"not be reachable from other machines; {fix}")
    return str(ip), int(port)


def _unix_path(directory: str, directory_fd: int) -> str:
    """The path that reaches the socket of ``directory`` (opened as ``directory_fd``): its
    own when it fits a socket address, else through ``/proc/self/fd`` (Linux)."""
    path = os.path.join(directory, SOCKET_NAME)
    if len(os.fsencode(path)) <= _SUN_PATH:
        return path
    short = f"/proc/self/fd/{directory_fd}/{SOCKET_NAME}"
    if os.path.isdir("/proc/self/fd"):
        return short
    raise ValueError(f"Control: the socket path {path} is too long for a Unix socket; use a "
                     "shorter run directory or Control(address='127.0.0.1:0')")


def _connect(address: _Address, directory: str, directory_fd: int,
             timeout: float) -> socket.socket:
    """A socket connected to the endpoint ``address`` (a record's), or OSError."""
    if "tcp" in address:
        host, port = address["tcp"]
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        target: tuple[str, int] | str = (host, port)
    else:
        sock = socket.socket(socket.AF_UNIX)
        target = _unix_path(directory, directory_fd)
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except BaseException:
        sock.close()
        raise
    return sock


# -- the endpoint record --------------------------------------------------------------------
def _open_directory(directory: str) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def read_endpoint(directory_fd: int) -> _Endpoint | None:
    """The endpoint record in the directory ``directory_fd``: None if there is none, else
    the record, or ValueError saying why the file there is not graphmod's (a link, another
    user's, readable by others, too big, not graphmod's JSON); it is never changed."""
    try:
        fd = os.open(ENDPOINT_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=directory_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        why = "a symbolic link" if error.errno == errno.ELOOP else error.strerror
        raise ValueError(f"{ENDPOINT_NAME} is {why}, not graphmod's record") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{ENDPOINT_NAME} is not a file")
        if info.st_uid != os.getuid():
            raise ValueError(f"{ENDPOINT_NAME} belongs to another user (uid {info.st_uid})")
        if info.st_mode & 0o077:
            raise ValueError(f"{ENDPOINT_NAME} may be read by others (mode "
                             f"{stat.S_IMODE(info.st_mode):o}); graphmod writes it 600")
        data = os.read(fd, MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        record = None
    if not _is_record(record):
        raise ValueError(f"{ENDPOINT_NAME} does not hold graphmod's record")
    return record


def _is_record(record: object) -> TypeGuard[_Endpoint]:
    if not (isinstance(record, dict) and record.get("graphmod") == "control"
            and isinstance(record.get("token"), str) and _TOKEN.fullmatch(record["token"])
            and isinstance(record.get("pid"), int) and isinstance(record.get("host"), str)):
        return False
    address = record.get("address")
    if address == {"unix": SOCKET_NAME}:
        return True
    tcp = address.get("tcp") if isinstance(address, dict) and len(address) == 1 else None
    if not (isinstance(tcp, list) and len(tcp) == 2 and isinstance(tcp[0], str)
            and isinstance(tcp[1], int) and 0 < tcp[1] < 65536):
        return False
    try:
        return ipaddress.ip_address(tcp[0]).is_loopback
    except ValueError:
        return False


def _write_endpoint(directory_fd: int, record: _Endpoint) -> os.stat_result:
    """Creates the endpoint record (never over a file: ``O_EXCL``, no link followed)."""
    fd = os.open(ENDPOINT_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600, dir_fd=directory_fd)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


def _answers(record: _Endpoint, directory: str, directory_fd: int) -> bool:
    """Whether a run still listens where ``record`` says (a connection is accepted)."""
    if record["host"] != socket.gethostname():
        return True  # another machine's run (a shared file system): not ours to judge
    if "tcp" in record["address"]:
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's
    try:
        _connect(record["address"], directory, directory_fd, 0.5).close()
    except OSError:
        return False
    return True


def _remove_if_same(name: str, directory_fd: int, made: os.stat_result | None) -> None:
    """Removes ``name`` if it is still the file ``made`` (ours), never anything else."""
    if made is None:
        return
    with contextlib.suppress(OSError):
        there = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
        if (there.st_dev, there.st_ino) == (made.st_dev, made.st_ino):
            os.unlink(name, dir_fd=directory_fd)


def _clear_stale(directory: str, directory_fd: int) -> None:
    """Removes the record and socket a run that died left, or raises ValueError for a run
    still listening there or for files graphmod did not write (left as they are)."""
    record = read_endpoint(directory_fd)
    try:
        sock = os.stat(SOCKET_NAME, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        sock = None
    if sock is not None and not (stat.S_ISSOCK(sock.st_mode) and sock.st_uid == os.getuid()):
        raise ValueError(f"{SOCKET_NAME} is not a socket of this user's: not graphmod's")
    if record is None:
        if sock is not None:
            raise ValueError(f"{SOCKET_NAME} is a socket no {ENDPOINT_NAME} of graphmod's "
                             "names: not known to be graphmod's")
        return
    if _answers(record, directory, directory_fd):
        raise ValueError(f"another run (process {record['pid']} on host {record['host']}) is "
                         "controlled from this directory and still answers")
    if sock is not None:
        os.unlink(SOCKET_NAME, dir_fd=directory_fd)  # a dead run's: its record named it
    os.unlink(ENDPOINT_NAME, dir_fd=directory_fd)


# -- the server -----------------------------------------------------------------------------
Handler = Callable[[Request], "dict[str, JSON]"]


class ControlServer:
    """Serves requests for a run from a daemon thread: each connection sends one request
    line and gets one answer line, ``{"ok": true, ...}`` with what ``handler(request)``
    returned, or ``{"ok": false, "error": ...}``. Opened by :meth:`open` (files claimed,
    socket bound, record written, thread started), closed by :meth:`close` (thread stopped,
    the files it wrote removed); see the module docstring for the rules.

    Examples:
        >>> import tempfile
        >>> from graphmod._train._control import ControlServer, send_command
        >>> server = ControlServer(tempfile.mkdtemp(), None, lambda r: {"echo": r.command})
        >>> server.open()
        >>> send_command(server.directory, "status")
        {'ok': True, 'echo': 'status'}
        >>> server.close()
    """

    def __init__(self, directory: str, address: tuple[str, int] | None, handler: Handler, *,
                 requests_per_second: float = 20.0, connections: int = 8) -> None:
        self.directory = os.path.abspath(directory)
        self.address = address
        self._handler = handler
        self._rate = RateLimit(requests_per_second, max(requests_per_second, 1.0))
        self._slots = threading.BoundedSemaphore(connections)
        self._token = ""
        self._fd: int | None = None
        self._listener: socket.socket | None = None
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._made: dict[str, os.stat_result] = {}  # the files this server wrote
        self._created_directory = False

    def open(self) -> None:
        """Claims the run directory's control files and starts serving; a ValueError names
        what is in the way (nothing was changed)."""
        self._created_directory = not os.path.lexists(self.directory)
        os.makedirs(self.directory, exist_ok=True)
        self._fd = _open_directory(self.directory)
        try:
            try:
                _clear_stale(self.directory, self._fd)
            except ValueError as error:
                raise ValueError(f"Control: {self.directory}: {error} (left as it is); stop "
                                 "that run, move the file out, or pass Control(directory=...) "
                                 "another directory") from None
            self._token = secrets.token_hex(32)
            self._listener = self._listen()
            self._wake = os.pipe()
            self._thread = threading.Thread(target=self._accept, name="graphmod-control",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    def _record(self, address: _Address) -> _Endpoint:
        return {"graphmod": "control", "token": self._token, "pid": os.getpid(),
                "host": socket.gethostname(), "address": address,
                "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

    def _listen(self) -> socket.socket:
        """The listening socket, with the record written (before a Unix socket appears, so
        that the socket is known to be graphmod's; after a TCP bind, which picks the port)."""
        assert self._fd is not None
        if self.address is None:
            path = _unix_path(self.directory, self._fd)
            self._made[ENDPOINT_NAME] = _write_endpoint(self._fd, self._record(
                {"unix": SOCKET_NAME}))
            listener = socket.socket(socket.AF_UNIX)
            try:
                listener.bind(path)
                self._made[SOCKET_NAME] = os.stat(SOCKET_NAME, dir_fd=self._fd,
                                                  follow_symlinks=False)
                os.chmod(SOCKET_NAME, 0o600, dir_fd=self._fd)  # before listen: none connected
            except BaseException:
                listener.close()
                raise
        else:
            host, port = self.address
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((host, port))
                bound = listener.getsockname()[1]
                self._made[ENDPOINT_NAME] = _write_endpoint(self._fd, self._record(
                    {"tcp": (host, bound)}))  # JSON writes the pair as [ip, port]
            except BaseException:
                listener.close()
                raise
        listener.listen(16)
        listener.setblocking(False)
        return listener

    def _accept(self) -> None:
        assert self._listener is not None and self._wake is not None
        with selectors.DefaultSelector() as selector:  # waits without a timeout: no CPU
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake[0], selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._wake[0]:
                        return
                    try:
                        conn, _ = self._listener.accept()
                    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                        continue
                    except OSError:
                        return  # closed under us
                    if self._slots.acquire(blocking=False):
                        threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                         name="graphmod-control-request").start()
                    else:
                        _answer(conn, _encoded({"ok": False,
                                                "error": "busy: too many connections"}))

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(READ_TIMEOUT_S)
            try:
                line = _read_line(conn)
                if not self._rate.allow():
                    raise Refused("too many requests: slow down")
                request = parse_request(line, self._token)
                answer = _encoded({"ok": True, **self._handler(request)})
            except Refused as refused:
                answer = _encoded({"ok": False, "error": str(refused)})
            except Exception as error:  # a bug must not take the run down
                _log.warning("graphmod control: a request failed", exc_info=True)
                answer = _encoded({"ok": False, "error": f"the run failed to answer: "
                                                         f"{type(error).__name__}: {error}"})
            _answer(conn, answer)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stops serving and removes the socket and record this server wrote (if still
        the same files); does nothing when not open."""
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._fd is not None:
            _remove_if_same(SOCKET_NAME, self._fd, self._made.pop(SOCKET_NAME, None))
            _remove_if_same(ENDPOINT_NAME, self._fd, self._made.pop(ENDPOINT_NAME, None))
            os.close(self._fd)
            self._fd = None
            if self._created_directory:
                with contextlib.suppress(OSError):
                    os.rmdir(self.directory)  # only if empty
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None


def _read_line(conn: socket.socket) -> bytes:
    """The request line (without its newline): at most :data:`MAX_REQUEST_BYTES` bytes,
    within :data:`READ_TIMEOUT_S`; else Refused (the connection is then closed)."""
    data = b""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while b"\n" not in data:
        if len(data) > MAX_REQUEST_BYTES:
            break
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES + 2 - len(data))
        except TimeoutError:
            raise Refused(f"no request line within {READ_TIMEOUT_S:g} s") from None
        if not chunk:
            raise Refused("a request is one line of JSON ending with a newline")
        data += chunk
    line, newline, _ = data.partition(b"\n")
    if not newline or len(line) > MAX_REQUEST_BYTES:
        raise Refused(f"the request is longer than {MAX_REQUEST_BYTES} bytes")
    return line


def _encoded(answer: dict[str, JSON]) -> bytes:
    """``answer`` as one line of strict JSON (no NaN: the handlers write none)."""
    return json.dumps(answer, allow_nan=False).encode() + b"\n"


def _answer(conn: socket.socket, line: bytes) -> None:
    """Sends the answer ``line`` and closes ``conn`` (a client gone is ignored)."""
    with contextlib.suppress(OSError), conn:
        conn.settimeout(READ_TIMEOUT_S)
        conn.sendall(line)


# -- the client -----------------------------------------------------------------------------
def send_command(directory: str, command: str, args: Mapping[str, JSON] | None = None, *,
                 wait: float = 5.0) -> dict[str, JSON]:
    """Sends ``command`` to the run controlled from ``directory`` and returns its answer
    (``{"ok": true, ...}``, or ``{"ok": false, "error": ...}`` when refused). Raises
    :class:`NotRunning` when no run answers there (no record, a record that is not
    graphmod's, a socket nothing listens on, a refused connection, no answer within
    ``wait`` + a few seconds): every socket operation has a timeout.

    Examples:
        >>> import tempfile
        >>> from graphmod._train._control import NotRunning, send_command
        >>> try:
        ...     send_command(tempfile.mkdtemp(), "status")
        ... except NotRunning as error:
        ...     print(str(error).split(":")[1].strip())
        no run is controlled from it (no graphmod-control.json
    """
    directory = os.path.abspath(directory)
    try:
        fd = _open_directory(directory)
    except OSError as error:
        raise NotRunning(f"{directory}: not a run directory ({error.strerror})") from None
    try:
        try:
            record = read_endpoint(fd)
        except ValueError as error:
            raise NotRunning(f"{directory}: {error} (left as it is)") from None
        if record is None:
            raise NotRunning(f"{directory}: no run is controlled from it (no {ENDPOINT_NAME}: "
                             "a run writes it while it runs with graphmod.plugins.Control)")
        if record["host"] != socket.gethostname():
            raise NotRunning(f"{directory}: its run is on host {record['host']}; run "
                             "graphmod control there")
        line = json.dumps({"token": record["token"], "command": command,
                           "args": dict(args or {}), "wait": wait}).encode() + b"\n"
        try:
            with _connect(record["address"], directory, fd, CONNECT_TIMEOUT_S) as sock:
                sock.settimeout(wait + CONNECT_TIMEOUT_S + READ_TIMEOUT_S)
                sock.sendall(line)
                return _reply(sock, directory)
        except TimeoutError:
            raise NotRunning(f"{directory}: the run (process {record['pid']}) did not answer "
                             f"within {wait + CONNECT_TIMEOUT_S + READ_TIMEOUT_S:g} s") from None
        except OSError as error:
            raise NotRunning(f"{directory}: the run that listened there (process "
                             f"{record['pid']}) is gone ({error.strerror or error}); it left "
                             f"{ENDPOINT_NAME} behind") from None
    finally:
        os.close(fd)


def _reply(sock: socket.socket, directory: str) -> dict[str, JSON]:
    data = b""
    while b"\n" not in data and len(data) < 1 << 20:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    try:
        answer = json.loads(data.partition(b"\n")[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise NotRunning(f"{directory}: the run's answer could not be read")
    return answer


def command_request(command: str, argument: str | None, *, save: bool = True
                    ) -> tuple[str, dict[str, JSON]]:
    """The command and arguments ``graphmod control DIR COMMAND [ARG]`` sends: ``set`` takes
    ``NAME=VALUE`` (a number), ``event`` a name, the others nothing; ``save=False`` (the
    ``--no-save`` flag) only goes with ``stop``. A ValueError says what to write instead.

    Examples:
        >>> from graphmod._train._control import command_request
        >>> command_request("set", "dropout/rate=0.25"), command_request("stop", None, save=False)
        (('set', {'name': 'dropout/rate', 'value': 0.25}), ('stop', {'save': False}))
    """
    takes = {"set": "NAME=VALUE, e.g. set lr=0.001", "event": "a NAME, e.g. event evaluate"}
    if command in takes and argument is None:
        raise ValueError(f"{command} takes {takes[command]}")
    if command not in takes and argument is not None:
        raise ValueError(f"{command} takes no argument (got {argument!r})")
    if not save and command != "stop":
        raise ValueError("--no-save goes with stop only")
    if command == "set" and argument is not None:  # set takes one (checked above)
        name, equals, text = argument.partition("=")
        try:
            value = float(text)
        except ValueError:
            value = None
        if not equals or value is None or not math.isfinite(value):
            raise ValueError(f"set takes NAME=VALUE with VALUE a finite number, got "
                             f"{argument!r} (e.g. set lr=0.001)")
        return command, check_arguments(command, {"name": name, "value": value})
    if command == "event":
        return command, check_arguments(command, {"name": argument})
    return command, {} if save else {"save": False}


def answer_lines(command: str, answer: Mapping[str, JSON]) -> list[str]:
    """What ``graphmod control`` prints for ``answer`` to ``command`` (unescaped: the
    caller escapes it for the terminal).

    Examples:
        >>> from graphmod._train._control import answer_lines
        >>> answer_lines("status", {"ok": True, "step": 120, "epoch": 2, "paused": False,
        ...                         "steps_per_second": 50.0, "planned_steps": 200,
        ...                         "seconds_left": 1.6, "metrics": {"loss": 0.25}})
        ['step 120 of 200, epoch 2: running', '50 steps/s, about 1.6 s left', 'loss: 0.25']
        >>> answer_lines("pause", {"ok": True, "message": "paused at step 7"})
        ['paused at step 7']
    """
    if not answer.get("ok"):
        return [f"refused: {answer.get('error')}"]
    if command != "status":
        return [str(answer.get("message", "done"))]
    planned = answer.get("planned_steps")
    of = f" of {planned}" if planned is not None else ""
    lines = [f"step {answer.get('step')}{of}, epoch {answer.get('epoch')}: "
             + ("paused" if answer.get("paused") else "running")]
    rate, left = answer.get("steps_per_second"), answer.get("seconds_left")
    if isinstance(rate, int | float):
        lines.append(f"{rate:.3g} steps/s" + (f", about {left:.3g} s left"
                                               if isinstance(left, int | float) else ""))
    metrics = answer.get("metrics")
    if isinstance(metrics, dict):
        lines += [f"{name}: {value:.6g}" if isinstance(value, float) else f"{name}: {value}"
                  for name, value in metrics.items()]
    elif answer.get("metrics_pending"):
        lines.append("metrics: not ready yet (the step is still running)")
    return lines

