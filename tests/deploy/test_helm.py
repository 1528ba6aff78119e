"""The Helm chart, rendered by the real Helm engine (helm-python-sdk) and checked offline.

Every ci/ value file is rendered, linted and validated against pinned Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors); Prometheus Operator resources, which
core schemas do not cover, are checked against the subset of their CRD schema the chart uses.
Invariants tie the pod spec to the values: launcher arguments, images, resources, security
contexts, grace periods, volumes, etcd wiring, network policies. Bad values must be refused
with a clear message, by values.schema.json or by the validateValues helper.

    pytest tests/deploy/test_helm.py
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rendezvous.etcd_server import free_port
from tests.deploy.conftest import (
    CHART_DIR,
    CI_VALUES,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    Manifests,
    ci_values_or_skip,
    ci_values_param,
    cli_dry_run,
    http_json,
    import_or_missing,
    kinds,
    load_values,
    only,
    require_dashboard,
    require_etcd_binary,
)
from tests.support.tls_pki import make_pki

pytestmark = pytest.mark.timeout(60)

LINT_INFO_ALLOWED = {"icon is recommended"}
SEVERITY_WARNING = 2


# ------------------------------------------------------------------------------------ helpers
def pod_specs(docs: Manifests) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload."""
    specs = []
    for _, doc in docs:
        if doc["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet"):
            specs.append(
                (f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"])
            )
    return specs


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def trainer(docs: Manifests) -> dict[str, Any]:
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    [container] = [c for c in spec["containers"] if c["name"] == "trainer"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def launcher_options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split `run --k=v ... (-m MODULE | SCRIPT) JOB_ARGS` into ({k: v}, [target, *job args])."""
    assert args[0] == "run", args
    options: dict[str, str] = {}
    rest = args[1:]
    while rest and rest[0].startswith("--"):
        key, sep, value = rest.pop(0)[2:].partition("=")
        assert sep, f"launcher option without '=': --{key}"
        assert key not in options, f"--{key} given twice"
        options[key] = value
    return options, rest


def merged(chart: Any, values: dict[str, Any]) -> dict[str, Any]:
    return chart.merge_values(values)


def deep_set(values: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node = out
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


# ------------------------------------------------------------------------------------ lint
@pytest.mark.parametrize("values_file", ci_values_param())
def test_helm_lint_is_clean(helm: Any, values_file: Path) -> None:
    values = ci_values_or_skip(values_file)
    for kube_version in KUBE_VERSIONS:
        report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{kube_version}")
        assert report["errors"] == [], report
        problems = [
            m
            for m in report["messages"]
            if m["severity"] >= SEVERITY_WARNING
            or m["error"].split(": ")[-1] not in LINT_INFO_ALLOWED
        ]
        assert problems == [], problems


def test_every_ci_values_file_exists() -> None:
    names = {path.name for path in CI_VALUES}
    assert names == {
        "defaults-values.yaml",
        "gpu-values.yaml",
        "external-etcd-tls-values.yaml",
        "bundled-etcd-tls-values.yaml",
        "monitoring-values.yaml",
    }


# ------------------------------------------------------------------------------------ schemas
def _validate_core(kubernetes_validate: Any, doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


CRD_GROUP = "monitoring.coreos.com/v1"
_ENDPOINT = {
    "type": "object",
    "required": ["port", "path", "interval", "scrapeTimeout"],
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
        "scrapeTimeout": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
    },
}
_MONITOR_REQUIRED = ["selector", "namespaceSelector"]
_MONITOR_SPEC: dict[str, Any] = {
    "type": "object",
    "required": _MONITOR_REQUIRED,
    "additionalProperties": False,
    "properties": {
        "selector": {
            "type": "object",
            "required": ["matchLabels"],
            "additionalProperties": False,
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "additionalProperties": {"type": "string"},
                }
            },
        },
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "matchNames": {"type": "array", "minItems": 1, "items": {"type": "string"}}
            },
        },
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
        "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
    },
}
# The part of the prometheus-operator CRDs (monitoring.coreos.com/v1) this chart emits.
CRD_SCHEMAS = {
    kind: {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": CRD_GROUP},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name", "namespace", "labels"],
                "properties": {
                    "name": {
                        "type": "string",
                        "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                        "maxLength": 63,
                    },
                    "namespace": {"type": "string", "minLength": 1},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
            "spec": {**_MONITOR_SPEC, "required": [*_MONITOR_REQUIRED, endpoints_key]},
        },
    }
    for kind, endpoints_key in (
        ("PodMonitor", "podMetricsEndpoints"),
        ("ServiceMonitor", "endpoints"),
    )
}


def validate_all(kubernetes_validate: Any, docs: Manifests) -> list[str]:
    """Validate every manifest; returns the kinds checked (to prove nothing was skipped)."""
    jsonschema = import_or_missing("jsonschema", "jsonschema")
    checked = []
    for template, doc in docs:
        if doc["kind"] in CRD_SCHEMAS:
            errors = sorted(
                jsonschema.Draft7Validator(CRD_SCHEMAS[doc["kind"]]).iter_errors(doc), key=str
            )
            assert not errors, f"{template}: {[e.message for e in errors]}"
        else:
            for version in KUBE_VERSIONS:
                try:
                    _validate_core(kubernetes_validate, doc, version)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(
                        f"{template} ({doc['kind']}) invalid for Kubernetes {version}: "
                        f"{list(exc.path)}: {exc.message}"
                    )
        checked.append(doc["kind"])
    return checked


@pytest.mark.parametrize("values_file", ci_values_param())
def test_every_manifest_validates_against_kubernetes_schemas(
    render: Any, kubernetes_validate: Any, values_file: Path
) -> None:
    docs = render(ci_values_or_skip(values_file))
    checked = validate_all(kubernetes_validate, docs)
    assert len(checked) == len(docs) and "Job" in checked


def test_service_monitor_variant_validates(render: Any, kubernetes_validate: Any) -> None:
    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert "ServiceMonitor" in validate_all(kubernetes_validate, docs)


def test_validator_rejects_an_unknown_field(render: Any, kubernetes_validate: Any) -> None:
    """Negative control: strict validation really catches a mistyped field."""
    job = copy.deepcopy(only(render(), "Job"))
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core(kubernetes_validate, job, KUBE_VERSIONS[0])


def test_one_resource_per_template(render: Any) -> None:
    docs = render({"metrics": {"podMonitor": {"enabled": True}}})
    templates = [template for template, _ in docs]
    assert len(templates) == len(set(templates)), templates


# ------------------------------------------------------------------------------------ launcher
@pytest.mark.parametrize("values_file", ci_values_param())
def test_launcher_arguments_match_values(chart: Any, render: Any, values_file: Path) -> None:
    values = ci_values_or_skip(values_file)
    v = merged(chart, values)
    docs = render(values)
    container = trainer(docs)
    assert "command" not in container, "command would replace the image's dumb-init entrypoint"
    options, target = launcher_options(container["args"])
    w = v["workers"]

    assert options["nnodes"] == f"{w['minNodes']}:{w['maxNodes']}"
    assert options["nproc-per-node"] == str(w["nprocPerNode"])
    assert options["max-restarts"] == str(w["maxRestarts"])
    assert options["metrics-port"] == str(w["metricsPort"])
    assert options["metrics-addr"] == "0.0.0.0"
    assert only(docs, "Job")["spec"]["parallelism"] == w["replicas"]

    run_id = w["runId"] or f"{NAMESPACE}-{RELEASE}-$(JOB_UID)"
    assert options["run-id"] == run_id

    if v["etcd"]["mode"] == "external":
        assert options["rdzv-endpoint"] == ",".join(v["etcd"]["external"]["endpoints"])
    else:
        sts = only(docs, "StatefulSet")
        svc = sts["spec"]["serviceName"]
        expected = [
            f"{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc.{v['clusterDomain']}:2379"
            for i in range(sts["spec"]["replicas"])
        ]
        assert options["rdzv-endpoint"].split(",") == expected

    for key, value in w["rdzvConf"].items():
        assert f"{key}={value}" in options["rdzv-conf"].split(",")

    t = v["training"]
    if t["script"]:
        assert target[0] == t["script"]
        job_args = target[1:]
    else:
        assert target[:2] == ["-m", t["module"]]
        job_args = target[2:]
    example_args = t["exampleArgs"] if not t["script"] and t["module"] == EXAMPLE_MODULE else []
    ckpt_dir = (
        f"{v['checkpoints']['mountPath']}/{v['checkpoints']['subPath'] or f'{NAMESPACE}-{RELEASE}'}"
    )
    assert job_args == [str(a) for a in example_args + t["args"]] + [f"--checkpoint-dir={ckpt_dir}"]
    assert env_of(container)["CHECKPOINT_DIR"] == ckpt_dir


def with_secret_files_here(args: list[str], container: dict[str, Any], root: Path) -> list[str]:
    """The pod reads etcd TLS files and a password from mounted Secrets; make those files under
    ``root`` (real PEM files of a throwaway PKI, a password) and point ``args`` at them. Every
    file --rdzv-conf names must lie in one of the container's mounts."""
    for mount in container.get("volumeMounts", []):
        args = [a.replace(mount["mountPath"] + "/", f"{root}{mount['mountPath']}/") for a in args]
    options, _ = launcher_options(args)
    conf = dict(i.split("=", 1) for i in filter(None, options.get("rdzv-conf", "").split(",")))
    keys = ("ca_cert", "ssl_cert", "ssl_cert_key", "password_file")
    files = {k: Path(conf[k]) for k in keys if k in conf}
    for key, path in files.items():
        assert path.is_relative_to(root), f"{key}={path} is not in a mounted volume"
        path.parent.mkdir(parents=True, exist_ok=True)
    if files.keys() & {"ca_cert", "ssl_cert", "ssl_cert_key"}:
        pki = make_pki(root / "pki")
        pem = {"ca_cert": pki.ca_cert, "ssl_cert": pki.client_cert, "ssl_cert_key": pki.client_key}
        for key in files.keys() & pem.keys():
            shutil.copyfile(pem[key], files[key])
    if "password_file" in files:
        files["password_file"].write_text("not-a-real-password\n")
    return args


@pytest.mark.parametrize("values_file", ci_values_param())
def test_the_real_cli_accepts_the_pod_arguments(
    render: Any, values_file: Path, tmp_path: Path
) -> None:
    """The launcher arguments are valid for `elastic-trainer run` itself (dry run: it parses,
    resolves, checks the TLS and password files and prints the torchrun command, contacting
    nothing). Secret volumes are materialised locally, as the kubelet mounts them."""
    container = trainer(render(ci_values_or_skip(values_file)))
    env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
    expand = {"JOB_UID": "0b5f7c3e-1d2a-4c6b-9e8f-123456789abc", "ETCD_USERNAME": "trainer"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: expand[m[1]], a) for a in container["args"]]
    args = with_secret_files_here(args, container, tmp_path)
    options, target = launcher_options(args)
    torchrun = cli_dry_run(args, env)
    assert f"--nnodes={options['nnodes']} " in torchrun
    assert f"--nproc-per-node={options['nproc-per-node']} " in torchrun
    assert "--rdzv-backend=etcd-v3 " in torchrun
    assert f"--rdzv-endpoint={options['rdzv-endpoint']} " in torchrun
    assert f"--rdzv-id={options['run-id']} " in torchrun
    for item in filter(None, options.get("rdzv-conf", "").split(",")):
        assert item in torchrun
    assert torchrun.endswith(" ".join(target))


def test_run_id_is_derived_from_the_release_never_shared(render: Any) -> None:
    ids = set()
    for name, namespace in (("a", "ns1"), ("b", "ns1"), ("a", "ns2")):
        options, _ = launcher_options(trainer(render(name=name, namespace=namespace))["args"])
        ids.add(options["run-id"])
    assert ids == {"ns1-a-$(JOB_UID)", "ns1-b-$(JOB_UID)", "ns2-a-$(JOB_UID)"}
    # $(JOB_UID) is the Job's uid: a recreated Job gets a fresh rendezvous.
    env = env_of(trainer(render()))
    assert env["JOB_UID"] == {
        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}
    }
    options, _ = launcher_options(trainer(render({"workers": {"runId": "fresh-start-2"}}))["args"])
    assert options["run-id"] == "fresh-start-2"


def test_checkpoint_dir_does_not_depend_on_the_run_id(render: Any) -> None:
    def ckpt(values: dict[str, Any]) -> tuple[str, str]:
        container = trainer(render(values))
        _, target = launcher_options(container["args"])
        return target[-1], env_of(container)["CHECKPOINT_DIR"]

    default = ckpt({})
    assert default == (
        f"--checkpoint-dir=/checkpoints/{NAMESPACE}-{RELEASE}",
        f"/checkpoints/{NAMESPACE}-{RELEASE}",
    )
    assert ckpt({"workers": {"runId": "other"}}) == default
    assert ckpt({"checkpoints": {"subPath": "from-scratch"}})[1] == "/checkpoints/from-scratch"


@pytest.mark.parametrize("values_file", ci_values_param())
def test_every_variable_reference_in_args_is_defined(render: Any, values_file: Path) -> None:
    """The kubelet leaves an undefined $(VAR) verbatim: every reference must have an env var."""
    for owner, spec in pod_specs(render(ci_values_or_skip(values_file))):
        for container in containers(spec):
            defined = {e["name"] for e in container.get("env", [])}
            for arg in container.get("command", []) + container.get("args", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in defined, (
                        f"{owner}/{container['name']}: $({ref}) in {arg!r} is not defined"
                    )


EXAMPLE_MODULE = "elastic_trainer.examples.synthetic_cnn"
EXAMPLE_ARGS = [
    "--max-steps=2000",
    "--epochs=10",
    "--global-batch-size=64",
    "--checkpoint-every=100",
    "--seed=0",
]
CKPT_FLAG = f"--checkpoint-dir=/checkpoints/{NAMESPACE}-{RELEASE}"

# (id, training values, exactly what follows the launcher options in the trainer's args)
TRAINING_CASES = [
    (
        "default: the example with its arguments",
        {},
        ["-m", EXAMPLE_MODULE, *EXAMPLE_ARGS, CKPT_FLAG],
    ),
    (
        "script alone: no example module, no example arguments",
        {"script": "/app/train.py"},
        ["/app/train.py", CKPT_FLAG],
    ),
    (
        "script with your arguments",
        {"script": "/app/train.py", "args": ["--lr", 0.1, "--epochs=3"]},
        ["/app/train.py", "--lr", "0.1", "--epochs=3", CKPT_FLAG],
    ),
    (
        "script that reads CHECKPOINT_DIR",
        {"script": "/app/train.py", "checkpointDirFlag": ""},
        ["/app/train.py"],
    ),
    ("module alone", {"module": "mypkg.train"}, ["-m", "mypkg.train", CKPT_FLAG]),
    (
        "module with your arguments and flag",
        {"module": "mypkg.train", "args": ["--steps", 100], "checkpointDirFlag": "--ckpt"},
        ["-m", "mypkg.train", "--steps", "100", f"--ckpt=/checkpoints/{NAMESPACE}-{RELEASE}"],
    ),
    (
        "example with an override: your flag comes last and wins",
        {"args": ["--max-steps=50"]},
        ["-m", EXAMPLE_MODULE, *EXAMPLE_ARGS, "--max-steps=50", CKPT_FLAG],
    ),
    (
        "script and the example module named explicitly: the script wins",
        {"script": "/app/train.py", "module": EXAMPLE_MODULE},
        ["/app/train.py", CKPT_FLAG],
    ),
]


@pytest.mark.parametrize(
    ("training", "expected"), [pytest.param(t, e, id=i) for i, t, e in TRAINING_CASES]
)
def test_what_the_ranks_run(render: Any, training: dict[str, Any], expected: list[str]) -> None:
    """Your own script or module runs with your arguments only; the example's arguments go to
    the example alone. The whole container command line is checked, options included."""
    container = trainer(render({"training": training}))
    assert "command" not in container
    options, target = launcher_options(container["args"])
    assert target == expected
    assert list(options) == [
        "nnodes",
        "nproc-per-node",
        "rdzv-endpoint",
        "run-id",
        "max-restarts",
        "metrics-port",
        "metrics-addr",
    ]
    assert container["args"] == ["run", *(f"--{k}={v}" for k, v in options.items()), *expected]


@pytest.mark.parametrize("training", [pytest.param(t, id=i) for i, t, _ in TRAINING_CASES])
def test_the_real_cli_accepts_what_the_ranks_run(
    render: Any, training: dict[str, Any], tmp_path: Path
) -> None:
    """`elastic-trainer run --dry-run` takes the rendered arguments and hands the target and
    its arguments to torchrun unchanged. The user's script and package exist here (the CLI
    checks that they do) at a local path instead of the image's."""
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text("print('training')\n")
    container = trainer(render({"training": training}))
    args = [
        a.replace("$(JOB_UID)", "0b5f7c3e-1d2a-4c6b-9e8f-123456789abc").replace(
            "/app/train.py", str(tmp_path / "train.py")
        )
        for a in container["args"]
    ]
    _, target = launcher_options(args)
    torchrun = cli_dry_run(args, {"PYTHONPATH": str(tmp_path)})
    assert torchrun.endswith(" " + " ".join(target))


# ------------------------------------------------------------------------------------ images
IMAGE_RE = re.compile(
    r"^(?P<repo>[a-z0-9./_-]+)(:(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(@(?P<digest>sha256:[a-f0-9]{64}))?$"
)


@pytest.mark.parametrize("values_file", ci_values_param())
def test_every_image_is_pinned(render: Any, values_file: Path) -> None:
    for owner, spec in pod_specs(render(ci_values_or_skip(values_file))):
        for container in containers(spec):
            match = IMAGE_RE.match(container["image"])
            assert match, f"{owner}: unparsable image {container['image']!r}"
            assert match["tag"] or match["digest"], f"{owner}: untagged image {container['image']}"
            assert match["tag"] != "latest", f"{owner}: floating tag in {container['image']}"


def test_etcd_is_the_official_image(render: Any) -> None:
    [etcd] = only(render(), "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert etcd["image"].startswith("quay.io/coreos/etcd:v3.")


def test_image_digest_wins_over_tag(render: Any) -> None:
    digest = "sha256:" + "ab" * 32
    assert trainer(render({"image": {"digest": digest}}))["image"] == f"elastic-trainer@{digest}"


# ------------------------------------------------------------------------------------ resources
@pytest.mark.parametrize("values_file", ci_values_param())
def test_requests_and_limits_on_every_container(render: Any, values_file: Path) -> None:
    for owner, spec in pod_specs(render(ci_values_or_skip(values_file))):
        for container in containers(spec):
            resources = container.get("resources", {})
            for section in ("requests", "limits"):
                got = resources.get(section, {})
                assert {"cpu", "memory"} <= set(got), (
                    f"{owner}/{container['name']}: {section} = {got}"
                )


def test_gpu_count_equals_ranks_per_node(chart: Any, render: Any) -> None:
    values = load_values(CHART_DIR / "ci" / "gpu-values.yaml")
    v = merged(chart, values)
    container = trainer(render(values))
    gpu = v["workers"]["gpu"]["resourceName"]
    assert container["resources"]["limits"][gpu] == v["workers"]["nprocPerNode"] == 8
    assert container["resources"]["requests"][gpu] == 8
    options, _ = launcher_options(container["args"])
    assert options["nproc-per-node"] == "8"
    assert "nvidia.com/gpu" not in trainer(render())["resources"]["limits"]


# ------------------------------------------------------------------------------------ security
@pytest.mark.parametrize("values_file", ci_values_param())
def test_security_contexts_are_restricted(render: Any, values_file: Path) -> None:
    for owner, spec in pod_specs(render(ci_values_or_skip(values_file))):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, owner
        assert pod.get("runAsUser", 0) > 0, owner
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", owner
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), f"{owner}: {flag}"
        assert spec.get("automountServiceAccountToken") is False, owner
        for volume in spec.get("volumes", []):
            assert "hostPath" not in volume, f"{owner}: hostPath volume {volume['name']}"
        for container in containers(spec):
            sc = container.get("securityContext", {})
            where = f"{owner}/{container['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert not sc.get("privileged"), where
            assert sc.get("readOnlyRootFilesystem") is True, where


def test_worker_uid_matches_the_image_user(render: Any) -> None:
    dockerfile = (CHART_DIR.parents[1] / "docker" / "Dockerfile").read_text()
    [user] = re.findall(r"^USER\s+(\d+):(\d+)\s*$", dockerfile, re.M)
    pod = only(render(), "Job")["spec"]["template"]["spec"]["securityContext"]
    assert (str(pod["runAsUser"]), str(pod["runAsGroup"])) == user


# ------------------------------------------------------------------------------------ grace
@pytest.mark.parametrize("values_file", ci_values_param())
def test_termination_grace_exceeds_checkpoint_grace(render: Any, values_file: Path) -> None:
    docs = render(ci_values_or_skip(values_file))
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    grace = int(env_of(trainer(docs))["ELASTIC_TRAINER_SIGTERM_GRACE_S"])
    assert spec["terminationGracePeriodSeconds"] > grace


# ------------------------------------------------------------------------------------ job semantics
def test_worker_job_semantics(render: Any) -> None:
    job = only(render(), "Job")
    spec = job["spec"]
    assert "completions" not in spec, "work-queue Job: success of any pod ends the Job"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert rules[1:] == [
        {
            "action": "Ignore",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]},
        }
    ]
    fail_fast = only(render({"workers": {"failFastExitCodes": [2, 3]}}), "Job")["spec"][
        "podFailurePolicy"
    ]["rules"]
    assert fail_fast[2] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2, 3]},
    }


def test_scaling_changes_only_parallelism(render: Any) -> None:
    """The Job's pod template is immutable: `helm upgrade --set workers.replicas=N` must touch
    nothing but spec.parallelism, or the upgrade would be refused by the API server."""
    two = only(render({"workers": {"replicas": 2}}), "Job")
    three = only(render({"workers": {"replicas": 3}}), "Job")
    assert (two["spec"]["parallelism"], three["spec"]["parallelism"]) == (2, 3)
    two["spec"].pop("parallelism")
    three["spec"].pop("parallelism")
    assert two == three
    labels = two["spec"]["template"]["metadata"]["labels"]
    assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels), labels


def test_worker_pods_have_resolvable_hostnames(render: Any) -> None:
    """torchrun publishes rank 0's FQDN as the store address: the pods need DNS records."""
    docs = render()
    pod = only(docs, "Job")["spec"]["template"]
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    svc = services[pod["spec"]["subdomain"]]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


# ------------------------------------------------------------------------------------ volumes
def test_checkpoint_volume_and_shm(chart: Any, render: Any) -> None:
    docs = render()
    v = merged(chart, {})
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    pvc = only(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {vol["name"]: vol for vol in spec["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": v["workers"]["shmSize"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"] == v["checkpoints"]["mountPath"]
    assert mounts["dshm"] == "/dev/shm"
    assert mounts["tmp"] == "/tmp"


def test_existing_checkpoint_claim_is_used_not_created(render: Any) -> None:
    docs = render({"checkpoints": {"existingClaim": "shared"}})
    assert "PersistentVolumeClaim" not in kinds(docs)
    volumes = {v["name"]: v for v in only(docs, "Job")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared"


# ------------------------------------------------------------------------------------ NCCL env
@pytest.mark.parametrize("values_file", ci_values_param())
def test_nccl_environment_comes_from_values(chart: Any, render: Any, values_file: Path) -> None:
    values = ci_values_or_skip(values_file)
    v = merged(chart, values)
    env = env_of(trainer(render(values)))
    for name, value in v["nccl"]["env"].items():
        expected = (
            str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        )
        assert env[name] == expected, name
    assert env["ELASTIC_TRAINER_PG_TIMEOUT_S"] == str(v["workers"]["processGroupTimeoutSeconds"])
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) >= int(env["ELASTIC_TRAINER_PG_TIMEOUT_S"])


def test_chart_pg_timeout_default_is_the_runtime_default(chart: Any) -> None:
    config = import_or_missing(
        "elastic_trainer.runtime.settings", "elastic-trainer (pip install -e .)"
    )
    assert merged(chart, {})["workers"]["processGroupTimeoutSeconds"] == config.DEFAULT_PG_TIMEOUT_S
    assert merged(chart, {})["workers"]["sigtermGraceSeconds"] == config.DEFAULT_SIGTERM_GRACE_S


# ------------------------------------------------------------------------------------ etcd
def test_bundled_etcd_cluster(render: Any) -> None:
    docs = render()
    sts = only(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]

    pdb = only(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    headless = [
        d
        for _, d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]
    ]
    assert len(headless) == 1 and headless[0]["spec"]["clusterIP"] == "None"
    assert headless[0]["spec"]["publishNotReadyAddresses"] is True

    [etcd] = sts["spec"]["template"]["spec"]["containers"]
    args = dict(a[2:].split("=", 1) for a in etcd["args"])
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    name = sts["metadata"]["name"]
    assert list(members) == [f"{name}-{i}" for i in range(3)]
    for member, url in members.items():
        assert (
            url
            == f"http://{member}.{sts['spec']['serviceName']}.{NAMESPACE}.svc.cluster.local:2380"
        )
    options, _ = launcher_options(trainer(docs)["args"])
    assert [e.split(".")[0] for e in options["rdzv-endpoint"].split(",")] == list(members)


def test_external_etcd_with_tls_and_credentials(render: Any) -> None:
    values = load_values(CHART_DIR / "ci" / "external-etcd-tls-values.yaml")
    docs = render(values)
    assert "StatefulSet" not in kinds(docs) and "PodDisruptionBudget" not in kinds(docs)
    container = trainer(docs)
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    options, _ = launcher_options(container["args"])
    conf = dict(pair.split("=", 1) for pair in options["rdzv-conf"].split(","))

    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    tls_dir = mounts["etcd-tls"]["mountPath"]
    assert mounts["etcd-tls"]["readOnly"] and mounts["etcd-auth"]["readOnly"]
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"
    assert conf["protocol"] == "https"
    tls_files = {item["path"] for item in volumes["etcd-tls"]["secret"]["items"]}
    assert tls_files == {"ca.crt", "tls.crt", "tls.key"}
    assert conf["ca_cert"] == f"{tls_dir}/ca.crt"
    assert conf["ssl_cert"] == f"{tls_dir}/tls.crt"
    assert conf["ssl_cert_key"] == f"{tls_dir}/tls.key"

    assert volumes["etcd-auth"]["secret"]["secretName"] == "etcd-client-auth"
    assert conf["password_file"] == f"{mounts['etcd-auth']['mountPath']}/password"
    assert conf["user"] == "$(ETCD_USERNAME)"
    env = env_of(container)
    assert env["ETCD_USERNAME"] == {"secretKeyRef": {"name": "etcd-client-auth", "key": "username"}}
    # The password is a file only: never an env var, never an argument.
    assert not any(
        "password" in str(e).lower() and "secretKeyRef" in str(e)
        for e in container["env"]
        if e["name"] != "ETCD_USERNAME"
    )
    assert conf["last_call_timeout"] == "30" and conf["join_timeout"] == "600"


def test_no_secret_material_is_rendered(render: Any) -> None:
    for values_file in CI_VALUES:
        values = load_values(values_file)
        if values.get("metrics", {}).get("dashboard", {}).get("enabled"):
            values["metrics"]["dashboard"]["enabled"] = False
        assert "Secret" not in kinds(render(values))


BUNDLED_TLS_VALUES = CHART_DIR / "ci" / "bundled-etcd-tls-values.yaml"
ETCD_URL_FLAGS = (
    "listen-client-urls",
    "advertise-client-urls",
    "listen-peer-urls",
    "initial-advertise-peer-urls",
)
ETCD_TLS_FLAGS = (
    "cert-file",
    "key-file",
    "trusted-ca-file",
    "client-cert-auth",
    "peer-cert-file",
    "peer-key-file",
    "peer-trusted-ca-file",
    "peer-client-cert-auth",
)


def etcd_args(docs: Manifests) -> dict[str, str]:
    [etcd] = only(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return dict(a[2:].split("=", 1) for a in etcd["args"])


def etcd_urls(args: dict[str, str]) -> list[str]:
    urls = [u for flag in ETCD_URL_FLAGS for u in args[flag].split(",")]
    return urls + [m.split("=", 1)[1] for m in args["initial-cluster"].split(",")]


def secret_volumes(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Volume name -> its secret source, for the Secret volumes of a pod spec."""
    return {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}


def test_bundled_etcd_tls_serves_mutual_tls_from_the_server_secret(render: Any) -> None:
    docs = render(load_values(BUNDLED_TLS_VALUES))
    args = etcd_args(docs)
    urls = etcd_urls(args)
    assert len(urls) == 4 + 3 and all(u.startswith("https://") for u in urls), urls
    assert args["client-cert-auth"] == "true" and args["peer-client-cert-auth"] == "true"
    # Probes stay on the plain-HTTP metrics listener, which serves /health without a certificate.
    assert args["listen-metrics-urls"] == "http://0.0.0.0:2381"

    spec = only(docs, "StatefulSet")["spec"]["template"]["spec"]
    [etcd] = spec["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert etcd[probe]["httpGet"]["port"] == "metrics", probe
    [mount] = [m for m in etcd["volumeMounts"] if m["name"] != "data"]
    assert mount["readOnly"] is True
    volume = secret_volumes(spec)[mount["name"]]
    assert volume["secretName"] == "etcd-server-tls"
    files = {item["key"]: f"{mount['mountPath']}/{item['path']}" for item in volume["items"]}
    assert {
        "cert-file": files["tls.crt"],
        "key-file": files["tls.key"],
        "trusted-ca-file": files["ca.crt"],
        "peer-cert-file": files["tls.crt"],
        "peer-key-file": files["tls.key"],
        "peer-trusted-ca-file": files["ca.crt"],
    }.items() <= args.items()


def test_bundled_etcd_tls_workers_get_only_the_client_secret(render: Any) -> None:
    docs = render(load_values(BUNDLED_TLS_VALUES))
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    volumes = secret_volumes(spec)
    # The server key lives in etcd-server-tls: no worker volume may reference that Secret.
    assert [v["secretName"] for v in volumes.values()] == ["etcd-client-tls"]
    [(name, volume)] = volumes.items()
    [init] = spec["initContainers"]
    for container in (init, trainer(docs)):
        [mount] = [m for m in container.get("volumeMounts", []) if m["name"] == name]
        assert mount["readOnly"] is True, container["name"]
    mount_path = mount["mountPath"]
    mounted = {item["key"]: f"{mount_path}/{item['path']}" for item in volume["items"]}
    assert set(mounted) == {"ca.crt", "tls.crt", "tls.key"}

    options, _ = launcher_options(trainer(docs)["args"])
    conf = dict(pair.split("=", 1) for pair in options["rdzv-conf"].split(","))
    assert conf == {
        "protocol": "https",
        "ca_cert": mounted["ca.crt"],
        "ssl_cert": mounted["tls.crt"],
        "ssl_cert_key": mounted["tls.key"],
    }
    # wait-for-etcd checks the same mutual TLS the launcher will use.
    assert init["command"][5:] == [mounted["ca.crt"], mounted["tls.crt"], mounted["tls.key"]]
    # No certificate material or Secret reference reaches env or args.
    for container in containers(spec):
        assert "secretKeyRef" not in json.dumps(container.get("env", []))
        assert "BEGIN" not in json.dumps(container)


def test_bundled_etcd_without_tls_stays_plaintext(render: Any) -> None:
    docs = render()
    args = etcd_args(docs)
    assert all(u.startswith("http://") for u in etcd_urls(args))
    assert not set(ETCD_TLS_FLAGS) & set(args)
    assert "volumes" not in only(docs, "StatefulSet")["spec"]["template"]["spec"]
    spec = only(docs, "Job")["spec"]["template"]["spec"]
    assert secret_volumes(spec) == {}
    options, _ = launcher_options(trainer(docs)["args"])
    assert "rdzv-conf" not in options
    [init] = spec["initContainers"]
    assert len(init["command"]) == 5 and "volumeMounts" not in init


def test_bundled_etcd_tls_with_cert_manager(helm: Any, render: Any) -> None:
    values = {
        "etcd": {
            "bundled": {
                "tls": {
                    "enabled": True,
                    "certManager": {"enabled": True, "issuerRef": {"name": "etcd-ca"}},
                }
            }
        }
    }
    docs = render(values)
    certs = {d["spec"]["secretName"]: d for _, d in docs if d["kind"] == "Certificate"}
    etcd_secret = next(
        iter(secret_volumes(only(docs, "StatefulSet")["spec"]["template"]["spec"]).values())
    )
    worker_secrets = [
        v["secretName"]
        for v in secret_volumes(only(docs, "Job")["spec"]["template"]["spec"]).values()
    ]
    server = certs[etcd_secret["secretName"]]
    [client_name] = worker_secrets
    client = certs[client_name]
    assert len(certs) == 2 and client_name != etcd_secret["secretName"]
    assert {"server auth", "client auth"} <= set(server["spec"]["usages"])
    assert (
        "server auth" not in client["spec"]["usages"] and "client auth" in client["spec"]["usages"]
    )
    for cert in (server, client):
        assert cert["spec"]["issuerRef"] == {
            "name": "etcd-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }

    def covered(host: str) -> bool:
        return any(
            name == host or (name.startswith("*.") and host.split(".", 1)[1] == name[2:])
            for name in server["spec"]["dnsNames"]
        )

    # Every member's client and peer URL (POD_NAME expanded) and every worker endpoint.
    sts = only(docs, "StatefulSet")
    hosts = [
        re.sub(r"^https://|:\d+$", "", u.replace("$(POD_NAME)", f"{sts['metadata']['name']}-0"))
        for u in etcd_urls(etcd_args(docs))
        if "0.0.0.0" not in u
    ]
    options, _ = launcher_options(trainer(docs)["args"])
    hosts += [e.rsplit(":", 1)[0] for e in options["rdzv-endpoint"].split(",")]
    assert hosts and all(covered(h) for h in hosts), (hosts, server["spec"]["dnsNames"])
    assert not covered("evil.example.com")

    report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == [], report


# ------------------------------------------------------------------------------------ network
def test_network_policies(chart: Any, render: Any) -> None:
    docs = render()
    v = merged(chart, {})
    policies = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "NetworkPolicy"}
    worker_labels = only(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    etcd_labels = only(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]

    [etcd_policy] = [
        p
        for p in policies.values()
        if p["spec"]["podSelector"]["matchLabels"].items() <= etcd_labels.items()
    ]
    client_rules = [
        r for r in etcd_policy["spec"]["ingress"] if {"port": 2379, "protocol": "TCP"} in r["ports"]
    ]
    sources = [peer["podSelector"]["matchLabels"] for r in client_rules for peer in r["from"]]
    assert all(
        set(peer) == {"podSelector"} for r in etcd_policy["spec"]["ingress"] for peer in r["from"]
    )
    assert all(
        s.items() <= worker_labels.items() or s.items() <= etcd_labels.items() for s in sources
    )
    assert any(s.items() <= worker_labels.items() for s in sources)

    [worker_policy] = [
        p
        for p in policies.values()
        if p["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
    ]
    metrics_rules = [r for r in worker_policy["spec"]["ingress"] if "ports" in r]
    assert metrics_rules == [
        {
            "from": [{"namespaceSelector": v["networkPolicy"]["monitoringNamespaceSelector"]}],
            "ports": [{"port": v["workers"]["metricsPort"], "protocol": "TCP"}],
        }
    ]
    [peers] = [r for r in worker_policy["spec"]["ingress"] if "ports" not in r]
    assert peers["from"] == [
        {"podSelector": {"matchLabels": worker_policy["spec"]["podSelector"]["matchLabels"]}}
    ]

    assert "NetworkPolicy" not in kinds(render({"networkPolicy": {"enabled": False}}))


def test_the_diagnostics_endpoints_listen_beyond_the_pod_only_when_asked(render: Any) -> None:
    """Default: no debug variables (the workers listen on 127.0.0.1) and no port opened. With
    workers.diagnostics.listen: the pod IP, a port per worker, and the NetworkPolicy opens that
    range to the monitoring namespace only (the metrics port's rule)."""
    docs = render()
    assert not {"ELASTIC_TRAINER_DEBUG_HOST", "ELASTIC_TRAINER_DEBUG_PORT"} & set(
        env_of(trainer(docs))
    )
    values = {"workers": {"nprocPerNode": 4, "diagnostics": {"listen": True, "port": 9600}}}
    docs = render(values)
    env = env_of(trainer(docs))
    assert env["ELASTIC_TRAINER_DEBUG_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["ELASTIC_TRAINER_DEBUG_PORT"] == "9600"
    [policy] = [
        d for _, d in docs if d["kind"] == "NetworkPolicy" and "worker" in d["metadata"]["name"]
    ]
    [rule] = [r for r in policy["spec"]["ingress"] if "ports" in r]
    assert {"port": 9600, "endPort": 9603, "protocol": "TCP"} in rule["ports"]
    assert all("namespaceSelector" in peer for peer in rule["from"])


# ------------------------------------------------------------------------------------ monitoring
def test_pod_monitor_selects_the_worker_metrics_port(render: Any) -> None:
    docs = render({"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    monitor = only(docs, "PodMonitor")
    pod = only(docs, "Job")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kps"
    port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


def test_service_monitor_selects_the_worker_service(render: Any) -> None:
    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    monitor = only(docs, "ServiceMonitor")
    [svc] = [
        d
        for _, d in docs
        if d["kind"] == "Service"
        and d["spec"]["selector"].get("app.kubernetes.io/component") == "worker"
    ]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_monitors_are_off_by_default(render: Any) -> None:
    assert not {"PodMonitor", "ServiceMonitor", "ConfigMap"} & set(kinds(render()))


def test_dashboard_configmap_loads_the_single_dashboard_file(render: Any) -> None:
    dashboard = require_dashboard()
    values = load_values(CHART_DIR / "ci" / "monitoring-values.yaml")
    cm = only(render(values), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["elastic-trainer.json"]) == json.loads(dashboard.read_text())


def test_dashboard_json_is_provisionable() -> None:
    """Valid JSON that both the Grafana sidecar and compose file provisioning can load: no
    export-for-sharing ``__inputs`` (provisioning cannot fill them) and every datasource it
    names is the provisioned uid "prometheus" or a dashboard variable."""
    dashboard = json.loads(require_dashboard().read_text())
    assert isinstance(dashboard, dict) and dashboard.get("title")
    assert "__inputs" not in dashboard, "export-for-sharing placeholders cannot be provisioned"
    variables = {var.get("name") for var in dashboard.get("templating", {}).get("list", [])}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for node in walk(dashboard):
        ds = node.get("datasource")
        uid = ds.get("uid") if isinstance(ds, dict) else ds if isinstance(ds, str) else None
        if uid is None or uid in ("prometheus", "-- Grafana --", "grafana"):
            continue
        var = re.fullmatch(r"\$\{?([A-Za-z0-9_]+)(:[a-z]+)?\}?", uid)
        assert var and var[1] in variables, (
            f"datasource {uid!r} is neither 'prometheus' nor a variable"
        )


def test_dashboard_enabled_without_the_file_fails_clearly(helm: Any, tmp_path: Path) -> None:
    """The ConfigMap must never silently ship an empty dashboard."""
    copy_dir = tmp_path / "elastic-trainer"
    shutil.copytree(CHART_DIR, copy_dir, ignore=shutil.ignore_patterns("dashboards"))
    with helm.Chart.load(copy_dir) as chart, pytest.raises(helm.HelmRenderError) as excinfo:
        chart.render(
            {"metrics": {"dashboard": {"enabled": True}}}, name=RELEASE, namespace=NAMESPACE
        )
    assert "metrics.dashboard.enabled but the chart has no dashboards/elastic-trainer.json" in str(
        excinfo.value
    )


# ------------------------------------------------------------------------------------ NOTES
def test_notes_show_how_to_scale_and_watch(chart: Any) -> None:
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True)[
        "elastic-trainer/templates/NOTES.txt"
    ]
    assert "--set workers.replicas=N" in notes
    assert f"patch job {RELEASE}-elastic-trainer-workers" in notes
    assert "logs -f -l" in notes and "port-forward" in notes and "/metrics" in notes
    assert f'run "{NAMESPACE}-{RELEASE}-<job uid>"' in notes


# ------------------------------------------------------------------------------------ bad values
VALIDATE_VALUES_CASES = [
    (
        "replicas above maxNodes",
        {"workers": {"replicas": 5, "maxNodes": 4}},
        "workers.replicas (5) must be between workers.minNodes (1) and workers.maxNodes (4)",
    ),
    (
        "replicas below minNodes",
        {"workers": {"replicas": 1, "minNodes": 2}},
        "workers.replicas (1) must be between workers.minNodes (2) and workers.maxNodes (4)",
    ),
    (
        "minNodes above maxNodes",
        {"workers": {"minNodes": 4, "maxNodes": 2, "replicas": 2}},
        "workers.minNodes (4) must be <= workers.maxNodes (2)",
    ),
    (
        "grace not above checkpoint grace",
        {"workers": {"terminationGracePeriodSeconds": 30}},
        "workers.terminationGracePeriodSeconds (30) must be greater than workers.sigtermGraceSeconds (30)",
    ),
    (
        "heartbeat below pg timeout",
        {"workers": {"processGroupTimeoutSeconds": 3600}},
        "nccl.env.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (1800) must be >= workers.processGroupTimeoutSeconds (3600)",
    ),
    (
        "external without endpoints",
        {"etcd": {"mode": "external"}},
        "etcd.mode is external but etcd.external.endpoints is empty",
    ),
    (
        "external tls without secret",
        {
            "etcd": {
                "mode": "external",
                "external": {"endpoints": ["e:2379"], "tls": {"enabled": True}},
            }
        },
        "etcd.external.tls.enabled needs etcd.external.tls.existingSecret",
    ),
    (
        "external auth without secret",
        {
            "etcd": {
                "mode": "external",
                "external": {"endpoints": ["e:2379"], "auth": {"enabled": True}},
            }
        },
        "etcd.external.auth.enabled needs etcd.external.auth.existingSecret",
    ),
    (
        "bundled tls without secrets",
        {"etcd": {"bundled": {"tls": {"enabled": True}}}},
        "etcd.bundled.tls.enabled needs etcd.bundled.tls.existingSecret",
    ),
    (
        "bundled tls without client secret",
        {"etcd": {"bundled": {"tls": {"enabled": True, "existingSecret": "s"}}}},
        "etcd.bundled.tls.enabled needs etcd.bundled.tls.clientSecret",
    ),
    (
        "bundled tls client secret is the server secret",
        {
            "etcd": {
                "bundled": {"tls": {"enabled": True, "existingSecret": "s", "clientSecret": "s"}}
            }
        },
        "etcd.bundled.tls.clientSecret must differ from etcd.bundled.tls.existingSecret",
    ),
    (
        "cert-manager without issuer",
        {"etcd": {"bundled": {"tls": {"enabled": True, "certManager": {"enabled": True}}}}},
        "etcd.bundled.tls.certManager.enabled needs etcd.bundled.tls.certManager.issuerRef.name",
    ),
    (
        "cert-manager and an existing secret",
        {
            "etcd": {
                "bundled": {
                    "tls": {
                        "enabled": True,
                        "existingSecret": "s",
                        "certManager": {"enabled": True, "issuerRef": {"name": "ca"}},
                    }
                }
            }
        },
        "etcd.bundled.tls.certManager.enabled creates the Secrets itself",
    ),
    (
        "cert-manager without tls",
        {"etcd": {"bundled": {"tls": {"certManager": {"enabled": True}}}}},
        "etcd.bundled.tls.certManager.enabled needs etcd.bundled.tls.enabled",
    ),
    (
        "your module and a script",
        {"training": {"script": "/x.py", "module": "mypkg.train"}},
        "set only one of training.module (mypkg.train) and training.script (/x.py)",
    ),
    (
        "neither module nor script",
        {"training": {"module": ""}},
        "set training.module or training.script",
    ),
    (
        "reserved rdzv-conf key",
        {"workers": {"rdzvConf": {"password": "hunter2"}}},
        "workers.rdzvConf.password is set by the chart from etcd.external or etcd.bundled.tls; remove it",
    ),
    (
        "two monitors",
        {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}},
        "enable at most one of metrics.podMonitor and metrics.serviceMonitor",
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), [pytest.param(v, m, id=i) for i, v, m in VALIDATE_VALUES_CASES]
)
def test_validate_values_rejects_with_a_clear_message(
    helm: Any, chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError) as excinfo:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    text = str(excinfo.value)
    assert "elastic-trainer: invalid values:" in text
    assert message in text


def test_validate_values_lists_every_problem_at_once(helm: Any, chart: Any) -> None:
    values = {
        "workers": {
            "replicas": 9,
            "minNodes": 5,
            "maxNodes": 3,
            "terminationGracePeriodSeconds": 10,
        }
    }
    with pytest.raises(helm.HelmRenderError) as excinfo:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert str(excinfo.value).count("\n  - ") == 3


SCHEMA_CASES = [
    ("negative replicas", "workers.replicas", -1, "/workers/replicas"),
    ("zero minNodes", "workers.minNodes", 0, "/workers/minNodes"),
    ("negative maxNodes", "workers.maxNodes", -2, "/workers/maxNodes"),
    (
        "negative checkpoint grace",
        "workers.sigtermGraceSeconds",
        -5,
        "/workers/sigtermGraceSeconds",
    ),
    ("negative max restarts", "workers.maxRestarts", -1, "/workers/maxRestarts"),
    ("non-integer replicas", "workers.replicas", "three", "/workers/replicas"),
    ("privileged metrics port", "workers.metricsPort", 80, "/workers/metricsPort"),
    ("latest tag", "image.tag", "latest", "/image/tag"),
    ("even etcd members", "etcd.bundled.replicas", 2, "/etcd/bundled/replicas"),
    ("unknown etcd mode", "etcd.mode", "embedded", "/etcd/mode"),
    ("mistyped key", "workers.replica", 3, "replica"),
    (
        "SIGTERM exit as fail-fast code",
        "workers.failFastExitCodes",
        [143],
        "/workers/failFastExitCodes",
    ),
    (
        "root user",
        "workers.podSecurityContext.runAsNonRoot",
        False,
        "/workers/podSecurityContext/runAsNonRoot",
    ),
    ("bad NCCL variable name", "nccl.env.FOO", "1", "FOO"),
    ("script path as module", "training.module", "train.py --lr", "/training/module"),
    ("example arguments as text", "training.exampleArgs", "--seed=0", "/training/exampleArgs"),
    ("tls switch as text", "etcd.bundled.tls.enabled", "yes", "/etcd/bundled/tls/enabled"),
    ("tls secret name", "etcd.bundled.tls.clientSecret", "Bad_Name", "clientSecret"),
    ("mistyped tls key", "etcd.bundled.tls.clientSecrets", "c", "clientSecrets"),
    (
        "bad async error handling",
        "nccl.env.TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "7",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ),
]


@pytest.mark.parametrize(
    ("dotted", "value", "where"), [pytest.param(d, v, w, id=i) for i, d, v, w in SCHEMA_CASES]
)
def test_schema_rejects_bad_values(
    helm: Any, chart: Any, dotted: str, value: Any, where: str
) -> None:
    values = deep_set({}, dotted, value)
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    text = str(excinfo.value)
    assert "values don't meet the specifications of the schema" in text
    assert where in text, text


def test_schema_accepts_every_ci_values_file(chart: Any) -> None:
    for values_file in CI_VALUES:
        chart.validate_schema(load_values(values_file))


# ------------------------------------------------------------------------------------ docs
def _leaf_keys_without_docs(text: str) -> list[str]:
    """Keys whose value is not a nested block and that have no comment above them or above an
    ancestor key (a comment on a block documents the whole block)."""
    undocumented = []
    lines = text.splitlines()
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    key_re = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/]+):(?P<rest>.*)$")
    for number, line in enumerate(lines):
        match = key_re.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        previous = next((lines[j] for j in range(number - 1, -1, -1) if lines[j].strip()), "")
        documented = previous.strip().startswith("#") or any(d for _, _, d in stack)
        rest = match["rest"].strip()
        is_block = (
            rest == ""
            and number + 1 < len(lines)
            and (
                len(lines[number + 1]) - len(lines[number + 1].lstrip()) > indent
                and not lines[number + 1].lstrip().startswith("- ")
            )
        )
        stack.append((indent, match["key"], documented))
        if not is_block and not documented:
            undocumented.append(".".join(k for _, k, _ in stack))
    return undocumented


def test_every_value_is_documented() -> None:
    assert _leaf_keys_without_docs((CHART_DIR / "values.yaml").read_text()) == []


def test_undocumented_value_is_detected() -> None:
    """Negative control for the documentation check."""
    assert _leaf_keys_without_docs("a:\n  # -- doc\n  b: 1\n  c: 2\n") == ["a.c"]


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        if sub.get("additionalProperties") is False:
            paths |= _schema_paths(sub, f"{path}.")
    return paths


def _value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        paths.add(f"{prefix}{key}")
        if isinstance(value, dict):
            paths |= _value_paths(value, f"{prefix}{key}.")
    return paths


def test_schema_and_values_describe_the_same_settings() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    phantom = _schema_paths(schema) - _value_paths(values) - {"global"}
    assert phantom == set(), f"schema properties with no default in values.yaml: {sorted(phantom)}"


def test_chart_readme_explains_the_workload_choice() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    assert "## Why a Job" in readme
    for topic in ("StatefulSet", "podFailurePolicy", "parallelism", "143"):
        assert topic in readme, topic


def test_operations_guide_covers_install_scale_watch_recover() -> None:
    guide = (CHART_DIR.parent / "README.md").read_text()
    for section in ("## Install", "## Scale", "## Watch", "## Recover"):
        assert section in guide, section
    assert "helm upgrade" in guide and "--set workers.replicas=" in guide


def test_chart_yaml_pins_kubernetes_floor() -> None:
    chart_yaml = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    floor = re.fullmatch(r">=(\d+\.\d+)\.0-0", chart_yaml["kubeVersion"])
    assert floor and floor[1] == KUBE_VERSIONS[0].rsplit(".", 1)[0]


# ------------------------------------------------------------------------------------ real etcd
def test_wait_for_etcd_gives_up_with_one_line(render: Any) -> None:
    [init] = only(render({"workers": {"waitForEtcd": {"timeoutSeconds": 1}}}), "Job")["spec"][
        "template"
    ]["spec"]["initContainers"]
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-c", init["command"][2], f"127.0.0.1:{port}", init["command"][4]],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"etcd not ready after 1 s: 127.0.0.1:{port}: ")
    assert proc.stderr.count("\n") == 1


def test_no_etcd_wait_with_external_etcd(render: Any) -> None:
    values = load_values(CHART_DIR / "ci" / "external-etcd-tls-values.yaml")
    assert "initContainers" not in only(render(values), "Job")["spec"]["template"]["spec"]
    off = {"workers": {"waitForEtcd": {"enabled": False}}}
    assert "initContainers" not in only(render(off), "Job")["spec"]["template"]["spec"]


def loopback_members(
    sts: dict[str, Any], members: list[str], data_root: Path, files: dict[str, Path] | None = None
) -> tuple[dict[str, dict[str, int]], Callable[[str, str], str]]:
    """Free loopback ports for each etcd member of ``sts``, and a function that rewrites one of a
    member's arguments for this machine: the kubelet's $(POD_NAME) expansion, pod DNS names and
    0.0.0.0 listeners mapped to those ports, mounted ``files`` to local paths, the data dir under
    ``data_root``."""
    domain = f"{sts['spec']['serviceName']}.{NAMESPACE}.svc.cluster.local"
    ports = {
        m: {"client": free_port(), "peer": free_port(), "metrics": free_port()} for m in members
    }

    def localize(arg: str, me: str) -> str:
        arg = arg.replace("$(POD_NAME)", me)
        for member, p in ports.items():
            for name, port in (("peer", 2380), ("client", 2379)):
                arg = arg.replace(f"{member}.{domain}:{port}", f"127.0.0.1:{p[name]}")
        for name, port in (("client", 2379), ("peer", 2380), ("metrics", 2381)):
            arg = arg.replace(f"0.0.0.0:{port}", f"127.0.0.1:{ports[me][name]}")
        for path, local in (files or {}).items():
            arg = arg.replace(path, str(local))
        if arg.startswith("--data-dir="):
            arg = f"--data-dir={data_root / me}"
        assert "0.0.0.0" not in arg and ".svc." not in arg and "/etc/" not in arg, (
            f"unmapped address or path in {arg}"
        )
        return arg

    return ports, localize


def test_bundled_etcd_arguments_form_a_real_cluster(render: Any, tmp_path: Path) -> None:
    """Start three real etcd processes with the StatefulSet's own arguments (the kubelet's
    $(POD_NAME) expansion and the pod DNS names mapped to loopback ports) and check that the
    members answer the chart's probe paths and replicate a write."""

    binary = require_etcd_binary()
    sts = only(render(), "StatefulSet")
    [container] = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    members = [
        m.split("=", 1)[0]
        for m in next(a for a in args if a.startswith("--initial-cluster="))
        .split("=", 1)[1]
        .split(",")
    ]
    ports, localize = loopback_members(sts, members, tmp_path)

    [init] = only(render(), "Job")["spec"]["template"]["spec"]["initContainers"]
    assert init["name"] == "wait-for-etcd"
    program, endpoints, timeout = init["command"][2:]
    assert init["command"][:2] == ["python", "-c"] and timeout == "600"
    local_endpoints = ",".join(f"127.0.0.1:{ports[m]['client']}" for m in members)
    assert endpoints.count(",") == local_endpoints.count(",")

    probes = {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    procs: list[subprocess.Popen[Any]] = []
    # The init container's program starts first and must wait until the cluster is up.
    waiter = subprocess.Popen(
        [sys.executable, "-c", program, local_endpoints, "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(waiter)
    try:
        for member in members:
            log = (tmp_path / f"{member}.log").open("w")
            procs.append(
                subprocess.Popen(
                    [binary, *(localize(a, member) for a in args)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + 30
        pending = {(m, path) for m in members for path in probes.values()}
        while pending and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs if p is not waiter), (
                tmp_path / f"{members[0]}.log"
            ).read_text()[-2000:]
            for member, path in sorted(pending):
                try:
                    if (
                        http_json(f"http://127.0.0.1:{ports[member]['metrics']}{path}")["health"]
                        == "true"
                    ):
                        pending.discard((member, path))
                except (urllib.error.URLError, OSError, ValueError):
                    pass
            time.sleep(0.1)
        assert not pending, f"members not healthy within 30 s: {sorted(pending)}"

        key, value = (
            base64.b64encode(b"elastic-trainer/probe").decode(),
            base64.b64encode(b"ok").decode(),
        )
        http_json(
            f"http://127.0.0.1:{ports[members[0]]['client']}/v3/kv/put",
            {"key": key, "value": value},
        )
        got = http_json(
            f"http://127.0.0.1:{ports[members[-1]]['client']}/v3/kv/range", {"key": key}
        )
        assert got["kvs"][0]["value"] == value
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def test_bundled_etcd_tls_arguments_form_a_real_cluster(render: Any, tmp_path: Path) -> None:
    """Three real etcd members with the TLS StatefulSet's own arguments (certificate paths
    mapped to a throwaway PKI): they form a cluster over https peers, the wait-for-etcd
    program gets through with the workers' client certificate, the probes answer on the
    http metrics port, and the client port refuses a client without a certificate."""
    binary = require_etcd_binary()
    pki = make_pki(tmp_path / "pki")
    docs = render(load_values(BUNDLED_TLS_VALUES))
    sts = only(docs, "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    [container] = spec["containers"]
    [server_mount] = [m for m in container["volumeMounts"] if m["name"] != "data"]
    server_files = {
        f"{server_mount['mountPath']}/ca.crt": pki.ca_cert,
        f"{server_mount['mountPath']}/tls.crt": pki.server_cert,
        f"{server_mount['mountPath']}/tls.key": pki.server_key,
    }
    args = etcd_args(docs)
    members = [m.split("=", 1)[0] for m in args["initial-cluster"].split(",")]
    ports, localize = loopback_members(sts, members, tmp_path, files=server_files)

    [init] = only(docs, "Job")["spec"]["template"]["spec"]["initContainers"]
    program, _, _, ca, cert, key = init["command"][2:]
    client_files = {ca: pki.ca_cert, cert: pki.client_cert, key: pki.client_key}
    endpoints = ",".join(f"127.0.0.1:{ports[m]['client']}" for m in members)
    waiter = subprocess.Popen(
        [sys.executable, "-c", program, endpoints, "30", *map(str, client_files.values())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs: list[subprocess.Popen[Any]] = [waiter]
    try:
        for member in members:
            log = (tmp_path / f"{member}.log").open("w")
            procs.append(
                subprocess.Popen(
                    [binary, *(localize(a, member) for a in container["args"])],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        out, err = waiter.communicate(timeout=45)
        assert waiter.returncode == 0, (err, (tmp_path / f"{members[0]}.log").read_text()[-2000:])
        assert out.startswith("etcd is ready (127.0.0.1:")

        for member in members:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = container[probe]["httpGet"]["path"]
                url = f"http://127.0.0.1:{ports[member]['metrics']}{path}"
                assert http_json(url)["health"] == "true", (member, probe)

        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        health = f"https://127.0.0.1:{ports[members[-1]]['client']}/health"
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            # No client certificate: the handshake is refused (--client-cert-auth).
            urllib.request.urlopen(health, timeout=5, context=context).read()
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        with urllib.request.urlopen(health, timeout=5, context=context) as response:
            assert json.load(response)["health"] == "true"
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
