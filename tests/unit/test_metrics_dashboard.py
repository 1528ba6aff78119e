"""The Grafana dashboard: structure, datasource variable, PromQL that promtool accepts.

That every expression also returns data from a real run is proven in
tests/integration/test_prometheus_dashboard.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.prometheus_server import require_binary

pytestmark = pytest.mark.timeout(60)

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "helm/elastic-trainer/dashboards/elastic-trainer.json"
)

# What Grafana substitutes before a query reaches Prometheus (the test run's values).
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$run_id": ".*", "$node": ".*"}

# Metrics the dashboard must show, per the issues: throughput, step time, allreduce, world size,
# restarts, checkpoint age, stragglers; progress (step and target, ETA, time since the last step,
# learning rate).
REQUIRED = (
    "elastic_trainer_samples_total",
    "elastic_trainer_step_duration_seconds_bucket",
    "elastic_trainer_step_duration_seconds_count",
    "elastic_trainer_allreduce_duration_seconds_bucket",
    "elastic_trainer_allreduce_bus_bandwidth_bytes_per_second",
    "elastic_trainer_world_size",
    "elastic_trainer_restarts_total",
    "elastic_trainer_last_checkpoint_timestamp_seconds",
    "elastic_trainer_step_compute_seconds_sum",
    "elastic_trainer_rendezvous_duration_seconds_count",
    "elastic_trainer_data_wait_seconds_sum",
    "elastic_trainer_step{",
    "elastic_trainer_target_steps",
    "elastic_trainer_last_step_timestamp_seconds",
    "elastic_trainer_learning_rate",
)
# Metrics that no longer exist: one restart count (elastic_trainer_restarts_total), not three.
GONE = ("elastic_trainer_worker_restarts", "elastic_trainer_agent_restarts_total")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    if "$" in expr:
        raise AssertionError(f"unsubstituted Grafana variable in {expr!r}")
    return expr


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every Prometheus annotation."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']}/{target['refId']}", substitute(target["expr"])))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            out.append((f"annotation {annotation['name']}", substitute(annotation["expr"])))
    return out


def variable_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of every ``label_values(selector, label)`` variable."""
    out = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert match, f"variable {variable['name']} is not label_values(...)"
        out.append((variable["name"], substitute(match.group(1)), match.group(2)))
    return out


def test_dashboard_structure() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "elastic-trainer"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel.get("description"), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    text = DASHBOARD.read_text()
    for metric in REQUIRED:
        assert metric in text, metric
    for metric in GONE:
        assert metric not in text, metric
    assert len(variable_queries(dashboard)) == 2


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    promtool = require_binary("promtool", "PROMTOOL_BIN")
    expressions = dashboard_expressions(load_dashboard())
    assert len(expressions) >= 20
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(expressions)
                ],
            }
        ]
    }
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout
