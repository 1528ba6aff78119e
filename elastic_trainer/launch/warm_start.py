"""Warm worker start: restarted workers are forked from a process that has already imported torch.

    python -m elastic_trainer.launch.warm_start serve --dir DIR --parent-fd FD --preload torch,...
    python -u -m elastic_trainer.launch.warm_start --socket DIR/server.sock -- -m MODULE ARGS...

``elastic-trainer run`` starts one warm server per node; torchrun starts each worker as a tiny
client that has the server fork the real worker with the client's stdio, environment, working
directory and arguments, forwards signals to it and exits with its status, so torchrun sees no
difference. Invariants: the server never initialises CUDA (it refuses to serve if the driver got
initialised) and never imports prometheus-client; a client that cannot use the server starts cold
after one line; no worker outlives its client or the launcher. The client is stdlib-only. Design:
``docs/design/warm-start.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from elastic_trainer.launch.janitor import OwnedDir
from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.atomic_files import write_atomically
from elastic_trainer.runtime.settings import (
    ENV_HEAL,
    ENV_HEAL_JOIN,
    ENV_HEAL_MARKER,
    ENV_STOPPING_FILE,
)

SOCKET_NAME = "server.sock"
FAILED_NAME = "server.failed"
WORKERS_DIR = "workers"
DIR_PREFIX = "elastic-trainer-warm-"
MAX_SOCKET_PATH = 100
"""Bytes of a unix socket path we rely on (Linux allows 107 plus the terminating NUL)."""

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.nn.parallel",
    torch_compat.DYNAMO_MODULE,
    "torch.utils.data",
    "elastic_trainer.train.trainer",
    "elastic_trainer.checkpoint.files",
    "elastic_trainer.runtime.failures",
    "elastic_trainer.train.worker_entry",
)
"""Imported by the server before it serves: what every runtime worker imports anyway. Never
``prometheus_client`` (nor the metrics modules): its multiprocess mode is fixed at import, before
the launcher has created the workers' directory."""

CONNECT_WAIT_S = 120.0
"""How long a client waits for a server that is still importing before it starts cold."""

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""Signals a client passes on to its worker's process group."""

_HEADER = struct.Struct("!I")
_MAX_REQUEST = 16 << 20


class WarmStartError(RuntimeError):
    """The warm server cannot start a worker (the client then starts cold)."""


# -- wire format: length-prefixed JSON, the request carrying three file descriptors ------------------
def _send_message(sock: socket.socket, payload: dict[str, object], fds: Sequence[int] = ()) -> None:
    body = json.dumps(payload).encode()
    data = _HEADER.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise EOFError("connection closed")
        chunks += chunk
    return bytes(chunks)


def _recv_message(sock: socket.socket, *, with_fds: int = 0) -> tuple[dict[str, object], list[int]]:
    fds: list[int] = []
    if with_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, with_fds)
        if not data:
            raise EOFError("connection closed")
        head = data + _recv_exact(sock, _HEADER.size - len(data))
    else:
        head = _recv_exact(sock, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    if size > _MAX_REQUEST:
        raise WarmStartError(f"message of {size} bytes is too large")
    message = json.loads(_recv_exact(sock, size))
    if not isinstance(message, dict):
        raise WarmStartError("message is not a JSON object")
    return message, fds


# -- the server ----------------------------------------------------------------------------------------
CUDA_ERROR_NOT_INITIALIZED = 3
"""What every CUDA driver call but ``cuInit`` returns in a process that never initialised the driver."""


def cuda_driver_initialized(
    maps: str | None = None, *, load: Callable[..., Any] | None = None
) -> bool:
    """Whether this process initialised the CUDA driver (``cuInit``), after which a ``fork`` is unsafe.

    A mapped ``libcuda`` is not enough to refuse (torch's CUDA builds map it at import). Each
    driver copy already loaded is asked (``RTLD_NOLOAD``) with ``cuCtxGetCurrent``, which answers
    ``CUDA_ERROR_NOT_INITIALIZED`` without initialising anything; a driver that cannot be asked
    counts as initialised. See ``docs/design/warm-start.md``.

    Args:
        maps: the text of ``/proc/self/maps`` (for tests); read when ``None``.
        load: ``ctypes.CDLL`` (for tests).
    """
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return False
    # The path is the sixth field and may hold spaces; a replaced file ends in " (deleted)".
    paths = {line.split(maxsplit=5)[-1].removesuffix(" (deleted)") for line in maps.splitlines()
             if "libcuda.so" in line and len(line.split(maxsplit=5)) == 6}  # fmt: skip
    if not paths:
        return False
    load = load or ctypes.CDLL
    asked = False
    for name in (
        "libcuda.so.1",
        *sorted(paths),
    ):  # the soname finds the copy the loader knows by it
        try:
            driver = load(name, mode=os.RTLD_NOLOAD)
            context = ctypes.c_void_p()
            answer = int(driver.cuCtxGetCurrent(ctypes.byref(context)))
        except (OSError, AttributeError):
            continue
        if answer != CUDA_ERROR_NOT_INITIALIZED:
            return True
        asked = True
    return not asked


@dataclass
class _Worker:
    pid: int
    conn: socket.socket
    client_pid: int


@dataclass
class _Server:
    directory: Path
    listener: socket.socket
    parent_pipe: int
    wakeup_read: int
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    by_pid: dict[int, _Worker] = field(default_factory=dict)
    by_conn: dict[int, _Worker] = field(default_factory=dict)

    def serve_forever(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.parent_pipe, selectors.EVENT_READ, "parent")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "parent":
                    if not os.read(self.parent_pipe, 4096):
                        return  # the launcher is gone
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_read, 4096)
                    self._reap()
                else:
                    self._client_event(key.data)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            conn.settimeout(10.0)
            request, fds = _recv_message(conn, with_fds=3)
            if len(fds) != 3:
                raise WarmStartError(f"expected 3 file descriptors, got {len(fds)}")
            pid = os.fork()
        except (OSError, EOFError, ValueError, WarmStartError) as exc:
            with contextlib.suppress(OSError):
                _send_message(conn, {"error": f"{type(exc).__name__}: {exc}"})
            conn.close()
            return
        if pid == 0:
            _become_worker(self, conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        client_pid = int(request.get("client_pid", 0))  # type: ignore[call-overload]
        worker = _Worker(pid, conn, client_pid)
        self.by_pid[pid] = worker
        self.by_conn[conn.fileno()] = worker
        with contextlib.suppress(OSError):
            write_atomically(
                self.directory / WORKERS_DIR / str(client_pid), str(pid).encode(), durable=False
            )
        try:
            _send_message(conn, {"pid": pid})
        except OSError:
            self._kill(worker)
            return
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, conn.fileno())

    def _client_event(self, conn_fd: int) -> None:
        worker = self.by_conn.get(conn_fd)
        if worker is None:
            return
        try:
            data = worker.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client died (or was killed): its worker must not outlive it
            self._kill(worker)

    def _kill(self, worker: _Worker) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.by_pid.pop(pid, None)
            if worker is None:
                continue
            self.by_conn.pop(worker.conn.fileno(), None)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(worker.conn)
            with contextlib.suppress(OSError):
                worker.conn.setblocking(True)
                _send_message(worker.conn, {"returncode": os.waitstatus_to_exitcode(status)})
            worker.conn.close()
            with contextlib.suppress(OSError):
                (self.directory / WORKERS_DIR / str(worker.client_pid)).unlink()

    def shutdown(self) -> None:
        for worker in list(self.by_pid.values()):
            self._kill(worker)


def _become_worker(
    server: _Server, conn: socket.socket, request: dict[str, object], fds: list[int]
) -> None:
    """In the forked child: turn into the worker the client asked for; never returns."""
    code = 1
    try:
        os.setsid()  # like torchrun's start_new_session=True: the worker leads its own group
        signal.set_wakeup_fd(-1)
        for sig in (
            signal.SIGCHLD,
            signal.SIGTERM,
            signal.SIGHUP,
            signal.SIGQUIT,
            signal.SIGUSR1,
            signal.SIGUSR2,
        ):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with contextlib.suppress(OSError):
            server.selector.close()
        for fd in (
            server.listener.fileno(),
            server.parent_pipe,
            server.wakeup_read,
            conn.fileno(),
            *(w.conn.fileno() for w in server.by_pid.values()),
        ):
            with contextlib.suppress(OSError):
                os.close(fd)
        for target_fd, fd in enumerate(fds):
            os.dup2(fd, target_fd)
            os.close(fd)
        env = request["env"]
        argv = request["argv"]
        if not isinstance(env, dict) or not isinstance(argv, list) or not argv:
            raise WarmStartError("bad request")
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        os.chdir(str(request["cwd"]))
        _reopen_stdio()
        _reseed_inherited_rngs()
        _apply_thread_settings()
        from elastic_trainer.train import worker_entry

        code = worker_entry.run([str(word) for word in argv])  # classifies and records a failure
    except BaseException:  # noqa: BLE001 - a failure of the fork itself: print it like python does
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        # End like a normal interpreter exit, without the server's inherited C++ teardown.
        from elastic_trainer.runtime.process_exit import exit_process

        exit_process(code)


def _reopen_stdio() -> None:
    """Fresh ``sys.std*`` over fds 0-2, unbuffered like ``python -u``."""
    encoding = os.environ.get("PYTHONIOENCODING", "").split(":")[0] or None
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=encoding)
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding=encoding, line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding=encoding,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )


def _reseed_inherited_rngs() -> None:
    """A fresh interpreter seeds these from the OS; forked siblings must not share a stream.
    (``random`` reseeds itself after ``fork``; torch's default generator starts from a fixed
    seed in a fresh process anyway.)"""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _apply_thread_settings() -> None:
    """OpenMP read ``OMP_NUM_THREADS`` when the server loaded torch; honour the worker's value."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if (
        torch is not None
        and wanted.isdigit()
        and int(wanted) > 0
        and torch.get_num_threads() != int(wanted)
    ):
        torch.set_num_threads(int(wanted))


def serve(directory: Path, preload: Sequence[str], parent_pipe: int) -> int:
    """The server's main: preload, then fork workers on request until the launcher goes away."""
    # torch.cuda.is_available() asks NVML instead of initialising the driver, should a preloaded
    # module call it (the workers take their clients' environments, so this stays here).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        _preload(preload)
    except BaseException as exc:  # noqa: BLE001 - any failure: tell clients to start cold, say why once
        if not directory.exists():
            return 0  # the launcher already stopped (e.g. a user error): nobody to tell
        return _unavailable(directory, parent_pipe, f"{type(exc).__name__}: {exc}".splitlines()[0])
    try:
        for name in (WORKERS_DIR, HEALS_DIR, DEATHS_DIR):
            (directory / name).mkdir(exist_ok=True)
    except FileNotFoundError:
        return 0  # the launcher stopped while we were importing
    wakeup_read = _wake_on_signals()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    scratch = directory / (SOCKET_NAME + ".tmp")
    try:
        listener.bind(str(scratch))
        listener.listen(64)
        os.replace(scratch, directory / SOCKET_NAME)  # the socket appears only once it accepts
    except FileNotFoundError:
        return 0  # the launcher stopped while we were starting
    except OSError as exc:  # e.g. a socket path too long: tell clients to start cold, once
        return _unavailable(
            directory, parent_pipe, f"cannot listen on {scratch}: {exc.strerror or exc}"
        )
    server = _Server(directory, listener, parent_pipe, wakeup_read)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
        _remove(directory)  # also when the launcher was SIGKILLed and could not clean up
    return 0


def _preload(modules: Sequence[str]) -> None:
    """Import ``modules``; raises if that left the server unsafe to fork workers from."""
    for name in modules:
        importlib.import_module(name)
    if cuda_driver_initialized():
        raise WarmStartError(
            "the CUDA driver got initialised while preloading; forking would be unsafe"
        )
    if "prometheus_client" in sys.modules:
        raise WarmStartError(
            "the preload imported prometheus_client, whose metrics mode is fixed at import "
            "(before the workers' PROMETHEUS_MULTIPROC_DIR exists)"
        )


def _unavailable(directory: Path, parent_pipe: int, reason: str) -> int:
    """Tell clients (once, in :data:`FAILED_NAME`) and the user why workers start cold; keep the
    reason readable while the launcher runs, then clean up. The server's exit status."""
    with contextlib.suppress(OSError):
        write_atomically(directory / FAILED_NAME, reason.encode(), durable=False)
    print(
        f"elastic-trainer: warm start unavailable ({reason}); workers start cold",
        file=sys.stderr,
        flush=True,
    )
    _wait_for_eof(parent_pipe)
    _remove(directory)
    return 1


def _wake_on_signals() -> int:
    """Set the server's signal handling; the read end of the pipe a SIGCHLD wakes."""
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_read, False)
    os.set_blocking(wakeup_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's pipe decides when we stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C goes to the launcher and its workers
    return wakeup_read


def _wait_for_eof(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass


def _remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


# -- the launcher's side ---------------------------------------------------------------------------------
@dataclass
class WarmStartServer:
    """Handle the launcher keeps on its node's warm server."""

    directory: Path
    _pipe_write: int
    _owner: OwnedDir | None = None

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET_NAME

    @property
    def stopping_file(self) -> Path:
        """Exists while the agent stops its workers (:meth:`agent_stopping`)."""
        return self.directory / STOPPING_NAME

    @contextlib.contextmanager
    def agent_stopping(self) -> Iterator[None]:
        """Mark the agent's stop of its workers: their signals are the launcher's, not a kill."""
        with contextlib.suppress(OSError):
            self.stopping_file.touch()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self.stopping_file.unlink()

    def client_args(self, target_args: Sequence[str]) -> list[str]:
        """torchrun's ``-m MODULE ARGS`` for a worker: the client, then the real target."""
        return ["-m", __name__, "--socket", str(self.socket_path), "--", *target_args]

    def wait_ready(self, timeout: float = CONNECT_WAIT_S) -> bool:
        """Wait until the server serves (``True``) or gave up / timed out (``False``).

        The launcher waits before it joins the rendezvous: a node joining a running job then
        interrupts the others only once its own workers can start at once.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket_path.exists():
                return True
            if (self.directory / FAILED_NAME).exists() or not self.directory.exists():
                return False
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the server (it SIGKILLs any worker still running) and remove its directory."""
        with contextlib.suppress(OSError):
            os.close(self._pipe_write)
        _remove(self.directory)
        if self._owner is not None:
            self._owner.release()


def start_server(preload: Sequence[str]) -> WarmStartServer:
    """Start this node's warm server in the background; it preloads while the rendezvous runs.

    The directory is ``$TMPDIR/elastic-trainer-warm-<launcher pid>-<random>``, mode 0700.
    """
    owner = OwnedDir(DIR_PREFIX)  # locked by the launcher: see janitor.sweep_stale
    if len(os.fsencode(owner.path / (SOCKET_NAME + ".tmp"))) > MAX_SOCKET_PATH:
        owner.release()  # a deep $TMPDIR: unix socket paths are limited to ~107 bytes
        shutil.rmtree(owner.path, ignore_errors=True)
        owner = OwnedDir(DIR_PREFIX, "/tmp")
    directory = owner.path
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    cmd = [
        sys.executable,
        "-u",
        "-m",
        __name__,
        "serve",
        "--dir",
        str(directory),
        "--parent-fd",
        str(read_end),
        "--preload",
        ",".join(preload),
    ]
    starter = subprocess.Popen(cmd, pass_fds=(read_end,), stdin=subprocess.DEVNULL, close_fds=True)
    os.close(read_end)
    starter.wait()  # the starter forks the server and exits at once
    return WarmStartServer(directory, write_end, owner)


def worker_pids(launcher_pid: int, child_pids: Sequence[int]) -> list[int]:
    """The processes running the target among a launcher's children: a warm client is replaced by
    the worker forked for it (when it has one yet); other children are returned as they are."""
    registries = sorted(
        Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}{launcher_pid}-*/{WORKERS_DIR}")
    )
    found: list[int] = []
    for pid in child_pids:
        worker = None
        for registry in registries:
            with contextlib.suppress(OSError, ValueError):
                worker = int((registry / str(pid)).read_text())
                break
        found.append(worker if worker is not None else pid)
    return found


# -- the client ------------------------------------------------------------------------------------------
def _connect(socket_path: Path, deadline: float) -> socket.socket:
    failed = socket_path.with_name(FAILED_NAME)
    while True:
        if failed.exists():
            raise WarmStartError(failed.read_text().strip() or "the warm server failed")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(socket_path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if not socket_path.parent.exists():
                raise WarmStartError("the warm server's directory is gone") from exc
            if time.monotonic() >= deadline:
                raise WarmStartError(
                    f"no warm server on {socket_path} after {CONNECT_WAIT_S:g} s"
                ) from exc
            time.sleep(0.02)


def _start_cold(target_args: Sequence[str], reason: str) -> NoReturn:
    print(
        f"elastic-trainer: warm start unavailable ({reason}); starting this worker cold",
        file=sys.stderr,
        flush=True,
    )
    os.execv(
        sys.executable,
        [sys.executable, "-u", "-m", "elastic_trainer.train.worker_entry", *target_args],
    )


HEALS_DIR = "heals"
"""Under the server's directory: a worker that heals in place creates ``heals/<client pid>``."""
STOPPING_NAME = "agent-stopping"
"""Under the server's directory: exists while the launcher's agent stops its workers."""
MAX_REPLACEMENTS = 100
"""Replacements one client starts at most (a worker that dies at every start is the agent's)."""
DEATHS_DIR = "deaths"
"""Under the server's directory: one file per replaced worker, its one-line root cause, for the
launcher to report when the heal it caused is done (:func:`take_deaths`)."""


def record_death(directory: Path, text: str) -> None:
    """Leave ``text`` (one line) for the launcher; never raises (the report is best effort)."""
    with contextlib.suppress(OSError):
        write_atomically(
            directory / DEATHS_DIR / f"{time.time_ns()}-{os.getpid()}", text.encode(), durable=False
        )


def take_deaths(directory: Path) -> list[str]:
    """The root causes :func:`record_death` left, oldest first; each is read once (then removed)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for path in sorted((directory / DEATHS_DIR).iterdir(), key=lambda p: p.name):
            with contextlib.suppress(OSError):
                found.append(path.read_text(errors="replace").strip())
                path.unlink()
    return [text for text in found if text]


def _fork_worker(
    sock_path: Path, target_args: Sequence[str], env: dict[str, str]
) -> tuple[socket.socket, int]:
    sock = _connect(sock_path, time.monotonic() + CONNECT_WAIT_S)
    _send_message(
        sock,
        {"argv": list(target_args), "env": env, "cwd": os.getcwd(), "client_pid": os.getpid()},
        fds=(0, 1, 2),
    )
    reply, _ = _recv_message(sock)
    if "pid" not in reply:
        sock.close()
        raise WarmStartError(str(reply.get("error", "the warm server refused")))
    return sock, int(reply["pid"])  # type: ignore[call-overload]


def run_client(socket_path: Path, target_args: Sequence[str]) -> int:
    """Have the warm server fork the worker, stand in for it, return (or die with) its status.

    When the job heals in place, a worker that died of a signal (SIGKILL, a crash, a SIGTERM not
    sent by the launcher) is replaced by a new one that joins its running peers; the agent sees
    nothing (it would restart every worker). A signal the launcher's agent sends while it stops
    its workers (:data:`STOPPING_NAME` exists) is passed on and ends the worker for good.
    Only a worker that said it heals in place (it created its marker file: the Trainer does; a
    script with its own loop does not) is replaced."""
    env = dict(os.environ)
    marker = socket_path.parent / HEALS_DIR / str(os.getpid())
    env[ENV_HEAL_MARKER] = str(marker)
    try:
        sock, worker_pid = _fork_worker(socket_path, target_args, env)
    except (OSError, EOFError, ValueError, WarmStartError) as exc:
        _start_cold(target_args, str(exc) or type(exc).__name__)
    current = [worker_pid]
    stopping = [False]
    stopping_file = env.get(ENV_STOPPING_FILE)

    def forward(signum: int, _frame: object) -> None:
        # The launcher's stop (its file exists) ends the worker for good; any other signal is a
        # kill of this process tree: the worker, if it heals in place, ends like a crash and is
        # replaced below (see elastic_trainer.runtime.signals.lone_signal).
        if not stopping_file or os.path.exists(stopping_file):
            stopping[0] = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(current[0], signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    replacements = 0
    while True:
        try:
            status, _ = _recv_message(sock)
            returncode = int(status["returncode"])  # type: ignore[call-overload]
        except (OSError, EOFError, ValueError, KeyError):
            # The server vanished (its launcher died): the worker went with it.
            return 1
        sock.close()
        heals = env.get(ENV_HEAL, "").strip().lower() in ("in_place", "1") and marker.exists()
        if not _replaces(returncode, heals=heals, stopping=stopping[0], replacements=replacements):
            break
        replacements += 1
        death = f"local worker {env.get('LOCAL_RANK', '?')} (pid {current[0]}) died of {signal.Signals(-returncode).name}"
        print(
            f"elastic-trainer: {death}; starting a replacement that joins its peers in place",
            file=sys.stderr,
            flush=True,
        )
        record_death(socket_path.parent, death)
        env[ENV_HEAL_JOIN] = "1"
        try:
            sock, current[0] = _fork_worker(socket_path, target_args, env)
        except (OSError, EOFError, ValueError, WarmStartError) as exc:
            print(
                f"elastic-trainer: no replacement ({exc}); leaving it to the agent",
                file=sys.stderr,
                flush=True,
            )
            break
    return _exit_like(returncode)


def _replaces(returncode: int, *, heals: bool, stopping: bool, replacements: int) -> bool:
    """Whether a worker that ended with ``returncode`` is replaced by one that joins its peers:
    it heals in place, a signal killed it, the launcher is not stopping it, and fewer than
    :data:`MAX_REPLACEMENTS` replaced it before."""
    return heals and returncode < 0 and not stopping and replacements < MAX_REPLACEMENTS


def _exit_like(returncode: int) -> int:
    """The client's exit status for its worker's; killed by a signal, it dies the same way so
    torchrun sees the same status."""
    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        time.sleep(1.0)
        return 128 - returncode
    return returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        parser = argparse.ArgumentParser(prog="elastic_trainer.launch.warm_start serve")
        parser.add_argument("--dir", required=True, type=Path)
        parser.add_argument("--parent-fd", required=True, type=int)
        parser.add_argument("--preload", default="")
        options = parser.parse_args(args[1:])
        if os.fork() > 0:  # detach: the server is not one of the launcher's worker processes
            os._exit(0)
        os.setsid()
        code = serve(options.dir, [m for m in options.preload.split(",") if m], options.parent_fd)
        # Skip the interpreter's teardown: with torch (and torch._dynamo) preloaded, its garbage
        # collection takes seconds, and the launcher's exit waits for this process to end.
        from elastic_trainer.runtime.process_exit import exit_process

        exit_process(code)
    if len(args) < 4 or args[0] != "--socket" or args[2] != "--":
        print(
            "usage: python -m elastic_trainer.launch.warm_start --socket PATH -- (-m MODULE | SCRIPT) [ARGS...]",
            file=sys.stderr,
        )
        return 2
    return run_client(Path(args[1]), args[3:])


if __name__ == "__main__":
    sys.exit(main())
