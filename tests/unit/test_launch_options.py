"""Option resolution of `elastic-trainer run`: precedence, validation, config files."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_trainer.launch.launcher import for_embedded_etcd
from elastic_trainer.launch.options import (
    OPTIONS,
    RunOptions,
    UserError,
    rendezvous_conf,
    resolve_run_options,
)
from elastic_trainer.launch.plan import (
    LaunchPlan,
    Target,
    rendezvous_settings,
    resolve_nproc,
    split_target,
    torchrun_argv,
)
from rendezvous.conf_keys import KEYS_BY_NAME


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_documented_and_elastic() -> None:
    options = resolve_run_options({}, env={})
    assert (options.min_nodes, options.max_nodes) == (1, 2)
    assert options.max_restarts == 3 and options.last_call_timeout == 5
    assert options.rdzv_endpoint is None and options.run_id is None
    assert all(source == "default" for source in options.sources.values())
    assert len(OPTIONS) == len(options.sources)


def test_precedence_cli_over_env_over_file_over_default(tmp_path: Path) -> None:
    config = write(tmp_path, '[run]\nnnodes = "2:4"\nmax_restarts = 7\nmetrics-port = 9500\n')
    env = {"ELASTIC_TRAINER_NNODES": "3:5", "ELASTIC_TRAINER_MAX_RESTARTS": "8"}
    options = resolve_run_options({"nnodes": "4:6"}, env=env, config_path=config)
    assert options.nnodes == "4:6" and options.sources["nnodes"] == "command"
    assert options.max_restarts == 8 and options.sources["max_restarts"] == "environment"
    assert options.metrics_port == 9500 and options.sources["metrics_port"] == "config"
    assert options.monitor_interval == 0.1 and options.sources["monitor_interval"] == "default"


def test_config_file_from_env_variable(tmp_path: Path) -> None:
    config = write(tmp_path, '[run]\nrun_id = "from-file"\n')
    assert resolve_run_options({}, env={"ELASTIC_TRAINER_CONFIG": config}).run_id == "from-file"


@pytest.mark.parametrize(
    ("cli", "env", "toml", "message"),
    [
        ({"nnodes": "0"}, {}, None, "command line --nnodes: bad value '0'"),
        ({"nnodes": "a:b"}, {}, None, "--nnodes: bad value 'a:b' \\(not a number\\)"),
        (
            {},
            {"ELASTIC_TRAINER_MAX_RESTARTS": "-1"},
            None,
            "environment ELASTIC_TRAINER_MAX_RESTARTS: bad value '-1'",
        ),
        ({}, {}, "[run]\nmetrics_port = 99999\n", "key metrics_port: bad value 99999"),
        ({}, {}, "[run]\nnodes = 2\n", "unknown key 'nodes' in \\[run\\]"),
        ({}, {}, "[launch]\nnnodes = 2\n", "unknown table or key 'launch'"),
        ({}, {}, "[run\n", "invalid TOML"),
        ({"device": "tpu"}, {}, None, "must be one of auto, cpu, cuda"),
        ({"rdzv_conf": "novalue"}, {}, None, "'novalue' is not KEY=VALUE"),
        (
            {"warm_start": "yes"},
            {},
            None,
            "--warm-start: bad value 'yes' \\(must be one of on, off\\)",
        ),
        (
            {},
            {"ELASTIC_TRAINER_WARM_PRELOAD": "ok.mod,bad-name"},
            None,
            "'bad-name' is not a module name",
        ),
    ],
)
def test_bad_values_name_option_and_source(
    tmp_path: Path, cli: dict, env: dict, toml: str | None, message: str
) -> None:
    config = write(tmp_path, toml) if toml is not None else None
    with pytest.raises(UserError, match=message):
        resolve_run_options(cli, env=env, config_path=config)


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read it"):
        resolve_run_options({}, env={}, config_path=str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    ("nproc", "device", "gpus", "expected"),
    [("auto", "auto", 0, 1), ("auto", "auto", 4, 4), ("2", "cpu", 4, 2), ("3", "auto", 0, 3)],
)
def test_resolve_nproc(nproc: str, device: str, gpus: int, expected: int) -> None:
    options = resolve_run_options({"nproc_per_node": nproc, "device": device}, env={})
    assert resolve_nproc(options, gpus) == expected


@pytest.mark.parametrize(
    ("nproc", "device", "gpus", "message"),
    [
        ("8", "cuda", 4, "--nproc-per-node 8: only 4 GPU"),
        ("8", "auto", 2, "only 2 GPU"),
        ("1", "cuda", 0, "no CUDA device"),
    ],
)
def test_resolve_nproc_rejects(nproc: str, device: str, gpus: int, message: str) -> None:
    options = resolve_run_options({"nproc_per_node": nproc, "device": device}, env={})
    with pytest.raises(UserError, match=message):
        resolve_nproc(options, gpus)


def test_torchrun_argv_user_rdzv_conf_wins_and_target_last() -> None:
    options = resolve_run_options({"rdzv_conf": "last_call_timeout=1,protocol=https"}, env={})
    target = split_target(["pkg.mod", "--lr", "0.1"], as_module=True)
    plan = LaunchPlan(options, target, 2, rendezvous_settings(options, "job"))
    argv = torchrun_argv(plan, "e:1", "job")
    assert argv[-4:] == ["-m", "pkg.mod", "--lr", "0.1"]
    assert "--rdzv-backend=etcd-v3" in argv and "--rdzv-id=job" in argv
    conf = rendezvous_conf(options)
    assert f"--rdzv-conf={conf}" in argv  # the parsed settings hand on the text as given
    assert conf.index("last_call_timeout=5") < conf.index("last_call_timeout=1")  # later key wins
    assert conf.endswith("protocol=https")


def test_warm_start_is_on_by_default_and_workers_go_through_the_client() -> None:
    options = resolve_run_options({"warm_preload": " mymodel , mymodel.layers "}, env={})
    assert options.warm_start == "on" and options.warm_preload == "mymodel,mymodel.layers"
    target = split_target(["pkg.mod", "--lr", "0.1"], as_module=True)
    client = [
        "-m",
        "elastic_trainer.launch.warm_start",
        "--socket",
        "/s",
        "--",
        *target.torchrun_args(),
    ]
    plan = LaunchPlan(options, target, 2, rendezvous_settings(options, "job"))
    argv = torchrun_argv(plan, "e:1", "job", client)
    assert argv[-len(client) :] == client


def test_target_requires_something_to_run() -> None:
    with pytest.raises(UserError, match="nothing to run"):
        split_target([], as_module=False)
    with pytest.raises(UserError, match="exactly one"):
        Target(None, None, ())


def test_each_rendezvous_option_is_the_rdzv_conf_key_itself() -> None:
    """One definition: a launcher option that is a ``--rdzv-conf`` key takes the key's meaning and
    default (only the documented launcher default of last_call_timeout differs), and the conf
    string of the defaults parses with the rendezvous's own parser to the same values."""
    from rendezvous.settings import settings_from_conf

    rendezvous = [spec for spec in OPTIONS if spec.rendezvous_key]
    assert {spec.name for spec in rendezvous} == {
        "join_timeout",
        "last_call_timeout",
        "lease_ttl",
    }
    for spec in rendezvous:
        key = KEYS_BY_NAME[spec.name]
        assert spec.help == key.doc
        assert spec.default == key.default or spec.name == "last_call_timeout"
    options = resolve_run_options({}, env={})
    settings = settings_from_conf(rendezvous_conf(options))
    for spec in rendezvous:
        assert getattr(settings, spec.name) == getattr(options, spec.name)
    with pytest.raises(
        UserError, match="--join-timeout: bad value 'soon' \\('soon' is not a number\\)"
    ):
        resolve_run_options({"join_timeout": "soon"}, env={})


def test_every_run_options_field_is_an_option() -> None:
    from dataclasses import fields

    assert [f.name for f in fields(RunOptions) if f.name != "sources"] == [
        spec.name for spec in OPTIONS
    ]


def test_the_progress_interval_defaults_to_the_publishers_own() -> None:
    from elastic_trainer.launch.progress_publisher import DEFAULT_INTERVAL_S

    assert resolve_run_options({}, env={}).progress_interval == DEFAULT_INTERVAL_S
    assert (
        resolve_run_options({}, env={"ELASTIC_TRAINER_PROGRESS_INTERVAL": "1.5"}).progress_interval
        == 1.5
    )
    with pytest.raises(UserError, match="--progress-interval"):
        resolve_run_options({"progress_interval": "0"}, env={})


def test_on_its_own_embedded_etcd_the_first_round_waits_no_last_call() -> None:
    """Issue 30: a launch on its own embedded etcd is the only node that can be there (others need
    the endpoint it prints), so its first round closes at once instead of after 5 s; an external
    etcd, or a --last-call-timeout the user gave, keeps its value."""
    assert for_embedded_etcd(resolve_run_options({}, env={})).last_call_timeout == 0.1
    external = resolve_run_options({"rdzv_endpoint": "127.0.0.1:2379", "run_id": "j"}, env={})
    assert for_embedded_etcd(external).last_call_timeout == 5
    given = resolve_run_options({"last_call_timeout": "3"}, env={})
    assert for_embedded_etcd(given).last_call_timeout == 3
    from_env = resolve_run_options({}, env={"ELASTIC_TRAINER_LAST_CALL_TIMEOUT": "2"})
    assert for_embedded_etcd(from_env).last_call_timeout == 2


def test_a_metrics_port_in_use_says_what_to_pass_instead(tmp_path: Path) -> None:
    """Two nodes on one host both take the default port 9400: the second's error says to give
    each node its own --metrics-port, or 0 for none (it said only "Address already in use")."""
    import socket

    from elastic_trainer.launch.node_metrics import MetricsError, serve_node_metrics
    from elastic_trainer.launch.plan import metrics_endpoint_error

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError) as caught:
            serve_node_metrics("127.0.0.1", port, str(tmp_path))
    line = metrics_endpoint_error("127.0.0.1", port, caught.value)
    assert line == (
        f"metrics port {port} on 127.0.0.1 is in use (another node on this host?): give each node "
        f"on one host its own --metrics-port (e.g. --metrics-port {port + 1}), or --metrics-port 0 "
        "for no metrics endpoint on this node"
    )
    other = metrics_endpoint_error("127.0.0.1", port, MetricsError("directory x does not exist"))
    assert other == f"metrics endpoint 127.0.0.1:{port}: directory x does not exist"
