"""A private network of Linux network namespaces, to partition one node from the others.

    hub namespace:   bridge br0 (198.18.0.1/24) + etcd on 198.18.0.1:2379
    node namespaces: eth0 (198.18.0.11/24, .12, ...), a veth pair whose other end is on br0

Every address lives only inside namespaces created here (198.18.0.0/15 is reserved for network
tests, RFC 2544) and nothing is added to the host's own namespace, so ports are fixed: each
namespace is empty. :meth:`Network.partition` takes a node's link down on the hub side (its
packets are dropped silently, as in a real partition: no reset, no error, just silence) and
:meth:`Network.heal` brings it back. :meth:`Network.close` kills what runs in the namespaces and
deletes them; use it as a context manager, so that happens even when a run fails. Needs root
(``ip netns``): without it, entering the context raises ``PermissionError`` with the failing
command. Used by ``benchmarks/recovery.py --scenarios partition`` and the chaos suite
(``tests/chaos/test_partition.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from rendezvous.etcd_server import find_etcd_binary

SUBNET = "198.18.0"
HUB_ADDRESS = f"{SUBNET}.1"
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise PermissionError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class Network:
    """The namespaces of the module docstring for ``nodes`` (names of a few letters)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.nodes = list(nodes)
        self.prefix = f"chaos-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.hub = f"{self.prefix}-hub"
        self._created: list[str] = []
        self._etcd: subprocess.Popen[bytes] | None = None

    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def address(self, node: str) -> str:
        return f"{SUBNET}.{11 + self.nodes.index(node)}"

    @property
    def etcd_endpoint(self) -> str:
        return f"{HUB_ADDRESS}:{ETCD_CLIENT_PORT}"

    def _hub_link(self, node: str) -> str:
        return f"v-{node}"

    def __enter__(self) -> Network:
        try:
            for ns in (self.hub, *map(self.namespace, self.nodes)):
                _ip("netns", "add", ns)
                self._created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for node in self.nodes:
                ns, hub_end = self.namespace(node), self._hub_link(node)
                _ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    hub_end,
                    "netns",
                    self.hub,
                )
                _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
                _ip("-n", self.hub, "link", "set", hub_end, "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_prefix(self, node: str | None) -> list[str]:
        """Command prefix that runs a program in ``node``'s namespace (the hub's for ``None``)."""
        return ["ip", "netns", "exec", self.hub if node is None else self.namespace(node)]

    def start_etcd(self, data_dir: Path, timeout: float = 30.0) -> str:
        """Start a one-member etcd in the hub namespace; returns its endpoint once it is healthy."""
        url = f"http://{HUB_ADDRESS}:{ETCD_CLIENT_PORT}"
        peer = f"http://{HUB_ADDRESS}:{ETCD_PEER_PORT}"
        data_dir.mkdir(parents=True, exist_ok=True)
        with open(data_dir.parent / "etcd-hub.log", "ab") as log:
            self._etcd = subprocess.Popen(
                [
                    *self.exec_prefix(None),
                    find_etcd_binary(),
                    "--name",
                    "hub",
                    "--data-dir",
                    str(data_dir),
                    "--listen-client-urls",
                    url,
                    "--advertise-client-urls",
                    url,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"hub={peer}",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        probe = (
            "import json,sys,urllib.request;"
            f"sys.exit(0 if json.load(urllib.request.urlopen('{url}/health',timeout=1))['health'] in ('true',True) else 1)"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._etcd.poll() is not None:
                raise RuntimeError(
                    f"etcd in {self.hub} exited with {self._etcd.returncode}; see {data_dir.parent}"
                )
            if (
                subprocess.run(
                    [*self.exec_prefix(None), sys.executable, "-c", probe],
                    capture_output=True,
                    timeout=10,
                ).returncode
                == 0
            ):
                return self.etcd_endpoint
            time.sleep(0.1)
        raise RuntimeError(f"etcd in {self.hub} not healthy within {timeout:g} s")

    def partition(self, node: str) -> None:
        """Cut ``node`` off from every other node and from etcd (packets silently dropped)."""
        _ip("-n", self.hub, "link", "set", self._hub_link(node), "down")

    def heal(self, node: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_link(node), "up")

    def close(self) -> None:
        """Stop etcd, kill anything still inside the namespaces, delete them (idempotent)."""
        if self._etcd is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._etcd.pid, signal.SIGKILL)
            self._etcd.wait(10)
            self._etcd = None
        for ns in reversed(self._created):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._created.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()
