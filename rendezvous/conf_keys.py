"""The ``--rdzv-conf`` key table of the ``etcd-v3`` rendezvous: names, parsers, defaults, meaning.

:data:`KEYS` is the only list of ``--rdzv-conf`` keys; :mod:`rendezvous.settings` builds the
validated :class:`~rendezvous.settings.RendezvousSettings` from it, and ``elastic-trainer run``
takes its rendezvous options (parser, default, help) from the same rows. This module imports
nothing heavy (no torch, no gRPC), so a launcher's option table and ``--help`` stay fast.
Every mistake is a :class:`RendezvousConfigError` with one line, ``rdzv-conf KEY: <problem>``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_KEY_PREFIX = "/elastic-trainer/rdzv"
DEFAULT_TTL = 7200


class RendezvousConfigError(ValueError):
    """A bad ``--rdzv-conf`` key or value, endpoint or node count; the message is one line."""


# -- value parsers: (key, raw value) -> typed value --------------------------------------------


def _number(key: str, raw: object) -> float:
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise RendezvousConfigError(f"rdzv-conf {key}: {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise RendezvousConfigError(f"rdzv-conf {key}: {raw!r} is not a finite number")
    return value


def _integer(key: str, raw: object) -> int:
    try:
        return int(str(raw).strip())
    except ValueError:
        raise RendezvousConfigError(f"rdzv-conf {key}: {raw!r} is not an integer") from None


def _text(key: str, raw: object) -> str:
    return str(raw).strip()


def optional_text(key: str, raw: object) -> str | None:
    return str(raw).strip() or None


def _lower(key: str, raw: object) -> str:
    return str(raw).strip().lower()


def _secret(key: str, raw: object) -> str:
    return str(raw)  # a password is taken as given, spaces included


@dataclass(frozen=True, slots=True)
class ConfKey:
    """One ``--rdzv-conf`` key."""

    name: str
    """The key, as written after ``--rdzv-conf``."""
    parse: Callable[[str, object], Any]
    """Turns the raw value (a string from the command line) into the typed value."""
    default: Any
    """The value when the key is absent (``None``: unset)."""
    doc: str
    """What it means, for people."""
    used_by: str
    """``all`` (read by the rendezvous) or ``torchrun`` (added by torchrun itself; ignored)."""


KEYS: tuple[ConfKey, ...] = (
    ConfKey("read_timeout", _number, 10.0, "gRPC deadline of one etcd request, seconds", "all"),
    ConfKey(
        "retry_timeout",
        _number,
        20.0,
        "total time transient etcd faults are retried, seconds; bounds an unreachable etcd",
        "all",
    ),
    ConfKey("protocol", _lower, "http", "``http`` or ``https``", "all"),
    ConfKey(
        "ca_cert",
        optional_text,
        None,
        "CA certificate (PEM) of the etcd servers; needs https",
        "all",
    ),
    ConfKey(
        "ssl_cert",
        optional_text,
        None,
        "client certificate (PEM) for mutual TLS, with ``ssl_cert_key``",
        "all",
    ),
    ConfKey("ssl_cert_key", optional_text, None, "private key (PEM) of ``ssl_cert``", "all"),
    ConfKey(
        "user", optional_text, None, "etcd user, with ``password_file`` or ``password``", "all"
    ),
    ConfKey(
        "password_file",
        optional_text,
        None,
        "file holding the password (a mounted Kubernetes Secret; one trailing newline is dropped)",
        "all",
    ),
    ConfKey("password", _secret, None, "the user's password; prefer ``password_file``", "all"),
    ConfKey(
        "key_prefix",
        _text,
        DEFAULT_KEY_PREFIX,
        "etcd prefix of all runs; a run lives under PREFIX/RUN_ID/",
        "all",
    ),
    ConfKey(
        "ttl",
        _integer,
        DEFAULT_TTL,
        "seconds an untouched rendezvous state lives (etcd lease)",
        "all",
    ),
    ConfKey(
        "handler",
        _lower,
        "lease",
        "``lease``, the one handler (``dynamic`` was retired and is refused)",
        "all",
    ),
    ConfKey("join_timeout", _number, 600.0, "seconds a rendezvous may take", "all"),
    ConfKey(
        "last_call_timeout",
        _number,
        30.0,
        "seconds to admit more nodes once the minimum is in (first round only)",
        "all",
    ),
    ConfKey(
        "lease_ttl",
        _integer,
        10,
        "seconds after which a node that died without a goodbye loses its membership",
        "all",
    ),
    ConfKey(
        "timeout",
        _text,
        None,
        "set by torchrun (900 unless given); ignored: use ``join_timeout``",
        "torchrun",
    ),
    ConfKey("rank", _text, None, "set by torchrun for its static backend; ignored", "torchrun"),
)
KEYS_BY_NAME = {key.name: key for key in KEYS}


def known_keys() -> list[str]:
    """The keys a user may write (the ones torchrun adds itself left out)."""
    return [key.name for key in KEYS if key.used_by != "torchrun"]


def conf_keys_table() -> str:
    """The key table as reStructuredText (for docstrings and ``--help``)."""
    lines = []
    for key in KEYS:
        default = (
            "unset"
            if key.default is None
            else f"{key.default:g}"
            if isinstance(key.default, float)
            else key.default
        )
        lines.append(f"``{key.name}`` (default {default}; {key.used_by})\n    {key.doc}.")
    return "\n".join(lines)


def unknown_key_message(key: str) -> str:
    """``rdzv-conf: unknown key 'X' (did you mean 'Y'?); known keys: ...``."""
    names = known_keys()
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"rdzv-conf: unknown key {key!r}{hint}; known keys: {', '.join(names)}"


def parse_conf_string(text: str) -> dict[str, str]:
    """Split ``"k=v,k2=v2"`` (an ``--rdzv-conf`` string) into a dict; a later key wins.

    Only the syntax is checked; :func:`settings_from_conf` checks keys and values too.

    Raises:
        RendezvousConfigError: an item is not ``KEY=VALUE`` with a non-empty key and value.
    """
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise RendezvousConfigError(f"rdzv-conf: {item.strip()!r} is not KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf
