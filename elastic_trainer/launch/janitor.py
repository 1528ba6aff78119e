"""Nothing outlives the launcher: a tiny process that cleans up after it, however it ends.

``elastic-trainer run`` starts one (``python -m elastic_trainer.launch.janitor LAUNCHER_PID``)
before anything else and registers, over the janitor's stdin, what must not outlive it:
directories, pids, and the environment marker its workers carry. When the launcher ends, even by
SIGKILL, the janitor reads end-of-file, stops those processes (SIGTERM, then SIGKILL after
:data:`GRACE_S`) and removes the directories. It is no child of the launcher, ignores
SIGINT/SIGTERM, and is stdlib-only. Design: ``docs/design/launcher.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

GRACE_S = 3.0
"""Seconds a registered process gets between SIGTERM and SIGKILL."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): tells a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    """Whether ``pid`` is the same process and has not ended (a zombie has ended: only its
    parent's ``wait`` is missing, and no signal changes that)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] != "Z" and (started is None or fields[19] == started)


def _matching_pids(paths: Iterable[str], markers: Iterable[str]) -> list[int]:
    """Processes whose command line mentions one of ``paths`` (e.g. ``--data-dir PATH``) or whose
    environment holds one of ``markers`` (``KEY=VALUE``: the launcher's workers)."""
    wanted = [p.encode() for p in paths if p]
    entries = {m.encode() for m in markers if m}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = set((entry / "environ").read_bytes().split(b"\0")) if entries else set()
        except OSError:
            continue
        if any(path in cmdline for path in wanted) or entries & environ:
            found.append(int(entry.name))
    return found


def clean_up(
    pids: dict[int, str | None],
    paths: list[str],
    markers: Iterable[str] = (),
    *,
    grace_s: float = GRACE_S,
    spare: Iterable[int] = (),
) -> None:
    """Stop ``pids`` (pid -> start time), any process naming ``paths`` and any process whose
    environment holds one of ``markers`` (never those in ``spare``); then remove ``paths``."""
    targets = {pid: started for pid, started in pids.items() if _alive(pid, started)}
    for pid in _matching_pids(paths, markers):
        targets.setdefault(pid, _start_time(pid))
    for pid in spare:
        targets.pop(pid, None)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in targets.items()):
        time.sleep(0.05)
    for pid, started in targets.items():
        if _alive(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


STALE_PREFIXES = ("elastic-trainer-metrics-", "elastic-trainer-warm-")
"""Temporary directories a launcher names ``<prefix><its pid>-<random>`` (see :func:`sweep_stale`)."""

OWNER_LOCK = ".owner.lock"
"""A file in each such directory that its launcher holds an exclusive ``flock`` on while it runs."""


class OwnedDir:
    """A temporary directory ``<prefix><pid>-<random>`` whose owner holds :data:`OWNER_LOCK`.

    The kernel drops the lock when the owner ends, however it ends, so :func:`sweep_stale` can
    tell a live owner from a dead one even where the pid says nothing: another pid namespace (a
    container) sharing the same temp dir, or a pid reused since.
    """

    def __init__(self, prefix: str, directory: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=directory))
        self._fd: int | None = os.open(self.path / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: never contended

    def release(self) -> None:
        """Drop the lock (idempotent); the directory itself is the caller's to remove."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _owner_alive(path: Path, pid: str) -> bool:
    """Whether the launcher that made ``path`` still runs: its :data:`OWNER_LOCK` is held, or,
    for a directory without one (made by an older launcher), its pid runs a process here."""
    try:
        fd = os.open(path / OWNER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return Path(f"/proc/{pid}").exists()
    except OSError:
        return True  # not ours to judge (permissions): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its owner runs, in this pid namespace or another
    finally:
        os.close(fd)
    return False


def sweep_stale(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the directories launchers that are gone left in ``directory`` (the temp dir by
    default): those named ``<prefix><pid>-...`` (:data:`STALE_PREFIXES`) whose owner lock
    (:class:`OwnedDir`) nobody holds. Normally a launcher's janitor removes them when it ends;
    this is for a launcher killed together with its janitor. Returns what was removed."""
    base = Path(directory if directory is not None else tempfile.gettempdir())
    removed = []
    for prefix in STALE_PREFIXES:
        for path in base.glob(prefix + "*"):
            pid = path.name[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or not path.is_dir() or _owner_alive(path, pid):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def serve(commands: IO[str], *, launcher: int) -> int:
    """Read registrations until end-of-file, then clean up (never touching ``launcher``)."""
    pids: dict[int, str | None] = {}
    paths: list[str] = []
    markers: list[str] = []
    for line in commands:
        kind, _, value = line.rstrip("\n").partition(" ")
        if kind == "pid" and value.isdigit():
            pids[int(value)] = _start_time(int(value))
        elif kind == "forget-pid" and value.isdigit():
            pids.pop(int(value), None)
        elif kind == "path" and value:
            paths.append(value)
        elif kind == "forget-path":
            with contextlib.suppress(ValueError):
                paths.remove(value)
        elif kind == "env" and "=" in value:
            markers.append(value)
    clean_up(pids, paths, markers, spare=(launcher,))
    return 0


class Janitor:
    """The launcher's handle: register what must not outlive it; :meth:`close` at a normal exit."""

    def __init__(self) -> None:
        starter = subprocess.Popen(
            [sys.executable, "-m", "elastic_trainer.launch.janitor", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        starter.wait()  # it forks the janitor and exits: the janitor is no child of ours
        self._proc = starter

    def _send(self, line: str) -> None:
        if self._proc.stdin is None or self._proc.stdin.closed:
            return
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()

    def remove_on_exit(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` (and stop processes naming it) once the launcher is gone."""
        self._send(f"path {os.fspath(path)}")

    def stop_processes_with_env(self, key: str, value: str) -> None:
        """Stop every process whose environment has ``key=value`` (this launcher's workers)."""
        self._send(f"env {key}={value}")

    def stop_on_exit(self, pid: int) -> None:
        """Stop process ``pid`` once the launcher is gone."""
        self._send(f"pid {pid}")

    def close(self, timeout: float = 10.0) -> None:
        """Normal exit: the janitor cleans whatever is left; wait (bounded) until it is done."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        if self._proc.stdout is not None:
            with selectors.DefaultSelector() as selector:
                selector.register(self._proc.stdout, selectors.EVENT_READ)
                selector.select(timeout)  # readable at end-of-file: the janitor finished
            self._proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    launcher = int(args[0]) if args and args[0].isdigit() else os.getppid()
    if (
        os.fork() > 0
    ):  # detach: the starter exits, the janitor is re-parented away from the launcher
        os._exit(0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        return serve(sys.stdin, launcher=launcher)
    finally:
        sys.stdout.close()  # tells a waiting launcher that the clean-up is done


if __name__ == "__main__":
    sys.exit(main())
