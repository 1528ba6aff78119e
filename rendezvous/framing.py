"""The framing of a rendezvous state value in etcd: ``MAGIC | sha256(state) | state``.

The lease handler frames its JSON round state and rank shards (:mod:`rendezvous.round_state`), so
that a corrupt or foreign value raises ``RendezvousStateError`` instead of being handed to the
rendezvous as garbage.
"""

from __future__ import annotations

import hashlib

from torch.distributed.elastic.rendezvous import RendezvousStateError

_MAGIC = b"ETv3"
_DIGEST_SIZE = hashlib.sha256().digest_size


def frame_state(state: bytes) -> bytes:
    """Prefix ``state`` with a magic and its sha256."""
    return _MAGIC + hashlib.sha256(state).digest() + state


def unframe_state(value: bytes, *, key: str) -> bytes:
    """Return the state inside a framed value.

    Raises:
        RendezvousStateError: the value is not ours or its checksum does not match.
    """
    header = len(_MAGIC) + _DIGEST_SIZE
    if len(value) < header or not value.startswith(_MAGIC):
        raise RendezvousStateError(
            f"the rendezvous state at {key} is not an etcd-v3 state (corrupt or foreign)"
        )
    digest, state = value[len(_MAGIC) : header], value[header:]
    if hashlib.sha256(state).digest() != digest:
        raise RendezvousStateError(f"the rendezvous state at {key} is corrupt (checksum mismatch)")
    return state
