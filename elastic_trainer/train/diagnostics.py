"""Every worker's diagnostics endpoint, found through etcd and kept current across heals.

    diagnostics = Diagnostics.start(settings, env, connection)   # ElasticGroup, once a process
    diagnostics.register(env)        # every attempt (a start, a heal, a join): its rank and world
    diagnostics.profiler.tick()      # the loop, at every step's start
    diagnostics.keep_evidence(...)   # a heal: this rank's stacks and flight recorder, on disk
    diagnostics.close()

The endpoint is torch's C++ worker server (``torch._C._distributed_c10d._WorkerServer``, the one
``torch.distributed.debug`` builds on) with its handlers: ``dump_traceback`` (every thread's Python
stack, taken in C++ without the GIL, so a rank blocked in a collective or spinning in Python
answers), ``fr_trace_json`` (the flight recorder), ``wait_counter_values``, ``pyspy_dump`` (with
py-spy installed), and one of ours, :data:`~elastic_trainer.runtime.settings.DEBUG_PROFILE_HANDLER` (``?steps=N``: a ``torch.profiler``
trace of the loop's next N steps, Chrome trace JSON). None runs code it is sent. It listens on
``ELASTIC_TRAINER_DEBUG_HOST`` (default 127.0.0.1: this node only) on a free port, or on
``ELASTIC_TRAINER_DEBUG_PORT`` plus the local rank.

Instead of torch's TCPStore at MASTER_ADDR (there is none under the etcd rendezvous, and rank 0
may be the rank that died), each worker writes ``{rank, world_size, node, local_rank, pid, url}``
to ``debug/<node>/<local rank>`` under the run's keys at every attempt: a replacement overwrites
the dead process's entry, survivors write their new ranks after a heal. ``elastic-trainer debug``
takes, for each rank of the newest world, its newest entry (etcd's revisions order them). The
write runs on a short-lived thread: an etcd outage never holds training. Design:
``docs/design/diagnostics.md``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import http.server
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    _dump_fr_trace_json,
    _WorkerServer,
)
from torch.profiler import profile

from elastic_trainer.heal.healer import heal_rendezvous
from elastic_trainer.metrics.node_name import local_node_name
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.settings import DEBUG_PROFILE_HANDLER, WorkerSettings, debug_host_of
from rendezvous.etcd_client import EtcdConnection
from rendezvous.etcd_ops import put_key
from rendezvous.round_state import RunKeys
from rendezvous.settings import RendezvousSettings

log = logging.getLogger(__name__)

EVIDENCE_DIR = "diagnostics"
"""Beside the checkpoints: ``diagnostics/<epoch>-heal/`` of each heal in place and
``diagnostics/<attempt>-restart/`` of each group failure that restarts the group."""
KEEP_EVIDENCE = 8
"""Folders of evidence kept (the newest)."""
MAX_EVIDENCE_BYTES = 4 << 20
"""What one rank writes into one folder at most (its flight recorder is cut beyond it)."""
REGISTER_DEADLINE_S = 5.0


class StepProfiler:
    """A ``torch.profiler`` trace of the next N steps, asked for by the endpoint's thread and run
    by the loop's: :meth:`tick` at every step's start (one attribute read while nobody asks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = 0
        self._left = 0
        self._profile: Any = None
        self._done = threading.Event()
        self._trace: bytes | None = None

    def request(self, steps: int, timeout: float) -> bytes | None:
        """(the endpoint's thread) The trace of the next ``steps`` steps; ``None`` when another
        request runs or the steps did not end within ``timeout`` seconds."""
        with self._lock:
            if self._wanted or self._profile is not None:
                return None
            self._done.clear()
            self._trace = None
            self._wanted = steps
        if not self._done.wait(timeout):
            with self._lock:
                self._wanted = 0  # not started: nobody waits for it any more
            return None
        return self._trace

    def tick(self) -> None:
        """(the loop's thread, at a step's start) Start, count and end a requested trace."""
        if not self._wanted and self._profile is None:
            return
        if self._profile is None:
            with self._lock:
                self._left, self._wanted = self._wanted, 0
            self._profile = profile(record_shapes=True)
            self._profile.__enter__()
            return
        self._left -= 1
        if self._left > 0:
            return
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "trace.json")
            prof.export_chrome_trace(str(path))
            self._trace = path.read_bytes()
        self._done.set()


class _ProfileHandler(http.server.BaseHTTPRequestHandler):
    """``POST /handler/elastic_trainer_profile?steps=N&timeout=S`` on the profile server."""

    profiler: StepProfiler

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path != f"/handler/{DEBUG_PROFILE_HANDLER}":
            return self._answer(404, b"not found", "text/plain")
        try:
            steps = int(query.get("steps", ["5"])[0])
            timeout = float(query.get("timeout", ["60"])[0])
        except ValueError:
            return self._answer(400, b"steps and timeout are numbers", "text/plain")
        if not (1 <= steps <= 1000 and 0 < timeout <= 3600):
            return self._answer(400, b"steps: 1..1000, timeout: (0, 3600] s", "text/plain")
        trace = self.profiler.request(steps, timeout)
        if trace is None:
            return self._answer(
                503, b"no trace: busy, or the steps did not end in time", "text/plain"
            )
        return self._answer(200, trace, "application/json")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # no line per request in the worker's log


def _serve_profile(profiler: StepProfiler, host: str, port: int) -> http.server.HTTPServer:
    """The profile's own small server, on a daemon thread (idle: blocked in ``select``)."""
    handler = type("Handler", (_ProfileHandler,), {"profiler": profiler})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="diagnostics-profile", daemon=True).start()
    return server


class Diagnostics:
    """This worker's endpoint and its registration; see the module docstring."""

    def __init__(
        self, server: Any, url: str, slot: str, connection: EtcdConnection | None, key: str | None
    ) -> None:
        self.url, self.slot = url, slot
        self.profile_url: str | None = None
        self.profiler = StepProfiler()
        self._server, self._connection, self._key = server, connection, key
        self._profile_server: http.server.HTTPServer | None = None
        self._owns_connection = False

    @classmethod
    def start(
        cls, settings: WorkerSettings, env: DistEnv, connection: EtcdConnection | None
    ) -> Diagnostics | None:
        """Start the endpoint (``None`` where it is off or torch has none); ``connection``: the
        healer's, else one of its own to the job's etcd when the environment names it."""
        if settings.debug_host is None or not env.launched:
            return None
        base = settings.debug_port
        try:
            with _quiet_stderr():  # c10d logs "Server listening to TCP host:0" as a warning
                server = _WorkerServer(settings.debug_host, base + env.local_rank if base else 0)
            profile = base + env.local_world_size + env.local_rank if base else 0
            profiler = StepProfiler()
            profile_server = _serve_profile(profiler, settings.debug_host, profile)
        except (RuntimeError, OSError) as exc:
            log.warning("no diagnostics endpoint: %s", exc)
            return None
        host = settings.debug_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        url = f"http://{host}:{server.port}"
        node = settings.node or local_node_name(os.getppid())  # plain torchrun: the agent's pid
        slot = f"{node}/{env.local_rank}"
        owns, key = False, None
        if settings.run_id and (connection is not None or settings.heal.endpoint):
            try:
                rendezvous = heal_rendezvous(settings.heal, settings.run_id)
                if connection is None:
                    connection, owns = EtcdConnection(rendezvous.client_config()), True
                key = RunKeys.from_settings(rendezvous).debug + slot
            except Exception as exc:  # noqa: BLE001 - diagnostics never stop training
                log.warning("the diagnostics endpoint is not registered: %s", exc)
        diagnostics = cls(server, url, slot, connection, key)
        diagnostics._owns_connection = owns
        diagnostics._profile_server = profile_server
        diagnostics.profiler = profiler
        diagnostics.profile_url = f"http://{host}:{profile_server.server_address[1]}"
        return diagnostics

    def register(self, env: DistEnv) -> None:
        """Write this process's entry for ``env`` (its rank and world now), on a thread."""
        if self._connection is None or self._key is None:
            return
        node, _, local = self.slot.rpartition("/")
        entry = {
            "rank": env.rank,
            "world_size": env.world_size,
            "node": node,
            "local_rank": int(local),
            "pid": os.getpid(),
            "url": self.url,
            "profile_url": self.profile_url,
            "unix": time.time(),
        }
        _register(self._connection, self._key, entry)

    def keep_evidence(self, directory: str | None, folder: str, rank: int, evidence: str) -> None:
        """Write ``evidence`` (:func:`capture_evidence`'s) as ``rank<r>.txt`` in
        ``<directory>/diagnostics/<folder>/``; rank 0 keeps the newest :data:`KEEP_EVIDENCE`."""
        if directory is None:
            return
        root = Path(directory, EVIDENCE_DIR)
        try:
            (root / folder).mkdir(parents=True, exist_ok=True)
            (root / folder / f"rank{rank}.txt").write_text(evidence)
            if rank == 0:
                for old in sorted(p for p in root.iterdir() if p.is_dir())[:-KEEP_EVIDENCE]:
                    shutil.rmtree(old, ignore_errors=True)
                cause = folder.rpartition("-")[2]
                log.warning(
                    "%s: diagnostics of the %s in %s (each survivor's stacks and flight recorder "
                    "as the group failed)",
                    cause,
                    cause,
                    root / folder,
                )
        except OSError as exc:
            log.warning("diagnostics not kept in %s: %s", root / folder, exc)

    def close(self) -> None:
        """Stop answering (the entry stays: a replacement overwrites it, ``debug`` skips it)."""
        server, self._server = self._server, None
        if server is not None:
            stop_endpoint(server)
        if self._profile_server is not None:
            self._profile_server.shutdown()
            self._profile_server.server_close()
            self._profile_server = None
        if self._owns_connection and self._connection is not None:
            self._connection.close()
        self._connection = None


def _register(
    connection: EtcdConnection, key: str, entry: dict[str, Any], *, close: bool = False
) -> None:
    """Put ``entry`` at ``key`` on a short-lived thread (``close``: the connection after it)."""

    def put() -> None:
        try:
            put_key(
                connection,
                key,
                json.dumps(entry).encode(),
                what="a diagnostics registration",
                deadline=time.monotonic() + REGISTER_DEADLINE_S,
            )
        except Exception as exc:  # noqa: BLE001 - diagnostics never stop training
            log.warning("the diagnostics endpoint is not registered: %s", exc)
        finally:
            if close:
                connection.close()

    threading.Thread(target=put, name="diagnostics-register", daemon=True).start()


def start_launcher_endpoint(rendezvous: RendezvousSettings, node: str) -> Any:
    """The launcher's own endpoint (torch's server: its threads' stacks), registered as
    ``debug/<node>/launcher`` with ``role: launcher``; ``None`` where it is off."""
    host = debug_host_of(os.environ)
    if host is None:
        return None
    try:
        with _quiet_stderr():
            server = _WorkerServer(host, 0)
        connection = EtcdConnection(rendezvous.client_config())
    except (RuntimeError, ValueError) as exc:
        log.warning("no diagnostics endpoint for the launcher: %s", exc)
        return None
    advertised = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
    entry = {"role": "launcher", "node": node, "pid": os.getpid(),
             "url": f"http://{advertised}:{server.port}", "unix": time.time()}  # fmt: skip
    _register(
        connection, f"{RunKeys.from_settings(rendezvous).debug}{node}/launcher", entry, close=True
    )
    return server


def stop_endpoint(server: Any) -> None:
    """Stop torch's server (its "Server shutting down" and "Server exited" lines kept quiet)."""
    with _quiet_stderr():
        server.shutdown()


def capture_evidence(url: str | None, cause: str) -> str:
    """This process's stacks (every thread) and flight recorder now, as text."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        stacks = out.read()
    try:
        trace = _dump_fr_trace_json(True, True)
    except RuntimeError as exc:
        trace = f"(no flight recorder: {exc})"
    head = f"pid {os.getpid()} {cause} at {time.strftime('%Y-%m-%d %H:%M:%S')} endpoint {url}\n"
    text = f"{head}\n== stacks\n{stacks}\n== flight recorder (fr_trace_json)\n{trace}\n"
    return text[:MAX_EVIDENCE_BYTES]


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """fd 2 to /dev/null for the C++ call inside (a warning that says nothing to a user)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
