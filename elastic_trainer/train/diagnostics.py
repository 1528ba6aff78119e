"""Every worker's diagnostics endpoint, found through etcd and kept current across heals.

    diagnostics = Diagnostics.start(settings, env, connection)   # ElasticGroup, once a process
    diagnostics.register(env)        # every attempt (a start, a heal, a join): its rank and world
    diagnostics.profiler.tick()      # the loop, at every step's start
    diagnostics.keep_evidence(...)   # a heal or a restart: this rank's stacks and flight recorder
    diagnostics.close()

The endpoint is one small stdlib HTTP server on a daemon thread (idle in ``select``; it takes the
GIL only to answer), listening on ``ELASTIC_TRAINER_DEBUG_HOST`` (default 127.0.0.1: this node
only) on a free port or on ``ELASTIC_TRAINER_DEBUG_PORT`` plus the local rank. ``POST
/handler/<name>``, the names of torch's worker server: ``dump_traceback`` (every thread's stack,
``faulthandler``), ``fr_trace_json`` (the flight recorder), ``pyspy_dump`` (native frames, with
py-spy installed), ``wait_counter_values`` (from torch's own C++ server, started in this process
on the first such request), and ``elastic_trainer_profile?steps=N`` (a ``torch.profiler`` trace of
the loop's next N steps); a launcher's also ``elastic_trainer_recent_lines`` (its newest log
lines). None runs code it is sent. Why not torch's server throughout (its pool
of one thread per core, and the GIL at its shutdown): ``docs/design/diagnostics.md``.

Instead of torch's TCPStore at MASTER_ADDR (there is none under the etcd rendezvous, and rank 0
may be the rank that died), each worker writes ``{rank, world_size, node, local_rank, pid, url}``
to ``debug/<node>/<local rank>`` under the run's keys at every attempt: a replacement overwrites
the dead process's entry, survivors write their new ranks after a heal. ``elastic-trainer debug``
takes, for each rank of the newest world, its newest entry (etcd's revisions order them). The
write runs on a short-lived thread: an etcd outage never holds training. After a heal, rank 0
adds each launcher's recent lines and stacks to the heal's folder (``launcher-<node>.txt``).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import http.server
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    _dump_fr_trace_json,
    _WorkerServer,
)
from torch.profiler import profile

from elastic_trainer.heal.healer import Healer, failure_reason, heal_rendezvous
from elastic_trainer.metrics.node_name import local_node_name
from elastic_trainer.runtime.distributed import DistEnv
from elastic_trainer.runtime.settings import (
    DEBUG_PROFILE_HANDLER,
    RECENT_LINES_HANDLER,
    WorkerSettings,
    debug_host_of,
)
from rendezvous.etcd_client import EtcdConnection
from rendezvous.etcd_ops import get_range, put_key
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
PYSPY_TIMEOUT_S = 20.0
RECENT_LINES = 200
LAUNCHER_TIMEOUT_S = 2.0
"""How long rank 0 waits for the launchers' view after a heal (all asked at once, on a thread
of its own; the registry's read has the same bound)."""


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


def stacks_text() -> str:
    """Every thread's Python stack now (``faulthandler``: the main thread's block is the last)."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        return out.read()


def flight_recorder_json() -> str:
    """torch's flight recorder as JSON (empty entries where nothing was recorded)."""
    dump = _dump_fr_trace_json(True, True)
    return dump.decode(errors="replace") if isinstance(dump, bytes) else str(dump)


class _Torch:
    """torch's own C++ worker server, started on the first request that needs it (its wait
    counters): it keeps a pool of one thread per core, idle, from then on."""

    _lock = threading.Lock()
    _server: Any = None
    _port: int | None = None

    @classmethod
    def ask(cls, name: str) -> bytes:
        with cls._lock:
            if cls._port is None:
                cls._server = _WorkerServer("127.0.0.1", 0)
                cls._port = int(cls._server.port)
        request = urllib.request.Request(
            f"http://127.0.0.1:{cls._port}/handler/{name}", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return bytes(response.read())


class _Handler(http.server.BaseHTTPRequestHandler):
    """``POST /handler/<name>`` (see the module docstring)."""

    profiler: StepProfiler
    recent: RecentLines | None = None
    """A launcher's: its recent log lines, the ``elastic_trainer_recent_lines`` handler."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlsplit(self.path)
        name = url.path.removeprefix("/handler/")
        try:
            if name == "dump_traceback":
                return self._answer(200, stacks_text().encode(), "text/plain")
            if name == RECENT_LINES_HANDLER and self.recent is not None:
                return self._answer(200, self.recent.text().encode(), "text/plain")
            if name == "fr_trace_json":
                return self._answer(200, flight_recorder_json().encode(), "application/json")
            if name == "wait_counter_values":
                return self._answer(200, _Torch.ask(name), "application/json")
            if name == "pyspy_dump":
                return self._pyspy()
            if name == DEBUG_PROFILE_HANDLER:
                return self._profile(urllib.parse.parse_qs(url.query))
        except Exception as exc:  # noqa: BLE001 - an answer, never a dead endpoint
            return self._answer(500, f"{type(exc).__name__}: {exc}".encode(), "text/plain")
        return self._answer(404, b"not found", "text/plain")

    def _pyspy(self) -> None:
        spy = shutil.which("py-spy")
        if spy is None:
            return self._answer(501, b"py-spy is not installed on this node", "text/plain")
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(os.getpid())],
            capture_output=True, timeout=PYSPY_TIMEOUT_S, check=False,
        )  # fmt: skip
        return self._answer(
            200 if done.returncode == 0 else 500, done.stdout + done.stderr, "text/plain"
        )

    def _profile(self, query: dict[str, list[str]]) -> None:
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


class RecentLines(logging.Handler):
    """The newest :data:`RECENT_LINES` log lines of this process (a launcher's view of its job:
    what reaches its root logger, the ``elastic-trainer:`` lines and torch's agent's warnings;
    the launcher logs at WARNING, so its INFO lines are not among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        self._lines: collections.deque[str] = collections.deque(maxlen=RECENT_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - a line that cannot be formatted is dropped
            return

    def text(self) -> str:
        with self.lock or contextlib.nullcontext():  # emit runs under the same lock
            lines = list(self._lines)
        return "\n".join(lines) + "\n"


def serve(
    host: str, port: int, profiler: StepProfiler, recent: RecentLines | None = None
) -> tuple[http.server.HTTPServer, str]:
    """The endpoint on a daemon thread, and the URL others reach it at."""
    handler = type("Handler", (_Handler,), {"profiler": profiler, "recent": recent})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="diagnostics", daemon=True).start()
    advertised = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
    return server, f"http://{advertised}:{server.server_address[1]}"


class Diagnostics:
    """This worker's endpoint and its registration; see the module docstring."""

    def __init__(
        self,
        server: http.server.HTTPServer,
        url: str,
        node: str,
        local_rank: int,
        profiler: StepProfiler,
        connection: EtcdConnection | None,
        registry: str | None,
        *,
        owns_connection: bool,
    ) -> None:
        self.url, self.node, self.local_rank, self.profiler = url, node, local_rank, profiler
        self._server, self._connection, self._registry = server, connection, registry
        """The run's registry prefix (``debug/``); this process's entry is ``<node>/<local>``."""
        self._key = None if registry is None else f"{registry}{node}/{local_rank}"
        self._owns_connection = owns_connection

    @classmethod
    def start(
        cls, settings: WorkerSettings, env: DistEnv, healer: Healer | None
    ) -> Diagnostics | None:
        """Start the endpoint (``None`` where it is off); registered through the healer's etcd
        connection and settings, else a connection of its own to the job's etcd when the
        environment names it."""
        if settings.debug_host is None or not env.launched:
            return None
        profiler = StepProfiler()
        port = settings.debug_port + env.local_rank if settings.debug_port else 0
        try:
            server, url = serve(settings.debug_host, port, profiler)
        except OSError as exc:
            log.warning("no diagnostics endpoint: %s", exc)
            return None
        node = settings.node or local_node_name(os.getppid())  # plain torchrun: the agent's pid
        connection, owns, registry = None, False, None
        if healer is not None:
            connection, rendezvous = healer.connection, healer.rendezvous
        elif settings.run_id and settings.heal.endpoint:
            try:
                rendezvous = heal_rendezvous(settings.heal, settings.run_id)
                connection, owns = EtcdConnection(rendezvous.client_config()), True
            except Exception as exc:  # noqa: BLE001 - diagnostics never stop training
                log.warning("the diagnostics endpoint is not registered: %s", exc)
        if connection is not None:
            registry = RunKeys.from_settings(rendezvous).debug
        return cls(
            server, url, node, env.local_rank, profiler, connection, registry, owns_connection=owns
        )

    def register(self, env: DistEnv) -> None:
        """Write this process's entry for ``env`` (its rank and world now), on a thread."""
        if self._connection is None or self._key is None:
            return
        entry = {"rank": env.rank, "world_size": env.world_size, "node": self.node,
                 "local_rank": self.local_rank, "pid": os.getpid(), "url": self.url,
                 "unix": time.time()}  # fmt: skip
        _register(self._connection, self._key, entry)

    def evidence(self, env: DistEnv, exc: BaseException) -> str:
        """This rank's stacks and flight recorder now, headed by the failure (see
        :func:`capture_evidence`)."""
        cause = f"rank {env.rank} of {env.world_size}: {failure_reason(exc)}"
        return capture_evidence(self.url, cause)

    def keep_evidence(
        self,
        directory: str | None,
        folder: str,
        rank: int,
        evidence: str,
        *,
        launchers: bool = False,
    ) -> None:
        """Write ``evidence`` (:func:`capture_evidence`'s) as ``rank<r>.txt`` in
        ``<directory>/diagnostics/<folder>/``; rank 0 keeps the newest :data:`KEEP_EVIDENCE`, and
        with ``launchers`` (a heal: the job goes on) adds the launchers' view on a thread."""
        if directory is None:
            return
        root = Path(directory, EVIDENCE_DIR)
        try:
            (root / folder).mkdir(parents=True, exist_ok=True)
            (root / folder / f"rank{rank}.txt").write_text(evidence)
            if rank == 0:
                for old in sorted(p for p in root.iterdir() if p.is_dir())[:-KEEP_EVIDENCE]:
                    shutil.rmtree(old, ignore_errors=True)
            if rank == 0 and launchers:
                threading.Thread(
                    target=self._keep_launchers, args=(root / folder,), name="diagnostics-launchers",
                    daemon=True,
                ).start()  # fmt: skip
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

    def keep_restart(self, directory: str | None, env: DistEnv, exc: BaseException) -> None:
        """(the loop, as its group failed and will restart) This rank's evidence in
        ``diagnostics/<attempt>-restart/``, written before the just-in-time save: the agent's
        SIGTERM that follows it ends the process."""
        if directory is not None:
            folder = f"{env.restart_count:06d}-restart"
            self.keep_evidence(directory, folder, env.rank, self.evidence(env, exc))

    def _keep_launchers(self, folder: Path) -> None:
        """(rank 0, on a thread) The view of the launchers of the live ranks' nodes beside the
        ranks' evidence, as ``launcher-<node>.txt``: its recent lines (what it saw of the fault)
        and its stacks, all asked at once, within :data:`LAUNCHER_TIMEOUT_S`."""
        connection, registry = self._connection, self._registry
        if connection is None or registry is None:
            return
        try:
            found = get_range(connection, registry, prefix=True, what="the launchers' entries",
                              retry_timeout=LAUNCHER_TIMEOUT_S)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - diagnostics never stop training
            log.warning("the launchers' view is not kept: %s", exc)
            return
        kvs = list(found.kvs)
        launchers = launchers_of(kvs, {rank.node for rank in live_ranks(kvs)[0]})
        with ThreadPoolExecutor(max_workers=2) as pool:
            recent, stacks = pool.map(
                lambda name: ask(launchers, name, LAUNCHER_TIMEOUT_S),
                (RECENT_LINES_HANDLER, "dump_traceback"),
            )
        for launcher, lines, frames in zip(launchers, recent, stacks, strict=True):
            parts = [f"{launcher.title()} at {launcher.url}"]
            for title, answer in (("recent lines", lines), ("stacks", frames)):
                body = answer.body.decode(errors="replace") if answer.body is not None else None
                parts.append(f"== {title}\n{body if body is not None else f'({answer.error})'}")
            with contextlib.suppress(OSError):
                (folder / f"launcher-{launcher.node}.txt").write_text(
                    "\n".join(parts)[:MAX_EVIDENCE_BYTES]
                )

    def close(self) -> None:
        """Stop answering (the entry stays: a replacement overwrites it, ``debug`` skips it)."""
        stop_endpoint(self._server)
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


# -- reading the registry (``elastic-trainer debug``, and rank 0 for the launchers' view) ----------
@dataclass(frozen=True, slots=True)
class Rank:
    """One rank's newest entry."""

    rank: int
    world_size: int
    node: str
    local_rank: int
    pid: int
    url: str
    revision: int

    @property
    def stem(self) -> str:
        """Its files' name in ``--out``."""
        return f"rank{self.rank}" if self.rank >= 0 else f"launcher-{self.node}"

    def title(self) -> str:
        if self.rank < 0:
            return f"launcher of node {self.node} (pid {self.pid})"
        return f"rank {self.rank} (node {self.node}, local {self.local_rank}, pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Answer:
    rank: Rank
    body: bytes | None
    """``None``: no answer within the bound (see :attr:`error`)."""
    error: str | None
    seconds: float


def launchers_of(kvs: list[Any], nodes: set[str]) -> list[Rank]:
    """The launchers' entries (``role: launcher``) of ``nodes``, as ranks numbered -1."""
    found = []
    for kv in kvs:
        try:
            data = json.loads(kv.value)
            if data.get("role") == "launcher" and data["node"] in nodes:
                found.append(Rank(-1, 0, str(data["node"]), -1, int(data["pid"]),
                                  str(data["url"]), int(kv.mod_revision)))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(found, key=lambda launcher: launcher.node)


def live_ranks(kvs: list[Any]) -> tuple[list[Rank], list[int]]:
    """The newest world's ranks from the registry's ``kvs``: the newest entry (by revision) of
    each rank, and the ranks of that world with none."""
    entries: list[Rank] = []
    for kv in kvs:
        try:
            data = json.loads(kv.value)
            entries.append(
                Rank(int(data["rank"]), int(data["world_size"]), str(data["node"]),
                     int(data["local_rank"]), int(data["pid"]), str(data["url"]),
                     int(kv.mod_revision))
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue  # not an entry of ours: skipped
    if not entries:
        return [], []
    world = max(entries, key=lambda e: e.revision).world_size
    newest: dict[int, Rank] = {}
    for entry in sorted(entries, key=lambda e: e.revision):
        if entry.rank < world:
            newest[entry.rank] = entry
    return [newest[r] for r in sorted(newest)], [r for r in range(world) if r not in newest]


def ask(ranks: list[Rank], handler: str, timeout: float) -> list[Answer]:
    """POST ``/handler/<handler>`` to every rank at once; each answer within ``timeout``."""

    def one(rank: Rank) -> Answer:
        started = time.monotonic()
        request = urllib.request.Request(f"{rank.url}/handler/{handler}", data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return Answer(rank, response.read(), None, time.monotonic() - started)
        except urllib.error.HTTPError as exc:
            reason = exc.read().decode(errors="replace").strip() or exc.reason
            return Answer(rank, None, f"answered {exc.code}: {reason}", time.monotonic() - started)
        except (OSError, ValueError) as exc:
            return Answer(rank, None, _no_answer(exc, timeout), time.monotonic() - started)

    pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(ranks))))
    futures = [pool.submit(one, rank) for rank in ranks]
    wait_all(futures, timeout=timeout + 0.5)
    pool.shutdown(wait=False, cancel_futures=True)
    return [
        f.result() if f.done() else Answer(r, None, _no_answer(TimeoutError(), timeout), timeout)
        for f, r in zip(futures, ranks, strict=True)
    ]


def _no_answer(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError) or "timed out" in str(exc):
        return f"no answer within {timeout:g} s (a stopped or hung process, or its host is unreachable)"
    return f"no answer: {exc}"


def start_launcher_endpoint(rendezvous: RendezvousSettings, node: str) -> Any:
    """The launcher's own endpoint (its threads' stacks), registered as ``debug/<node>/launcher``
    with ``role: launcher``; ``None`` where it is off."""
    host = debug_host_of(os.environ)
    if host is None:
        return None
    recent = RecentLines()
    try:
        server, url = serve(host, 0, StepProfiler(), recent)
        connection = EtcdConnection(rendezvous.client_config())
    except (OSError, ValueError) as exc:
        log.warning("no diagnostics endpoint for the launcher: %s", exc)
        return None
    logging.getLogger().addHandler(recent)
    entry = {"role": "launcher", "node": node, "pid": os.getpid(), "url": url, "unix": time.time()}
    _register(
        connection, f"{RunKeys.from_settings(rendezvous).debug}{node}/launcher", entry, close=True
    )
    return server


def stop_endpoint(server: http.server.HTTPServer) -> None:
    """Stop answering and close the listening socket (a launcher's: its lines' handler too)."""
    server.shutdown()
    server.server_close()
    recent = getattr(server.RequestHandlerClass, "recent", None)
    if recent is not None:
        logging.getLogger().removeHandler(recent)


def capture_evidence(url: str | None, cause: str) -> str:
    """This process's stacks (every thread) and flight recorder now, as text."""
    try:
        trace = flight_recorder_json()
    except RuntimeError as exc:
        trace = f"(no flight recorder: {exc})"
    head = f"pid {os.getpid()} {cause} at {time.strftime('%Y-%m-%d %H:%M:%S')} endpoint {url}\n"
    text = f"{head}\n== stacks\n{stacks_text()}\n== flight recorder (fr_trace_json)\n{trace}\n"
    return text[:MAX_EVIDENCE_BYTES]
