"""Writing files so that a reader never sees half of one and a failure leaves nothing behind."""

from __future__ import annotations

import contextlib
import os


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (one name per process, so
    two processes writing one file never share a half-written one), renamed over ``path``; the
    temporary file is removed if anything fails, and the error raised."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
