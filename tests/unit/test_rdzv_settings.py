"""The ``--rdzv-conf`` key table and its one parser, and the job identity (no server needed)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous.job_identity import (
    JobIdentity,
    current_job_identity,
    identity_from_torchrun_argv,
    set_job_identity,
)
from rendezvous.settings import (
    KEYS,
    KEYS_BY_NAME,
    RendezvousConfigError,
    RendezvousSettings,
    known_keys,
    parse_conf_string,
    parse_settings,
    settings_from_conf,
)

README = Path(__file__).resolve().parents[2] / "docs" / "rendezvous.md"


def params(**conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", "h:1", "run", 1, 2, **conf)


def test_every_settings_field_is_a_key_or_comes_from_torchrun_itself() -> None:
    own = {"run_id", "endpoints", "min_nodes", "max_nodes", "local_addr", "conf"}
    names = {f.name for f in fields(RendezvousSettings)}
    assert names - own == {k.name for k in KEYS if k.used_by != "torchrun"} - {"password_file"}
    for key in KEYS:
        if key.name in names:
            assert getattr(RendezvousSettings(run_id="r"), key.name) == key.default, key.name


def test_every_key_of_the_readme_table_is_known() -> None:
    text = README.read_text()
    table = text[text.index("`--rdzv-conf` keys:") :]
    table = table[: table.index("\n\n", table.index("| key |"))]
    documented = {
        name for row in table.splitlines()[3:] for name in re.findall(r"`(\w+)`", row.split("|")[1])
    }
    assert documented == set(known_keys())


def test_the_keys_torchrun_adds_itself_are_accepted() -> None:
    """Parameters built by torch's own code: ``timeout`` always, ``rank`` for ``static``."""
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import config_from_args, get_args_parser

    config, _, _ = config_from_args(
        get_args_parser().parse_args(
            ["--rdzv-backend=static", "--nnodes=1:2", "--rdzv-conf=join_timeout=5", "x.py"]
        )
    )
    assert {"timeout", "rank"} <= set(config.rdzv_configs)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=2, nproc_per_node=1, rdzv_configs=dict(config.rdzv_configs)
    )
    settings = parse_settings(
        RendezvousParameters("etcd-v3", "h:1", "run", 1, 2, **launch.rdzv_configs)
    )
    assert settings.join_timeout == 5.0


def test_handler_lease_is_accepted_and_the_retired_dynamic_handler_is_one_line() -> None:
    assert parse_settings(params(handler="Lease", lease_ttl="4")).handler == "lease"
    with pytest.raises(RendezvousConfigError) as raised:
        parse_settings(params(handler="dynamic"))
    assert str(raised.value) == (
        "rdzv-conf handler: 'dynamic' (torch's dynamic rendezvous) was retired; "
        "omit handler to use the lease handler"
    )


@pytest.mark.parametrize(
    "key", ["close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt"]
)
def test_the_retired_dynamic_handlers_keys_are_unknown_keys(key: str) -> None:
    with pytest.raises(RendezvousConfigError, match=f"^rdzv-conf: unknown key {key!r}"):
        parse_settings(params(**{key: "5"}))


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("read_timout", "read_timeout"),
        ("handlr", "handler"),
        ("lease-ttl", "lease_ttl"),
        ("bogus", None),
    ],
)
def test_an_unknown_key_is_named_with_its_closest_match_and_the_known_keys(
    key: str, suggestion: str | None
) -> None:
    with pytest.raises(RendezvousConfigError) as raised:
        parse_settings(params(**{key: "5"}))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"rdzv-conf: unknown key {key!r}")
    assert (f"(did you mean {suggestion!r}?)" in message) == (suggestion is not None), message
    assert message.endswith("known keys: " + ", ".join(known_keys()))
    assert "timeout," not in message.replace("_timeout,", "")  # torchrun's own keys are not offered


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"read_timeout": "abc"}, "rdzv-conf read_timeout: 'abc' is not a number"),
        ({"join_timeout": "nan"}, "rdzv-conf join_timeout: 'nan' is not a finite number"),
        ({"last_call_timeout": "-1"}, "rdzv-conf last_call_timeout: must be > 0, got -1"),
        ({"ttl": "1.5"}, "rdzv-conf ttl: '1.5' is not an integer"),
        ({"lease_ttl": "1"}, "rdzv-conf lease_ttl: must be >= 2 seconds"),
        ({"ttl": "0"}, "rdzv-conf ttl: must be > 0, got 0"),
        ({"handler": "etcd"}, "rdzv-conf handler: must be lease, got 'etcd'"),
        (
            {"key_prefix": "runs"},
            "rdzv-conf key_prefix: must be an absolute path like /a/b, got 'runs'",
        ),
        ({"key_prefix": ""}, "rdzv-conf key_prefix: must be an absolute path"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(conf: dict[str, str], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=re.escape(message)) as raised:
        parse_settings(params(**conf))
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_the_password_file_is_read_and_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("hunter2\n")
    settings = parse_settings(params(user="u", password_file=str(secret)))
    assert settings.password == "hunter2" and settings.client_config().password == "hunter2"
    assert "hunter2" not in repr(settings)
    with pytest.raises(RendezvousConfigError, match="rdzv-conf password_file: cannot read"):
        parse_settings(params(user="u", password_file=str(tmp_path / "none")))


def test_conf_strings() -> None:
    assert parse_conf_string(" a=1, b = x=y ,,a=2") == {"a": "2", "b": "x=y"}
    assert parse_conf_string("") == {}
    for bad in ("a", "=1", "a="):
        with pytest.raises(RendezvousConfigError, match="is not KEY=VALUE"):
            parse_conf_string(bad)
    settings = settings_from_conf("join_timeout=60,lease_ttl=3", endpoint="e:1", run_id="job")
    assert (settings.join_timeout, settings.lease_ttl, settings.run_id) == (60.0, 3, "job")
    with pytest.raises(RendezvousConfigError, match="unknown key 'bogus'"):
        settings_from_conf("bogus=1")


def test_settings_keep_their_conf_text_and_move_to_an_endpoint_known_later(tmp_path) -> None:
    """A launcher parses its settings once, before its etcd is up, and hands the text on as given
    (a password file stays a file name); the endpoint and run id come later."""
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    text = f"join_timeout=60,user=u,password_file={secret}"
    settings = settings_from_conf(text, run_id="check")
    assert settings.conf == text and "s3cret" not in settings.conf
    moved = settings.for_endpoint("127.0.0.1:2379", "job")
    assert (str(moved.endpoints[0]), moved.run_id, moved.join_timeout) == (
        "127.0.0.1:2379",
        "job",
        60.0,
    )
    assert (moved.conf, moved.password, settings.run_id) == (text, "s3cret", "check")
    assert parse_settings(params(join_timeout=7)).conf == "join_timeout=7"
    with pytest.raises(RendezvousConfigError, match="rdzv endpoint"):
        settings.for_endpoint("h:x", "job")


def test_numbers_come_as_strings_or_numbers() -> None:
    settings = parse_settings(params(join_timeout=7, read_timeout=0.5, ttl="60"))
    assert (settings.join_timeout, settings.read_timeout, settings.ttl) == (7.0, 0.5, 60)
    assert KEYS_BY_NAME["ttl"].parse("ttl", " 9 ") == 9


# -- the job identity ---------------------------------------------------------------------------


@pytest.fixture
def no_declared_identity() -> Iterator[None]:
    set_job_identity(None)
    try:
        yield
    finally:
        set_job_identity(None)


def test_the_fingerprint_covers_target_args_and_nnodes_only() -> None:
    base = JobIdentity("train.py", False, ("--lr", "0.1"), 1, 2)
    assert base.fingerprint == JobIdentity("./train.py", False, ["--lr", "0.1"], 1, 2).fingerprint  # type: ignore[arg-type]
    assert (
        base.fingerprint
        == JobIdentity.create("train.py", ["--lr", "0.1"], module=False, nnodes="1:2").fingerprint
    )
    for other in (
        JobIdentity("eval.py", False, ("--lr", "0.1"), 1, 2),
        JobIdentity("train.py", False, ("--lr", "0.2"), 1, 2),
        JobIdentity("train.py", True, ("--lr", "0.1"), 1, 2),
        JobIdentity("train.py", False, ("--lr", "0.1"), 2, 2),
    ):
        assert other.fingerprint != base.fingerprint, other
    assert base.description == "'train.py --lr 0.1' with --nnodes 1:2"
    assert (
        JobIdentity.create("pkg.train", [], module=True, nnodes="2").description
        == "'-m pkg.train' with --nnodes 2:2"
    )
    with pytest.raises(ValueError, match="nnodes"):
        JobIdentity.create("x.py", [], module=False, nnodes="a:b")


def test_the_identity_of_a_torchrun_command_line(no_declared_identity: None) -> None:
    argv = [
        "/venv/bin/torchrun",
        "--nnodes=1:3",
        "--nproc-per-node=4",
        "--rdzv-backend=etcd-v3",
        "-m",
        "pkg.train",
        "--steps",
        "5",
    ]
    identity = identity_from_torchrun_argv(argv)
    assert identity == JobIdentity("pkg.train", True, ("--steps", "5"), 1, 3)
    # nproc-per-node differs between nodes of one job: not part of the identity
    other_node = identity_from_torchrun_argv([*argv[:2], "--nproc-per-node=8", *argv[3:]])
    assert other_node is not None and other_node.fingerprint == identity.fingerprint
    as_module = identity_from_torchrun_argv(["/x/torch/distributed/run.py", "--nnodes=2", "t.py"])
    assert as_module == JobIdentity("t.py", False, (), 2, 2)
    assert identity_from_torchrun_argv(["/usr/bin/pytest", "--nnodes=2", "t.py"]) is None
    assert identity_from_torchrun_argv(["torchrun", "--nnodes=x:y", "t.py"]) is None


def test_a_declared_identity_wins_over_the_command_line(no_declared_identity: None) -> None:
    assert current_job_identity() is None  # pytest is not torchrun
    declared = JobIdentity("t.py")
    set_job_identity(declared)
    assert current_job_identity() is declared
