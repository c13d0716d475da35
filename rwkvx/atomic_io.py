"""Files written whole or not at all: a temporary file beside the target, fsynced, then renamed over it.

Every file rwkvx writes (checkpoints, exports, prepared data, run logs) goes through here, so an
interrupted write never leaves a half-written file under the final name."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator


@contextlib.contextmanager
def atomic_files(*paths: str | os.PathLike) -> Iterator[list[BinaryIO]]:
    """Temporary files beside ``paths``, open for binary writing. When the block ends without an error,
    each is fsynced and renamed over its path, in the order given; on an error they are deleted and
    the paths are left as they were."""
    paths = [Path(p) for p in paths]
    umask = os.umask(0)
    os.umask(umask)
    temps: list[str] = []
    files: list[BinaryIO] = []
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            temps.append(tmp)
            files.append(os.fdopen(fd, "wb"))
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes the file owner-only; give it a normal file's mode
        yield files
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    except BaseException:
        for f in files:
            f.close()
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    for parent in dict.fromkeys(p.parent for p in paths):
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def atomic_write(path: str | os.PathLike, write: Any) -> None:
    """Call ``write(fileobj)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    with atomic_files(path) as (f,):
        write(f)


def cannot_write(path: str | os.PathLike) -> str | None:
    """Why ``path`` (a file or a directory, existing or not) cannot be written by this process, or None:
    its nearest existing ancestor must be a directory this process may create files in."""
    p = Path(path).absolute()
    existing = next(a for a in (p.parent, *p.parent.parents) if a.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"permission denied in {existing}"
    return None
