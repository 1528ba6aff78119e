"""Replace a file atomically: readers see the old content or the new, never a part of it.

Stdlib only (the warm-start client imports it). The content goes to a hidden temporary file in the
target's directory, which is then renamed over the target; with ``durable=True`` the file is
fsynced before the rename (and :func:`fsync_directory` makes the rename itself durable). On any
error the temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(
    target: Path, *, durable: bool = True, before_replace: Callable[[], None] | None = None
) -> Iterator[BinaryIO]:
    """A binary file to write; it replaces ``target`` when the block ends without an error.
    ``before_replace`` runs once the data is durable, right before the rename; if it raises,
    ``target`` is left as it was."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            if durable:
                os.fsync(file.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_atomically(target: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``target`` with ``data`` (see :func:`atomic_file`)."""
    with atomic_file(target, durable=durable) as file:
        file.write(data)


def fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
