"""Parsing and validation of the etcd-v3 rendezvous parameters (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from rendezvous.etcd_client import Endpoint, EtcdClientConfig, parse_endpoints
from rendezvous.framing import frame_state, unframe_state
from rendezvous.settings import RendezvousConfigError, parse_settings


def params(endpoint: str = "h:1", **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, "run", 1, 2, **conf)


def client_config(params: RendezvousParameters) -> EtcdClientConfig:
    return parse_settings(params).client_config()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("etcd:2379", (Endpoint("etcd", 2379),)),
        ("etcd", (Endpoint("etcd", 2379),)),
        ("http://a:1, https://b:2/", (Endpoint("a", 1), Endpoint("b", 2))),
        ("[::1]:2379", (Endpoint("::1", 2379),)),
    ],
)
def test_parse_endpoints(text: str, expected: tuple[Endpoint, ...]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty endpoint"),
        ("a:1,,b:2", "empty endpoint"),
        ("host:port", "port 'port' .* is not a number"),
        ("host:70000", "out of range"),
        ("ho st:1", "malformed host"),
        (":2379", "malformed host"),
    ],
)
def test_parse_endpoints_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoints(text)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"read_timeout": "abc"}, "rdzv-conf read_timeout: 'abc' is not a number"),
        ({"read_timeout": "0"}, "rdzv-conf read_timeout: must be > 0"),
        ({"retry_timeout": "-1"}, "rdzv-conf retry_timeout: must be > 0"),
        ({"protocol": "ftp"}, "rdzv-conf protocol: must be 'http' or 'https'"),
        ({"user": "root"}, "rdzv-conf user: user and password"),
        ({"password": "x", "password_file": "/f"}, "give password or password_file, not both"),
        ({"ssl_cert": "/c.pem"}, "rdzv-conf protocol: TLS files were given"),
        (
            {"protocol": "https", "ca_cert": "/no/such.pem"},
            "rdzv-conf ca_cert: cannot read /no/such.pem",
        ),
    ],
)
def test_bad_conf_values_name_the_key(conf: dict[str, str], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=message) as raised:
        client_config(params(**conf))
    assert "\n" not in str(raised.value)


def test_defaults() -> None:
    config = client_config(params("a:1,b:2"))
    assert config.endpoints == (Endpoint("a", 1), Endpoint("b", 2))
    assert (config.read_timeout, config.retry_timeout, config.protocol) == (10.0, 20.0, "http")


def test_password_is_not_in_repr(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("hunter2\n")
    config = client_config(params(user="u", password_file=str(secret)))
    assert config.password == "hunter2"
    assert "hunter2" not in repr(config)


def test_config_requires_an_endpoint() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        EtcdClientConfig(endpoints=())
    settings = parse_settings(params(""))  # a launcher may check its settings before etcd exists
    with pytest.raises(RendezvousConfigError, match="rdzv endpoint: none given"):
        settings.client_config()
    with pytest.raises(RendezvousConfigError, match="port 'x'"):
        parse_settings(params("h:x"))


def test_framing_round_trip_and_tamper_detection() -> None:
    framed = frame_state(b"state")
    assert unframe_state(framed, key="k") == b"state"
    tampered = framed[:-1] + b"X"
    with pytest.raises(RendezvousStateError, match="checksum"):
        unframe_state(tampered, key="k")
    with pytest.raises(RendezvousStateError, match="not an etcd-v3 state"):
        unframe_state(b'{"v2": 1}', key="k")
